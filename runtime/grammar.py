"""Constrained decoding: a request's ``Grammar`` compiled into a matcher that gives, before each
token, the mask of the tokens that keep the output inside the grammar.

llguidance does the work: it reads the model's byte-level vocabulary once (at the first constrained
request, so a daemon that never constrains never pays for it), compiles each JSON schema lazily as
the output grows, and refuses schema features it does not implement (a 400 at the edge, never a
schema quietly ignored). The mask is computed for one row at a time on the host and handed to the
sampler as a boolean row; the sampler puts ``-inf`` where it is false (runtime.sampler).

Whitespace between JSON tokens is fixed (``", "`` and ``": "``), so a model cannot spend its
tokens on blank space inside a structure. Numbers are bounded the same way: a JSON number's integer
part, fraction and exponent may each grow only to ``NUMBER_DIGITS``; past that, tokens that begin with
a digit are masked wherever the grammar allows anything else, so a model that would write
``100.000...`` until its budget runs out has to end the number. The output still matches the grammar,
which is the whole contract: the bound only narrows which of its strings the model may pick.
"""
from __future__ import annotations

import json
from typing import Optional

import importlib

import numpy as np
import torch

from .errors import InvalidRequest
from .request import Grammar

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# the most digits a generated number's integer part, fraction and exponent may each take: 20 holds any
# 64-bit integer, 16 more than a float64 resolves, 3 any float64 exponent
NUMBER_DIGITS = {"int": 20, "frac": 16, "exp": 3}
_DIGITS = frozenset(b"0123456789")


def _llguidance():
    """The grammar library, imported at the first constrained request: a daemon that never
    constrains (or a machine whose wheel is missing) never loads it."""
    return importlib.import_module("llguidance")


class GrammarError(InvalidRequest):
    """A grammar llmd cannot compile, or a schema feature the grammar library does not implement."""


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary (``vocab_json``: ``Tokenizer.to_json()``, the
    tokenizers library's JSON of the model's tokenizer; ``vocab_size``: the width of its logits)."""

    def __init__(self, vocab_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._vocab_json = vocab_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer = None
        self._digit_start: Optional[torch.Tensor] = None

    def _lltokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = _llguidance().LLTokenizer(self._vocab_json, n_vocab=self.vocab_size,
                                                     eos_token=self._eos or None)
        return self._tokenizer

    def compile(self, grammar: Grammar) -> "Matcher":
        """A fresh matcher at the grammar's start. Raises GrammarError naming what is wrong."""
        text = grammar_text(grammar)
        matcher = _llguidance().LLMatcher(self._lltokenizer(), text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {grammar.kind} cannot be used: {_short(matcher.get_error())}")
        return Matcher(matcher, self.vocab_size, tuple(self._eos), self._lltokenizer(), self._digit_starts())

    def _digit_starts(self) -> torch.Tensor:
        """A bool row ``[vocab_size]``: true for the tokens whose text begins with an ASCII digit."""
        if self._digit_start is None:
            tok = self._lltokenizer()
            n = min(self.vocab_size, tok.vocab_size)
            starts = torch.zeros(self.vocab_size, dtype=torch.bool)
            starts[:n] = torch.tensor([bool(b) and b[0] in _DIGITS
                                       for b in (tok.decode_bytes([i]) for i in range(n))], dtype=torch.bool)
            self._digit_start = starts
        return self._digit_start


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar for ``grammar``; GrammarError for a schema that is not a JSON object."""
    if grammar.kind == "json_object":
        schema: object = {"type": "object"}
    else:
        try:
            schema = json.loads(grammar.text)
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"the json_schema is not valid JSON: {_short(str(e))}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a json_schema must be a JSON object")
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the json_schema cannot be used: {_short(str(e))}") from None


class Matcher:
    """One request's position in its grammar. ``allowed`` gives the mask for the next token;
    ``advance`` moves past a chosen one."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: tuple[int, ...], tokenizer,
                 digit_starts: torch.Tensor):
        self._m = matcher
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._tokenizer = tokenizer
        self._digit_starts = digit_starts
        self.numbers = NumberRun()

    def allowed(self) -> torch.Tensor:
        """A bool row ``[vocab_size]``: true where the token keeps the output in the grammar. A
        matcher with nothing left to allow (an error, or the grammar ended) allows the end tokens."""
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:self._vocab_size]
        mask = torch.from_numpy(bits.astype(np.bool_))
        if not self._words.any():
            mask[list(self._eos)] = True
        elif self.numbers.full():
            bounded = mask & ~self._digit_starts
            if bounded.any():
                mask = bounded
        return mask

    def advance(self, token_id: int) -> bool:
        """Move past ``token_id``; False when the grammar does not allow it."""
        if not self._m.consume_token(token_id) or self._m.is_error():
            return False
        self.numbers.feed(self._tokenizer.decode_bytes([token_id]))
        return True

    @property
    def stopped(self) -> bool:
        """The output is complete: the grammar allows no further token."""
        return self._m.is_stopped()

    @property
    def error(self) -> Optional[str]:
        return _short(self._m.get_error()) if self._m.is_error() else None


class NumberRun:
    """Where the JSON text written so far stands in a number: which part (``int``, ``frac``, ``exp``)
    and how many digits that part has, or ``part`` None outside a number (strings included)."""

    def __init__(self):
        self.part: Optional[str] = None
        self.digits = 0
        self._string = False
        self._escape = False

    def full(self) -> bool:
        return self.part is not None and self.digits >= NUMBER_DIGITS[self.part]

    def feed(self, data: bytes) -> None:
        for b in data:
            if self._string:
                if self._escape:
                    self._escape = False
                elif b == 0x5C:                               # backslash
                    self._escape = True
                elif b == 0x22:                               # closing quote
                    self._string = False
            elif b in _DIGITS:
                if self.part is None:
                    self.part, self.digits = "int", 0
                self.digits += 1
            elif b == 0x2E and self.part == "int":            # "."
                self.part, self.digits = "frac", 0
            elif b in b"eE" and self.part is not None:
                self.part, self.digits = "exp", 0
            elif b in b"+-" and self.part == "exp" and self.digits == 0:
                pass
            elif b == 0x2D:                                   # "-" opens a number
                self.part, self.digits = "int", 0
            else:
                self.part = None
                self._string = b == 0x22


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."
