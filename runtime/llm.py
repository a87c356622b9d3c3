"""LLM: the offline Python API over Engine.

    llm = LLM("models/code-target", kv_memory="1GiB")
    outs = llm.generate(["def fib(n):", [1, 2, 3]], SamplingParams(max_tokens=32))
    answer = llm.chat([{"role": "user", "content": "What is 2 + 2?"}], SamplingParams(max_tokens=32))
    for delta in llm.stream("def fib(n):", SamplingParams(max_tokens=32)): ...
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from typing import Iterator, Optional, Sequence

from .config import EngineConfig
from .engine import Engine, StepOutput
from .errors import InvalidRequest
from .request import Priority, SamplingParams


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    logprobs: Optional[list] = None
    metrics: dict = field(default_factory=dict)


class LLM:
    def __init__(self, model: str, *, progress=None, **engine_options):
        """``model``: a path, or a model name found on this machine (llmd.runtime.model_names: llmd's cache,
        Ollama's store, the Hub's cache). ``engine_options``: any EngineConfig field but ``model``
        (llmd.runtime.config), e.g. kv_memory."""
        unknown = sorted(set(engine_options) - {f.name for f in fields(EngineConfig) if f.name != "model"})
        if unknown:
            raise InvalidRequest(f"LLM() got unknown engine option(s) {', '.join(unknown)}; the options are "
                                 "EngineConfig's fields (llmd.runtime.config)")
        self.engine = Engine(EngineConfig(model=str(model), **engine_options), progress=progress)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Priority | str = Priority.NORMAL, reuse_key: str | None = None) -> list[Completion]:
        """Run all prompts through continuous batching; results in prompt order. Any number of prompts:
        they enter the engine's queue as it has room (its bound is the daemon's admission control).
        ``reuse_key`` allows shifted reuse among requests under that key (approximate; Engine.add_request)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling parameters")
        done: dict[str, Completion] = {}
        order = []
        unsent = iter(zip(prompts, plist))
        unfinished = len(prompts)
        try:              # a prompt refused part way leaves none of the ones added before it behind
            while unfinished:
                while len(order) < len(prompts) and self.engine.scheduler.num_waiting < self.engine.config.max_waiting:
                    prompt, p = next(unsent)
                    rid = f"llm-{next(self._ids)}"
                    self.engine.add_request(rid, prompt, p, priority, reuse_key=reuse_key)
                    done[rid] = Completion(rid)
                    order.append(rid)
                for out in self.engine.step():
                    if out.request_id in done:
                        _merge(done[out.request_id], out)
                        unfinished -= out.finished
        finally:
            for r in order:
                if done[r].finish_reason is None:
                    self.engine.abort(r)
        return [done[r] for r in order]

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             priority: Priority | str = Priority.NORMAL) -> Completion:
        """One chat turn: ``messages`` ({"role", "content"}) through the model's chat template."""
        return self.generate([self.tokenizer.encode_chat(messages)], params, priority)[0]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               priority: Priority | str = Priority.NORMAL) -> Iterator[str]:
        """Yield text deltas as they are produced. Leaving the loop early aborts the request."""
        for out in self.stream_outputs(prompt, params, priority):
            if out.text_delta:
                yield out.text_delta

    def stream_outputs(self, prompt, params=None, priority=Priority.NORMAL) -> Iterator[StepOutput]:
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params or SamplingParams(), priority)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid)
                self.engine.step()

    def stats(self) -> dict:
        return self.engine.stats()


def _merge(c: Completion, out: StepOutput) -> None:
    c.text += out.text_delta
    c.token_ids.extend(out.new_token_ids)
    if out.logprobs:
        c.logprobs = (c.logprobs or []) + out.logprobs
    if out.finished:
        c.finish_reason, c.error, c.metrics = out.finish_reason, out.error, out.metrics or {}
