"""Sampling fields as llama.cpp spells them, shared by llama.cpp's ``/completion`` and Ollama's
``options``, and how each becomes llmd's sampling map.

Unlike the OpenAI bodies, these models forbid unknown fields: a field llmd does not know may change
the output, so it is refused (400, naming it) rather than ignored. The knobs llmd has (temperature,
the filters, the penalties) come from llmd.sampling_fields through ``http_knobs``; fields of samplers
llmd lacks (tail-free, mirostat) are taken only at the value that turns them off.

Penalty windows: llmd's ``repeat_penalty`` covers the prompt and the output (llama.cpp's
``repeat_last_n`` -1), its presence and frequency penalties the output. ``repeat_last_n`` 0 turns
all three off, as in llama.cpp; another window with a penalty set is refused.
"""
from __future__ import annotations

from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field

from llmd.sampling_fields import LLAMA, PENALTIES

from .http_api import MAX_STOP, MAX_TOKENS, Finite, HttpError, StopText
from .http_knobs import knob_model, knobs

SEED_MASK = (1 << 63) - 1        # llmd's seeds are 63-bit; a client's 64-bit seed is folded in


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class LlamaSampling(knob_model("_LlamaKnobs", LLAMA, Strict)):
    """llama.cpp's sampling fields: the knobs (``temperature``, ``top_k``, ``typical_p``,
    ``repeat_penalty`` ...: http_knobs) and these."""

    seed: Optional[Annotated[int, Field(ge=-1, lt=1 << 64)]] = None
    stop: Optional[Annotated[list[StopText], Field(max_length=MAX_STOP)]] = None
    repeat_last_n: Optional[Annotated[int, Field(ge=-1, le=MAX_TOKENS)]] = None
    # samplers llmd lacks: accepted only where they are off
    tfs_z: Optional[Annotated[Finite, Field(ge=0, le=100)]] = None
    mirostat: Optional[Annotated[int, Field(ge=0, le=2)]] = None
    # mirostat's settings: no effect while mirostat is off
    mirostat_tau: Optional[Annotated[Finite, Field(ge=0, le=1000)]] = None
    mirostat_eta: Optional[Annotated[Finite, Field(ge=0, le=1000)]] = None

    def last_n(self) -> tuple[str, Optional[int]]:
        """The penalty window: the field's name as sent, and its value."""
        return "repeat_last_n", self.repeat_last_n

    def sampling(self, where: str = "") -> dict:
        """llmd's sampling map for these fields (HttpError 400 naming a field llmd cannot honour);
        ``where`` prefixes the names in messages (``options.``)."""
        off = {"tfs_z": (self.tfs_z is None or self.tfs_z >= 1, "tail-free sampling", 1.0),
               "mirostat": (not self.mirostat, "mirostat sampling", 0)}
        for name, (ok, what, neutral) in off.items():
            if not ok:
                refuse(where + name, f"llmd has no {what}; only {neutral} (off) is accepted")
        window, last_n = self.last_n()
        s = {**knobs(self, LLAMA), "seed": fold_seed(self.seed), "stop": self.stop or None}
        s = {k: v for k, v in s.items() if v is not None}
        return {**windowed(s, last_n, where + window), **{k: v for k, v in s.items() if k not in _PENALTY_NAMES}}


def refuse(name: str, why: str) -> None:
    raise HttpError(400, f"{name}: {why}", param=name)


def fold_seed(seed: Optional[int]) -> Optional[int]:
    """-1 (llama.cpp's and Ollama's "random") is no seed; a 64-bit seed keeps its low 63 bits."""
    return None if seed is None or seed < 0 else seed & SEED_MASK


_PENALTY_NAMES = {p.name for p in PENALTIES}


def windowed(sampling: dict, last_n: Optional[int], name: str) -> dict:
    """The penalties of ``sampling`` under llama.cpp's window ``last_n`` (see the module docstring)."""
    s = {p.name: sampling[p.name] for p in PENALTIES if p.name in sampling}
    if last_n == 0:
        return {}
    active = any(not p.is_off(s[p.name]) for p in PENALTIES if p.name in s)
    if active and last_n not in (None, -1):
        refuse(name, "llmd's repeat_penalty covers the whole prompt and output, and its presence and frequency "
               "penalties the output: send -1 (the whole context) or 0 (penalties off)")
    return s


def predicted(n: Optional[int], default: int) -> dict:
    """llama.cpp's ``n_predict`` and Ollama's ``num_predict``: absent, the default; -1 (no limit) and
    -2 (fill the context) run to the end of text or of the context window; 0 computes the prompt
    into the cache and generates nothing."""
    if n is None:
        return {"max_tokens": default}
    if n < 0:
        return {"max_tokens": MAX_TOKENS}
    if n == 0:
        return {"max_tokens": 1, "prompt_only": True}
    return {"max_tokens": n}
