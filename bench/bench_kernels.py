"""llmd's CPU kernels as they are now against another git revision of llmd, each run by its own code:
single-stream and 16-stream decode on one random model, rounds alternating between the two.

    .venv/bin/python bench/bench_kernels.py --against HEAD~1 --shape tiny --threads 2 --rounds 7
    .venv/bin/python bench/bench_kernels.py --against HEAD~1 --products 1,4,5,9,16    # the products alone
    .venv/bin/python bench/bench_kernels.py --against HEAD~1 --products 1,4,64 --form int4 --shape qwen2-0.5b

``--against`` is checked out into a temporary ``git worktree``; a worker process imports llmd from
it (its Python, and its kernels built from its own C sources), another imports this checkout's llmd,
and each keeps its engine (or its packed weights) loaded while the driver asks them for one round at a
time, alternating. This file's worker code runs in both, so it uses only what both revisions offer
(an ImportError from the worker names what the older one lacks). Reported: medians of each side's
decode tokens/s (prompts cached, counted from the first token, as ``llmd bench`` does), the 16-stream /
one-stream ratio, and whether both produced the same tokens (a kernel change must not change greedy
output); for ``--products``, microseconds per pass and whether both gave the same bits.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import torch

import llmd
from llmd.runtime import kernels
from llmd.runtime.formats.quantized import quantize_int4, quantize_int8
from llmd.runtime.kernels import ops
from llmd.runtime.llm import LLM
from llmd.runtime.models.layers import can_pack, pack_weight
from llmd.runtime.models.random_model import SHAPES, write_random_model
from llmd.runtime.request import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
FORMS = ("bf16", "int8", "int4")


@contextlib.contextmanager
def checkout(rev: str, where: Path):
    """``rev`` in a detached ``git worktree`` under ``where``: yields it and the folder (``importable``) to
    put on PYTHONPATH to import its llmd. The worktree is removed on the way out."""
    tree = where / "tree"
    done = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), rev],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"cannot check out {rev!r} into a worktree: {done.stderr.strip()}")
    try:
        yield tree, importable(tree, where / "site")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)


def importable(tree: Path, site: Path) -> Path:
    """A folder from which ``import llmd`` loads ``tree``'s llmd, made of links (nothing is written into
    ``tree``): its subpackages where its pyproject.toml's package-dir puts them, as an install would."""
    tool = tomllib.loads((tree / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    dirs = tool.get("package-dir", {"llmd": "llmd"})
    top = site / "llmd"
    top.mkdir(parents=True)
    for entry in (tree / dirs.get("llmd", "llmd")).iterdir():
        (top / entry.name).symlink_to(entry)
    for name, folder in dirs.items():
        link = site.joinpath(*name.split("."))
        if name.count(".") == 1 and not link.exists():         # llmd.runtime -> runtime/, ...
            link.symlink_to(tree / folder, target_is_directory=True)
    return site


def decode_rate(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, list]:
    llm.generate(prompts, params)                 # prompts cached, as in llmd bench
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    first = max(o.metrics["ttft_s"] for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / (wall - first), [o.token_ids for o in outs]


def add_decode_args(ap: argparse.ArgumentParser) -> None:
    """The options of a side-by-side decode run (also used by bench_decode_paths.py)."""
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="random model shape (default tiny)")
    ap.add_argument("--threads", type=int, default=2, help="torch and kernel threads (default 2)")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per stream (default 128)")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per stream (default 64)")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds; medians reported (default 7)")


def layer_shapes(shape: str) -> list[tuple[int, int]]:
    """(in, out) of one layer's float32 products and the head, for a model shape."""
    c = SHAPES[shape]
    h, d = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c.get("num_key_value_heads", c["num_attention_heads"])) * d
    return [(h, qkv), (c["num_attention_heads"] * d, h), (h, 2 * c["intermediate_size"]),
            (c["intermediate_size"], h), (h, c["vocab_size"])]


def weight_forms(shape: str, form: str) -> list[tuple[int, callable]]:
    """(in, product of x) per weight of the shape's layer and head: bfloat16-valued float32 blocks (as llmd
    stores such weights), int8 with a scale per row, or int4 in groups of 32 (float16 scales), packed.
    The same weights in every process (a seeded generator)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k, n in layer_shapes(shape):
        w = torch.randn(n, k, generator=g) * 0.05
        if form == "bf16":
            wb = w.to(torch.bfloat16).float()
            blocks, copy = ops.f32_blocks(wb), (pack_weight(wb) if can_pack(torch.float32) else None)
            out.append((k, lambda x, b=blocks, c=copy: bf16_product(x, b, c)))
        elif form == "int8":
            packed = ops.int8_pack(*quantize_int8(w))
            out.append((k, lambda x, p=packed: ops.packed_matvec(x, p)))
        else:
            q, s, z = quantize_int4(w, 32)
            packed = ops.int4_pack(q, s, z, 32)
            out.append((k, lambda x, p=packed: ops.packed_matvec(x, p)))
    return out


def bf16_product(x: torch.Tensor, blocks: torch.Tensor, copy: torch.Tensor | None) -> torch.Tensor | None:
    """The product as the engine takes it: llmd's kernel where the build takes the row count (more than 16
    rows on AMX), else the oneDNN copy a layer keeps for many rows."""
    y = ops.f32_matvec(x, blocks, None)
    if y is None and copy is not None:
        y = torch.ops.mkldnn._linear_pointwise(x, copy, None, "none", [], "")
    return y


def digest(ys: list[torch.Tensor | None]) -> str:
    """The bits of a pass's outputs, for comparing two processes' ("none" where a product declined)."""
    h = hashlib.sha256()
    for y in ys:
        h.update(b"none" if y is None else y.contiguous().numpy().tobytes())
    return h.hexdigest()


def products_round(weights: list, xs: dict[int, list[torch.Tensor]]) -> dict:
    """Seconds per pass of the products at each row count, and the outputs' digest."""
    out = {}
    for m, rows in xs.items():
        t0 = time.perf_counter()
        for _ in range(20):
            ys = [fn(x) for x, (_, fn) in zip(rows, weights)]
        out[m] = {"s": (time.perf_counter() - t0) / 20, "bits": digest(ys)}
    return out


