"""The completion logic behind ``llmd lsp``, apart from the LSP wiring.

One request goes: cache lookup (answer at once on a hit) → debounce (a newer request for the
same document makes this one give up before reaching the daemon) → an ``infill`` sent with the
document's ``replace`` key (the daemon cancels the document's previous infill still running) →
trim → cache store. A request that gives up, is replaced or is cancelled by the editor answers
None. Every outcome is counted and every answered request's latency is logged.

Prefill while typing: after an edit (``prefill``), once the debounce passes without another edit or
a completion of the document, its new prompt goes to the daemon as a prompt-only infill under the
same ``replace`` key, interactive, so when the completion is asked for its prompt is already cached,
or the completion takes over the prefill's computed blocks. A newly
opened document gets a prompt-only infill of its whole window at batch priority under a key of its
own (``warm_key``), which completions never replace.

Prompt budget: until a document's window is known to be cached (its warm-up answered, or a completion
with the whole window did), its prompt is cut to what the daemon computes within ``target_ms``, at
the prompt rate measured from the daemon's own answers (``PromptRate``); the window then grows to
the configured one.

Line split (``split="line"``, the default): the prompt's prefix ends at the start of the cursor's
line and the line up to the cursor goes after the middle token, as the start of the middle that the
model continues. While the user types on a line the prompt up to the middle token does not change,
so a keystroke computes only the line's new tokens, exactly. After a new line the prefix still ends at
the document's anchor (the middle carries the lines since, up to ``MAX_MIDDLE_CHARS``) while the new
line's own prompt is computed at batch priority under ``anchor_key``; once it answers, the new line
start is the anchor.

Shifted reuse (``shift_reuse``, off unless asked): every infill asks the daemon to take the keys and
values its earlier infills of the document computed (the suffix, after a keystroke in the prefix) at
their new positions instead of computing them again. Approximate: those keys and values were computed
before the edit (the daemon bounds how many changed tokens they may have missed, ``shift_max_stale``),
and fill-in-the-middle models read the gap from them: on the real coder it costs most completions
(docs/perf/2026-12-01-quantized-kernels.md, "Completion quality of the prompt layouts").

Suffix first (``layout="spm"``): the prompt starts with the text after the cursor, so what is cached
serves one cursor spot (one suffix) rather than the whole document. A document is warm at a spot:
opening it warms nothing (the cursor is unknown), and a completion at a cold spot is cut to
``target_ms`` while a prompt-only request of the whole window at that spot runs at batch priority
under the warm-up key; once it answers, that spot gets the whole window.

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
from .lsp_prompt import MAX_MIDDLE_CHARS, SPLITS, FimBudget, build_fim, fit_budget, head_at_line
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
    prefill: bool = True            # prompt-only requests on open and on each edit
    target_ms: float = 150.0        # a cold document's first completion should fit in this
    layout: str = "psm"             # the infill prompt's order: "psm" or "spm" (suffix first)
    shift_reuse: bool = False       # the daemon may move a document's keys and values after an edit
    split: str = "line"             # the prefix ends at the cursor's line start ("line") or the cursor

    def __post_init__(self):
        if self.max_tokens < 1 or self.max_lines < 1:
            raise ValueError("max_tokens and max_lines must be >= 1")
        if self.debounce_ms < 0 or self.timeout_s <= 0:
            raise ValueError("--debounce-ms must be >= 0 and --timeout > 0")
        if not self.target_ms > 0:
            raise ValueError(f"--target-ms must be > 0, got {self.target_ms}")
        if self.cache_size < 0:
            raise ValueError(f"--cache-size must be >= 0, got {self.cache_size}")
        if self.layout not in ("psm", "spm"):
            raise ValueError(f"--fim-layout must be psm or spm, got {self.layout!r}")
        if self.split not in SPLITS:
            raise ValueError(f"--fim-split must be line or cursor, got {self.split!r}")


def _document_key(kind: str, uri: str) -> str:
    return kind + ":" + hashlib.sha256(uri.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def replace_key(uri: str) -> str:
    """The daemon-side ``replace`` key of a document: one infill in flight per document."""
    return _document_key("lsp", uri)


def anchor_key(uri: str) -> str:
    """The ``replace`` key of a document's prompt for a new line (line split), in the background."""
    return _document_key("lsp-line", uri)


