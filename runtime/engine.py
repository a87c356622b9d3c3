"""Engine: the step loop the daemon and the offline API drive.

    step():  plan = scheduler.schedule()        who runs, how many tokens, which blocks to copy
             result = runner.execute(plan)      copies, proposals, forward, sampling and verification
             scheduler.update(plan, result)     tokens appended, stop checks, blocks cached or trimmed

Single-threaded: exactly one thread calls add_request, abort and step.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from . import kernels
from .block_manager import BlockManager
from .config import DRAFT_K, NGRAM_K, EngineConfig
from .detokenizer import IncrementalDetokenizer
from .errors import CapacityError, EngineDirError, InvalidRequest
from .grammar import GrammarCompiler, Matcher
from .kv_tier import DiskTier
from .loading import LoadedModel, load_for_engine, make_runner
from .model_names import resolve_config
from .output import RequestOutput
from .request import FinishReason, Priority, Request, SamplingParams
from .runner import StepResult
from .sampler import make_generator
from .scheduler import Scheduler
from .spec.controller import SpecController
from .spec.draft import DraftProposer
from .spec.ngram import NgramProposer
from .spec.proposer import Proposer
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


class Engine:
    def __init__(self, config: EngineConfig, progress=None):
        if config.threads:
            torch.set_num_threads(config.threads)
        kernels.configure(kernels=config.kernels, amx=config.amx, kernel_cache=config.kernel_cache)
        self.config = config
        loaded: LoadedModel = load_for_engine(config, progress=progress)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.context_len(config.max_model_len)
        self.tokenizer.limit_tokens = self.max_model_len     # a text that cannot fit is refused untokenized
        self.block_manager = BlockManager(loaded.num_blocks, config.block_size, config.prefix_cache)
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
        self.runner = make_runner(loaded, loaded.model, config, self.max_model_len,
                                  k if (lookup or loaded.draft is not None) else 0)
        if config.prefix_cache and self.runner.can_shift:
            self.block_manager.max_stale = config.shift_max_stale      # shifted reuse: off where keys cannot move
        self.eos_token_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(loaded.config.eos_token_ids)))
        self.proposer: Optional[Proposer] = None
        spec: Optional[SpecController] = None
        if loaded.draft is not None:
            self.draft_runner = make_runner(loaded, loaded.draft, config, self.max_model_len, 0, draft=True)
            self.proposer = DraftProposer(self.draft_runner)
        elif lookup:
            self.proposer = NgramProposer(config.ngram_n)
        if self.proposer is not None and k > 0:
            # a draft with a shorter context than the target's stops proposing where its context ends
            spec_len = self.max_model_len if loaded.draft is None else min(
                self.max_model_len, loaded.draft.config.max_position_embeddings)
            spec = SpecController(k, spec_len, config.adaptive_speculation, proposer_is_free=lookup,
                                       greedy_only=lookup and config.draft == "auto")
        self.runner.proposer = self.proposer
        self.scheduler = Scheduler(self.block_manager, config.max_batch_tokens, config.max_num_seqs,
                                   config.batch_prompt_chunk, config.batch_quiet_ms / 1000, self.max_model_len,
                                   spec)
        self.stats_ = EngineStats()
        self.tier = self._open_tier(loaded)
        self._pending: list[StepOutput] = []     # aborts and failures reported at the next step
        self._seeds = itertools.count(config.seed * 1_000_003 + 1)
        self._grammars: Optional[GrammarCompiler] = None     # built at the first constrained request

    @property
    def spec(self) -> Optional[SpecController]:
        """The speculation controller the scheduler plans depths with (None: the engine never speculates)."""
        return self.scheduler.spec

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
                 "backend": loaded.backend.name if loaded.backend is not None else None}
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
        """``reuse_key``: allow shifted reuse (approximate; see llmd.runtime.block_reuse) of the keys
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
        req.matcher = self._compile(params)
        req.generator = None if params.greedy else make_generator(
            params.seed if params.seed is not None else next(self._seeds))
        req.output = RequestOutput(IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop))
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
        plan = self.scheduler.schedule()
        if self.tier is not None:
            self.tier.spill()              # evicted blocks leave for disk before anything overwrites them
        outputs, self._pending = self._pending, []
        outputs.extend(self._final(req) for req in plan.finished_out_of_memory)
        try:
            result = self.runner.execute(plan)
        except Exception as e:     # a failed forward fails its batch, never the engine
            log.exception("model step failed")
            result = StepResult.failed(plan, f"internal error in the model step: {e}")
        touched = self.scheduler.update(plan, result)
        outputs.extend(self._collect(touched))
        if plan.empty or result.error is not None:
            return outputs
        self._record(plan, result, time.perf_counter() - t0, time.process_time() - cpu0)
        return outputs

    def _record(self, plan, result: StepResult, seconds: float, cpu_seconds: float) -> None:
        """The step's figures, for the stats and the speculation controller."""
        verified = [v for v in result.verified if v is not None]
        proposed = sum(v.proposed for v in verified)
        if proposed:
            self.stats_.record_spec(proposed, sum(v.accepted for v in verified), result.draft_s, result.verify_s)
        if self.spec is not None:
            self.spec.observe_step(sum(len(t) for t in result.tokens), seconds, proposed > 0, cpu_seconds)
        self.stats_.record_step(plan.num_tokens, len(plan.scheduled), seconds)

    # ---- results out -------------------------------------------------------------------------
    def _collect(self, requests: list[Request]) -> list[StepOutput]:
        outs = []
        for req in requests:
            if req.is_finished:
                outs.append(self._final(req))
                continue
            new_ids, text, logprobs = req.output.take()
            outs.append(StepOutput(req.request_id, new_ids, text, logprobs=logprobs or None))
        return outs

    def _final(self, req: Request) -> StepOutput:
        out = req.output
        text = out.text
        if req.finish_reason is not FinishReason.STOP or not isinstance(req.stop_reason, str):
            text += out.detok.flush()
        metrics = req.metrics.as_dict(req.num_prompt_tokens, req.num_output_tokens)
        metrics["stop_reason"] = req.stop_reason
        self.stats_.record_finished(req, metrics)
        return StepOutput(req.request_id, out.new_ids, text, True, req.finish_reason.value, req.error,
                          out.logprobs or None, metrics)

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
            "kv_dtype": self.kv_dtype,
            "max_model_len": self.max_model_len,
            **self.runner.stats(),
            **(self.tier.stats() if self.tier is not None else {}),
            # decode steps by the deepest speculation they verified (the controller's choices)
            **({"spec_depth_steps": {str(k): n for k, n in sorted(self.spec.depth_steps.items())}}
               if self.spec is not None else {}),
        }
