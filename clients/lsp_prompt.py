"""Fill-in-the-middle prompts for the language server, cut to token budgets.

Budgets are in tokens but measured in characters: ``chars = tokens * chars_per_token``. Asking
the daemon to tokenize would cost a round trip per keystroke; a ratio costs nothing. The ratio
starts at the configured value (3.0: large code vocabularies average 3 to 4 characters a token)
and the completion service then measures it from each answer's ``usage.prompt_tokens``. The
budgets are scaled to the model's context window (``fit_budget``), and the daemon still refuses a
prompt that cannot fit, so a wrong ratio costs context or one retry, never correctness.

The prefix keeps the text nearest the cursor and starts at a line boundary; the suffix keeps
the text right after the cursor and ends at one. Other open files go in as extra context (the
daemon joins them with ``<|file_sep|>``), nearest-first, each cut at a line boundary, until
their budget is spent. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence
from urllib.parse import unquote, urlparse


@dataclass(frozen=True)
class FimBudget:
    prefix_tokens: int = 1024
    suffix_tokens: int = 64         # everything after the cursor is recomputed on each keystroke: keep it short
    context_tokens: int = 1024      # all other open files together
    chars_per_token: float = 3.0

    def __post_init__(self):
        for name in ("prefix_tokens", "suffix_tokens", "context_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")

    def chars(self, tokens: int) -> int:
        return int(tokens * self.chars_per_token)


@dataclass(frozen=True)
class FimPrompt:
    prefix: str
    suffix: str
    files: tuple[tuple[str, str], ...]     # (path, text) of other open files
    middle: str = ""                       # the start of the middle, already typed (after <fim_middle>)
    held: str = ""                         # typed whitespace after it, left for the model to write

    @property
    def chars(self) -> int:
        """Characters of text the prompt holds (the held whitespace counted: the model writes it)."""
        return len(self.prefix) + len(self.suffix) + len(self.middle) + len(self.held) + \
            sum(len(p) + len(t) for p, t in self.files)

    def completion(self, raw: str) -> str:
        """The model's text as it continues the document at the cursor: the held whitespace, which
        the model writes first, taken off (or, when it wrote other whitespace, all of it)."""
        if raw.startswith(self.held):
            return raw[len(self.held):]
        return raw.lstrip(" \t") if self.held else raw


SPLITS = ("line", "cursor")
MAX_MIDDLE_CHARS = 240     # a longer line before the cursor is split at the cursor


def tail_at_line(text: str, limit: int) -> str:
    """The last ``limit`` characters of ``text`` or fewer, starting at a line start when cut."""
    if len(text) <= limit:
        return text
    cut = text[len(text) - limit:]
    newline = cut.find("\n")
    return cut[newline + 1:] if newline >= 0 else cut


ANCHOR_LINES = 32


def stable_tail(text: str, limit: int, anchor_lines: int = ANCHOR_LINES) -> str:
    """Like ``tail_at_line``, but the kept text starts at a line whose number is a multiple of an anchor
    step: while the user types, the start stays put for many keystrokes, so the daemon's prefix cache
    keeps serving the prompt up to the cursor instead of missing whenever the window slides. The step is
    ``anchor_lines``, or a quarter of the lines the budget holds when that is less, so rounding the start
    up never gives away more than a quarter of a small budget."""
    if len(text) <= limit:
        return text
    first = len(text) - limit                                  # earliest character the budget allows
    line = text.count("\n", 0, first) + (0 if first == 0 or text[first - 1] == "\n" else 1)
    step = max(1, min(anchor_lines, text.count("\n", first) // 4))
    line = -(-line // step) * step                             # round up to an anchor line
    pos = 0
    for _ in range(line):
        pos = text.find("\n", pos) + 1
        if pos == 0:                                           # fewer lines than the anchor: fall back
            return tail_at_line(text, limit)
    return text[pos:]


def head_at_line(text: str, limit: int) -> str:
    """The first ``limit`` characters of ``text`` or fewer, ending after a newline when cut."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    newline = cut.rfind("\n")
    return cut[:newline + 1] if newline >= 0 else cut


def display_path(uri: str) -> str:
    """A file path for the prompt: the path of a file:// URI, else the URI itself."""
    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme == "file" else uri


def build_fim(text: str, offset: int, others: Sequence[tuple[str, str]], budget: FimBudget,
              split: str = "cursor", anchor: Optional[int] = None) -> FimPrompt:
    """The prompt for a cursor at ``offset`` (a character index) in ``text``.

    ``others`` are (path, text) of other open documents, most relevant first. ``split="line"``
    ends the prefix at the start of the cursor's line and carries the line up to the cursor as the
    start of the middle: while the user types on a line, the prompt stays the same up to the middle
    token, so each keystroke computes only the line's new tokens, exactly. The middle's trailing
    spaces and tabs are held back (``held``): a model reads text ending in a whitespace token as
    followed by a word without its leading space, so it writes them itself (``completion``).
    ``anchor``: under the line split, an earlier line start to end the prefix at instead (the middle
    then carries the lines since), when it is within ``MAX_MIDDLE_CHARS`` of the cursor.
    """
    if not 0 <= offset <= len(text):
        raise ValueError(f"cursor offset {offset} is outside the document (0..{len(text)})")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    middle = ""
    if split == "line":
        start = text.rfind("\n", 0, offset) + 1
        if anchor is not None and 0 <= anchor <= start and offset - anchor <= MAX_MIDDLE_CHARS:
            start = anchor
        if offset - start <= MAX_MIDDLE_CHARS:
            middle = text[start:offset]
    prefix = stable_tail(text[:offset - len(middle)], budget.chars(budget.prefix_tokens))
    kept = middle.rstrip(" \t")
    held, middle = middle[len(kept):], kept
    suffix = head_at_line(text[offset:], budget.chars(budget.suffix_tokens))
    files = []
    left = budget.chars(budget.context_tokens)
    for path, body in others:
        if left <= 0:
            break
        piece = head_at_line(body, left)
        if piece.strip():
            files.append((path, piece))
            left -= len(piece) + len(path) + 2
    return FimPrompt(prefix, suffix, tuple(files), middle, held)


def fit_budget(budget: FimBudget, context_length: Optional[int], reserve: int,
               chars_per_token: Optional[float] = None) -> FimBudget:
    """``budget`` scaled down so the prompt leaves ``reserve`` tokens of the model's context free,
    with ``chars_per_token`` (a measured ratio) in place of the configured one when given."""
    ratio = chars_per_token or budget.chars_per_token
    total = budget.prefix_tokens + budget.suffix_tokens + budget.context_tokens
    room = (context_length - reserve) if context_length else total
    scale = min(1.0, max(0, room) / total) if total else 1.0
    return FimBudget(int(budget.prefix_tokens * scale), int(budget.suffix_tokens * scale),
                     int(budget.context_tokens * scale), ratio)
