"""Split streamed text into sentences and lines, for speech. Pure Python, no torch.

Feed text deltas as they arrive; each call returns the sentences completed so far. A sentence
ends at a newline, or at . ! ? … (and their CJK forms) followed by whitespace, with closing
quotes or brackets kept on the sentence. A period after a common abbreviation or a single
letter (an initial) does not end one. ``flush`` returns what is left at the end of the stream.
"""
from __future__ import annotations

_ENDERS = ".!?…"
_CJK_ENDERS = "。！？"        # end a sentence even without a following space
_CLOSERS = "\"')]}”’»"
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "vs", "etc", "e.g", "i.e", "cf", "fig", "no"})


class SentenceSplitter:
    def __init__(self):
        self._buf = ""

    def feed(self, text: str) -> list[str]:
        self._buf += text
        out = []
        start = 0
        i = 0
        n = len(self._buf)
        while i < n:
            end = self._boundary(i)
            if end is None:
                break            # need more text to decide
            if end:
                sentence = self._buf[start:end].strip()
                if sentence:
                    out.append(sentence)
                start = i = end
            else:
                i += 1
        self._buf = self._buf[start:]
        return out

    def flush(self) -> str | None:
        rest, self._buf = self._buf.strip(), ""
        return rest or None

    def _boundary(self, i: int) -> int | None:
        """End index of a sentence ending at position i, 0 if none ends here, None if undecided."""
        buf = self._buf
        c = buf[i]
        if c == "\n":
            return i + 1
        if c in _CJK_ENDERS:
            j = i + 1
            while j < len(buf) and buf[j] in _CLOSERS:
                j += 1
            return j
        if c not in _ENDERS:
            return 0
        j = i + 1
        while j < len(buf) and (buf[j] in _CLOSERS or buf[j] in _ENDERS):
            j += 1
        if j == len(buf):
            return None
        if not buf[j].isspace():
            return 0
        if c == "." and self._is_abbreviation(i):
            return 0
        return j

    def _is_abbreviation(self, i: int) -> bool:
        word = self._buf[:i].rsplit(None, 1)[-1] if self._buf[:i].strip() else ""
        word = word.lstrip("\"'([{“‘«").lower()
        return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())
