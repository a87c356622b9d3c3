"""A GGUF file's prompt speed, start and memory, llmd against llama.cpp on the same file.

    python -m llmd.bench.gguf_peer FILE.gguf --threads 2 [--prompt-len 512] [--repeat 3] [--cold]

- prompt: llmd's prefill of a --prompt-len prompt of random tokens (one engine, prefix cache off, best
  of --repeat) against `llama-bench -p N -n 0` (best of --repeat), as tokens/s and their ratio;
- start: a new process to the first token of a 16-token prompt, llmd (`LLM(FILE)` then one token)
  against llama-server's start plus one /completion token; --cold drops the page cache before each
  (root only), else the file is read once first so that both start warm;
- memory: llmd's peak resident memory (VmHWM) over that start, beside the file's size and the KV
  pool's, and the bytes llmd wrote under its cache directory for the file;
- batch: greedy tokens of --batch PROMPTSxTOKENS random prompts, each alone and all in one batch.

Each side runs alone in turn; the load average is printed with the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from llmd.runtime.formats.gguf_import import cache_root
from llmd.runtime.llm import LLM
from llmd.runtime.request import SamplingParams

from .llama_bench import llama_bench_binary
from .llama_server import LlamaServer, binary as server_binary

START_SCRIPT = r"""
import json, sys, time
t0 = float(sys.argv[3])
from llmd.runtime.llm import LLM
from llmd.runtime.request import SamplingParams
import torch
torch.set_num_threads(int(sys.argv[2]))
llm = LLM(sys.argv[1], draft="none", kv_memory=sys.argv[4])
loaded = time.time() - t0
ids = list(range(1000, 1016))
out = llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))[0]
first = time.time() - t0
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"loaded_s": loaded, "first_token_s": first, "peak_rss": hwm, "tokens": len(out.token_ids)}))
"""


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def cache_bytes() -> int:
    root = cache_root().parent
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def llmd_start(path: Path, threads: int, kv: str) -> dict:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", START_SCRIPT, str(path), str(threads), repr(t0), kv],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if out.returncode:
        raise SystemExit(f"llmd failed: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = time.time() - t0
    return res


def llama_start(path: Path, threads: int) -> dict:
    t0 = time.time()
    with LlamaServer() as server:
        url = server.start(server_binary(), path, threads, ["-c", "2048", "-np", "1"])
        ready = time.time() - t0
        body = json.dumps({"prompt": list(range(1000, 1016)), "n_predict": 1, "cache_prompt": False}).encode()
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            json.loads(r.read())
        first = time.time() - t0
    return {"ready_s": ready, "first_token_s": first}


def llmd_prompt(path: Path, threads: int, n: int, repeat: int) -> float:
    torch.set_num_threads(threads)
    llm = LLM(str(path), draft="none", prefix_cache=False, kv_memory="1GiB")
    rng = random.Random(0)
    vocab = min(llm.tokenizer.vocab_size, llm.engine.model_config.vocab_size)
    llm.generate([[rng.randrange(vocab) for _ in range(16)]], SamplingParams(max_tokens=1, ignore_eos=True))
    best = float("inf")
    for _ in range(repeat):
        prompt = [rng.randrange(vocab) for _ in range(n)]
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        best = min(best, time.perf_counter() - t)
    return n / best


def llama_prompt(path: Path, threads: int, n: int, repeat: int) -> float:
    out = subprocess.run([str(llama_bench_binary()), "-m", str(path), "-p", str(n), "-n", "0", "-t", str(threads),
                          "-r", str(repeat), "-o", "json"], capture_output=True, text=True, check=True)
    row = json.loads(out.stdout)[0]
    return max(float(v) for v in row["samples_ts"])


def batch_invariance(path: Path, threads: int, prompts: int, tokens: int) -> dict:
    """Greedy tokens of ``prompts`` random prompts, each alone and all in one batch: how many agree."""
    torch.set_num_threads(threads)
    llm = LLM(str(path), draft="none", prefix_cache=False, kv_memory="1GiB")
    rng = random.Random(1)
    vocab = min(llm.tokenizer.vocab_size, llm.engine.model_config.vocab_size)
    batch = [[rng.randrange(vocab) for _ in range(rng.randrange(8, 64))] for _ in range(prompts)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    together = [c.token_ids for c in llm.generate(batch, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in batch]
    return {"prompts": prompts, "tokens": tokens, "identical_requests": sum(a == b for a, b in zip(alone, together)),
            "identical_tokens": sum(x == y for a, b in zip(alone, together) for x, y in zip(a, b))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmd.bench.gguf_peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path, help="the GGUF file both read")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens for the prompt test (default 512)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of each test (default 3)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each start (root only)")
    ap.add_argument("--kv-memory", default="512MiB", help="llmd's KV pool in the start test (default 512MiB)")
    ap.add_argument("--skip", default="", help="comma-separated tests to skip: prompt, start, batch")
    ap.add_argument("--batch", default="8x128", help="batch invariance: PROMPTSxTOKENS greedy, alone and together")
    a = ap.parse_args(argv)
    skip = set(a.skip.split(","))
    res: dict = {"file": str(a.file), "bytes": a.file.stat().st_size, "threads": a.threads,
                 "load_average": os.getloadavg()[0]}
    if "start" not in skip:
        starts = {"llmd": [], "llama": []}
        before = cache_bytes()
        for _ in range(a.repeat):
            for who, fn in (("llmd", lambda: llmd_start(a.file, a.threads, a.kv_memory)),
                            ("llama", lambda: llama_start(a.file, a.threads))):
                if a.cold:
                    if not drop_caches():
                        raise SystemExit("--cold needs root (writes /proc/sys/vm/drop_caches)")
                else:
                    warm(a.file)
                starts[who].append(fn())
        best = {w: min(v, key=lambda r: r["first_token_s"]) for w, v in starts.items()}
        res["start"] = {"cold": a.cold, "llmd": best["llmd"], "llama": best["llama"],
                        "ratio": best["llmd"]["first_token_s"] / best["llama"]["first_token_s"],
                        "llmd_peak_rss_max": max(r["peak_rss"] for r in starts["llmd"]),
                        "written_bytes": cache_bytes() - before}
    if "prompt" not in skip:
        mine, theirs = llmd_prompt(a.file, a.threads, a.prompt_len, a.repeat), llama_prompt(a.file, a.threads,
                                                                                            a.prompt_len, a.repeat)
        res["prompt"] = {"tokens": a.prompt_len, "llmd_tok_s": mine, "llama_tok_s": theirs, "ratio": mine / theirs}
    if "batch" not in skip:
        n, t = map(int, a.batch.split("x"))
        res["batch"] = batch_invariance(a.file, a.threads, n, t)
    res["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    gib = 1 << 30
    if "start" in res:
        s = res["start"]
        print(f"start ({'cold' if a.cold else 'warm'} page cache): llmd {s['llmd']['first_token_s']:.2f} s, "
              f"llama-server {s['llama']['first_token_s']:.2f} s: {s['ratio']:.2f}x; llmd peak RSS "
              f"{s['llmd_peak_rss_max'] / gib:.2f} GiB for a {res['bytes'] / gib:.2f} GiB file; written "
              f"{s['written_bytes'] / 1e6:.1f} MB", file=sys.stderr)
    if "prompt" in res:
        p = res["prompt"]
        print(f"prompt {p['tokens']}: llmd {p['llmd_tok_s']:.1f} tok/s, llama.cpp {p['llama_tok_s']:.1f} tok/s: "
              f"{p['ratio']:.2f}x", file=sys.stderr)
    if "batch" in res:
        b = res["batch"]
        print(f"batch invariance: {b['identical_requests']} of {b['prompts']} requests, {b['identical_tokens']} of "
              f"{b['prompts'] * b['tokens']} tokens identical alone and in one batch", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
