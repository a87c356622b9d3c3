"""Side-by-side speed of float32, int8, int4 and w8a8 on one model shape, through the serving path
(llmd's ModelRunner: packed tokens, paged KV pool, logits of the sampled row).

    .venv/bin/python bench/bench_quant.py --shape qwen2-0.5b --threads 2

Random weights are built in memory (nothing written to disk). For each variant it measures
single-stream decode (tokens/s over --decode steps after a --prompt-token prompt) and prompt
processing (tokens/s of one --prompt-token forward). All variants are built first and --repeat
rounds alternate between them. On a shared machine the fastest step is the figure least disturbed
by other work; medians are printed beside it, and each ratio is given both ways: a memory-bound
variant gains more than a compute-bound one when the neighbours leave bandwidth free.

With --model (a model directory or a GGUF file, such as the ones `make models-real` fetches), the
variants are built from those weights instead, each int4 group the largest that divides the model's
widths (int4-g32 keeps groups of 32: GGUF's Q4 blocks, and SmolLM2's int4 export); with --llamacpp and a GGUF file, llama.cpp runs that file as it is.

With --engine DIR (an llmd engine directory, such as `llmd import FILE.gguf --keep-blocks` writes), the
variant "engine" runs it as the engine loads it, beside the others (float32 from --model: that file's
float32 import).

With --llamacpp (needs the ``bench`` extra: llama-cpp-python and gguf), the same random weights are
written once as a model directory, converted to GGUF Q8_0 and Q4_0 (every matrix, the tied
embedding/head included), and llama.cpp decodes the same prompt with the same thread count in this
process; the report adds llmd int8 / llama.cpp Q8_0 and llmd int4 / llama.cpp Q4_0.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from llmd.bench.to_gguf import convert
from llmd.runtime.formats.engine_dir import load_engine_part
from llmd.runtime.formats.gguf_import import resolve_model_path
from llmd.runtime.formats.manifest import read_manifest
from llmd.runtime.formats.quantized import QuantSpec, auto_group_size, prepare_quantized, quantize_model
from llmd.runtime.model_runner import Feed, ModelRunner
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.llama import LlamaForCausalLM
from llmd.runtime.models.loader import load_model
from llmd.runtime.models.random_model import hf_config, init_weights, write_random_model

VARIANTS = {"float32": QuantSpec("none"), "bf16": QuantSpec("none"), "int8": QuantSpec("int8"), "int4": QuantSpec("int4", group_size=128),
            "w8a8": QuantSpec("w8a8"), "int8-int8head": QuantSpec("int8", head="int8"),
            # every matrix at 4 bits, the head too: what llama.cpp's Q4_0 file here holds
            "int4-int4head": QuantSpec("int4", group_size=128, head="int4"),
            "int4-g32": QuantSpec("int4", group_size=32)}
BF16_VALUES = {"bf16"}      # float32 weights rounded to bfloat16 values: served from bfloat16 blocks (half the bytes)


def build(shape: str, spec: QuantSpec, seed: int, model_dir: str | None = None,
          bf16_values: bool = False) -> LlamaForCausalLM:
    if model_dir is None:
        model = LlamaForCausalLM(ModelConfig.from_dict(hf_config(shape)))
        init_weights(model, seed)
    else:
        model = load_model(model_dir, "float32")
        cfg = model.config
        if "int4" in (spec.method, spec.head) and any(w % spec.group_size
                                                      for w in (cfg.hidden_size, cfg.q_size, cfg.intermediate_size)):
            spec = replace(spec, group_size=auto_group_size([cfg]))
    if bf16_values:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    quantize_model(model, spec)
    model.prepare_for_inference()
    prepare_quantized(model)
    return model


def step(runner: ModelRunner, ids: list[int], start: int, blocks: list[int]) -> torch.Tensor:
    return runner.run(runner.prepare_feeds([Feed(ids, start, blocks, 1)]))


class Timer:
    """One variant's runner and its timings; ``round()`` times one prompt forward and its decode, of
    ``streams`` streams decoding together (one row each per step; the first stream's prompt timed)."""

    def __init__(self, model: LlamaForCausalLM, prompt_tokens: int, decode: int, streams: int = 1):
        block = 16
        blocks = (prompt_tokens + decode) // block + 2
        self.runner = ModelRunner(model, blocks * streams, block, "float32")
        self.block_ids = [list(range(s * blocks, (s + 1) * blocks)) for s in range(streams)]
        self.prompts = [[(s * 7 + i) % 1000 + 1 for i in range(prompt_tokens)] for s in range(streams)]
        self.decode = decode
        self.prefill: list[float] = []
        self.per_token: list[float] = []     # a step's time over its streams: 1 / it is tokens/s

    def round(self) -> None:
        toks = []
        for s, (prompt, blocks) in enumerate(zip(self.prompts, self.block_ids)):
            t = time.perf_counter()
            toks.append(int(step(self.runner, prompt, 0, blocks).argmax()))
            if s == 0:
                self.prefill.append(time.perf_counter() - t)
        start = len(self.prompts[0])
        for i in range(self.decode):
            t = time.perf_counter()
            feeds = [Feed([tok], start + i, blocks, 1) for tok, blocks in zip(toks, self.block_ids)]
            toks = self.runner.run(self.runner.prepare_feeds(feeds)).argmax(-1).tolist()
            self.per_token.append((time.perf_counter() - t) / len(feeds))

    def rates(self) -> dict:
        return rates(len(self.prompts[0]), self.prefill, self.per_token)


def rates(prompt_tokens: int, prefill: list[float], per_token: list[float]) -> dict:
    """Tokens/s from the timed prompt forwards and decode steps: the best run and the median."""
    return {"prefill_tps": prompt_tokens / min(prefill), "prefill_tps_median": prompt_tokens / statistics.median(prefill),
            "decode_tps": 1 / min(per_token), "decode_tps_median": 1 / statistics.median(per_token)}


def measure_llamacpp(shape: str, quant: str, threads: int, prompt_tokens: int, decode: int, repeat: int,
                     work: Path) -> dict:
    """llama.cpp on this shape's seed-0 random weights in GGUF ``quant``: the same prompt length, the
    same number of decode steps, timed per token as for llmd."""
    import llama_cpp

    if quant == "file":                 # ``work`` is the GGUF file itself
        path = work
    else:
        model_dir = work / "model"
        if not (model_dir / "config.json").is_file():
            write_random_model(model_dir, shape, seed=0)
        path = convert(model_dir, work / f"model-{quant}.gguf", quant=quant)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=prompt_tokens + decode + 8, n_batch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = list(range(1, prompt_tokens + 1))
    prefill, per_token = [], []
    for _ in range(repeat):
        llm.reset()
        t = time.perf_counter()
        last = t
        for i, _tok in enumerate(llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True)):
            now = time.perf_counter()
            (prefill if i == 0 else per_token).append(now - last)
            last = now
            if i == decode:
                break
    del llm
    return rates(prompt_tokens, prefill, per_token)


