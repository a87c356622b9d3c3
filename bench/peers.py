"""The engines under test, behind one small interface: llmd (offline engine), transformers, llama.cpp.

Every peer replays a workload open-loop: a request is handed over no earlier than its arrival time,
and all latencies count from that arrival, so a peer that serves one request at a time pays for its
queue. Each peer reports per request the time of every output chunk, which is all the metrics need.
A peer that cannot be loaded is `Missing` with the reason; nothing is ever substituted for it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from llmd.clients import AsyncClient, Client, Done, Error, RequestError, Token
from llmd.runtime.formats.gguf_import import source_gguf
from llmd.runtime.request import SamplingParams

from .to_gguf import convert
from .workloads import Workload, WorkRequest


@dataclass
class Timing:
    rid: str
    kind: str
    arrival_s: float
    prompt_tokens: int
    stamps: list = field(default_factory=list)        # (seconds since the run began, tokens in this chunk)
    output_ids: list = field(default_factory=list)
    cached_tokens: Optional[int] = None


@dataclass(frozen=True)
class Missing:
    name: str
    reason: str


class Peer:
    """run() replays a workload; sweep() serves `prompts` together and returns aggregate tokens/s."""
    name = "peer"
    concurrent = False            # True when the peer batches requests that overlap

    def run(self, workload: Workload) -> list[Timing]:
        """One request at a time, each started at its arrival time (or when the previous ends)."""
        out = []
        t0 = time.perf_counter()
        for r in workload.requests:
            _wait_until(t0, r.arrival_s)
            tm = _timing(r)
            self._serve_one(list(r.prompt_ids), r.max_tokens, tm, t0)
            out.append(tm)
        return out

    def _serve_one(self, prompt_ids: list[int], max_tokens: int, timing: Timing, t0: float) -> None:
        """Generate for one request, stamping ``timing`` (seconds since t0) as tokens appear."""
        raise NotImplementedError

    def sweep(self, prompts: list[list[int]], gen: int) -> float:
        raise NotImplementedError


class LLMDPeer(Peer):
    """The offline engine, stepped in this thread; samples its stats once per step while busy."""
    concurrent = True

    def __init__(self, llm, name: str = "llmd"):
        self.llm, self.name = llm, name
        self.samples: list[dict] = []

    def run(self, workload: Workload) -> list[Timing]:
        eng = self.llm.engine
        pending = list(workload.requests)
        timings = {r.rid: _timing(r) for r in workload.requests}
        self.samples = []
        t0 = time.perf_counter()
        while pending or eng.has_unfinished():
            now = time.perf_counter() - t0
            while pending and pending[0].arrival_s <= now:
                r = pending.pop(0)
                eng.add_request(r.rid, list(r.prompt_ids), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
            if not eng.has_unfinished():
                time.sleep(max(0.0, pending[0].arrival_s - now))
                continue
            outs = eng.step()
            stamp = time.perf_counter() - t0
            for o in outs:
                tm = timings[o.request_id]
                if o.new_token_ids:
                    tm.stamps.append((stamp, len(o.new_token_ids)))
                    tm.output_ids.extend(o.new_token_ids)
                if o.finished and o.metrics:
                    tm.cached_tokens = o.metrics.get("cached_tokens")
            self.samples.append(_sample(eng.stats()))
        return [timings[r.rid] for r in workload.requests]

    def sweep(self, prompts, gen):
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=gen, ignore_eos=True))
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def _sample(s: dict) -> dict:
    keys = ("kv_usage", "kv_slots_unused", "kv_blocks_used", "running", "waiting", "preemptions")
    return {k: s.get(k) for k in keys}


def _timing(r: WorkRequest) -> Timing:
    return Timing(r.rid, r.kind, r.arrival_s, len(r.prompt_ids))


def _wait_until(t0: float, arrival_s: float) -> None:
    delay = arrival_s - (time.perf_counter() - t0)
    if delay > 0:
        time.sleep(delay)


class HFPeer(Peer):
    """transformers `generate()`, one request at a time (assisted generation when a draft is in use)."""
    name = "hf"

    def __init__(self, model_dir: str, draft: Optional[str], num_speculative_tokens: int):
        import torch
        import transformers
        load = transformers.AutoModelForCausalLM.from_pretrained
        self.model = load(model_dir, dtype=torch.float32).eval()
        self.extra: dict = {}
        if draft == "ngram":
            self.extra["prompt_lookup_num_tokens"] = num_speculative_tokens
        elif draft:
            self.extra["assistant_model"] = load(draft, dtype=torch.float32).eval()

    def _generate(self, ids: list[list[int]], gen: int, streamer=None):
        import torch
        with torch.inference_mode():
            return self.model.generate(torch.tensor(ids), max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                                       pad_token_id=0, eos_token_id=None, streamer=streamer,
                                       attention_mask=torch.ones(len(ids), len(ids[0]), dtype=torch.long),
                                       **(self.extra if len(ids) == 1 else {}))

    def _serve_one(self, prompt_ids, max_tokens, timing, t0):
        self._generate([prompt_ids], max_tokens, _Stamper(timing, t0))

    def sweep(self, prompts, gen):
        t0 = time.perf_counter()
        res = self._generate(prompts, gen)
        return (res.shape[1] - len(prompts[0])) * len(prompts) / (time.perf_counter() - t0)


class _Stamper:
    """A transformers streamer that records when each chunk of new tokens appears."""

    def __init__(self, timing: Timing, t0: float):
        self.timing, self.t0, self.seen_prompt = timing, t0, False

    def put(self, value) -> None:
        if not self.seen_prompt:                  # generate() first hands over the prompt itself
            self.seen_prompt = True
            return
        ids = value.reshape(-1).tolist()
        self.timing.stamps.append((time.perf_counter() - self.t0, len(ids)))
        self.timing.output_ids.extend(ids)

    def end(self) -> None:
        pass


class LlamaCppPeer(Peer):
    """llama.cpp through llama-cpp-python on the same weights converted to GGUF; one request at a time
    (its one sequence keeps the previous prompt's prefix, llama.cpp's own prefix reuse)."""
    name = "llamacpp"

    def __init__(self, gguf_path: str, n_ctx: int, threads: Optional[int]):
        import llama_cpp
        kw = {"n_threads": threads, "n_threads_batch": threads} if threads else {}
        self.llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=512, verbose=False, **kw)

    def _stream(self, ids: list[int], gen: int):
        n = 0
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            yield tok
            n += 1
            if n >= gen:
                return

    def _serve_one(self, prompt_ids, max_tokens, timing, t0):
        for tok in self._stream(prompt_ids, max_tokens):
            timing.stamps.append((time.perf_counter() - t0, 1))
            timing.output_ids.append(int(tok))

    def sweep(self, prompts, gen):
        t0 = time.perf_counter()
        n = sum(sum(1 for _ in self._stream(p, gen)) for p in prompts)
        return n / (time.perf_counter() - t0)


class DaemonPeer(Peer):
    """llmd through a running daemon (it must serve the same model): every request is sent at its
    arrival time over one asyncio client, so the daemon batches whatever overlaps."""
    name = "llmd-daemon"
    concurrent = True

    def __init__(self, socket: Optional[str]):
        self.socket = socket
        with Client(socket, timeout=10) as c:
            if c.health().get("state") != "ready":
                raise RuntimeError("the daemon is not ready")

    def run(self, workload):
        import asyncio
        return asyncio.run(self._run(list(workload.requests)))

    def sweep(self, prompts, gen):
        import asyncio
        reqs = [WorkRequest(f"sweep-{i}", "sweep", tuple(p), gen, 0.0) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        timings = asyncio.run(self._run(reqs))
        return sum(len(t.output_ids) for t in timings) / (time.perf_counter() - t0)

    async def _run(self, requests: list[WorkRequest]) -> list[Timing]:
        import asyncio
        async with AsyncClient(self.socket, timeout=600) as c:
            t0 = time.perf_counter()

            async def one(r: WorkRequest) -> Timing:
                await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
                tm = _timing(r)
                stream = await c.generate(token_ids=list(r.prompt_ids), max_tokens=r.max_tokens, ignore_eos=True)
                async for ev in stream:
                    if isinstance(ev, Token) and ev.token_ids:
                        tm.stamps.append((time.perf_counter() - t0, len(ev.token_ids)))
                        tm.output_ids.extend(ev.token_ids)
                    elif isinstance(ev, Done):
                        tm.cached_tokens = ev.usage.get("cached_tokens")
                    elif isinstance(ev, Error):
                        raise RequestError(ev)
                return tm
            return list(await asyncio.gather(*(one(r) for r in requests)))


def load_peer(name: str, model_dir: str, *, draft: Optional[str], num_speculative_tokens: int,
              threads: Optional[int], n_ctx: int, work_dir: str, socket: Optional[str] = None) -> Peer | Missing:
    """A peer ready to run, or Missing with the reason it could not be loaded."""
    if name == "daemon":
        try:
            return DaemonPeer(socket)
        except Exception as e:
            return Missing(name, f"no usable llmd daemon at {socket or 'the default socket'}: {type(e).__name__}: {e}")
    if name == "hf":
        try:
            return HFPeer(model_dir, draft, num_speculative_tokens)
        except ImportError as e:
            return Missing(name, f"transformers is not installed ({e}); pip install 'llmd[bench]'")
        except Exception as e:           # a checkpoint transformers cannot read (an llmd int8 engine dir)
            return Missing(name, f"transformers could not load {model_dir}: {type(e).__name__}: {e}")
    if name == "llamacpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            return Missing(name, f"llama-cpp-python is not installed ({e}); pip install 'llmd[bench]'")
        try:
            # a model imported from GGUF: llama.cpp reads that very file, so both engines read the same numbers
            path = source_gguf(model_dir) or convert(model_dir, f"{work_dir}/model.gguf")
            return LlamaCppPeer(str(path), n_ctx, threads)
        except Exception as e:
            return Missing(name, f"could not convert or load the GGUF: {type(e).__name__}: {e}")
    return Missing(name, f"unknown peer {name!r} (known: hf, llamacpp, daemon)")
