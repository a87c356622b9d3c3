"""TensorRT: the build and run path needs TensorRT and a CUDA GPU, which these machines lack; those
tests skip saying so. Without TensorRT, the export refuses up front with a clear error."""
import importlib.util

import pytest
import torch

from llmd.cli import main

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
NEEDS_GPU = pytest.mark.skipif(not (HAVE_TRT and torch.cuda.is_available()),
                               reason="TensorRT and a CUDA GPU are needed; TensorRT cannot be installed on this machine")


@pytest.fixture(scope="module")
def source(model_factory):
    return model_factory("trt-src", hidden=64, intermediate=128, layers=2)


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
@pytest.mark.heavy
def test_export_without_tensorrt_fails_up_front(source, tmp_path, capsys):
    out = tmp_path / "trt"
    assert main(["export", "--target", str(source), "--quant", "none", "--backend", "tensorrt", "--out", str(out)]) == 2
    assert "llmd[gpu]" in capsys.readouterr().err
    assert not (out / "manifest.json").exists()


def test_profiles_cover_every_token_count_once():
    from llmd.runtime.backends.tensorrt import profiles
    ranges = profiles({"tokens": [1, 16, 64, 256, 512]}, max_context=4096)
    assert ranges == [(1, 1), (2, 16), (17, 64), (65, 256), (257, 512)]


@NEEDS_GPU
@pytest.mark.heavy
def test_tensorrt_greedy_matches_torch(source, tmp_path):
    from llmd.runtime.formats.manifest import read_manifest
    from llmd.runtime.backends.base import create_backend
    from step_greedy import same_greedy_count
    out = tmp_path / "trt"
    assert main(["export", "--target", str(source), "--quant", "none", "--backend", "tensorrt",
                 "--eval-windows", "1", "--eval-tokens", "32", "--out", str(out)]) == 0
    backend = create_backend("tensorrt", out, read_manifest(out))
    assert same_greedy_count(backend, source, source, n=16) >= 2          # FP16 kernels: near-ties may flip
