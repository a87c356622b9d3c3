"""Every sampling parameter, declared once: its name, kind, default, bounds, help text, where the
sampler applies it, and the spelling under which each HTTP front takes it.

Everything else is derived from ``PARAMS``: the wire's ``Sampling`` model (llmd.protocol), the
runtime's frozen ``SamplingParams`` and its checks (runtime/request.py), the Python client's keys
(clients/client.py), the knobs of the HTTP fronts' bodies (clients/http_options.py), and the
``params`` table of docs/protocol.md (``python -m llmd.sampling_fields``). docs/protocol.md says
how to add one.

Pure Python: no torch, no pydantic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

OPENAI = "openai"        # /v1/completions and /v1/chat/completions
LLAMA = "llama.cpp"      # /completion, /infill and Ollama's options, in llama.cpp's spelling
FRONTS = (OPENAI, LLAMA)

KINDS = ("int", "float", "bool", "texts", "token_ids", "grammar")
PENALTY, FILTER = "penalty", "filter"      # stages of the sampler (runtime/sampler.py)
TOKEN_ID_LIMIT = 1 << 31


class Spelling(NamedTuple):
    """How a front names a parameter. ``high``: the front also takes values past the parameter's
    upper bound, up to this one; they mean the upper bound (llama.cpp's ``typical_p`` 5 is off, 1)."""

    name: str
    high: Optional[float] = None


@dataclass(frozen=True)
class Param:
    name: str
    kind: str                       # one of KINDS
    default: Any
    help: str
    low: Optional[float] = None     # numbers: the bounds; ``open_*``: the bound itself is out of range
    high: Optional[float] = None
    open_low: bool = False
    open_high: bool = False
    optional: bool = False          # nil (None) is a value: "not set"
    items: int = 0                  # texts, token_ids: at most this many
    item_len: int = 0               # texts: each of 1 to item_len characters
    stage: str = ""                 # PENALTY or FILTER: a knob of the distribution, off at its default
    fronts: dict = field(default_factory=dict)   # front -> Spelling, for the knobs the fronts pass on as they are
    chain: str = ""                 # its name in llama.cpp's ``samplers`` chain
    wire: bool = True               # False: a library keyword only, never on the wire

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {KINDS}")
        if self.stage and self.kind not in ("int", "float"):
            raise ValueError(f"{self.name}: a knob of the sampler is a number")
        if self.default is not None or not self.optional:
            self.check(self.default)

    def is_off(self, value: Any) -> bool:
        """True where ``value`` leaves the distribution as it is (its default, for a knob)."""
        return value == self.default

    def range_text(self) -> str:
        """The bounds as docs and errors write them: ``[0, 1)``, ``≥ 0``."""
        if self.kind not in ("int", "float") or self.low is None:
            return ""
        lo = ("(" if self.open_low else "[") + _num(self.low)
        return f"{lo}, {_num(self.high)}" + (")" if self.open_high else "]")

    def describe(self) -> str:
        """What a value must be, for an error message."""
        text = {"int": f"an integer in {self.range_text()}", "float": f"a finite number in {self.range_text()}",
                "bool": "true or false",
                "texts": f"at most {self.items} strings of 1 to {self.item_len} characters",
                "token_ids": f"at most {self.items} token ids in [0, 2^31)",
                "grammar": "a grammar"}[self.kind]
        return f"nil or {text}" if self.optional else text

    def check(self, value: Any) -> Any:
        """``value`` as the runtime keeps it (a sequence as a tuple); ValueError naming the field."""
        if value is None and self.optional:
            return None
        if self.kind == "grammar":
            return value
        if self.kind in ("texts", "token_ids"):
            return self._check_items(value)
        if self.kind == "bool":
            self._require(isinstance(value, bool), value)
            return value
        self._require(_is_number(value, self.kind), value)
        if not math.isfinite(value):
            raise ValueError(f"{self.name} must be a finite number, got {value!r}")
        self._require(self.in_range(value), value)
        return value

    def in_range(self, value: float) -> bool:
        lo_ok = self.low is None or (value > self.low if self.open_low else value >= self.low)
        return lo_ok and (self.high is None or (value < self.high if self.open_high else value <= self.high))

    def _check_items(self, value: Any) -> tuple:
        if self.kind == "texts" and isinstance(value, str):
            value = (value,)
        self._require(isinstance(value, (list, tuple)) and len(value) <= self.items, value)
        if self.kind == "texts":
            ok = all(isinstance(s, str) and 0 < len(s) <= self.item_len for s in value)
        else:
            ok = all(_is_number(t, "int") and 0 <= t < TOKEN_ID_LIMIT for t in value)
        self._require(ok, value)
        return tuple(value)

    def _require(self, ok: bool, value: Any) -> None:
        if not ok:
            shown = repr(value)
            raise ValueError(f"{self.name} must be {self.describe()}, got {shown[:80]}")


def _is_number(value: Any, kind: str) -> bool:
    types = (int,) if kind == "int" else (int, float)
    return isinstance(value, types) and not isinstance(value, bool)


def _num(x: float) -> str:
    for power in (20, 31, 63):
        if x == 1 << power:
            return f"2^{power}"
    return str(int(x)) if float(x).is_integer() else str(x)


def _both(name: str, llama: str = "", llama_high: Optional[float] = None) -> dict:
    return {OPENAI: Spelling(name), LLAMA: Spelling(llama or name, llama_high)}


MAX_TOKENS = 1 << 20

PARAMS: tuple[Param, ...] = (
    Param("max_tokens", "int", 64, "the most tokens to generate", low=1, high=MAX_TOKENS),
    Param("prompt_only", "bool", False, "true: compute the prompt into the prefix cache and generate nothing "
          "(the `done` event comes with no tokens, `finish_reason` `length`); an editor sends one per edit with the "
          "document's `replace` key so the next completion finds its prompt cached"),
    Param("temperature", "float", 0.0, "0 samples greedily (the most likely token)", low=0, high=100,
          fronts=_both("temperature"), chain="temperature"),
    Param("top_k", "int", 0, "keep the k most likely tokens (ties at the k-th kept); 0: off", low=0, high=MAX_TOKENS,
          stage=FILTER, fronts=_both("top_k"), chain="top_k"),
    Param("top_p", "float", 1.0, "keep the most likely tokens whose probability reaches top_p; 1: off", low=0,
          high=1, open_low=True, stage=FILTER, fronts=_both("top_p"), chain="top_p"),
    Param("typical_p", "float", 1.0, "locally typical sampling: keep the tokens whose surprise is nearest the "
          "distribution's entropy until their probability reaches typical_p; 1: off", low=0, high=1, open_low=True,
          stage=FILTER, fronts=_both("typical_p", llama_high=100), chain="typ_p"),
    Param("min_p", "float", 0.0, "drop tokens less likely than min_p times the most likely one; 0: off", low=0,
          high=1, open_high=True, stage=FILTER, fronts=_both("min_p"), chain="min_p"),
    Param("repetition_penalty", "float", 1.0, "over the prompt and the output: a seen token's logit is divided by "
          "it when positive, multiplied when negative; 1: off", low=0, high=10, open_low=True, stage=PENALTY,
          fronts=_both("repetition_penalty", "repeat_penalty")),
    Param("presence_penalty", "float", 0.0, "over the output: subtracted from the logit of every token it holds; "
          "0: off", low=-2, high=2, stage=PENALTY, fronts=_both("presence_penalty")),
    Param("frequency_penalty", "float", 0.0, "over the output: subtracted once per occurrence; 0: off", low=-2,
          high=2, stage=PENALTY, fronts=_both("frequency_penalty")),
    Param("seed", "int", None, "seeds the request's own random stream: the same tokens whatever shares the step",
          low=0, high=1 << 63, open_high=True, optional=True),
    Param("stop", "texts", (), "strings that end the output; removed from it", items=16, item_len=256),
    Param("stop_token_ids", "token_ids", (), "token ids that end the output", items=64),
    Param("ignore_eos", "bool", False, "go on past the end-of-sequence token"),
    Param("logprobs", "int", None, "the chosen token's logprob (0) plus the top n", low=0, high=20, optional=True),
    Param("grammar", "grammar", None, "`{\"kind\": \"json_object\"}` or "
          "`{\"kind\": \"json_schema\", \"text\": SCHEMA}` "
          "(≤ 64 KiB): the output is constrained token by token to a JSON object, or to one the schema accepts, and "
          "ends when it is complete; a schema that does not compile, or uses a keyword the grammar library does not "
          "implement, fails with `invalid_request`. Such a request does not speculate", optional=True),
    Param("skip_special_tokens", "bool", True, "leave special tokens out of the text", wire=False),
)

BY_NAME = {p.name: p for p in PARAMS}
WIRE = tuple(p for p in PARAMS if p.wire)
KNOBS = tuple(p for p in PARAMS if p.stage)
PENALTIES = tuple(p for p in PARAMS if p.stage == PENALTY)


def for_front(front: str) -> tuple[tuple[Param, Spelling], ...]:
    """The parameters ``front`` takes as they are, with its spelling of each."""
    return tuple((p, p.fronts[front]) for p in PARAMS if front in p.fronts)


def markdown_table() -> str:
    """The ``params`` table of docs/protocol.md."""
    rows = ["| key | type | default | range | HTTP | |", "|---|---|---|---|---|---|"]
    for p in WIRE:
        rows.append(f"| `{p.name}` | {_type_text(p)} | {_default_text(p)} | {p.range_text()} | {_fronts_text(p)} "
                    f"| {p.help} |")
    return "\n".join(rows)


def _type_text(p: Param) -> str:
    text = {"int": "int", "float": "number", "bool": "bool", "grammar": "map",
            "texts": f"array (≤ {p.items}) of strings (1–{p.item_len} chars)",
            "token_ids": f"array (≤ {p.items}) of token ids"}[p.kind]
    return f"{text} or nil" if p.optional else text


def _default_text(p: Param) -> str:
    if p.default is None:
        return "nil"
    if isinstance(p.default, bool):
        return str(p.default).lower()
    return "`[]`" if p.default == () else str(p.default)


def _fronts_text(p: Param) -> str:
    return ", ".join(front if s.name == p.name else f"{front} `{s.name}`" for front, s in p.fronts.items())


if __name__ == "__main__":
    print(markdown_table())
