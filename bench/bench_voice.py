"""Voice workload: time from a Wyoming transcript to the first complete sentence of the answer.

    .venv/bin/python bench/bench_voice.py --model models/code-target --threads 2
    .venv/bin/python bench/bench_voice.py --socket /run/user/1000/llmd/llmd.sock   # a running daemon

The daemon runs as a separate process unless --socket names a running one; the voice bridge
(``llmd voice``'s code) listens on a unix socket in this process and the `wyoming` package's
client sends it transcripts one at a time, each in a fresh conversation. For each it records the
time from writing the transcript to the first ``handled-chunk`` (the first sentence a speech
engine could start saying) and to ``handled``, and reports p50/p95 of both.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from wyoming.asr import Transcript
from wyoming.client import AsyncClient as WyomingClient

from llmd.bench.bench_editor import daemon_socket
from llmd.clients.lsp_service import percentile
from llmd.clients.voice import VoiceConfig, serve_voice

QUESTIONS = ["What is the weather like today?", "Turn on the kitchen lights.", "Tell me a fun fact about octopuses.",
             "How long should I boil an egg?", "What time is sunset?", "Set a timer for ten minutes.",
             "Who wrote Pride and Prejudice?", "Explain what a black hole is."]


async def run_voice(socket: str, args) -> dict:
    path = Path(tempfile.mkdtemp()) / "voice.sock"
    config = VoiceConfig(socket=socket, max_tokens=args.max_tokens, temperature=args.temperature,
                         sampling={"seed": 0} if args.temperature else {})
    started = asyncio.Event()
    server = asyncio.create_task(serve_voice(f"unix://{path}", config, started))
    await asyncio.wait_for(started.wait(), 30)
    first, whole, sentences = [], [], []
    try:
        async with WyomingClient.from_uri(f"unix://{path}", read_timeout=120) as client:
            for i in range(args.requests + args.warmup):
                text = QUESTIONS[i % len(QUESTIONS)]
                t = time.perf_counter()
                await client.write_event(Transcript(text=text, context={"conversation_id": f"bench-{i}"}).event())
                t_first, chunks = None, 0
                while True:
                    event = await client.read_event()
                    if event.type == "handled-chunk":
                        chunks += 1
                        t_first = t_first or time.perf_counter()
                    elif event.type in ("handled", "not-handled"):
                        t_end = time.perf_counter()
                    elif event.type == "handled-stop":
                        break
                if i >= args.warmup:
                    first.append(1000 * ((t_first or t_end) - t))
                    whole.append(1000 * (t_end - t))
                    sentences.append(chunks)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    return {"requests": len(first), "first_sentence_p50_ms": percentile(first, 50),
            "first_sentence_p95_ms": percentile(first, 95), "answer_p50_ms": percentile(whole, 50),
            "answer_p95_ms": percentile(whole, 95), "mean_sentences": sum(sentences) / max(1, len(sentences))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory for a daemon started here")
    p.add_argument("--socket", help="use the daemon already running at this socket instead")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `llmd serve` flag (repeatable)")
    p.add_argument("--threads", type=int, default=2, help="engine threads of the daemon started here (default 2)")
    p.add_argument("--requests", type=int, default=16, help="transcripts measured (default 16)")
    p.add_argument("--warmup", type=int, default=2, help="transcripts before measuring (default 2)")
    p.add_argument("--max-tokens", type=int, default=96, help="most tokens per answer (default 96)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    if not (args.model or args.socket):
        p.error("give --model (start a daemon) or --socket (use a running one)")
    with daemon_socket(args) as socket:
        result = asyncio.run(run_voice(socket, args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['requests']} transcripts: first sentence p50 {result['first_sentence_p50_ms']:.1f} ms, "
              f"p95 {result['first_sentence_p95_ms']:.1f} ms; whole answer p50 {result['answer_p50_ms']:.1f} ms, "
              f"p95 {result['answer_p95_ms']:.1f} ms; {result['mean_sentences']:.1f} sentences an answer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
