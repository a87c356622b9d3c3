"""Fill-in-the-middle prompts for the language server, cut to token budgets.

Budgets are in tokens but measured in characters: ``chars = tokens * chars_per_token``. Asking
the daemon to tokenize would cost a round trip per keystroke; a fixed ratio costs nothing and
errs on the safe side for code (byte-level BPE vocabularies average 3 to 4 characters a token
on source code; the default 3.0 rarely overshoots). The daemon still refuses a prompt that
cannot fit, so a wrong ratio costs context, never correctness.

The prefix keeps the text nearest the cursor and starts at a line boundary; the suffix keeps
the text right after the cursor and ends at one. Other open files go in as extra context (the
daemon joins them with ``<|file_sep|>``), nearest-first, each cut at a line boundary, until
their budget is spent. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence
from urllib.parse import unquote, urlparse


@dataclass(frozen=True)
class FimBudget:
    prefix_tokens: int = 1024
    suffix_tokens: int = 256
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


def tail_at_line(text: str, limit: int) -> str:
    """The last ``limit`` characters of ``text`` or fewer, starting at a line start when cut."""
    if len(text) <= limit:
        return text
    cut = text[len(text) - limit:]
    newline = cut.find("\n")
    return cut[newline + 1:] if newline >= 0 else cut


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


def build_fim(text: str, offset: int, others: Sequence[tuple[str, str]], budget: FimBudget) -> FimPrompt:
    """The prompt for a cursor at ``offset`` (a character index) in ``text``.

    ``others`` are (path, text) of other open documents, most relevant first.
    """
    if not 0 <= offset <= len(text):
        raise ValueError(f"cursor offset {offset} is outside the document (0..{len(text)})")
    prefix = tail_at_line(text[:offset], budget.chars(budget.prefix_tokens))
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
    return FimPrompt(prefix, suffix, tuple(files))
