"""Step 0 of bench/gpu_check.sh, about 20 s on a GPU machine, before anything is installed: what Triton
needs to build its launchers (a C compiler and Python.h), a one-line Triton kernel launched, and llmd's
two custom ops (``llmd::store_kv``, ``llmd::paged_attention``, read from this tree without installing
llmd) captured in one CUDA graph at Qwen2-0.5B's attention shapes (14 query heads, 2 kv heads of 64,
bfloat16 pools), replayed and compared with the eager launch.

    python bench/gpu_preflight.py [--rehearse] [--env FILE]
        prints one JSON object; exit 1 when a check failed, 2 (before any check) when torch, triton or,
        unless rehearsing, a CUDA GPU is missing. --env writes the versions and the GPU's name to FILE.

Every check runs whatever the others gave. Without a GPU (``--rehearse``: CPU tensors, TRITON_INTERPRET=1
set before this starts) the graph is the stand-in: the same static buffers run twice eagerly, and the
contexts are short so that the interpreter takes seconds.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[1] / "runtime" / "execution" / "cuda"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16        # Qwen2-0.5B's attention; llmd's KV block


def compiler() -> dict:
    """A C compiler that builds against this Python's headers (Triton compiles its launcher so)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    include = Path(sysconfig.get_paths()["include"])
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH: Triton cannot build its launcher")
    if not (include / "Python.h").is_file():
        raise RuntimeError(f"{include}/Python.h is missing: install this Python's headers (python3-dev)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("#include <Python.h>\nint probe(void) { return Py_IsInitialized(); }\n")
        r = subprocess.run([cc, "-c", "-fPIC", f"-I{include}", str(src), "-o", str(Path(tmp) / "probe.o")],
                           capture_output=True, text=True, timeout=60)
        if r.returncode:
            raise RuntimeError(f"{cc} cannot compile against Python.h: {r.stderr.strip()[-400:]}")
    return {"cc": cc, "python_h": str(include / "Python.h")}


def one_line_kernel(device: str) -> dict:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)
    x = torch.zeros(1, dtype=torch.int32, device=device)
    add_one[(1,)](x)
    if x.item() != 1:
        raise RuntimeError(f"a one-line Triton kernel wrote {x.item()}, not 1")
    return {"triton": triton.__version__}


def load_ops():
    """runtime/execution/cuda/ops.py (and kernels.py) as a package of their own: llmd need not be installed."""
    spec = importlib.util.spec_from_file_location("llmd_preflight_cuda", CUDA_DIR / "__init__.py",
                                                  submodule_search_locations=[str(CUDA_DIR)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module(f"{spec.name}.ops")


def step_inputs(device: str, contexts: list[int]):
    """One decode step of len(contexts) requests: new keys and values, pools, metadata (int64, as llmd's)."""
    import torch
    g = torch.Generator().manual_seed(0)
    need = [-(-n // BLOCK) for n in contexts]
    width, blocks = max(need), sum(need) + 2
    order = torch.randperm(blocks, generator=g)
    table = torch.zeros(len(contexts), width, dtype=torch.int64)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = order[at:at + n]
        at += n
    lens = torch.tensor(contexts)
    slots = table[torch.arange(len(contexts)), (lens - 1) // BLOCK] * BLOCK + (lens - 1) % BLOCK
    pools = [torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(2)]
    new = [torch.randn(len(contexts), h, HEAD_DIM, generator=g).to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS)]
    meta = [torch.arange(len(contexts) + 1), lens, table, slots]
    return [t.to(device) for t in new + pools + meta]


def ops_in_a_graph(device: str) -> dict:
    import torch
    ops = load_ops()
    contexts = [1 + (i * 37) % 1000 for i in range(8)] if device == "cuda" else [17, 40]
    q, k, v, kc, vc, qstart, lens, table, slots = step_inputs(device, contexts)
    splits = ops.decode_splits(len(contexts), KV_HEADS, table.shape[1])

    def step():
        torch.ops.llmd.store_kv(k, v, kc, vc, slots)
        one = torch.ops.llmd.paged_attention(q, kc, vc, qstart, lens, table, 1, 1, HEAD_DIM ** -0.5)
        split = torch.ops.llmd.paged_attention(q, kc, vc, qstart, lens, table, 1, splits, HEAD_DIM ** -0.5)
        return one, split
    if device != "cuda":
        eager, again = step(), step()          # the stand-in: the same static buffers, run twice
        mode = "standin"
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager = step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            again = step()
        graph.replay()
        torch.cuda.synchronize()
        mode = "captured"
    for a, b in zip(eager, again):
        if not torch.equal(a, b):
            raise RuntimeError("the graph's replay differs from the eager step")
    if not torch.isfinite(eager[0].float()).all():
        raise RuntimeError("paged attention gave non-finite values")
    err = (eager[0].float() - eager[1].float()).abs().max().item()
    if err > 3e-2:
        raise RuntimeError(f"split-KV ({splits} splits) differs from one pass by {err:.3g}")
    return {"graph": mode, "requests": len(contexts), "splits": splits, "split_vs_single_max_abs": err}


def environment(rehearse: bool) -> dict:
    """Python, torch, CUDA, triton and the GPU; SystemExit where the check cannot run here."""
    import platform
    try:
        import torch
        import triton
    except ImportError as e:
        raise SystemExit(f"gpu_check: {e}: this Python needs torch (with CUDA) and triton")
    if not rehearse and not torch.cuda.is_available():
        raise SystemExit(f"gpu_check: torch {torch.__version__} sees no CUDA GPU (--rehearse runs on the CPU)")
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "rehearsal": rehearse,
            "gpu": None if rehearse else torch.cuda.get_device_name(0)}


def main(argv: list[str]) -> int:
    t0 = time.perf_counter()
    rehearse = "--rehearse" in argv
    device = "cpu" if rehearse else "cuda"
    try:
        env = environment(rehearse)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    if "--env" in argv:
        Path(argv[argv.index("--env") + 1]).write_text(json.dumps(env, indent=1))
    out: dict = {"device": device}
    failed = False
    for name, check in (("compiler", compiler), ("triton_kernel", lambda: one_line_kernel(device)),
                        ("ops_graph", lambda: ops_in_a_graph(device))):
        start = time.perf_counter()
        try:
            out[name] = {"ok": True, **check()}
        except Exception as e:  # each check reports and the next runs
            failed = True
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "where": traceback.format_exc(limit=-2).strip().splitlines()[-3:]}
        out[name]["seconds"] = round(time.perf_counter() - start, 2)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
