"""The model's tokenizer inside ``llmd http``, for llama.cpp's ``/tokenize`` and ``/detokenize``.

The daemon's protocol has no message for these, so the front reads ``tokenizer.json`` from the
model directory the daemon names (its ``models`` reply): the file the daemon's own tokenizer is
built from. Token ids agree with the daemon's for ordinary text; the daemon's BOS rule
(``add_bos_token`` of tokenizer_config.json) is not read here, only the file's post-processor. A
model whose tokenizer lives inside its weights (a GGUF file), or a directory this process may not
read, answers 501.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from .http_api import HttpError


class ModelTokenizer:
    """Two instances of one tokenizer: one reads special-token spellings as those tokens (llama.cpp's
    ``parse_special``), the other as plain text, so no shared flag is toggled between calls."""

    def __init__(self, text: str):
        self._parsed = Tokenizer.from_str(text)
        self._plain = Tokenizer.from_str(text)
        self._plain.encode_special_tokens = True

    @classmethod
    def load(cls, model_path: str) -> "ModelTokenizer":
        unreadable = "the model's tokenizer.json cannot be read by llmd http (a GGUF model carries its tokenizer " \
                     "inside; or this process may not read the model directory)"
        try:
            text = (Path(model_path) / "tokenizer.json").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, ValueError):
            raise HttpError(501, unreadable, "server_error", code="not_implemented") from None
        try:
            return cls(text)
        except Exception:  # the tokenizers library raises a bare Exception for a bad file
            raise HttpError(501, unreadable, "server_error", code="not_implemented") from None

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        tok = self._parsed if parse_special else self._plain
        return tok.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: list[int]) -> str:
        self._check(ids)
        return self._parsed.decode(ids, skip_special_tokens=False)

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token's text decoded alone."""
        return [self._parsed.decode([i], skip_special_tokens=False) for i in ids]

    def _check(self, ids: list[int]) -> None:
        for i in ids:
            if self._parsed.id_to_token(i) is None:
                raise HttpError(400, f"tokens: {i} is not a token of the model", param="tokens")
