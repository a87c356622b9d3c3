"""Closed-loop load, llmd's daemon against llama.cpp's server on the same weights
(``llmd bench MODEL --against llamacpp-server``).

At each concurrency N, N clients each send a request, wait for its last token and send the next,
until the level's requests are served. Every request is a different window of held-out text
(``--prompt-len`` tokens, from the held-out split of llmd's corpus, never the quality gate's
evaluation text), generating ``--gen`` tokens with end-of-text ignored, greedy. The two servers take
turns level by level (the first of a level alternates) and receive the same prompts in the same order;
no prompt is sent twice to either, so neither serves one from its prompt cache.

Reported per level and server: output tokens/s (all tokens over the level's wall time) and the p50
and p95 of request latency (send to last token), and llmd / llama.cpp for each.

Both servers are started here and stopped at the end: llmd's daemon on a private socket in a
temporary folder (its own settings only), llama-server on a free 127.0.0.1 port with one slot per
client of the largest level, continuous batching and a context of ``slots x (prompt + gen + 16)``.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from llmd.clients import AsyncClient, Client, Done, Error, RequestError, Token
from llmd.options import flag_name
from llmd.runtime.formats.gguf_check import is_gguf_file
from llmd.runtime.formats.gguf_native import gguf_tokenizer
from llmd.runtime.tokenizer import Tokenizer

from .llama_server import LlamaServer, binary, file_tail
from .runner import pct
from .workloads import heldout_texts

GOAL_RATIO = 2.0          # issue 22: the daemon at least twice llama.cpp's server's tokens/s at every level


@dataclass(frozen=True)
class LoadConfig:
    levels: tuple[int, ...] = (1, 4, 8, 16)
    prompt_len: int = 150
    gen: int = 64
    requests_per_client: int = 4         # a level serves max(min_requests, N x this) requests
    min_requests: int = 8
    repeat: int = 1                      # rounds of every level; a later round gets new prompts
    threads: int = 2
    seed: int = 0

    def __post_init__(self):
        if not self.levels or any(n < 1 or n > 256 for n in self.levels):
            raise ValueError(f"concurrency levels must be in [1, 256], got {self.levels}")
        for name in ("prompt_len", "gen", "requests_per_client", "min_requests", "repeat", "threads"):
            if not 1 <= getattr(self, name) <= 1 << 16:
                raise ValueError(f"{name} must be in [1, 65536], got {getattr(self, name)}")

    def requests(self, n: int) -> int:
        return max(self.min_requests, n * self.requests_per_client)

    @property
    def slots(self) -> int:
        return max(self.levels)


def heldout_prompts(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` different windows of ``length`` tokens, cut end to end from held-out files."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    for _, text in heldout_texts(rng, 4 * count, 8 * length):
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.extend(ids[i:i + length] for i in range(0, len(ids) - length + 1, length))
        if len(out) >= count:
            return out[:count]
    raise ValueError(f"the held-out text gives only {len(out)} windows of {length} tokens; {count} are needed")


def tokenizer_dir(model_dir: str | Path) -> Path:
    """Where a model directory's tokenizer is: an engine directory keeps it with its target model."""
    model_dir = Path(model_dir)
    manifest = model_dir / "manifest.json"
    if manifest.is_file():
        return model_dir / json.loads(manifest.read_text())["models"]["target"]["dir"]
    return model_dir