def worker(args) -> None:
    """One side of the comparison: set up once, then one round per line read (the results as a JSON
    line), until stdin closes."""
    torch.set_num_threads(args.threads)
    if kernels.lib() is None:
        raise SystemExit(f"llmd's kernels are unavailable here: {kernels.why()}")
    one_round = products_worker(args) if args.products else decode_worker(args)
    print(json.dumps({"llmd": llmd.__file__, "library": kernels.variant()}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(one_round()), flush=True)


def products_worker(args):
    weights = weight_forms(args.shape, args.form)
    g = torch.Generator().manual_seed(1)
    xs = {m: [torch.randn(m, k, generator=g) for k, _ in weights] for m in rows_of(args.products)}
    products_round(weights, xs)                # warm: first calls size each thread's scratch
    return lambda: products_round(weights, xs)


def decode_worker(args):
    llm = LLM(args.model, dtype="float32", kv_memory="1GiB", draft="none")
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    params = SamplingParams(max_tokens=args.gen, ignore_eos=True)

    def one_round():
        one, _ = decode_rate(llm, prompts[:1], params)
        many, tokens = decode_rate(llm, prompts, params)
        return {"one": one, "many": many, "tokens": tokens}
    return one_round


def rows_of(text: str) -> list[int]:
    return [int(r) for r in text.split(",")]


class Side:
    """A worker process running this file with the llmd of ``tree`` (laid out by ``importable`` in
    ``site``) on its path: this checkout, or the worktree of the revision compared against."""

    def __init__(self, name: str, tree: Path, site: Path, argv: list[str]):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", *argv], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self.read()
        if not Path(self.hello["llmd"]).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"{name}'s worker imported llmd from {self.hello['llmd']}, not from {tree}")

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}'s worker stopped (exit {self.proc.wait()}); its error is above")
        return json.loads(line)

    def round(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def compare(sides: list[Side], rounds: int) -> dict[str, list[dict]]:
    """Each side's results per round, the order of the sides swapped every round."""
    out = {s.name: [] for s in sides}
    for r in range(rounds):
        for s in sides if r % 2 == 0 else sides[::-1]:
            out[s.name].append(s.round())
    return out


def products_report(args, now: str, base: str, runs: dict) -> dict:
    rows = {}
    for m in rows_of(args.products):
        a, b = (statistics.median(r[str(m)]["s"] for r in runs[n]) for n in (now, base))
        same = all(x[str(m)]["bits"] == y[str(m)]["bits"] for x, y in zip(runs[now], runs[base]))
        rows[m] = {"now_us": round(a * 1e6, 1), "baseline_us": round(b * 1e6, 1), "now_over_baseline": round(a / b, 3),
                   "same_bits": same}
    return {"shape": args.shape, "form": args.form, "threads": args.threads, "rows": rows}


def decode_report(args, now: str, base: str, runs: dict) -> dict:
    result = {"shape": args.shape, "threads": args.threads, "streams": args.streams, "rounds": args.rounds,
              "same_tokens": all(x["tokens"] == y["tokens"] for x, y in zip(runs[now], runs[base]))}
    for name in (now, base):
        a, b = (statistics.median(r[key] for r in runs[name]) for key in ("one", "many"))
        result[name] = {"one_stream_tok_s": round(a, 1), "streams_tok_s": round(b, 1), "ratio": round(b / a, 2)}
    result["streams_now_over_baseline"] = round(result[now]["streams_tok_s"] / result[base]["streams_tok_s"], 3)
    return result


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="HEAD", help="git revision whose llmd is the baseline (default HEAD)")
    ap.add_argument("--products", help="instead of decoding, time the products of these row counts "
                    "(e.g. 1,4,5,9,16) over the shape's layer and head weights")
    ap.add_argument("--form", choices=FORMS, default="bf16",
                    help="the weights --products multiplies: bfloat16-valued float32 blocks, int8, or int4 "
                    "groups of 32 (default bf16)")
    add_decode_args(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)       # the workers' model, written by the driver
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.against == "now":
        ap.error("--against names a git revision other than the word 'now' (the name of this checkout's side)")
    if args.products and not all(r.isdigit() and int(r) > 0 for r in args.products.split(",")):
        ap.error(f"--products takes row counts separated by commas, e.g. 1,4,16; got {args.products!r}")
    with tempfile.TemporaryDirectory() as tmp, checkout(args.against, Path(tmp)) as (tree, site):
        if not args.products:
            argv = [*argv, "--model", str(write_random_model(Path(tmp) / "model", args.shape))]
        now = importable(ROOT, Path(tmp) / "site-now")
        sides = [Side("now", ROOT, now, argv), Side(args.against, tree, site, argv)]
        try:
            runs = compare(sides, args.rounds)
        finally:
            for s in sides:
                s.close()
    report = (products_report if args.products else decode_report)(args, "now", args.against, runs)
    report["library"] = {s.name: s.hello["library"] for s in sides}
    print(json.dumps(report, indent=1))
    same = report["same_tokens"] if "rows" not in report else all(r["same_bits"] for r in report["rows"].values())
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
