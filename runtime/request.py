"""A request's state inside the engine, and the sampling parameters a caller sets.

A request has no phases. ``num_computed_tokens`` chases ``num_tokens`` (prompt + output, plus
speculative tokens while they are being verified); the scheduler gives it a token budget each step.
Only the scheduler writes ``status`` and ``num_computed_tokens``; only the block manager writes
``block_ids``.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, make_dataclass
from typing import Optional

from llmd.sampling_fields import KNOBS, PARAMS, PENALTIES

from .errors import InvalidRequest

MAX_GRAMMAR_CHARS = 1 << 16
GRAMMAR_KINDS = ("json_object", "json_schema")


class Priority(enum.IntEnum):
    """Lower value is served first and preempted last."""

    INTERACTIVE = 0
    NORMAL = 1
    BATCH = 2

    @classmethod
    def parse(cls, value: "Priority | str | int") -> "Priority":
        if isinstance(value, Priority):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise InvalidRequest(f"priority must be interactive, normal or batch, not {value!r}") from None
        try:
            return cls(value)
        except ValueError:
            raise InvalidRequest(f"priority must be 0, 1 or 2, not {value!r}") from None


class Status(enum.Enum):
    WAITING = "waiting"        # queued, or preempted and waiting to be recomputed
    RUNNING = "running"        # holds blocks and is scheduled each step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"              # an EOS or stop token id, or a stop string
    LENGTH = "length"          # max_tokens reached, or the context window is full
    ABORT = "abort"            # cancelled by the caller
    ERROR = "error"            # failed inside the engine; other requests go on


@dataclass(frozen=True)
class Grammar:
    """What a constrained request's output must match: any JSON object (``json_object``) or a JSON
    schema (``json_schema``, its text in ``text``). Compiled into a token mask by runtime.grammar."""

    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequest(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"a grammar's text must be a string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.kind == "json_schema" and not self.text:
            raise InvalidRequest("a json_schema grammar needs the schema")

    @classmethod
    def parse(cls, value: "Grammar | dict | None") -> "Optional[Grammar]":
        if value is None or isinstance(value, Grammar):
            return value
        if isinstance(value, dict) and set(value) <= {"kind", "text"}:
            return cls(**value)
        raise InvalidRequest("grammar must be {\"kind\": ..., \"text\": ...}")


class _SamplingChecks:
    """The checks and views every SamplingParams has; its fields are llmd.sampling_fields.PARAMS."""

    def __post_init__(self):
        for p in PARAMS:
            try:
                object.__setattr__(self, p.name, p.check(getattr(self, p.name)))
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        object.__setattr__(self, "grammar", Grammar.parse(self.grammar))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return any(not p.is_off(getattr(self, p.name)) for p in PENALTIES)

    @property
    def knobs_on(self) -> frozenset[str]:
        """The sampler's knobs (penalties and filters) set away from off."""
        return frozenset(p.name for p in KNOBS if not p.is_off(getattr(self, p.name)))


_TYPES = {"int": "int", "float": "float", "bool": "bool", "texts": "tuple[str, ...]", "token_ids": "tuple[int, ...]",
          "grammar": "Grammar"}
SamplingParams = make_dataclass(
    "SamplingParams", [(p.name, f"Optional[{_TYPES[p.kind]}]" if p.optional else _TYPES[p.kind],
                        field(default=p.default)) for p in PARAMS],
    bases=(_SamplingChecks,), frozen=True, kw_only=True,
    namespace={"__module__": __name__, "__doc__": "How to pick each next token: the fields of "
               "llmd.sampling_fields.PARAMS, by keyword. Validated when built; every field is bounded."})


@dataclass
class RequestMetrics:
    arrival_s: float = field(default_factory=time.monotonic)
    first_scheduled_s: Optional[float] = None
    first_token_s: Optional[float] = None
    finished_s: Optional[float] = None
    cached_tokens: int = 0           # prompt tokens served from the prefix cache (shifted ones included)
    shifted_tokens: int = 0          # of which taken from another position (approximate)
    preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0

    def as_dict(self, num_prompt: int, num_output: int) -> dict:
        end = self.finished_s or time.monotonic()
        ttft = (self.first_token_s - self.arrival_s) if self.first_token_s else None
        decode = (end - self.first_token_s) if self.first_token_s else None
        return {
            "prompt_tokens": num_prompt,
            "output_tokens": num_output,
            "cached_tokens": self.cached_tokens,
            "shifted_tokens": self.shifted_tokens,
            "queued_s": (self.first_scheduled_s - self.arrival_s) if self.first_scheduled_s else None,
            "ttft_s": ttft,
            "decode_s": decode,
            "e2e_s": end - self.arrival_s,
            "tokens_per_s": (num_output - 1) / decode if decode and num_output > 1 else None,
            "preemptions": self.preemptions,
            "spec_proposed": self.spec_proposed,
            "spec_accepted": self.spec_accepted,
            "spec_acceptance": (self.spec_accepted / self.spec_proposed) if self.spec_proposed else None,
            "spec_mean_accepted_len": (self.spec_accepted / self.spec_steps) if self.spec_steps else None,
        }


class Request:
    """One sequence. ``token_ids`` = prompt + verified output (+ speculative tokens being verified)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: Priority = Priority.NORMAL, cache_salt: Optional[str] = None,
                 eos_token_ids: tuple[int, ...] = (), reuse_key: Optional[str] = None):
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []   # proposals awaiting verification (not in token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0            # prefix-cache hit length at the last admission
        self.block_ids: list[int] = []        # written by BlockManager only
        self.status = Status.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.error: Optional[str] = None
        self.stop_reason: Optional[str | int] = None
        self.metrics = RequestMetrics()
        self.arrival_seq = 0                  # FIFO order within a priority class, set by the scheduler
        # how its tokens are drawn and checked, and what the caller has not been sent yet: set by the
        # engine when it takes the request (runtime.output.RequestOutput)
        self.generator = None                 # torch.Generator of a sampled request (None: greedy)
        self.matcher = None                   # grammar.Matcher of a constrained request
        self.output = None                    # output.RequestOutput
        self.spec_k: int = 0                  # current speculative depth, written by the proposer policy
        # shifted reuse (BlockManager): the key its tables are remembered and looked up under, the
        # first position whose keys and values are approximate, and how many changed tokens they missed
        self.reuse_key = reuse_key
        self.stale_from: Optional[int] = None
        self.stale = 0
        self.hole: Optional[tuple[int, int]] = None   # positions whose keys and values are being copied in

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={self.block_ids})")