class DaemonTarget:
    """llmd's daemon, started on a private socket; requests stream over one async client."""
    name = "llmd"

    def __init__(self, model_dir: str, engine: dict, work_dir: str, ready_timeout_s: float = 600.0):
        self.socket = str(Path(work_dir) / "llmd.sock")
        cmd = [sys.executable, "-m", "llmd.daemon", "serve", "--model", model_dir, "--socket", self.socket,
               *daemon_flags(engine)]
        env = {**os.environ, "XDG_CONFIG_HOME": work_dir}          # no settings file of the user's
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.client: Optional[AsyncClient] = None
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmd's daemon exited ({self.proc.returncode}): {self.log_tail()}")
            if Path(self.socket).exists():
                try:
                    with Client(self.socket, timeout=5) as c:
                        if c.health().get("state") == "ready":
                            return
                except Exception:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"llmd's daemon was not ready within {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        return file_tail(self._log, chars)

    async def complete(self, ids: list[int], gen: int) -> int:
        if self.client is None:
            self.client = AsyncClient(self.socket, timeout=600)
        n = 0
        # whole answers, as llama-server's /completion is asked for them (stream false): no event per token
        stream = await self.client.generate(token_ids=ids, max_tokens=gen, ignore_eos=True, temperature=0.0,
                                            stream=False)
        async for ev in stream:
            if isinstance(ev, Token):
                n += len(ev.token_ids)
            elif isinstance(ev, Error):
                raise RequestError(ev)
            elif isinstance(ev, Done):
                break
        return n

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def daemon_flags(engine: dict) -> list[str]:
    """``llmd.daemon serve`` flags for the engine settings given (EngineConfig field -> value)."""
    out: list[str] = []
    for name, value in engine.items():
        if name == "model" or value is None:
            continue
        if isinstance(value, bool):
            out.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        else:
            out += [flag_name(name), str(value)]
    return out


class LlamaServerTarget:
    """llama.cpp's server: one non-streamed ``/completion`` per request, the prompt as token ids."""
    name = "llama.cpp"

    def __init__(self, url: str):
        self.url = url
        self.session = None

    async def complete(self, ids: list[int], gen: int) -> int:
        import aiohttp
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        body = completion_body(ids, gen)
        async with self.session.post(self.url + "/completion", json=body) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"llama-server answered {r.status}: {str(data)[:300]}")
        return predicted_tokens(data)

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def completion_body(ids: list[int], gen: int) -> dict:
    """Greedy, ``gen`` tokens whatever they are, the prompt used as given (no BOS added)."""
    return {"prompt": list(ids), "n_predict": gen, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "stream": False, "add_special": False}


def predicted_tokens(data: dict) -> int:
    """Tokens generated, from a ``/completion`` answer."""
    n = data.get("tokens_predicted", (data.get("timings") or {}).get("predicted_n"))
    if not isinstance(n, int) or n < 0:
        raise RuntimeError(f"llama-server's answer gives no token count: {sorted(data)[:12]}")
    return n


async def closed_loop(target, prompts: list[list[int]], concurrency: int, gen: int) -> tuple[int, float, list[float]]:
    """``concurrency`` clients, each sending its next prompt when its previous request is done.
    -> (tokens generated, wall seconds, latency of each request)."""
    queue = iter(prompts)
    latencies: list[float] = []
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        for ids in queue:                       # the iterator is shared: each prompt is sent once
            t = time.perf_counter()
            n = await target.complete(ids, gen)    # not `tokens += await ...`: that reads tokens before the wait
            tokens += n
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return tokens, time.perf_counter() - t0, latencies


def level_summary(latencies: list[float], tokens: int, wall: float) -> dict:
    p = pct(latencies, (50, 95))
    return {"requests": len(latencies), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall if wall > 0 else 0.0,
            "latency_p50_s": p["p50"], "latency_p95_s": p["p95"]}


def merge_rounds(rounds: list[tuple[int, float, list[float]]]) -> dict:
    """One level's rounds together: tokens over the summed wall time, latencies pooled."""
    return level_summary([x for r in rounds for x in r[2]], sum(r[0] for r in rounds), sum(r[1] for r in rounds))


def compare(llmd: dict, peer: dict) -> dict:
    """llmd / llama.cpp: tokens/s (higher is better for llmd) and latencies (lower is better)."""
    out = {"tok_s": llmd["tok_s"] / peer["tok_s"] if peer["tok_s"] else None}
    for key in ("latency_p50_s", "latency_p95_s"):
        out[key] = llmd[key] / peer[key] if peer[key] else None
    out["goal_met"] = bool(out["tok_s"] and out["tok_s"] >= GOAL_RATIO and llmd["latency_p95_s"] <= peer["latency_p95_s"])
    return out


