"""The ONNX tests' shared fixtures: a small random source model and its onnxruntime exports, each made
once per test module that asks for it (tests/export/test_onnx_backend.py, test_onnx_quantized.py: two
modules, so that their exports run on two workers).

Every export of one source traces the same float graph first (torch's exporter: most of an export's
time); a module's exports after its first copy that graph, traced once, and then quantize, optimize,
check and measure it as an export does."""
import hashlib
import shutil

import pytest

from llmd.export import onnx as onnx_export
from llmd.export.cli import ExportOptions, export_engine
from llmd.runtime.backends.base import create_backend
from llmd.runtime.formats.manifest import read_manifest


@pytest.fixture(scope="module")
def source(model_factory):
    return model_factory("onnx-src", hidden=64, intermediate=128, layers=2)


def export(source, out, quant, group_size=128, head="auto"):
    export_engine(ExportOptions(str(source), str(out), quant=quant, group_size=group_size, head=head,
                                backend="onnxruntime", eval_windows=1, eval_tokens=32, accept_loss=True))   # random


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """``exported(quant, group_size, head)``: the engine directory of that export, made once for the module
    (tests only read it)."""
    made, traced = {}, {}
    trace = onnx_export.export_float_graph

    def trace_once(model, file):
        key = weights_digest(model)
        if key not in traced:
            trace(model, file)
            traced[key] = tmp_path_factory.mktemp("float-graph") / "float.onnx"
            shutil.copyfile(file, traced[key])
        else:
            shutil.copyfile(traced[key], file)

    def get(quant, group_size=128, head="auto"):
        key = (quant, group_size, head)
        if key not in made:
            made[key] = tmp_path_factory.mktemp(f"onnx-{quant}-{group_size}-{head}")
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(onnx_export, "export_float_graph", trace_once)
                export(source, made[key], quant, group_size, head)
        return made[key]
    return get


def backend_of(out):
    return create_backend("onnxruntime", out, read_manifest(out))
