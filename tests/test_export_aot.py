"""torch compiled: AOTInductor packages of the step graph built at export time (about a minute
each on two cores), loaded warm, driven over llmd's paged pool like the ONNX graph."""
import pytest

from llmd import LLM, SamplingParams
from llmd.export.cli import ExportOptions, export_engine
from llmd.export.manifest import read_manifest
from llmd.runtime.backends.base import create_backend
from llmd.runtime.models.config import ModelConfig
from test_onnx_backend import PROMPTS, greedy_onnx


def export_aot(source, out, quant):
    export_engine(ExportOptions(str(source), str(out), quant=quant, aot=True, eval_windows=1, eval_tokens=32))
    manifest = read_manifest(out)
    assert manifest["artifacts"]["aot"]["decode"] in manifest["files"]     # hashed like the weights
    return create_backend("aot", out, manifest)


@pytest.fixture(scope="module")
def source(model_factory):
    return model_factory("aot-src", hidden=64, intermediate=128, layers=2)


def test_aot_quant_none_gives_the_torch_greedy_tokens(source, tmp_path):
    backend = export_aot(source, tmp_path / "none", "none")
    cfg = ModelConfig.from_dir(source)
    ref = LLM(str(source), kv_memory="16MiB").generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, r in zip(PROMPTS, ref):
        assert greedy_onnx(backend, cfg, prompt, 32) == r.token_ids


@pytest.mark.slow
def test_aot_int8_gives_the_eager_int8_greedy_tokens(source, tmp_path):
    backend = export_aot(source, tmp_path / "int8", "int8")
    cfg = ModelConfig.from_dir(source)
    eager = LLM(str(tmp_path / "int8"), kv_memory="16MiB").generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    same = sum(greedy_onnx(backend, cfg, p, 32) == r.token_ids for p, r in zip(PROMPTS, eager))
    assert same >= 2
