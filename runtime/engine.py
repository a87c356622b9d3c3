"""Engine: the step loop the daemon and the offline API drive.

    step():  schedule -> (propose) -> prepare inputs -> forward -> sample / verify -> advance & stop checks

Single-threaded: exactly one thread calls add_request, abort and step.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .block_manager import BlockManager
from .config import DRAFT_K, NGRAM_K, EngineConfig, float_dtype
from .detokenizer import IncrementalDetokenizer
from .errors import CapacityError, EngineDirError, InvalidRequest
from . import kernels
from .kernels import ops
from .execution import choose
from .grammar import GrammarCompiler, Matcher
from .kv_tier import DiskTier
from .loading import LoadedModel, load_for_engine
from .model_names import resolve_config
from .model_runner import ModelRunner
from .request import FinishReason, Priority, Request, SamplingParams
from .sampler import SamplingRow, apply_penalties, logprobs_for, make_generator, processed_probs, sample
from .scheduler import ScheduledRequest, Scheduler
from .spec.controller import SpecController
from .spec.draft import DraftProposer
from .spec.ngram import NgramProposer
from .spec.proposer import Proposal, Proposer
from .spec.rejection import verify_greedy, verify_sampled
from .stats import EngineStats

log = logging.getLogger("llmd.engine")
MAX_REQUEST_ID_LEN = 256


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    logprobs: Optional[list] = None
    metrics: Optional[dict] = None


class _Live:
    """Per-request engine-side state that the scheduler does not own."""

    __slots__ = ("detok", "generator", "new_ids", "text", "logprobs", "matcher")

    def __init__(self, detok: IncrementalDetokenizer, generator: Optional[torch.Generator],
                 matcher: Optional[Matcher] = None):
        self.detok, self.generator, self.matcher = detok, generator, matcher
        self.new_ids: list[int] = []
        self.text = ""
        self.logprobs: list = []


class Engine:
    def __init__(self, config: EngineConfig, progress=None):
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        loaded: LoadedModel = load_for_engine(config, progress=progress)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        if loaded.config.window_cap and (loaded.device == "cuda" or loaded.backend is not None):
            # their attention computes every layer in full: exact up to where a window starts to slide
            self.max_model_len = min(self.max_model_len, loaded.config.window_cap)
        self.tokenizer.limit_tokens = self.max_model_len     # a text that cannot fit is refused untokenized
        self.block_manager = BlockManager(loaded.num_blocks, config.block_size, config.prefix_cache)
        self.scheduler = Scheduler(self.block_manager, config.max_batch_tokens, config.max_num_seqs,
                                   config.batch_prompt_chunk, config.batch_quiet_ms / 1000)
        self.kv_dtype = loaded.kv_dtype
        if loaded.backend is not None and loaded.kv_dtype != "auto":
            raise EngineDirError(f"the {loaded.backend.name} backend keeps keys and values in the model's dtype; "
                                 "use --kv-dtype auto")
        lookup = loaded.draft is None and config.draft in ("ngram", "auto")
        k = config.num_speculative_tokens
        if k is None:
            # n-gram proposals cost nothing to make, and verifying 9 rows costs about 1.3 decode
            # steps here, so lookups may run deeper than a draft model's (bench_spec measures both)
            k = NGRAM_K if lookup else DRAFT_K
        self.num_speculative_tokens = k         # the depth in force (the config's None resolved)
        self.runner = self._make_runner(loaded, loaded.model, k if (lookup or loaded.draft is not None) else 0)
        # greedy steps ask for tokens, not logits, where the model has a head screen (formats/head_screen.py)
        self._screens = self.runner.screens_head
        if config.prefix_cache and self.runner.can_shift:
            self.block_manager.max_stale = config.shift_max_stale      # shifted reuse: off where keys cannot move
        self.eos_token_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(loaded.config.eos_token_ids)))
        self.proposer: Optional[Proposer] = None
        self.spec: Optional[SpecController] = None
        if loaded.draft is not None:
            self.draft_runner = self._make_runner(loaded, loaded.draft, 0, draft=True)
            self.proposer = DraftProposer(self.draft_runner)
        elif lookup:
            self.proposer = NgramProposer(config.ngram_n)
        if self.proposer is not None and k > 0:
            # a draft with a shorter context than the target's stops proposing where its context ends
            spec_len = self.max_model_len if loaded.draft is None else min(
                self.max_model_len, loaded.draft.config.max_position_embeddings)
            self.spec = SpecController(k, spec_len, config.adaptive_speculation, proposer_is_free=lookup,
                                       greedy_only=lookup and config.draft == "auto")
        self.stats_ = EngineStats()
        self.tier = self._open_tier(loaded)
        self._live: dict[str, _Live] = {}
        self._pending: list[StepOutput] = []     # aborts and failures reported at the next step
        self._seeds = itertools.count(config.seed * 1_000_003 + 1)
        self._grammars: Optional[GrammarCompiler] = None     # built at the first constrained request

    def _make_runner(self, loaded: LoadedModel, model, num_spec_tokens: int, draft: bool = False):
        c = self.config
        if loaded.device == "cuda":
            from .execution.cuda.backend import CudaBackend     # needs triton: imported for the GPU only
            return CudaBackend(model, loaded.num_blocks, c.block_size, float_dtype(c.dtype), loaded.kv_dtype, "cuda",
                               c.max_num_seqs, num_spec_tokens, self.max_model_len,
                               graphs=None if c.cuda_graphs else "off")
        if draft:
            return ModelRunner(model, loaded.num_blocks, c.block_size, float_dtype(c.dtype), kv_dtype=loaded.kv_dtype,
                               execution=choose(c.execution))
        return ModelRunner(model, loaded.num_blocks, c.block_size, float_dtype(c.dtype), reference_attention=c.attention == "reference",
                           kv_dtype=loaded.kv_dtype, backend=loaded.backend, execution=loaded.execution)

    def _open_tier(self, loaded: LoadedModel) -> Optional[DiskTier]:
        """The prefix cache's tier on disk (llmd.runtime.kv_tier), keyed by what makes a block's keys
        and values: the model files, dtypes, pool layout and how steps run."""
        c = self.config
        if not c.kv_disk:
            return None
        resolved = resolve_config(c)
        paths = [resolved.model] + ([resolved.draft] if loaded.draft is not None and resolved.draft
                                    and resolved.draft not in ("auto", "ngram", "none") else [])
        facts = {"dtype": c.dtype, "kv_dtype": loaded.kv_dtype, "execution": loaded.execution,
                 "attention": c.attention, "device": loaded.device, "draft": loaded.draft is not None,
                 "backend": getattr(loaded.backend, "name", None)}
        runners = [self.runner] + ([self.draft_runner] if loaded.draft is not None else [])
        return DiskTier.open(c, paths, facts, self.block_manager, runners)

    def close(self) -> None:
        """Write what the disk tier lacks and stop its thread (nothing to do without one)."""
        if self.tier is not None:
            self.tier.close()

    # ---- requests in -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: Priority | str = Priority.NORMAL, cache_salt: Optional[str] = None,
                    reuse_key: Optional[str] = None) -> None:
        """``reuse_key``: allow shifted reuse (approximate; see llmd.runtime.block_manager) of the keys
        and values of earlier requests under the same key, and remember this one's for later ones."""
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
            raise InvalidRequest(f"request_id must be a string of 1 to {MAX_REQUEST_ID_LEN} characters")
        if request_id in self.scheduler.requests or (self.tier is not None and request_id in self.tier.parked):
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be SamplingParams")
        if self._num_waiting() >= self.config.max_waiting:
            raise CapacityError(f"the queue is full ({self.config.max_waiting} waiting); retry later")
        priority = Priority.parse(priority)
        if reuse_key is not None and not (isinstance(reuse_key, str) and 0 < len(reuse_key) <= MAX_REQUEST_ID_LEN):
            raise InvalidRequest(f"reuse_key must be a string of 1 to {MAX_REQUEST_ID_LEN} characters")
        ids = self._prompt_ids(prompt)
        if self.block_manager.blocks_needed(len(ids) + 1) > self.block_manager.num_blocks:
            raise CapacityError(f"the prompt needs {len(ids) + 1} KV slots but the pool has "
                                f"{self.block_manager.num_blocks * self.config.block_size}; raise kv_memory")
        req = Request(request_id, ids, params, priority, cache_salt, self.eos_token_ids,
                      reuse_key=None if reuse_key is None else f"{cache_salt}\0{reuse_key}")
        matcher = self._compile(params)
        gen = None if params.greedy else make_generator(params.seed if params.seed is not None else next(self._seeds))
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop)
        self._live[request_id] = _Live(detok, gen, matcher)
        if self.tier is None or not self.tier.park(req):      # parked while the tier reads its blocks
            self.scheduler.add(req)

    def _compile(self, params: SamplingParams) -> Optional[Matcher]:
        if params.grammar is None:
            return None
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.model_config.vocab_size,
                                             self.eos_token_ids)
        return self._grammars.compile(params.grammar)

    def _num_waiting(self) -> int:
        return self.scheduler.num_waiting + (len(self.tier.parked) if self.tier is not None else 0)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
                raise InvalidRequest(f"token ids must be integers in [0, {vocab})")
            ids = list(prompt)
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; the context window is {self.max_model_len}, "
                                 "which leaves no room to generate")
        return ids

    def abort(self, request_id: str) -> bool:
        if self.tier is not None and request_id in self.tier.parked:
            self.scheduler.add(self.tier.parked.pop(request_id))     # ended by the scheduler like any other
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, FinishReason.ABORT)
        self._pending.append(self._final(req))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self.tier and self.tier.parked)

    def deferred_s(self) -> float:
        """Seconds the next step may wait for: only batch prompts held back for a quiet moment are
        left (0: step now)."""
        return 0.0 if self._pending else self.scheduler.deferred_s()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        if self.tier is None:
            return self._step()
        for req in self.tier.land(wait=not self.scheduler.has_unfinished()):
            self.scheduler.add(req)
        outputs = self._step()
        if not self.has_unfinished():
            self.tier.flush()              # idle: what is cached goes to disk
        return outputs

    def _step(self) -> list[StepOutput]:
        t0, cpu0 = time.perf_counter(), time.process_time()
        if self.spec is not None:
            self._plan_speculation()
        sched = self.scheduler.schedule()
        if self.tier is not None:
            self.tier.spill()              # evicted blocks leave for disk before anything overwrites them
        outputs, self._pending = self._pending, []
        for req in sched.finished_out_of_memory:
            outputs.append(self._final(req))
        if self.proposer is not None:
            for req in sched.preempted:
                self.proposer.reset(req)
        for src, dst, n in self.block_manager.take_copies():      # partly cached blocks, before any write
            self.runner.copy_slots(src, dst, n)
        for src, dst, delta in self.block_manager.take_shifts():  # runs taken at other positions
            self.runner.copy_shifted(src, dst, delta)
        self.block_manager.release_held()
        if sched.empty:
            return outputs
        try:
            proposals, draft_s = self._propose(sched.scheduled)
            t1 = time.perf_counter()
            batch = self.runner.prepare(sched.scheduled)
            if self._screens and all(_plain_greedy(s.request.params) for s in sched.scheduled):
                picks = self.runner.run_greedy(batch)       # the head's screen: the tokens, not the logits
                verify_s = time.perf_counter() - t1
                sampled = self._greedy(sched.scheduled, batch.sample_counts, picks)
            else:
                logits = self.runner.run(batch)
                verify_s = time.perf_counter() - t1
                sampled = self._sample(sched.scheduled, batch.sample_counts, logits, proposals)
        except Exception as e:   # a failed forward fails its batch, never the engine
            log.exception("model step failed")
            for s in sched.scheduled:
                outputs.append(self._fail(s.request, f"internal error in the model step: {e}"))
            return outputs
        if self.spec is not None:
            self.spec.observe_target(sched.num_tokens, verify_s)
        touched = []
        proposed = accepted = 0
        for s, tokens in zip(sched.scheduled, sampled):
            k = s.num_spec_tokens
            old_len = s.request.num_tokens
            self.scheduler.advance(s, num_rejected=k - (len(tokens) - 1) if k else 0)
            if k:
                proposed, accepted = proposed + k, accepted + len(tokens) - 1
                self._after_verify(s.request, k, len(tokens) - 1, old_len, proposals.get(id(s)))
            if s.request.params.prompt_only:
                if tokens:        # the whole prompt is in the cache: nothing is generated
                    self.scheduler.finish(s.request, FinishReason.LENGTH)
                    touched.append(s.request)
            elif tokens:
                self._accept(s.request, tokens)
                touched.append(s.request)
            if not s.request.is_finished:
                # slots reserved for proposals that were rejected or never made go back to the pool
                self.block_manager.trim(s.request, s.request.num_tokens)
        if proposed:
            self.stats_.record_spec(proposed, accepted, draft_s, verify_s)
        outputs.extend(self._collect(touched))
        seconds = time.perf_counter() - t0
        if self.spec is not None:
            self.spec.observe_step(sum(len(t) for t in sampled), seconds, proposed > 0, time.process_time() - cpu0)
        self.stats_.record_step(sched.num_tokens, len(sched.scheduled), seconds)
        return outputs

    # ---- speculation -----------------------------------------------------------------------
    def _plan_speculation(self) -> None:
        decoding, other = [], 0
        for r in self.scheduler.running:
            if r.params.grammar is not None:
                continue           # constrained rows never speculate: each token needs the mask after the last
            if r.num_computed_tokens == r.num_tokens - 1:
                decoding.append(r)
            else:
                other += r.num_tokens - r.num_computed_tokens
        self.spec.plan(decoding, min(other, self.config.max_batch_tokens))

    def _row(self, req: Request, extra: list[int]) -> SamplingRow:
        history = req.token_ids + extra if req.params.needs_penalties else None
        live = self._live[req.request_id]
        allowed = live.matcher.allowed() if live.matcher is not None else None
        return SamplingRow(req.params, live.generator, history, req.num_prompt_tokens, allowed)

    def _propose(self, scheduled: list[ScheduledRequest]) -> tuple[dict[int, Proposal], float]:
        items = [s for s in scheduled if s.num_spec_tokens]
        if not items:
            return {}, 0.0
        t0 = time.perf_counter()
        props = self.proposer.propose([(s.request, s.num_spec_tokens) for s in items], self._row)
        seconds = time.perf_counter() - t0
        out = {}
        for s, prop in zip(items, props):
            got = prop.token_ids[:s.num_spec_tokens]
            missing = s.num_spec_tokens - len(got)
            s.num_spec_tokens -= missing
            s.num_new_tokens -= missing
            s.request.spec_token_ids = got
            out[id(s)] = prop
        if self.spec is not None:
            self.spec.observe_proposals(len(items), sum(1 for s in items if s.num_spec_tokens))
            per_forward = getattr(self.proposer, "forward_s", None)
            if per_forward is not None and not self.spec.proposer_is_free:
                self.spec.observe_draft(len(items), per_forward)
        return out, seconds

    def _after_verify(self, req: Request, proposed: int, accepted: int, old_len: int,
                      prop: Optional[Proposal]) -> None:
        req.spec_token_ids = []
        m = req.metrics
        m.spec_proposed += proposed
        m.spec_accepted += accepted
        m.spec_steps += 1
        self.proposer.on_verified(req, proposed, accepted, old_len)
        if self.spec is not None and not (prop is not None and prop.guess):
            self.spec.observe_acceptance(req.request_id, proposed, accepted)

    def _sample(self, scheduled: list[ScheduledRequest], counts: list[int], logits: torch.Tensor,
                proposals: dict[int, Proposal]) -> list[list]:
        """Per scheduled request, the (token, logprobs) pairs it gains this step."""
        out: list[list] = [[] for _ in scheduled]
        on_device = self.runner.samples_on_device     # the CUDA runner's logits stay there
        if on_device and any(s.request.params.logprobs is not None or s.num_spec_tokens
                             or s.request.params.grammar is not None for s in scheduled):
            p = [s.request.params for s in scheduled]
            if all(_plain_greedy(x) for x in p):
                return self._greedy(scheduled, counts, logits.argmax(-1).tolist())   # one copy: the ids
            logits, on_device = logits.cpu(), False    # sampled verification and logprobs read them on the host
        plain_rows, plain_idx, plain_at = [], [], []
        offset = 0
        for i, (s, k) in enumerate(zip(scheduled, counts)):
            if k == 1 and not s.num_spec_tokens:
                plain_rows.append(self._row(s.request, []))
                plain_idx.append(i)
                plain_at.append(offset)
            elif k:
                out[i] = self._verify(s, logits[offset:offset + k], proposals.get(id(s)))
            offset += k
        if plain_rows:
            rows_logits = logits if len(plain_at) == logits.shape[0] else logits[torch.tensor(plain_at)]
            if on_device:                  # drawn on the device, the ids back in one copy
                for i, tok in zip(plain_idx, self.runner.sample(rows_logits, plain_rows)):
                    out[i] = [(tok, None)]
                return out
            result = sample(rows_logits, plain_rows)
            for j, (i, tok) in enumerate(zip(plain_idx, result.token_ids.tolist())):
                out[i] = [(tok, result.logprobs[j] if result.logprobs else None)]
        return out

    def _greedy(self, scheduled: list[ScheduledRequest], counts: list[int], picks: list[int]) -> list[list]:
        """Per scheduled request, its tokens from the argmax of each of its sampled rows."""
        out, offset = [], 0
        for s, k in zip(scheduled, counts):
            row = picks[offset:offset + k]
            tokens = verify_greedy(row, s.request.spec_token_ids) if s.num_spec_tokens else row
            out.append([(t, None) for t in tokens])
            offset += k
        return out

    def _verify(self, s: ScheduledRequest, logits: torch.Tensor, prop: Optional[Proposal]) -> list:
        req = s.request
        x = req.spec_token_ids
        rows = [self._row(req, x[:j]) for j in range(len(x) + 1)]
        p = req.params
        if p.greedy and not p.needs_penalties:
            tokens = verify_greedy(self.runner.execution.greedy(logits).tolist(), x)
        else:
            probs = processed_probs(logits, rows)
            if p.greedy:
                tokens = verify_greedy(self.runner.execution.greedy(probs).tolist(), x)
            else:
                q = prop.probs if prop is not None else None
                tokens = verify_sampled(probs, q, x, self._live[req.request_id].generator)
        if p.logprobs is None:
            return [(t, None) for t in tokens]
        n = len(tokens)
        lps = logprobs_for(apply_penalties(logits[:n], rows[:n]), torch.tensor(tokens), [p.logprobs] * n)
        return list(zip(tokens, lps))

    def _accept(self, req: Request, tokens: list[tuple[int, Optional[dict]]]) -> None:
        """Append verified tokens one by one, stopping at the first stop condition."""
        live = self._live[req.request_id]
        now = time.monotonic()
        if req.metrics.first_token_s is None:
            req.metrics.first_token_s = now
        for tok, lp in tokens:
            req.token_ids.append(tok)
            live.new_ids.append(tok)
            if lp is not None:
                live.logprobs.append(lp)
            reason = self._stop_reason(req, tok, live)
            if reason is not None:
                self.scheduler.finish(req, reason)
                return

    def _stop_reason(self, req: Request, tok: int, live: _Live) -> Optional[FinishReason]:
        p = req.params
        if tok in req.eos_token_ids or tok in p.stop_token_ids:
            req.stop_reason = tok
            return FinishReason.STOP
        if live.matcher is not None and not live.matcher.advance(tok):
            req.error = f"the output left its grammar: {live.matcher.error}"
            return FinishReason.ERROR
        delta, hit = live.detok.add([tok])
        live.text += delta
        if hit is not None:
            req.stop_reason = hit
            return FinishReason.STOP
        if live.matcher is not None and live.matcher.stopped:
            return FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _collect(self, requests: list[Request]) -> list[StepOutput]:
        outs = []
        for req in requests:
            if req.is_finished:
                outs.append(self._final(req))
                continue
            live = self._live[req.request_id]
            outs.append(StepOutput(req.request_id, live.new_ids, live.text, logprobs=live.logprobs or None))
            live.new_ids, live.text, live.logprobs = [], "", []
        return outs

    def _final(self, req: Request, error: Optional[str] = None) -> StepOutput:
        live = self._live.pop(req.request_id)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        text = live.text
        if req.finish_reason is not FinishReason.STOP or not isinstance(req.stop_reason, str):
            text += live.detok.flush()
        metrics = req.metrics.as_dict(req.num_prompt_tokens, req.num_output_tokens)
        metrics["stop_reason"] = req.stop_reason
        self.stats_.record_finished(req, metrics)
        return StepOutput(req.request_id, live.new_ids, text, True, req.finish_reason.value, error or req.error,
                          live.logprobs or None, metrics)

    def _fail(self, req: Request, message: str) -> StepOutput:
        req.error = message
        self.scheduler.finish(req, FinishReason.ERROR)
        return self._final(req, message)

    # ---- observability ---------------------------------------------------------------------
    def stats(self) -> dict:
        running = self.scheduler.running
        allocated = sum(len(r.block_ids) for r in running) * self.config.block_size
        used = sum(min(r.num_computed_tokens, r.num_tokens) for r in running)
        return {
            **self.block_manager.stats(),
            **self.stats_.snapshot(),
            "running": len(running),
            "waiting": self._num_waiting(),
            "preemptions": self.scheduler.num_preemptions,
            "kv_slots_unused": allocated - used,
            "kv_bytes_total": self.runner.k_pool.numel() * self.runner.k_pool.element_size() * 2,
            "kv_dtype": self.kv_dtype,
            "kv_pool_dtype": str(self.runner.k_pool.dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len,
            **({"cuda_graphs": self.runner.step_graphs} if self.runner.step_graphs is not None else {}),
            **(self.tier.stats() if self.tier is not None else {}),
            **self._kernel_stats(),
            **self._screen_stats(),
            # decode steps by the deepest speculation they verified (the controller's choices)
            **({"spec_depth_steps": {str(k): n for k, n in sorted(self.spec.depth_steps.items())}}
               if self.spec is not None else {}),
        }

    def _kernel_stats(self) -> dict:
        """Which of llmd's CPU kernel libraries the cpu backend runs: avx512, avx2, or none (torch's ops);
        from how many rows its int8 products take AMX's tile unit (0: never), and past how many rows
        products over bfloat16 blocks do (0: never)."""
        if self.runner.execution.kernels is None:
            return {}
        on = self.runner.execution.kernels
        return {"cpu_kernels": kernels.variant() if on else "none",
                "cpu_amx_rows": kernels.lib().llmd_amx_min_rows(-1) if on else 0,
                "cpu_amx_bf16": ops.bf16_amx_rows() if on else 0}

    def _screen_stats(self) -> dict:
        """The head screen's counters: greedy rows it served, the head rows it scored exactly per row,
        and rows that read the whole head instead."""
        if not self._screens:
            return {}
        st = self.runner.model.head_screen.stats
        return {"head_screen_on": st.on, "head_screen_rows": st.rows, "head_screen_whole": st.whole,
                "head_screen_candidates_mean": round(st.candidates / st.rows, 1) if st.rows else None}


def _plain_greedy(params: SamplingParams) -> bool:
    """A row whose token is its logits' argmax: greedy, without penalties or logprobs."""
    return params.greedy and not params.needs_penalties and params.logprobs is None and params.grammar is None
