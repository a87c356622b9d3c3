"""Recent completions, reused while the user types what was suggested.

An entry remembers the document text before and after the cursor when the suggestion was made.
A later request in the same document hits it when the text after the cursor is unchanged, the
text before it extends the old prefix, and the extension (what the user typed since) is a proper
start of the suggestion: the answer is the rest of the suggestion. The store is an LRU of
``capacity`` entries, newest last; a hit moves an entry to the end. Each entry holds its document's
text, so one document keeps at most ``per_document`` entries: the suggestions being typed through are
the last few, and a large file is not held dozens of times over or compared dozens of times a keystroke.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class _Entry:
    prefix: str
    suffix: str
    text: str


class CompletionCache:
    def __init__(self, capacity: int = 64, per_document: int = 8):
        if capacity < 0 or per_document < 1:
            raise ValueError(f"cache capacity must be >= 0 and per_document >= 1, got {capacity}, {per_document}")
        self.capacity, self.per_document = capacity, per_document
        self._entries: collections.OrderedDict[tuple[str, int], _Entry] = collections.OrderedDict()
        self._serial = 0

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, uri: str, prefix: str, suffix: str, text: str) -> None:
        if not text or self.capacity == 0:
            return
        self._serial += 1
        self._entries[(uri, self._serial)] = _Entry(prefix, suffix, text)
        mine = [k for k in self._entries if k[0] == uri]
        for key in mine[:max(0, len(mine) - self.per_document)]:      # this document's oldest beyond its share
            del self._entries[key]
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def lookup(self, uri: str, prefix: str, suffix: str) -> Optional[str]:
        """The rest of a cached suggestion the user is typing through, or None."""
        for key in reversed(self._entries):
            if key[0] != uri:
                continue
            e = self._entries[key]
            if e.suffix != suffix or len(prefix) < len(e.prefix) or not prefix.startswith(e.prefix):
                continue
            typed = prefix[len(e.prefix):]
            if len(typed) < len(e.text) and e.text.startswith(typed):
                self._entries.move_to_end(key)
                return e.text[len(typed):]
        return None

    def forget(self, uri: str) -> None:
        for key in [k for k in self._entries if k[0] == uri]:
            del self._entries[key]
