"""Trim a raw model suggestion to what an editor should show as ghost text.

Rules, in order:

* cursor mid-line (code after it on the line): one line only, and the text already after the
  cursor is not repeated at the suggestion's end;
* otherwise at most ``max_lines`` lines, ending before the first non-blank line indented less
  than the cursor's line (the block the cursor is in has ended), before a line that repeats the
  first non-blank line of the suffix (the model is re-writing what follows), and before two
  blank lines in a row;
* trailing whitespace goes; a suggestion of only whitespace is no suggestion.

Pure Python.
"""
from __future__ import annotations


def indent_width(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def trim_suggestion(raw: str, line_before: str, line_after: str, suffix: str = "", max_lines: int = 8) -> str:
    """``line_before``/``line_after``: the cursor's line split at the cursor; ``suffix``: the text after it."""
    if line_after.strip():
        return _single_line(raw, line_after)
    base = indent_width(line_before) if line_before.strip() else len(line_before)
    next_code = next((ln.strip() for ln in suffix.splitlines()[1:] if ln.strip()), None)
    lines = raw.split("\n")
    kept = [lines[0]]
    blanks = 0
    for line in lines[1:max_lines]:
        if not line.strip():
            blanks += 1
            if blanks == 2:
                break
            kept.append(line)
            continue
        blanks = 0
        if indent_width(line) < base or (next_code is not None and line.strip() == next_code):
            break
        kept.append(line)
    return "\n".join(kept).rstrip() if "".join(kept).strip() else ""


def _single_line(raw: str, line_after: str) -> str:
    first = raw.split("\n", 1)[0]
    rest = line_after.rstrip("\r\n")
    if rest and first.endswith(rest):
        first = first[:len(first) - len(rest)]
    return first.rstrip() if first.strip() else ""