async def _run_levels(targets: list, cfg: LoadConfig, prompts: list[list[int]], log) -> dict:
    for t in targets:                                       # warm-up: first requests pay one-time costs
        await t.complete(prompts[0][:16], 4)
    used = 1
    levels: dict = {}
    for i, n in enumerate(cfg.levels):
        rounds: dict = {t.name: [] for t in targets}
        for r in range(cfg.repeat):
            batch = prompts[used:used + cfg.requests(n)]
            used += len(batch)
            for t in (targets if (i + r) % 2 == 0 else targets[::-1]):
                rounds[t.name].append(await closed_loop(t, batch, n, cfg.gen))
                s = level_summary(rounds[t.name][-1][2], *rounds[t.name][-1][:2])
                log(f"concurrency {n} round {r + 1} {t.name}: {s['tok_s']:.1f} tok/s, latency p50 "
                    f"{s['latency_p50_s']:.2f} s, p95 {s['latency_p95_s']:.2f} s ({s['requests']} requests)")
        levels[str(n)] = {name: merge_rounds(rs) for name, rs in rounds.items()}
    return levels


def run_load(model_dir: str, gguf: str, engine: dict, cfg: LoadConfig, log=print) -> dict:
    """Start both servers, run every level on each in turn, stop them; the result as a dict."""
    total = 1 + sum(cfg.requests(n) for n in cfg.levels) * cfg.repeat
    tok = gguf_tokenizer(model_dir) if is_gguf_file(model_dir) else Tokenizer.from_dir(tokenizer_dir(model_dir))
    prompts = heldout_prompts(tok, total, cfg.prompt_len, cfg.seed)
    ctx = cfg.slots * (cfg.prompt_len + cfg.gen + 16)
    server_args = ["-np", str(cfg.slots), "-c", str(ctx), "-cb"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="llmd-load-") as work, LlamaServer() as server:
        log(f"starting llama-server on {gguf} ({cfg.slots} slots) and llmd's daemon on {model_dir}")
        url = server.start(binary(), gguf, cfg.threads, server_args)
        daemon = DaemonTarget(model_dir, {"threads": cfg.threads, **engine}, work)
        try:
            targets = [daemon, LlamaServerTarget(url)]
            levels = asyncio.run(_with_close(targets, _run_levels(targets, cfg, prompts, log)))
        finally:
            daemon.stop()
    for res in levels.values():
        res["llmd/llama.cpp"] = compare(res["llmd"], res["llama.cpp"])
    return {"model": model_dir, "gguf": str(gguf), "config": asdict(cfg), "engine": engine,
            "llama_server_args": server_args, "load_average": [load_before, os.getloadavg()], "levels": levels}


async def _with_close(targets, coro):
    try:
        return await coro
    finally:
        for t in targets:
            await t.aclose()


def table(res: dict) -> str:
    c = res["config"]
    la = " -> ".join(f"{a[0]:.1f}" for a in res["load_average"])
    lines = [f"llmd daemon {res['model']}  vs  llama-server {res['gguf']}",
             f"closed loop: {c['prompt_len']}-token held-out prompts, {c['gen']} tokens each, {c['threads']} threads; "
             f"load average {la}", "",
             f"{'clients':>7}{'llmd tok/s':>12}{'llama.cpp':>11}{'ratio':>7}"
             f"{'llmd p50/p95 s':>17}{'llama.cpp p50/p95 s':>22}{'p95 ratio':>11}  goal (>= {GOAL_RATIO:g}x, p95 no worse)"]
    for n, r in res["levels"].items():
        a, b, q = r["llmd"], r["llama.cpp"], r["llmd/llama.cpp"]
        lines.append(f"{n:>7}{a['tok_s']:>12.1f}{b['tok_s']:>11.1f}{q['tok_s']:>6.2f}x"
                     f"{a['latency_p50_s']:>8.2f}/{a['latency_p95_s']:<8.2f}"
                     f"{b['latency_p50_s']:>13.2f}/{b['latency_p95_s']:<8.2f}{q['latency_p95_s']:>10.2f}x"
                     f"  {'met' if q['goal_met'] else 'NOT met'}")
    return "\n".join(lines)
