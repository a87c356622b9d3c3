"""Two ways of running the same float32 decode step, side by side in one process, rounds alternating:

    .venv/bin/python bench/bench_decode_paths.py --compare fused --shape tiny
    .venv/bin/python bench/bench_decode_paths.py --compare bf16-blocks --model models/code-target
    .venv/bin/python bench/bench_decode_paths.py --compare int4-half --model models/code-target

``fused``: every layer in one kernel call (llmd.runtime.models.fused_decode) against the layer-by-layer
Python forward, on one loaded model (the fused form is switched off for the baseline's rounds).
``bf16-blocks``: a checkpoint whose weights are all bfloat16 values, served in float32, with its
blocked weights kept in bfloat16 (widened exactly in the kernel) against the same model loaded with
float32 blocks. ``int4-half``: an int4 engine whose scales and zeros are float16 values (any int4 engine
directory as --model, or a float model exported here to int4 with groups of 32, plain rounding) with its
int4 blocks holding them as float16 (5 bits a weight) against the same engine loaded with float32
blocks (6 bits). Reported: medians of one-stream and N-stream decode tokens/s (prompts cached,
counted from the first token, as ``llmd bench`` does), their ratios, and whether both produced the
same tokens in every round (both paths compute the same float32 numbers, so they must), and how
many steps the fused form served.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch

from llmd.bench.bench_kernels import add_decode_args, decode_rate
from llmd.export.cli import ExportOptions, export_engine
from llmd.runtime.formats.quantized import Int4Linear
from llmd.runtime.kernels import ops
from llmd.runtime.llm import LLM
from llmd.runtime.models.random_model import write_random_model
from llmd.runtime.request import SamplingParams


class Toggle:
    """One engine whose fused form is on (``use(True)``) or off."""

    def __init__(self, llm: LLM):
        self.llm, self.model = llm, llm.engine.runner.model
        self.fused = self.model.fused_decode
        if self.fused is None:
            raise SystemExit("this model has no fused form here (see llmd.runtime.models.fused_decode)")

    def use(self, on: bool) -> LLM:
        self.model.fused_decode = self.fused if on else None
        return self.llm


def narrow_and_wide(model: str, opts: dict, check: str) -> tuple[LLM, LLM]:
    """The model loaded as it loads, and again with ``ops.<check>`` (the narrowing test of its blocks)
    answering None: the baseline keeps float32 blocks."""
    narrow = LLM(model, draft="none", **opts)
    keep = getattr(ops, check)
    setattr(ops, check, lambda t: None)
    try:
        wide = LLM(model, draft="none", **opts)
    finally:
        setattr(ops, check, keep)
    return narrow, wide


def int4_engine(model: str, tmp: str) -> str:
    """``model`` when it is an int4 engine directory, else its export to int4 with groups of 32 (plain
    rounding, a short quality check) under ``tmp``."""
    manifest = Path(model) / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("quantization", {}).get("method") == "int4":
        return model
    out = Path(tmp) / "int4-g32"
    export_engine(ExportOptions(model, str(out), quant="int4", group_size=32, scale_search=False, eval_windows=1,
                                eval_tokens=16, accept_loss=True))
    return str(out)


def builds(args, model: str, tmp: str) -> dict:
    """name -> a function giving the LLM to run for that build's round."""
    opts = dict(kv_memory="1GiB", kv_dtype=args.kv_dtype)
    if args.compare == "fused":
        toggle = Toggle(LLM(model, draft="none", **opts))
        return {"fused": lambda: toggle.use(True), "layer_by_layer": lambda: toggle.use(False)}
    if args.compare == "int4-half":
        narrow, wide = narrow_and_wide(int4_engine(model, tmp), opts, "as_float16")
        kinds = {m.kernel_product().kind for m in narrow.engine.runner.model.modules()
                 if isinstance(m, Int4Linear) and m.kernel_product() is not None}
        if ops.KIND_Q4H not in kinds:
            raise SystemExit(f"{model}: no int4 weight has float16 scales and zeros here, so there is nothing to compare")
        return {"int4_f16_blocks": lambda: narrow, "int4_f32_blocks": lambda: wide}
    narrow, wide = narrow_and_wide(model, opts, "as_bfloat16")
    stored = {str(m.stored.dtype) for m in narrow.engine.runner.model.modules() if getattr(m, "stored", None) is not None}
    if "torch.bfloat16" not in stored:
        raise SystemExit(f"{model}: no weight is all bfloat16 values, so there are no bfloat16 blocks to compare")
    return {"bf16_blocks": lambda: narrow, "f32_blocks": lambda: wide}


def fused_steps_of(runs: dict) -> int:
    """Steps the fused form served over the run (the first build's model)."""
    fused = next(iter(runs.values()))().engine.runner.model.fused_decode
    return fused.steps if fused is not None else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", choices=["fused", "bf16-blocks", "int4-half"], required=True, help="which two paths")
    ap.add_argument("--model", help="model directory (default: a random model of --shape)")
    add_decode_args(ap)
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "bfloat16"], help="KV pool (default: the model's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_random_model(Path(tmp) / "model", args.shape))
        runs = builds(args, model, tmp)
        vocab = next(iter(runs.values()))().engine.model_config.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(min(100, vocab // 2), vocab) for _ in range(args.prompt_len)]
                   for _ in range(args.streams)]
        params = SamplingParams(max_tokens=args.gen, ignore_eos=True)
        rates = {name: ([], []) for name in runs}
        same = True
        for _ in range(args.rounds):
            tokens = []
            for name, get in runs.items():
                llm = get()
                one, t1 = decode_rate(llm, prompts[:1], params)
                many, tn = decode_rate(llm, prompts, params)
                rates[name][0].append(one)
                rates[name][1].append(many)
                tokens.append((t1, tn))
            same = same and tokens[0] == tokens[1]
        fused_steps = fused_steps_of(runs)
    new, base = list(runs)
    result = {"compare": args.compare, "model": args.model or f"random {args.shape}", "threads": args.threads,
              "streams": args.streams, "rounds": args.rounds, "same_tokens": same, "fused_steps": fused_steps}
    for name, (one, many) in rates.items():
        result[name] = {"one_stream_tok_s": round(statistics.median(one), 1),
                        "streams_tok_s": round(statistics.median(many), 1)}
    result["one_stream_ratio"] = round(result[new]["one_stream_tok_s"] / result[base]["one_stream_tok_s"], 3)
    result["streams_ratio"] = round(result[new]["streams_tok_s"] / result[base]["streams_tok_s"], 3)
    print(json.dumps(result, indent=1))
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
