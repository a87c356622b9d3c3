"""torch compiled: AOTInductor packages of the step graph built at export time (about a minute
each on two cores), loaded warm, driven over llmd's paged pool like the ONNX graph."""
import pytest

from llmd.export.cli import ExportOptions, export_engine
from llmd.runtime.formats.manifest import read_manifest
from llmd.runtime.backends.base import create_backend
from step_greedy import PROMPTS, same_greedy_count

pytestmark = pytest.mark.heavy          # AOTInductor compiles


def export_aot(source, out, quant):
    export_engine(ExportOptions(str(source), str(out), quant=quant, aot=True, eval_windows=1, eval_tokens=32))
    manifest = read_manifest(out)
    assert manifest["artifacts"]["aot"]["decode"] in manifest["files"]     # hashed like the weights
    assert manifest["quality"]["measured_on"].startswith("aot decode package")   # the gate ran the package
    return create_backend("aot", out, manifest)


@pytest.fixture(scope="module")
def source(model_factory):
    return model_factory("aot-src", hidden=64, intermediate=128, layers=2)


@pytest.mark.slow     # two AOTInductor compiles, the slowest test here: `make bench` runs it
def test_aot_quant_none_gives_the_torch_greedy_tokens(source, tmp_path):
    backend = export_aot(source, tmp_path / "none", "none")
    assert same_greedy_count(backend, source, source) == len(PROMPTS)


@pytest.mark.slow
def test_aot_int8_gives_the_eager_int8_greedy_tokens(source, tmp_path):
    backend = export_aot(source, tmp_path / "int8", "int8")
    assert same_greedy_count(backend, source, tmp_path / "int8") >= 2
