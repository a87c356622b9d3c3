"""Rehearse llmd's CUDA path where there is no GPU: ``--device cuda`` runs the engine's own CudaRunner
over CPU tensors, the Triton kernels on Triton's interpreter and the graph buckets on their CPU stand-in
(static buffers replayed as eager calls). Everything else (loading, the engine, the bench, the stats) is
the code a GPU run uses.

    python -m llmd.bench.gpu_rehearse MODULE [ARGS...]     run MODULE as __main__ (e.g. llmd.cli bench ...)

With LLMD_REHEARSE_IMPORTS=FILE, the top-level modules the run imported are added to FILE, one a line
(tests/cuda/test_gpu_check.py holds them to bench/gpu_wheels.txt and what a GPU machine has).

Run so, the ``tiny`` random-weight shape (``llmd bench --shape tiny``) has one layer and one kv head: the
interpreter runs a kernel's programs one after another, tens of milliseconds each.

bench/gpu_check.sh --rehearse runs its stages through this; the tests use ``rehearsing()``. A graph
setting of ``off`` stays off; any other becomes ``graphs`` (the stand-in, or ``capture`` to rehearse a
capture that fails: a CPU torch has no CUDA graphs).
"""
from __future__ import annotations

import inspect
import os
import runpy
import sys
from contextlib import contextmanager

# Triton reads this when a kernel is defined: set before the CUDA backend's kernels are imported
os.environ.setdefault("TRITON_INTERPRET", "1")
from llmd.runtime import loading  # noqa: E402
from llmd.runtime.execution.cuda.backend import CudaRunner  # noqa: E402
from llmd.runtime.models.random_model import SHAPES  # noqa: E402


@contextmanager
def rehearsing(graphs: str = "standin"):
    """While open, ``--device cuda`` builds CudaRunners on the CPU (interpreted kernels, graph stand-in)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("rehearsing needs TRITON_INTERPRET=1 from the start (the kernels are compiled for a GPU "
                           "otherwise); run it in a process without TRITON_INTERPRET set")
    init, missing = CudaRunner.__init__, loading.cuda_missing
    sig = inspect.signature(init)

    def on_the_cpu(self, *args, **kw):
        bound = sig.bind(self, *args, **kw)
        bound.arguments["device"] = "cpu"
        bound.arguments["pin"] = False
        if bound.arguments.get("graphs") != "off":
            bound.arguments["graphs"] = graphs
        init(*bound.args, **bound.kwargs)

    CudaRunner.__init__, loading.cuda_missing = on_the_cpu, lambda: None
    try:
        yield
    finally:
        CudaRunner.__init__, loading.cuda_missing = init, missing


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    SHAPES["tiny"] = {**SHAPES["tiny"], "num_hidden_layers": 1, "num_key_value_heads": 1}
    sys.argv = list(argv)
    try:
        with rehearsing():
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        record_imports(os.environ.get("LLMD_REHEARSE_IMPORTS"))
    return 0


def record_imports(path) -> None:
    if path:
        names = {m.split(".")[0] for m in list(sys.modules)} - set(sys.stdlib_module_names)
        with open(path, "a") as f:
            f.writelines(f"{n}\n" for n in sorted(names) if not n.startswith("_"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
