"""The same model, settings and prompt give the same greedy tokens and logits, bit for bit, after a
restart, whatever the machine was doing at start-up: two processes, the second with every core
held by a busy loop while it loads and runs."""
import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.heavy          # subprocesses under a busy CPU

TESTS = Path(__file__).resolve().parents[1]
MODELS = TESTS.parent / "models"
# served in float32 (llmd's kernels, the fused step) and in bfloat16 (torch's products, split by rule)
RUNS = [f"{MODELS / 'code-draft'}:float32", f"{MODELS / 'code-draft'}:bfloat16"]


def run_greedy(out: Path) -> tuple[dict, dict]:
    subprocess.run([sys.executable, str(TESTS / "support" / "greedy_run.py"), str(out), *RUNS], check=True, timeout=600)
    return json.loads(out.with_suffix(".json").read_text()), load_file(str(out.with_suffix(".safetensors")))


def busy_loops() -> list[subprocess.Popen]:
    """A process spinning on each core this process may use, pinned there."""
    spin = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin, str(cpu)]) for cpu in sorted(os.sched_getaffinity(0))]


def test_a_restart_under_a_busy_cpu_gives_the_same_plans_tokens_and_logits(tmp_path):
    quiet, quiet_logits = run_greedy(tmp_path / "quiet")
    spinning = busy_loops()
    try:
        busy, busy_logits = run_greedy(tmp_path / "busy")
    finally:
        for p in spinning:
            p.kill()
            p.wait()
    for run in RUNS:
        assert busy[run]["plans"] == quiet[run]["plans"], run
        assert busy[run]["tokens"] == quiet[run]["tokens"], run
        assert len(quiet[run]["tokens"]) == 8
    assert quiet_logits.keys() == busy_logits.keys()
    for name, logits in quiet_logits.items():
        assert logits.dtype == torch.float32 and logits.shape[0] >= 8
        assert torch.equal(logits.view(torch.int32), busy_logits[name].view(torch.int32)), name   # every bit
