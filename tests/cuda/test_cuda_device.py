"""``--device cuda`` where torch sees no GPU: a clear error and no traceback, from every entry point;
``auto`` picks the GPU when torch sees one."""
from pathlib import Path

import pytest
import torch

from daemon_fixtures import daemon_process, daemon_settings
from llmd.runtime.config import EngineConfig
from llmd.runtime.errors import ModelLoadError
from llmd.runtime.loading import hf_device

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.mark.parametrize("command", [["generate", "{model}", "def f():", "--max-tokens", "2"],
                                     ["bench", "{model}", "--gen", "2", "--prompt-len", "4", "--against", ""]])
@pytest.mark.heavy
def test_cli_refuses_cuda_with_a_clear_error(tiny_model_dir, command, capsys):
    from llmd.cli import main
    assert main([*[a.format(model=tiny_model_dir) for a in command], "--device", "cuda"]) == 2    # no exception
    err = capsys.readouterr().err
    assert "--device cuda:" in err and "use --device cpu" in err


@pytest.mark.heavy
def test_serve_refuses_cuda_with_a_clear_error(tiny_model_dir, tmp_path):
    proc = daemon_process(daemon_settings(tiny_model_dir, tmp_path), "--device", "cuda")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "--device cuda:" in err and "Traceback" not in err


def test_library_refuses_cuda_with_a_typed_error(tiny_model_dir):
    from llmd.runtime.llm import LLM
    with pytest.raises(ModelLoadError, match="--device cuda: .*use --device cpu"):
        LLM(str(tiny_model_dir), device="cuda")


def test_auto_picks_the_gpu_when_torch_sees_one(monkeypatch):
    config = EngineConfig(model="m", device="auto")
    assert hf_device(config) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pytest.importorskip("triton")
    assert hf_device(config) == "cuda"
    assert hf_device(EngineConfig(model="m", device="cpu")) == "cpu"
    assert hf_device(EngineConfig(model="m", device="auto", kv_dtype="int8")) == "cpu"    # a pool it cannot hold
    with pytest.raises(ModelLoadError, match="block-size 16"):
        hf_device(EngineConfig(model="m", device="cuda", block_size=32))
