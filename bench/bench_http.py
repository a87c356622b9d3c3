"""What `llmd http` adds to a streamed token, side by side with the ZeroMQ client in one run.

    .venv/bin/python bench/bench_http.py --model models/code-target --rounds 20 --tokens 64

Starts the daemon (``python -m llmd.daemon serve``) and ``llmd http`` as separate processes, then
alternates, round by round, one greedy streamed completion through the ZeroMQ ``AsyncClient`` and
the same one through HTTP (aiohttp reading server-sent events from ``/v1/completions``). For each
token it records the arrival time; it reports p50 of the time to the first token and of the
gap between tokens for both paths, and the difference (the HTTP hop's cost per streamed token).
Target: the HTTP path adds <= 1 ms p50 to a streamed token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from llmd.clients.client import AsyncClient, ClientError
from llmd.protocol import Token
from llmd.clients.lsp_service import percentile

PROMPT = "def quicksort(items):\n"


async def via_zmq(client: AsyncClient, tokens: int) -> list[float]:
    t0 = time.perf_counter()
    stamps = []
    async with await client.generate(PROMPT, max_tokens=tokens, ignore_eos=True) as stream:
        async for ev in stream:
            if isinstance(ev, Token):
                stamps.append(time.perf_counter() - t0)
    return stamps


async def via_http(session: aiohttp.ClientSession, url: str, tokens: int) -> list[float]:
    body = {"model": "x", "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps = []
    async with session.post(url + "/v1/completions", json=body) as r:
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event[5:].strip()
                if data != b"[DONE]" and json.loads(data)["choices"][0]["text"]:
                    stamps.append(time.perf_counter() - t0)
    return stamps


def summary(runs: list[list[float]]) -> dict:
    ttft = [r[0] * 1000 for r in runs if r]
    gaps = [(b - a) * 1000 for r in runs for a, b in zip(r, r[1:])]
    return {"ttft_p50_ms": percentile(ttft, 50), "gap_p50_ms": percentile(gaps, 50), "tokens": sum(map(len, runs))}


async def measure(sock: str, url: str, rounds: int, tokens: int) -> dict:
    client = AsyncClient(sock, timeout=120)
    zmq_runs, http_runs = [], []
    async with aiohttp.ClientSession() as session:
        await via_zmq(client, 4)                 # warm both paths
        await via_http(session, url, 4)
        for i in range(rounds):
            pair = [via_zmq(client, tokens), via_http(session, url, tokens)]
            for coro in (pair if i % 2 == 0 else pair[::-1]):
                result = await coro
                (zmq_runs if coro is pair[0] else http_runs).append(result)
    await client.aclose()
    z, h = summary(zmq_runs), summary(http_runs)
    return {"zmq": z, "http": h, "added_ttft_p50_ms": h["ttft_p50_ms"] - z["ttft_p50_ms"],
            "added_gap_p50_ms": h["gap_p50_ms"] - z["gap_p50_ms"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(sock: str, url: str, procs, timeout: float = 300) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"a server exited early ({p.args[:4]}): {p.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the servers did not become ready")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/code-target", help="model directory (default models/code-target)")
    p.add_argument("--rounds", type=int, default=20, help="completions per path (default 20)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per completion (default 64)")
    p.add_argument("--threads", type=int, default=1, help="engine threads (default 1)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sock, port = str(Path(tmp) / "llmd.sock"), free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "XDG_CONFIG_HOME": tmp}
        daemon = subprocess.Popen([sys.executable, "-m", "llmd.daemon", "serve", "--model", args.model, "--socket", sock,
                                   "--threads", str(args.threads)], env=env, stderr=subprocess.PIPE, text=True)
        front = subprocess.Popen([sys.executable, "-m", "llmd.cli", "http", "--socket", sock, "--port", str(port),
                                  "--log-level", "warning"], env=env, stderr=subprocess.PIPE, text=True)
        try:
            wait_ready(sock, url, (daemon, front))
            result = asyncio.run(measure(sock, url, args.rounds, args.tokens))
        except ClientError as e:
            raise SystemExit(f"bench_http: {e}")
        finally:
            for proc in (front, daemon):
                proc.terminate()
                proc.wait(30)
    print(json.dumps(result, indent=2))
    verdict = "meets" if result["added_gap_p50_ms"] <= 1.0 else "misses"
    print(f"llmd http adds {result['added_gap_p50_ms']:.3f} ms p50 per streamed token "
          f"({result['added_ttft_p50_ms']:.3f} ms to the first): {verdict} the 1 ms target", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
