"""The completion logic behind ``llmd lsp``, apart from the LSP wiring.

One request goes: cache lookup (answer at once on a hit) → debounce (a newer request for the
same document makes this one give up before reaching the daemon) → an ``infill`` sent with the
document's ``replace`` key (the daemon cancels the document's previous infill still running) →
trim → cache store. A request that gives up, is replaced or is cancelled by the editor answers
None. Every outcome is counted and every answered request's latency is logged.

State: ``_latest`` (the newest request number per document) is written only by ``complete``;
the cache and the stats are written only here too. All of it lives on the server's event loop.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .backend import async_client, features
from .client import AsyncClient, ClientError
from llmd.protocol import Done, Error, Token
from .lsp_cache import CompletionCache
from .lsp_prompt import FimBudget, build_fim, fit_budget
from .lsp_trim import trim_suggestion

log = logging.getLogger("llmd.lsp")


@dataclass(frozen=True)
class LspConfig:
    socket: Optional[str] = None
    budget: FimBudget = field(default_factory=FimBudget)
    max_tokens: int = 16
    max_lines: int = 8
    debounce_ms: float = 15.0
    cache_size: int = 64
    temperature: float = 0.0
    timeout_s: float = 10.0

    def __post_init__(self):
        if self.max_tokens < 1 or self.max_lines < 1:
            raise ValueError("max_tokens and max_lines must be >= 1")
        if self.debounce_ms < 0 or self.timeout_s <= 0:
            raise ValueError("debounce_ms must be >= 0 and timeout_s > 0")
        if self.cache_size < 0:
            raise ValueError(f"--cache-size must be >= 0, got {self.cache_size}")


def replace_key(uri: str) -> str:
    """The daemon-side ``replace`` key of a document: one infill in flight per document."""
    return "lsp:" + hashlib.sha256(uri.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


class CompletionStats:
    """Outcome counts and the latencies (ms) of the last ``window`` answered requests."""

    OUTCOMES = ("completed", "cache_hit", "debounced", "replaced", "cancelled", "empty", "error")

    def __init__(self, window: int = 1000):
        self.counts = dict.fromkeys(self.OUTCOMES, 0)
        self.latencies_ms: collections.deque = collections.deque(maxlen=window)

    def record(self, outcome: str, ms: float) -> None:
        self.counts[outcome] += 1
        if outcome in ("completed", "cache_hit", "empty"):
            self.latencies_ms.append(ms)
        log.info("completion %s in %.1f ms", outcome, ms)

    def snapshot(self) -> dict:
        lat = list(self.latencies_ms)
        return {**self.counts, "latency_ms": {"p50": percentile(lat, 50), "p95": percentile(lat, 95), "n": len(lat)}}


class CompletionService:
    def __init__(self, config: LspConfig, client: Optional[AsyncClient] = None):
        self.config = config
        self.client = client or async_client(config.socket, timeout=config.timeout_s)
        self.cache = CompletionCache(config.cache_size)
        self.stats = CompletionStats()
        self._latest: dict[str, int] = {}
        self._serial = 0
        self._context_length: Optional[int] = None     # the model's, asked once
        self._chars_per_token: Optional[float] = None  # measured from answers; None: the configured one

    async def complete(self, uri: str, text: str, offset: int, others: Sequence[tuple[str, str]] = ()) -> Optional[str]:
        """A suggestion to insert at ``offset`` in document ``uri``, or None."""
        start = time.perf_counter()
        outcome, suggestion = "error", None
        try:
            outcome, suggestion = await self._complete(uri, text, offset, others)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except ClientError as e:
            log.warning("completion failed: %s", e)
        finally:
            self.stats.record(outcome, 1000 * (time.perf_counter() - start))
        return suggestion

    async def _complete(self, uri, text, offset, others) -> tuple[str, Optional[str]]:
        prefix_all, suffix_all = text[:offset], text[offset:]
        self._serial += 1
        me = self._latest[uri] = self._serial
        hit = self.cache.lookup(uri, prefix_all, suffix_all)
        if hit is not None:
            return "cache_hit", hit
        if self.config.debounce_ms:
            await asyncio.sleep(self.config.debounce_ms / 1000)
            if self._latest.get(uri) != me:
                return "debounced", None
        raw, final = await self._ask(uri, text, offset, others)
        if isinstance(final, Done) and final.finish_reason == "cancelled":
            return "replaced", None
        if isinstance(final, Error):
            log.warning("daemon refused the completion: %s: %s", final.code, final.message)
            return "error", None
        line_before = prefix_all[prefix_all.rfind("\n") + 1:]
        line_after = suffix_all.split("\n", 1)[0]
        suggestion = trim_suggestion(raw, line_before, line_after, suffix_all, self.config.max_lines)
        if not suggestion:
            return "empty", None
        self.cache.store(uri, prefix_all, suffix_all, suggestion)
        return "completed", suggestion

    async def _ask(self, uri, text, offset, others) -> tuple[str, object]:
        """Build the prompt within the model's context and ask; a prompt the daemon finds too long
        (the ratio was optimistic) is retried once with half the characters per token."""
        if self._context_length is None:
            models = await self.client.models()
            self._context_length = int(models[0].get("context_length") or 0) or None if models else None
        for _ in range(2):
            budget = fit_budget(self.config.budget, self._context_length, self.config.max_tokens + 8,
                                self._chars_per_token)
            prompt = build_fim(text, offset, others, budget)
            raw, final = await self._infill(uri, prompt)
            if isinstance(final, Done) and final.usage.get("prompt_tokens"):
                chars = len(prompt.prefix) + len(prompt.suffix) + sum(len(p) + len(t) for p, t in prompt.files)
                self._measure(chars / final.usage["prompt_tokens"])
            if not (isinstance(final, Error) and final.code == "invalid_request" and "context" in final.message):
                break
            self._chars_per_token = budget.chars_per_token / 2
        return raw, final

    def _measure(self, ratio: float) -> None:
        """Move the characters-per-token estimate toward an observed ratio (a running average)."""
        current = self._chars_per_token or self.config.budget.chars_per_token
        self._chars_per_token = max(0.25, 0.7 * current + 0.3 * ratio)

    async def _infill(self, uri: str, prompt) -> tuple[str, object]:
        stream = await self.client.infill(prompt.prefix, prompt.suffix, files=list(prompt.files) or None,
                                          replace=replace_key(uri), max_tokens=self.config.max_tokens,
                                          priority="interactive", temperature=self.config.temperature)
        parts = []
        try:
            async for event in stream:
                if isinstance(event, Token):
                    parts.append(event.text)
        finally:
            await stream.aclose()
        return "".join(parts), stream.final

    def backend_status(self) -> dict:
        """Where completions come from and how each protocol feature is served there."""
        return {"address": getattr(self.client, "address", None), "features": features(self.client),
                "off": [k for k, v in features(self.client).items() if v != "native"]}

    def forget(self, uri: str) -> None:
        self._latest.pop(uri, None)
        self.cache.forget(uri)

    async def aclose(self) -> None:
        await self.client.aclose()
