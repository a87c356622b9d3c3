"""Linear-layer plans chosen by rule (now) against those another revision chose by timing, side by side
in one process: for each weight of a model shape (its layer products and its head), the plan each
picks, and where they differ, the time of the products the model runs through it.

    .venv/bin/python bench/bench_plans.py --against 2458811 --threads 2
    .venv/bin/python bench/bench_plans.py --against 2458811 --decode float32,bfloat16 --models tiny,code-draft

``--against``'s ``runtime/models/layers.py`` is read from git and its ``matvec_plan`` run here, as a
model of that revision would have run it at load. A model whose every layer product the fused step
serves stores them for llmd's kernel whatever the plan (``prepare_for_inference``), so for those the
plan in effect is compared, not the timed one. Weights are random: float32 (float32 blocks),
bfloat16 values served in float32 (bfloat16 blocks: the same plan, half the bytes), and a model
served in bfloat16. Rounds alternate between the two plans; the fastest round of each is reported
with their ratio (below 1: the rule's plan is faster), and the ratio of medians beside it. Quantized weights (int8, int4) have no plan: their
products are the same in both revisions. With ``--decode``, one engine per model decodes (one stream,
then 16) with its plans swapped between the two each round, as bench_kernels.py swaps libraries.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmd.bench.bench_kernels import decode_rate
from llmd.runtime import kernels
from llmd.runtime.kernels import ops
from llmd.runtime.llm import LLM
from llmd.runtime.models import layers
from llmd.runtime.models.fused_decode import FusedDecode, layer_linears
from llmd.runtime.models.layers import Linear, MatvecPlan
from llmd.runtime.models.random_model import write_random_model
from llmd.runtime.request import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
# hidden, heads, kv heads, head size, intermediate, vocabulary of each model shape
MODELS = {"tiny": (256, 4, 4, 64, 1024, 8192), "code-target": (384, 6, 2, 64, 1024, 8192),
          "code-draft": (128, 4, 2, 32, 384, 8192), "qwen2-0.5b": (896, 14, 2, 64, 4864, 151936)}
VARIANTS = ("float32", "bfloat16-blocks", "bfloat16")


def layers_at(rev: str):
    """``rev``'s runtime/models/layers.py as a module (its relative imports resolve to today's package)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:runtime/models/layers.py"], capture_output=True,
                            text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("llmd.runtime.models._layers_at_rev", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "llmd.runtime.models"
    sys.modules[spec.name] = module           # its dataclasses look their module up by name
    exec(compile(source, f"{rev}:runtime/models/layers.py", "exec"), module.__dict__)
    return module


def weight_shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, in, out) of one layer's products and the head."""
    e, h, kvh, d, i, v = MODELS[model]
    return [("qkv", e, (h + 2 * kvh) * d), ("o", h * d, e), ("gate_up", e, 2 * i), ("down", i, e), ("head", e, v)]


def fused_layers(model: str, dtype: torch.dtype) -> bool:
    """The fused step serves this model's layer products: they are stored for llmd's kernel."""
    return (dtype == torch.float32 and layers.can_pack(dtype) and kernels.available()
            and all(n % 64 == 0 for name, _, n in weight_shapes(model) if name != "head"))


def linear(w: torch.Tensor, plan: MatvecPlan) -> Linear:
    m = Linear(w.shape[1], w.shape[0])
    m.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    m.apply_plan(plan)
    return m


