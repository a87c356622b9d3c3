"""bench/gpu_check.sh itself, rehearsed on the CPU (``--rehearse``: CPU torch, Triton's interpreter, the
graph stand-in, a one-layer model, a few tokens), so that the script a GPU machine runs cannot rot: every
stage runs and exits 0, check.json holds each stage and the figures, and what the stages import is
either on a GPU machine already or in bench/gpu_wheels.txt."""
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES = ["step0", "install", "bench", "pytest_gpu", "lint"]
# what the GPU machine has (torch with CUDA, triton, numpy, transformers) brings these with it
MACHINE = ("torch", "triton", "numpy", "transformers")
# imported here only because this environment has them: transformers loads accelerate (and its psutil)
# and protobuf when installed, anyio sniffio; a GPU machine without them runs the same code
WHERE_INSTALLED = {"accelerate", "psutil", "google", "sniffio"}

pytestmark = [pytest.mark.heavy, pytest.mark.slow,     # every stage of the script: `make bench` runs it
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="rehearsed where there is no GPU")]
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--rehearse", str(out)], env=env,
                       capture_output=True, text=True, timeout=280, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_every_stage_runs_and_is_recorded(results):
    check = json.loads((results / "check.json").read_text())
    assert [s["stage"] for s in check["stages"]] == STAGES
    assert all(s["exit"] == 0 for s in check["stages"]), check["stages"]
    assert check["env"]["rehearsal"] is True
    f = check["figures"]
    assert f["step0"] == {"compiler": True, "triton_kernel": True, "ops_graph": True}
    assert f["graph_capture"] == "standin"
    bench = f["bench"]
    assert bench["decode_tok_s"] > 0 and bench["hf_decode_tok_s"] > 0 and bench["ttft_s"] > 0
    assert bench["streams"] == 2 and bench["cuda_graphs"] == "standin"
    summary = (results / "summary.txt").read_text()
    assert re.search(r"bench: exit 0 \(single stream \d+ tok/s .* graphs: standin\)", summary), summary
    assert (results / "pytest.xml").is_file()


def test_the_bench_ran_on_the_cuda_backend(results):
    bench = json.loads((results / "bench.json").read_text())
    assert bench["device"] == "cpu" and bench["llmd_single"]["tokens"] == 3
    assert "cpu_kernels" not in bench["engine_stats"]          # the CUDA runner's execution, not the CPU's


def requirement_closure(names) -> set[str]:
    from packaging.requirements import Requirement
    seen, todo = set(), [canon(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in reqs:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canon(req.name))
    return seen


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_wheel_list_covers_what_the_stages_import(results):
    listed = {canon(line.split()[1].split("==")[0]) for line in (REPO / "bench" / "gpu_wheels.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    there = requirement_closure(MACHINE)
    owners = metadata.packages_distributions()
    imported = set((results / "imports.txt").read_text().split()) - {"llmd", "conftest", "modelfactory", "cuda_cases"}
    imported = {m for m in imported if not m.startswith("test_")} - WHERE_INSTALLED
    assert imported
    uncovered = {m: owners[m] for m in imported                   # (modules of no distribution: built in)
                 if m in owners and not any(canon(d) in listed | there for d in owners[m])}
    assert not uncovered, f"imported by the stages, neither on a GPU machine nor in gpu_wheels.txt: {uncovered}"
