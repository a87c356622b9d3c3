"""One-stream decode of several engines on the same machine, side by side in one process.

    python bench/bench_engines.py ENGINE_A ENGINE_B [ENGINE_C ...] --rounds 5
    python bench/bench_engines.py ENGINE ENGINE::head_screen=false     # one engine, a setting changed

Each model (an engine directory, a model directory, or a GGUF file, imported as ``llmd bench`` imports
it) is loaded once; then every round runs one stream on each in turn (the prompt's first token, then
``--gen - 1`` decode steps, timed as ``llmd bench`` times its one stream), so a slow spell of the
machine falls on all of them alike. Reported: each engine's decode tokens/s per round and its median,
and each one's per-round ratio to the first engine, with the median of those ratios. Used for the
formats of one model against each other (int4 against bfloat16 blocks, an int4 head against an
int8g one), which ``llmd bench --against`` does not compare, and for one engine with a setting changed:
``PATH::name=value,...`` loads PATH with those engine settings (EngineConfig's fields; true / false
for a flag), so the head screen can be timed against the whole head.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch

from llmd.bench.cli import collector_frozen, single_stream
from llmd.runtime.formats.gguf_import import is_gguf, resolve_model_path
from llmd.runtime.llm import LLM


def load(spec: str, kv_memory: str) -> LLM:
    """``spec``: a model path, with ``::name=value,...`` engine settings after it."""
    path, _, extra = spec.partition("::")
    options = {}
    for item in filter(None, extra.split(",")):
        name, _, value = item.partition("=")
        options[name.strip()] = _value(value.strip())
    model = resolve_model_path(path, "float32") if is_gguf(path) else path
    return LLM(model, **{"draft": "none", "kv_memory": kv_memory, **options})


def _value(text: str):
    """A setting's value as written: true / false, an integer, a number, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def compare(llms: list[LLM], rounds: int, prompt_len: int, gen: int) -> dict:
    vocab = min(min(e.engine.model_config.vocab_size, e.tokenizer.vocab_size) for e in llms)
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    for e in llms:
        single_stream(e, prompt[:8], 8)                 # warm-up
    rates: list[list[float]] = [[] for _ in llms]
    for _ in range(rounds):
        for i, e in enumerate(llms):
            rates[i].append(single_stream(e, prompt, gen)["decode_tok_s"])
    ratios = [[r / b for r, b in zip(rates[i], rates[0])] for i in range(len(llms))]
    return {"rates": rates, "median_tok_s": [statistics.median(r) for r in rates],
            "ratios": ratios, "median_ratio": [statistics.median(r) for r in ratios]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="two or more engine directories, model directories or GGUF files, each "
                   "with ::name=value,... engine settings if wanted; ratios are to the first")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each running every engine once (default 5)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--gen", type=int, default=65, help="tokens per stream, the first from the prompt (default 65)")
    p.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    p.add_argument("--kv-memory", default="256MiB", help="KV pool of each engine (default 256MiB)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if len(args.models) < 2 or args.rounds < 1 or args.prompt_len < 1 or args.gen < 2 or args.threads < 1:
        p.error("give two or more models, --rounds >= 1, --prompt-len >= 1, --gen >= 2 and --threads >= 1")
    torch.set_num_threads(args.threads)
    llms = [load(m, args.kv_memory) for m in args.models]
    with collector_frozen():
        res = compare(llms, args.rounds, args.prompt_len, args.gen)
    res.update(models=args.models, threads=args.threads, prompt_len=args.prompt_len, gen=args.gen)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    for i, m in enumerate(args.models):
        rounds = " ".join(f"{r:.1f}" for r in res["rates"][i])
        ratio = "" if i == 0 else (f"  {res['median_ratio'][i]:.2f}x the first (rounds "
                                   + " ".join(f"{r:.2f}" for r in res["ratios"][i]) + ")")
        print(f"{m}: decode {res['median_tok_s'][i]:.1f} tok/s (rounds {rounds}){ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