def warm_key(uri: str) -> str:
    """The ``replace`` key of a document's warm-up prefill (never replaced by a completion)."""
    return _document_key("lsp-warm", uri)


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


MIN_PREFIX_TOKENS = 32
MIN_SUFFIX_TOKENS = 8


class PromptRate:
    """Prompt tokens per second the daemon computes, from the ``usage`` and ``timings`` of its
    answers (a running average over answers that computed at least ``min_tokens``)."""

    def __init__(self, min_tokens: int = 16):
        self.min_tokens = min_tokens
        self.tokens_per_s: Optional[float] = None

    def observe(self, usage: dict, timings: dict) -> None:
        computed = (usage.get("prompt_tokens") or 0) - (usage.get("cached_tokens") or 0)
        ms = timings.get("prompt_ms") or 0
        if computed < self.min_tokens or ms <= 0:
            return
        rate = computed / (ms / 1000)
        self.tokens_per_s = rate if self.tokens_per_s is None else 0.7 * self.tokens_per_s + 0.3 * rate


def speed_budget(budget: FimBudget, tokens_per_s: Optional[float], target_ms: float) -> FimBudget:
    """``budget`` cut so its whole prompt is computed within ``target_ms`` at ``tokens_per_s``: the
    suffix keeps at most a quarter of the room (never below ``MIN_SUFFIX_TOKENS``), the other files'
    context goes first, then the prefix (never below ``MIN_PREFIX_TOKENS``); unknown speed leaves it
    as it is."""
    if tokens_per_s is None:
        return budget
    room = int(tokens_per_s * target_ms / 1000)
    suffix = min(budget.suffix_tokens, max(MIN_SUFFIX_TOKENS, room // 4))
    prefix = max(MIN_PREFIX_TOKENS, min(budget.prefix_tokens, room - suffix))
    context = max(0, min(budget.context_tokens, room - suffix - prefix))
    return FimBudget(prefix, suffix, context, budget.chars_per_token)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


class CompletionStats:
    """Outcome counts and the latencies (ms) of the last ``window`` answered requests."""

    OUTCOMES = ("completed", "cache_hit", "debounced", "replaced", "cancelled", "empty", "error",
                "prefilled", "prefill_replaced", "prefill_error")

    def __init__(self, window: int = 1000):
        self.counts = dict.fromkeys(self.OUTCOMES, 0)
        self.latencies_ms: collections.deque = collections.deque(maxlen=window)

    def record(self, outcome: str, ms: float) -> None:
        self.counts[outcome] += 1
        if outcome in ("completed", "cache_hit", "empty"):
            self.latencies_ms.append(ms)
        log.info("%s in %.1f ms", outcome if outcome.startswith("prefill") else "completion " + outcome, ms)

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
        self.rate = PromptRate()
        # the line split needs a backend that puts text after the middle token (llama.cpp's does not)
        self.split = config.split if features(self.client).get("middle", "native") == "native" else "cursor"
        self._warm: dict[str, Optional[str]] = {}      # document -> spot whose whole window is believed cached
        self._anchors: dict[str, tuple[int, str]] = {}  # document -> (line start the prefix ends at, digest before it)
        self._refreshing: dict[str, int] = {}          # document -> line start whose prompt is being computed
        self._edits: dict[str, int] = {}               # document -> edits seen (a prefill waits for the last)
        self._tasks: set[asyncio.Task] = set()

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
        for _ in range(2):
            spot = await self.spot(text, offset)
            budget, whole = await self.budget(uri, spot)
            if not whole and self.config.layout == "spm" and self.config.prefill:
                self._spawn(self._warm_spot(uri, text, offset, others, spot))
            prompt = build_fim(text, offset, others, budget, self.split, self._anchor(uri, text, offset, others))
            raw, final = await self._infill(uri, prompt)
            raw = prompt.completion(raw)
            self._observe(prompt, final)
            if whole and isinstance(final, Done) and final.finish_reason != "cancelled":
                self._warm[uri] = spot
            if not self._too_long(final, budget):
                break
        return raw, final

    async def full_budget(self) -> FimBudget:
        """The configured budget within the model's context window (asked once)."""
        if self._context_length is None:
            models = await self.client.models()
            self._context_length = int(models[0].get("context_length") or 0) or None if models else None
        return fit_budget(self.config.budget, self._context_length, self.config.max_tokens + 8, self._chars_per_token)

    async def spot(self, text: str, offset: int) -> Optional[str]:
        """What a cached window must share with a prompt at ``offset`` to serve it: nothing under psm
        (the window from the file's head serves every cursor), the suffix under spm."""
        if self.config.layout == "psm":
            return None
        full = await self.full_budget()
        return head_at_line(text[offset:], full.chars(full.suffix_tokens))

    async def budget(self, uri: str, spot: Optional[str] = None) -> tuple[FimBudget, bool]:
        """The budget for a prompt in ``uri`` at ``spot`` now, and whether it is the whole configured window."""
        full = await self.full_budget()
        if uri in self._warm and self._warm[uri] == spot:
            return full, True
        cut = speed_budget(full, self.rate.tokens_per_s, self.config.target_ms)
        return cut, cut == full

    def _too_long(self, final, budget: FimBudget) -> bool:
        """Did the daemon refuse the prompt as longer than the context? Then the characters-per-token
        ratio was optimistic: halve it for the next prompt."""
        if isinstance(final, Error) and final.code == "invalid_request" and "context" in final.message:
            self._chars_per_token = budget.chars_per_token / 2
            return True
        return False

    def _observe(self, prompt, final) -> None:
        if isinstance(final, Done) and final.usage.get("prompt_tokens"):
            self._measure(prompt.chars / final.usage["prompt_tokens"])
            self.rate.observe(final.usage, final.timings)
            u, t = final.usage, final.timings
            log.debug("daemon: %s prompt tokens, %s cached, %s generated; queued %s ms, prompt %s ms, decode %s ms",
                      u.get("prompt_tokens"), u.get("cached_tokens"), u.get("completion_tokens"),
                      t.get("queued_ms"), t.get("prompt_ms"), t.get("decode_ms"))

    # ---- prefill while typing ------------------------------------------------------------
    def opened(self, uri: str, text: str, others: Sequence[tuple[str, str]] = ()) -> None:
        """A document was opened: warm its whole window at batch priority (in the background; under
        spm nothing, as the cursor is not known yet)."""
        if self.config.prefill and self.config.layout == "psm":
            self._spawn(self._warm_up(uri, text, others))

    def edited(self, uri: str, text: str, offset: int, others: Sequence[tuple[str, str]] = ()) -> None:
        """The document changed, the cursor now at ``offset``: prefill the prompt the next completion
        will send (interactive, under the completion's key, so the completion takes it over), unless
        within the debounce another edit comes or a completion is asked (which computes it anyway)."""
        if self.config.prefill:
            self._edits[uri] = edit = self._edits.get(uri, 0) + 1
            self._spawn(self._prefill_edit(uri, text, offset, others, edit, self._latest.get(uri)))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm_up(self, uri, text, others) -> None:
        budget = await self.full_budget()
        # the cursor is unknown: its prompt runs from the start of the file, which any cursor within
        # the window shares up to itself
        offset = len(head_at_line(text, budget.chars(budget.prefix_tokens)))
        prompt = build_fim(text, offset, others, budget, self.split)
        final = await self._prefill(prompt, budget, warm_key(uri), "batch")
        if isinstance(final, Done) and final.finish_reason != "cancelled":
            self._warm[uri] = None

    async def _warm_spot(self, uri, text, offset, others, spot) -> None:
        """spm: compute the whole window at a cold cursor spot, at batch priority."""
        budget = await self.full_budget()
        final = await self._prefill(build_fim(text, offset, others, budget, self.split), budget,
                                    warm_key(uri), "batch")
        if isinstance(final, Done) and final.finish_reason != "cancelled":
            self._warm[uri] = spot

    async def _prefill_edit(self, uri, text, offset, others, edit: int, asked: Optional[int]) -> None:
        if self.config.debounce_ms:
            await asyncio.sleep(self.config.debounce_ms / 1000)
            if self._edits.get(uri) != edit or self._latest.get(uri) != asked:
                return
        budget, _ = await self.budget(uri, await self.spot(text, offset))
        prompt = build_fim(text, offset, others, budget, self.split, self._anchor(uri, text, offset, others))
        await self._prefill(prompt, budget, replace_key(uri), "interactive")

    # ---- where the prefix ends (line split) --------------------------------------------------
    def _anchor(self, uri: str, text: str, offset: int, others) -> Optional[int]:
        """The line start the prompt's prefix ends at: the document's anchor while the text before it
        is unchanged and the cursor within reach (a new line then keeps the cached prompt, and the
        new line's own prompt is computed in the background, taking over once it is cached), else
        the cursor's line start, which becomes the anchor."""
        if self.split != "line":
            return None
        line = text.rfind("\n", 0, offset) + 1
        stored = self._anchors.get(uri)
        if stored is not None:
            at, digest = stored
            if at <= line and offset - at <= MAX_MIDDLE_CHARS and digest == _digest(text[:at]):
                if at < line and self.config.prefill and self._refreshing.get(uri) != line:
                    self._refreshing[uri] = line
                    self._spawn(self._refresh_anchor(uri, text, offset, others, line))
                return at
        self._anchors[uri] = (line, _digest(text[:line]))
        return line

    async def _refresh_anchor(self, uri, text, offset, others, line) -> None:
        """Compute the prompt ending its prefix at ``line`` (batch priority); once cached it is the anchor."""
        budget, _ = await self.budget(uri, await self.spot(text, offset))
        prompt = build_fim(text, offset, others, budget, "line", line)
        final = await self._prefill(prompt, budget, anchor_key(uri), "batch")
        if self._refreshing.get(uri) == line:
            del self._refreshing[uri]
        if isinstance(final, Done) and final.finish_reason != "cancelled":
            at = self._anchors.get(uri, (-1, ""))[0]
            if at < line:
                self._anchors[uri] = (line, _digest(text[:line]))

    async def _prefill(self, prompt, budget: FimBudget, key: str, priority: str):
        start = time.perf_counter()
        final = None
        try:
            stream = await self._send(prompt, key, max_tokens=1, priority=priority, prompt_only=True)
            try:
                async for _ in stream:
                    pass
            finally:
                await stream.aclose()
            final = stream.final
            self._observe(prompt, final)
            if isinstance(final, Error) and not self._too_long(final, budget):
                log.warning("daemon refused the prefill: %s: %s", final.code, final.message)
        except ClientError as e:
            log.warning("prefill failed: %s", e)
        cancelled = isinstance(final, Done) and final.finish_reason == "cancelled"
        outcome = "prefilled" if isinstance(final, Done) and not cancelled else \
            "prefill_replaced" if cancelled else "prefill_error"
        self.stats.record(outcome, 1000 * (time.perf_counter() - start))
        return final

    def _measure(self, ratio: float) -> None:
        """Move the characters-per-token estimate toward an observed ratio (a running average)."""
        current = self._chars_per_token or self.config.budget.chars_per_token
        self._chars_per_token = max(0.25, 0.7 * current + 0.3 * ratio)

    async def _infill(self, uri: str, prompt) -> tuple[str, object]:
        # the model stops where the trimmed suggestion would end anyway: at the line's end when the
        # cursor is mid-line (one line is shown), else at two blank lines in a row
        mid_line = prompt.suffix.split("\n", 1)[0].strip()
        stream = await self._send(prompt, replace_key(uri), max_tokens=self.config.max_tokens,
                                  priority="interactive", temperature=self.config.temperature,
                                  stop=["\n"] if mid_line else ["\n\n\n"])
        parts = []
        try:
            async for event in stream:
                if isinstance(event, Token):
                    parts.append(event.text)
        finally:
            await stream.aclose()
        return "".join(parts), stream.final

    async def _send(self, prompt, key: str, **kw):
        """An infill of ``prompt`` under ``key``, in the configured layout."""
        return await self.client.infill(prompt.prefix, prompt.suffix, files=list(prompt.files) or None,
                                        replace=key, layout=self.config.layout, shift_reuse=self._shift(key),
                                        middle=prompt.middle or None, **kw)

    def _shift(self, key: str) -> Optional[bool]:
        """Ask for shifted reuse on a document's edits and completions (a warm-up computes its whole
        window exactly: it is what later requests reuse)."""
        return True if self.config.shift_reuse and key.startswith("lsp:") else None

    def backend_status(self) -> dict:
        """Where completions come from and how each protocol feature is served there."""
        return {"address": getattr(self.client, "address", None), "features": features(self.client),
                "off": [k for k, v in features(self.client).items() if v != "native"]}

    def forget(self, uri: str) -> None:
        self._latest.pop(uri, None)
        self._warm.pop(uri, None)
        self._anchors.pop(uri, None)
        self._refreshing.pop(uri, None)
        self._edits.pop(uri, None)
        self.cache.forget(uri)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.client.aclose()
