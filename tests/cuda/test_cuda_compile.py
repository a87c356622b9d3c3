"""The CUDA backend's Triton kernels compiled for an H200 on the CPU (tests/support/cuda_compile.py): the
interpreter does not type-check, a GPU compile does. (A loop bound of mixed int32/int64 type passed
the interpreted tests and failed here.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy          # a Triton compile for sm_90

pytest.importorskip("triton")
SUPPORT = Path(__file__).resolve().parents[1] / "support"


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(SUPPORT / "cuda_compile.py")], env=env, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compiled 10 kernels for sm_90" in r.stdout
