"""The quantized ONNX step graphs: int8 and int4 through onnxruntime's integer kernels, close to llmd's
own quantized torch modules, and a float head left float in the graph (the float graph's tests are in
test_onnx_backend.py; the two modules' exports run on two workers)."""
import pytest
import torch

from optional import need  # noqa: E402

need("onnxruntime")
need("onnxscript")
pytestmark = pytest.mark.heavy          # every test exports an ONNX graph

from llmd.runtime.formats.manifest import read_manifest  # noqa: E402
from onnx_exports import backend_of, exported, source  # noqa: E402,F401 (fixtures)


# int8: 8-bit weight blocks; activations are never quantized once per tensor (DynamicQuantizeLinear)
@pytest.mark.parametrize("quant,ops,group", [("int8", {"MatMulNBits"}, 128),
                                             ("int4", {"MatMulNBits"}, 32)])
def test_quantized_onnx_uses_integer_kernels_and_stays_close(source, exported, quant, ops, group):
    """Teacher-forced on one prompt: onnxruntime's quantized graph agrees with the float model about
    as well as llmd's own torch modules of the same method do."""
    import onnx

    from llmd.runtime.formats.quantized import QuantSpec, prepare_quantized, quantize_model
    from llmd.runtime.models.loader import load_model
    out = exported(quant, group)
    backend = backend_of(out)
    graph = onnx.load(str(out / "onnx" / "target.onnx"))
    assert any(n.op_type in ops for n in graph.graph.node)
    assert not any(n.op_type in ("DynamicQuantizeLinear", "DynamicQuantizeMatMul") for n in graph.graph.node)
    ids = torch.tensor([(7 * i * i + 3 * i) % 400 + 1 for i in range(48)])
    ref = load_model(source)
    mine = quantize_model(load_model(source), QuantSpec(quant, group_size=group, head="float"))
    prepare_quantized(mine)
    with torch.no_grad():
        want, torch_q = ref.forward_dense(ids[None])[0], mine.forward_dense(ids[None])[0]
    c = ref.config
    empty = torch.zeros(c.num_layers, 0, c.num_kv_heads, c.head_dim)
    got, _, _ = backend.forward(ids, torch.arange(len(ids)), empty, empty)
    err_ort = ((got - want).norm() / want.norm()).item()
    err_torch = ((torch_q - want).norm() / want.norm()).item()
    assert err_ort < 2 * err_torch + 0.01
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= (0.9 if quant == "int8" else 0.6)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_float_head_stays_float_in_the_graph(exported, quant):
    """--head float is what the manifest records, so the shipped graph's head must be a float product
    (it used to be quantized with the rest); the default head is quantized."""
    import onnx

    group = 128 if quant == "int8" else 32          # the exports the test above makes: one fewer to make

    def head_op(head):
        out = exported(quant, group, head)
        graph = onnx.load(str(out / read_manifest(out)["artifacts"]["onnx"]))
        made_by = {o: n for n in graph.graph.node for o in n.output}
        return made_by[graph.graph.output[0].name].op_type

    assert head_op("float") == "MatMul"
    assert head_op("auto") in ("DynamicQuantizeMatMul", "MatMulNBits", "MatMulInteger")