def product_times(w: torch.Tensor, plans: dict, rows: list[int], rounds: int) -> dict:
    """Microseconds of a product of each row count through each plan, rounds alternating: the fastest
    round of each (other work on the machine only ever adds time), and the ratio of medians beside it."""
    mods = {name: linear(w, plan) for name, plan in plans.items()}
    out = {}
    for m in rows:
        x = torch.randn(m, w.shape[1], dtype=w.dtype)
        reps = max(1, min(50, int(2e8 // (w.numel() * m + 1))))
        times = {name: [] for name in mods}
        for _ in range(rounds):
            for name, mod in mods.items():
                mod(x)
                t0 = time.perf_counter()
                for _ in range(reps):
                    mod(x)
                times[name].append((time.perf_counter() - t0) / reps)
        best = {k: min(v) for k, v in times.items()}
        median = {k: statistics.median(v) for k, v in times.items()}
        out[m] = {"rule_us": round(best["rule"] * 1e6, 1), "timed_us": round(best["timed"] * 1e6, 1),
                  "rule_over_timed": round(best["rule"] / best["timed"], 3),
                  "medians_rule_over_timed": round(median["rule"] / median["timed"], 3)}
    return out


def model_linears(model) -> list[Linear]:
    """Every Linear of a prepared model, its tied head included."""
    found = [m for m in model.modules() if type(m) is Linear]
    return found + ([model._tied_head] if model._tied_head is not None else [])


def timed_plans(old, model, threads: int) -> list[MatvecPlan]:
    """The plans ``old``'s timing picks for each Linear of ``model``, with that revision's override: a
    model the fused step serves stores its layer products for llmd's kernel."""
    fused = {id(m) for m in layer_linears(model)} if model.fused_decode is not None else set()
    plans = []
    for m in model_linears(model):
        t = old.matvec_plan(m.in_features, m.out_features, m.dense_weight().dtype, threads)
        t = MatvecPlan(t.layout, t.splits, t.split_max_rows, t.packed)
        plans.append(MatvecPlan("blocked", 1, ops.F32_MAX_ROWS, packed=True) if id(m) in fused else t)
    return plans


def decode_side_by_side(old, models: list[str], dtypes: list[str], args) -> list[dict]:
    """Decode tokens/s of one engine per model and dtype, its plans swapped between the rule's and the
    timed ones each round (the fused step rebuilt for each)."""
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            path = ROOT / "models" / name if (ROOT / "models" / name).is_dir() else write_random_model(Path(tmp) / name, name)
            for dtype in dtypes:
                llm = LLM(str(path), dtype=dtype, kv_memory="256MiB", threads=args.threads)
                model = llm.engine.runner.model
                linears = model_linears(model)
                plans = {"rule": [m.plan for m in linears], "timed": timed_plans(old, model, args.threads)}

                def use(which: str) -> None:
                    for m, plan in zip(linears, plans[which]):
                        if m.plan != plan:
                            m.apply_plan(plan)
                    model.fused_decode = FusedDecode.build(model)

                rng = random.Random(0)
                vocab = model.config.vocab_size
                prompts = [[rng.randrange(vocab) for _ in range(64)] for _ in range(16)]
                params = SamplingParams(max_tokens=args.gen, ignore_eos=True)
                rates = {k: ([], []) for k in plans}
                tokens = {}
                for _ in range(args.rounds):
                    for which in plans:
                        use(which)
                        one, tokens[which] = decode_rate(llm, prompts[:1], params)
                        many, _ = decode_rate(llm, prompts, params)
                        rates[which][0].append(one)
                        rates[which][1].append(many)
                row = {"model": name, "dtype": dtype, "plans_differ": sum(a != b for a, b in zip(*plans.values())),
                       "same_tokens": tokens["rule"] == tokens["timed"]}
                for i, label in enumerate(("one_stream", "streams")):
                    best = {k: max(v[i]) for k, v in rates.items()}
                    median = {k: statistics.median(v[i]) for k, v in rates.items()}
                    row[label] = {"rule_tok_s": round(best["rule"], 1), "timed_tok_s": round(best["timed"], 1),
                                  "rule_over_timed": round(best["rule"] / best["timed"], 3),
                                  "medians_rule_over_timed": round(median["rule"] / median["timed"], 3)}
                print(json.dumps(row), flush=True)
                report.append(row)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="HEAD", help="git revision whose timed plans are the baseline")
    ap.add_argument("--threads", type=int, default=2, help="torch and kernel threads (default 2)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"model shapes (default {','.join(MODELS)})")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"weight kinds (default {','.join(VARIANTS)})")
    ap.add_argument("--rows", default="1,4,16,64", help="row counts timed where the plans differ")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    ap.add_argument("--decode", metavar="DTYPES", help="instead, decode with each model (a bundled model "
                    "directory's name or a random shape) in these dtypes (e.g. float32,bfloat16), plans swapped")
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per stream with --decode (default 32)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old = layers_at(args.against)
    if args.decode:
        decode_side_by_side(old, args.models.split(","), args.decode.split(","), args)
        return 0
    rows = [int(r) for r in args.rows.split(",")]
    report = []
    with torch.inference_mode():
        for model in args.models.split(","):
            for variant in args.variants.split(","):
                dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
                for name, k, n in weight_shapes(model):
                    rule = layers.matvec_plan(k, n, dtype, args.threads)
                    if name != "head" and fused_layers(model, dtype):
                        timed = MatvecPlan("blocked", 1, ops.F32_MAX_ROWS, packed=True)
                    else:
                        t = old.matvec_plan(k, n, dtype, args.threads)
                        timed = MatvecPlan(t.layout, t.splits, t.split_max_rows, t.packed)
                    row = {"model": model, "weights": variant, "product": name, "shape": [k, n],
                           "rule": rule.__dict__, "timed": timed.__dict__, "same_plan": rule == timed}
                    if rule != timed:
                        w = torch.randn(n, k)
                        w = w.to(torch.bfloat16) if variant == "bfloat16" else w
                        w = w.to(torch.bfloat16).float() if variant == "bfloat16-blocks" else w
                        row["times"] = product_times(w, {"rule": rule, "timed": timed}, rows, args.rounds)
                    report.append(row)
                    print(json.dumps(row), flush=True)
    print(json.dumps({"plans": len(report), "same": sum(r["same_plan"] for r in report)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
