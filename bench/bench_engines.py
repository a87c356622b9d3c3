"""One-stream decode of several engines on the same machine, side by side in one process.

    python bench/bench_engines.py ENGINE_A ENGINE_B [ENGINE_C ...] --rounds 5
    python bench/bench_engines.py ENGINE ENGINE::head_screen=false     # one engine, a setting changed
    python bench/bench_engines.py ENGINE ENGINE::fused_rows=16 --streams 17,32   # N streams decoding at once

Each model (an engine directory, a model directory, or a GGUF file, imported as ``llmd bench`` imports
it) is loaded once; then every round runs one stream on each in turn (the prompt's first token, then
``--gen - 1`` decode steps, timed as ``llmd bench`` times its one stream), so a slow spell of the
machine falls on all of them alike. Reported: each engine's decode tokens/s per round and its median,
and each one's per-round ratio to the first engine, with the median of those ratios. Used for the
formats of one model against each other (int4 against bfloat16 blocks, an int4 head against an
int8g one), which ``llmd bench --against`` does not compare, and for one engine with a setting changed:
``PATH::name=value,...`` loads PATH with those engine settings (EngineConfig's fields; true / false
for a flag), so the head screen can be timed against the whole head. Two are the bench's own:
``fused_rows=N``: the engine's fused step takes at most N rows (16: as before bfloat16 blocks and
the packed quantized forms took more), the Python forward the rest; ``f32_rows=N``: float32 blocks
(and bfloat16 ones where AMX does not take them) take N rows on the kernel and more on a float32
oneDNN copy of the weight, as before the kernel took every row count. Each round also times the
first token (the prompt's forward).

``--streams N,...`` times N streams decoding together instead (decode tokens/s of all of them, with
their prompts served from the prefix cache, as ``llmd bench --concurrency`` reports it), each count a
round of its own for every engine in turn.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch

from llmd.bench.cli import collector_frozen, concurrent, single_stream
from llmd.runtime.formats.gguf_import import is_gguf, resolve_model_path
from llmd.runtime.kernels import ops
from llmd.runtime.llm import LLM
from llmd.runtime.models.fused_decode import FusedDecode
from llmd.runtime.models.layers import Linear, MatvecPlan, pack_weight


def load(spec: str, kv_memory: str) -> LLM:
    """``spec``: a model path, with ``::name=value,...`` engine settings after it."""
    path, _, extra = spec.partition("::")
    options = {}
    for item in filter(None, extra.split(",")):
        name, _, value = item.partition("=")
        options[name.strip()] = _value(value.strip())
    fused_rows, f32_rows = options.pop("fused_rows", None), options.pop("f32_rows", None)
    model = resolve_model_path(path, "float32") if is_gguf(path) else path
    llm = LLM(model, **{"draft": "none", "kv_memory": kv_memory, **options})
    net = llm.engine.runner.model
    if f32_rows is not None:
        for m in net.modules():
            if (type(m) is Linear and m.plan.layout == "blocked"
                    and (m.stored.dtype == torch.float32 or not ops.bf16_amx_rows())):
                m.plan = MatvecPlan("blocked", 1, int(f32_rows), packed=True)
                m.packed = pack_weight(m.dense_weight().detach())
        net.fused_decode = FusedDecode.build(net) if net.fused_decode is not None else None
    if fused_rows is not None and net.fused_decode is not None:
        net.fused_decode.max_rows = min(net.fused_decode.max_rows, int(fused_rows))
    return llm


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


def compare(llms: list[LLM], rounds: int, prompt_len: int, gen: int, streams: int = 1) -> dict:
    vocab = min(min(e.engine.model_config.vocab_size, e.tokenizer.vocab_size) for e in llms)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(streams)]
    for e in llms:
        single_stream(e, prompts[0][:8], 8)              # warm-up
        if streams > 1:
            concurrent(e, [p[:8] for p in prompts], 8)
    rates: list[list[float]] = [[] for _ in llms]
    ttfts: list[list[float]] = [[] for _ in llms]
    for _ in range(rounds):
        for i, e in enumerate(llms):
            if streams == 1:
                got = single_stream(e, prompts[0], gen)
                rates[i].append(got["decode_tok_s"])
                ttfts[i].append(got["ttft_s"])
            else:
                got = concurrent(e, prompts, gen)
                rates[i].append(got["decode_aggregate_tok_s"])
                ttfts[i].append(got["ttft_p50_s"])
    ratios = [[r / b for r, b in zip(rates[i], rates[0])] for i in range(len(llms))]
    return {"rates": rates, "median_tok_s": [statistics.median(r) for r in rates],
            "ratios": ratios, "median_ratio": [statistics.median(r) for r in ratios],
            "ttft_s": ttfts, "median_ttft_s": [statistics.median(t) for t in ttfts]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="two or more engine directories, model directories or GGUF files, each "
                   "with ::name=value,... engine settings if wanted; ratios are to the first")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each running every engine once (default 5)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--gen", type=int, default=65, help="tokens per stream, the first from the prompt (default 65)")
    p.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    p.add_argument("--kv-memory", default="256MiB", help="KV pool of each engine (default 256MiB)")
    p.add_argument("--streams", default="1", help="comma-separated stream counts: 1 (default) times one stream; "
                   "N > 1 times N streams decoding together, each count compared on its own")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:
        counts = [int(c) for c in args.streams.split(",")]
    except ValueError:
        counts = []
    if len(args.models) < 2 or args.rounds < 1 or args.prompt_len < 1 or args.gen < 2 or args.threads < 1:
        p.error("give two or more models, --rounds >= 1, --prompt-len >= 1, --gen >= 2 and --threads >= 1")
    if not counts or not all(1 <= c <= 256 for c in counts):
        p.error(f"--streams takes stream counts from 1 to 256, comma-separated, got {args.streams!r}")
    torch.set_num_threads(args.threads)
    llms = [load(m, args.kv_memory) for m in args.models]
    results = []
    with collector_frozen():
        for n in counts:
            res = compare(llms, args.rounds, args.prompt_len, args.gen, n)
            res.update(models=args.models, threads=args.threads, prompt_len=args.prompt_len, gen=args.gen, streams=n)
            results.append(res)
            if not args.json:
                print_table(res, len(counts) > 1 or n > 1)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=1))
    return 0


def print_table(res: dict, with_streams: bool) -> None:
    head = f"{res['streams']} streams, " if with_streams else ""
    for i, m in enumerate(res["models"]):
        rounds = " ".join(f"{r:.1f}" for r in res["rates"][i])
        ratio = "" if i == 0 else (f"  {res['median_ratio'][i]:.2f}x the first (rounds "
                                   + " ".join(f"{r:.2f}" for r in res["ratios"][i]) + ")")
        first = res["median_ttft_s"][i] * 1e3
        print(f"{head}{m}: decode {res['median_tok_s'][i]:.1f} tok/s (rounds {rounds}){ratio}; first token "
              f"{first:.1f} ms", flush=True)

if __name__ == "__main__":
    sys.exit(main())
