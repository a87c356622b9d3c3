"""Turns a request's output token ids into text deltas as they arrive, and finds stop strings.

Token ids and their text, for one request::

    ids:   [ ... done ... | prefix ........ read | new ids ... ]
                          ^ _prefix             ^ _read
    text:                 <- _prefix_text ----->

Each step decodes ``ids[_prefix:]`` (a window of a few tokens, so that a token's leading space and
merged bytes come out as in a full decode) and emits what follows ``_prefix_text``. When that text
ends in U+FFFD, a multi-byte character is still incomplete and nothing is emitted; the window then
grows until the character completes (at most ``MAX_HELD_TOKENS`` tokens, after which the bytes are
really invalid and the replacement character is emitted as ``decode`` would). When several ids come
at once, the window advances to the last of them after which the text is complete. Decoding cost
per token is independent of the output length.

Stop strings: text that could be the start of a stop string is held back in ``_pending``, so a stop
string split over several tokens is still found, and the text emitted never contains one.
"""
from __future__ import annotations

from typing import Optional, Sequence

CONTEXT_TOKENS = 6      # prompt tokens decoded before the first output token
MAX_HELD_TOKENS = 8     # a UTF-8 character has at most 4 bytes; byte-level BPE needs at most 4 tokens
_TRIM_AT = 256          # drop ids before the window once this many have piled up
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streaming detokenizer for one request.

    With no stop string hit, the concatenation of all deltas (and ``flush()``) equals
    ``tokenizer.decode(output_ids)`` for byte-level tokenizers. (Decoders that strip a leading space
    at the start of a decode keep it here, since the output follows the prompt.)
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(0, self._read)
        self._stops = tuple(s for s in stop if s)
        self._pending = ""
        self._finished = False

    @property
    def finished(self) -> bool:
        """True after a stop string was found or ``flush()`` was called."""
        return self._finished

    def add(self, new_ids: Sequence[int]) -> tuple[str, Optional[str]]:
        """Take new output ids; return (text delta, the stop string found or None).

        After a stop string is found the request is over: later calls return ("", None).
        """
        if self._finished:
            return "", None
        self._ids.extend(new_ids)
        return self._scan(self._pending + self._complete_text(final=False), final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character or a possible stop-string start), at the end."""
        if self._finished:
            return ""
        text, _ = self._scan(self._pending + self._complete_text(final=True), final=True)
        self._finished = True
        return text

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _complete_text(self, final: bool) -> str:
        """New text up to the last token boundary where the text is complete; advances the window."""
        end = len(self._ids)
        if end == self._read:
            return ""
        full = self._decode(self._prefix, end)
        if final or not full.endswith(_REPLACEMENT):
            return self._advance(full, end)
        # Several ids may have come at once (speculation): find the last clean boundary among them.
        for cut in range(end - 1, max(self._read, end - MAX_HELD_TOKENS), -1):
            text = self._decode(self._prefix, cut)
            if not text.endswith(_REPLACEMENT):
                return self._advance(text, cut)
        if end - self._read >= MAX_HELD_TOKENS:   # the bytes are invalid, not incomplete
            return self._advance(full, end)
        return ""

    def _advance(self, text: str, end: int) -> str:
        start = len(self._prefix_text)
        if not text.startswith(self._prefix_text):
            # a character begun in the prompt (a token-id prompt cut mid-character), completed by the
            # output: its replacement character in the prompt's text becomes the character, emitted here
            start = next((i for i, (a, b) in enumerate(zip(text, self._prefix_text)) if a != b), start)
        delta = text[start:]
        self._prefix, self._read = self._read, end
        self._prefix_text = self._decode(self._prefix, self._read)
        if self._prefix >= _TRIM_AT:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta

    def _scan(self, text: str, final: bool) -> tuple[str, Optional[str]]:
        """Cut ``text`` at the earliest stop string, or hold back a suffix that may start one."""
        self._pending = ""
        if not self._stops:
            return text, None
        hits = [(at, stop) for stop in self._stops if (at := text.find(stop)) >= 0]
        if hits:
            at, stop = min(hits, key=lambda h: h[0])
            self._finished = True
            return text[:at], stop
        if final:
            return text, None
        keep = max(_stop_prefix_suffix(text, stop) for stop in self._stops)
        self._pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None


def _stop_prefix_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    at = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while at >= 0:
        if stop.startswith(text[at:]):
            return len(text) - at
        at = text.find(stop[0], at + 1)
    return 0
