"""A request's state inside the engine, and the sampling parameters a caller sets.

A request has no phases. ``num_computed_tokens`` chases ``num_tokens`` (prompt + output, plus
speculative tokens while they are being verified); the scheduler gives it a token budget each step.
Only the scheduler writes ``status`` and ``num_computed_tokens``; only the block manager writes
``block_ids``.
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from .errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
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


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Validated when built; every field is bounded."""

    max_tokens: int = 64
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # >1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None    # None: none; 0: chosen token only; n: chosen plus top-n
    skip_special_tokens: bool = True
    prompt_only: bool = False         # compute the prompt into the prefix cache, generate nothing
    grammar: Optional[Grammar] = None # constrain the output (structured output, forced tool calls)

    def __post_init__(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise InvalidRequest(msg)

        def finite(name: str):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                  f"{name} must be a finite number, got {v!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            finite(name)
        check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and 1 <= self.max_tokens <= 1 << 20,
              f"max_tokens must be an integer from 1 to {1 << 20}, got {self.max_tokens!r}")
        check(isinstance(self.prompt_only, bool), f"prompt_only must be true or false, got {self.prompt_only!r}")
        check(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        check(isinstance(self.top_k, int) and 0 <= self.top_k <= 1 << 20, f"top_k must be an integer >= 0, got {self.top_k!r}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(0.0 <= self.min_p < 1.0, f"min_p must be in [0, 1), got {self.min_p}")
        check(0.0 < self.repetition_penalty <= 10.0, f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 1 << 63),
              f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN for s in self.stop),
              f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_LEN} characters")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers")
        check(len(self.stop_token_ids) <= 64, "at most 64 stop token ids")
        object.__setattr__(self, "grammar", Grammar.parse(self.grammar))
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
              f"logprobs must be None or an integer from 0 to {MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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
        self.output_logprobs: list = []
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