def report(name: str, r: dict) -> None:
    print(f"{name:16s} decode {r['decode_tps']:7.2f} tok/s (median {r['decode_tps_median']:7.2f})   "
          f"prompt {r['prefill_tps']:8.1f} tok/s (median {r['prefill_tps_median']:8.1f})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2-0.5b", help="random-weight model shape, as for llmd bench (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for time to first token (default %(default)s)")
    p.add_argument("--decode", type=int, default=32, help="tokens decoded per run (default %(default)s)")
    p.add_argument("--streams", type=int, default=1, choices=range(1, 17), metavar="1..16",
                   help="streams decoding together, one row each per step; decode tok/s counts all (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each variant, taken in turns; medians reported (default %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants to compare (default %(default)s)")
    p.add_argument("--model", default=None, help="a model directory or GGUF file instead of random weights of --shape")
    p.add_argument("--engine", type=Path, default=None,
                   help="also run this llmd engine directory (e.g. from `llmd import FILE.gguf --keep-blocks`)")
    p.add_argument("--llamacpp", action="store_true", help="also run llama.cpp on the same weights at Q8_0 and Q4_0")
    p.add_argument("--work", type=Path, default=None, help="where the GGUF files go (default: a temporary folder)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gguf = args.model if args.model and args.model.lower().endswith(".gguf") else None
    if args.model:
        args.model = resolve_model_path(args.model)
    # every variant is built first and the rounds alternate between them, so that a slow minute on
    # a shared machine falls on all of them alike, not on whichever ran then
    names = args.variants.split(",")
    timers = {}
    for name in names:
        model = build(args.shape, VARIANTS[name], 0, args.model, name in BF16_VALUES)
        timers[name] = Timer(model, args.prompt_tokens, args.decode, args.streams)
        print(f"{name}: built ({'fused step' if model.fused_decode is not None else 'layer-by-layer forward'})",
              flush=True)
    if args.engine:
        names.append("engine")
        timers["engine"] = Timer(load_engine_part(args.engine, read_manifest(args.engine), "target")[0],
                                 args.prompt_tokens, args.decode, args.streams)
    with torch.inference_mode():
        for _ in range(args.repeat):
            for name in names:
                timers[name].round()
    results = {name: timers[name].rates() for name in names}
    for name in names:
        report(name, results[name])
    if args.llamacpp and gguf:
        results["llama.cpp file"] = measure_llamacpp(args.shape, "file", args.threads, args.prompt_tokens,
                                                     args.decode, args.repeat, Path(gguf))
        report("llama.cpp file", results["llama.cpp file"])
    elif args.llamacpp:
        with tempfile.TemporaryDirectory(prefix="llmd-gguf-") as tmp:
            work = args.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            for quant in ("q8_0", "q4_0"):
                results[f"llama.cpp {quant}"] = measure_llamacpp(args.shape, quant, args.threads, args.prompt_tokens,
                                                                 args.decode, args.repeat, work)
                report(f"llama.cpp {quant}", results[f"llama.cpp {quant}"])
    ratios = [("int8 / float32 decode", "int8", "float32", "decode_tps", 1.8),
              ("int8 / bf16 decode", "int8", "bf16", "decode_tps", 1.4),
              ("int4 / bf16 decode", "int4", "bf16", "decode_tps", 1.8),
              ("bf16 / float32 decode", "bf16", "float32", "decode_tps", None),
              ("int4 / int8 decode", "int4", "int8", "decode_tps", 1.3),
              ("int4-g32 / bf16 decode", "int4-g32", "bf16", "decode_tps", 1.8),
              ("int4-g32 / int4 decode", "int4-g32", "int4", "decode_tps", None),
              ("int4 (int4 head) / int8 decode", "int4-int4head", "int8", "decode_tps", 1.3),
              ("w8a8 / int8 prompt", "w8a8", "int8", "prefill_tps", 1.5),
              ("int8 / llama.cpp Q8_0 decode", "int8", "llama.cpp q8_0", "decode_tps", 0.8),
              ("int4 / llama.cpp Q4_0 decode", "int4", "llama.cpp q4_0", "decode_tps", None),
              ("int4 (int4 head) / llama.cpp Q4_0", "int4-int4head", "llama.cpp q4_0", "decode_tps", 0.8),
              ("int8 / llama.cpp Q8_0 prompt", "int8", "llama.cpp q8_0", "prefill_tps", None),
              ("w8a8 / llama.cpp Q8_0 prompt", "w8a8", "llama.cpp q8_0", "prefill_tps", None),
              ("int8 / llama.cpp (file) decode", "int8", "llama.cpp file", "decode_tps", None),
              ("int4 / llama.cpp (file) decode", "int4", "llama.cpp file", "decode_tps", None),
              ("engine / float32 decode", "engine", "float32", "decode_tps", None),
              ("engine / float32 prompt", "engine", "float32", "prefill_tps", None),
              ("engine / int4 decode", "engine", "int4", "decode_tps", None)]
    for label, a, b, key, goal in ratios:
        if a in results and b in results:
            ratio = results[a][key] / results[b][key]
            median = results[a][key + "_median"] / results[b][key + "_median"]
            verdict = f"  (goal {goal}x: {'met' if ratio >= goal else 'NOT met'})" if goal else ""
            print(f"{label:30s} {ratio:5.2f}x  (medians {median:4.2f}x){verdict}")


if __name__ == "__main__":
    main()
