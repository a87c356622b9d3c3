"""The model step as an ONNX graph whose KV cache stays in llmd's paged pool.

One sequence per call. The runtime gathers the sequence's past keys/values from its blocks, the
graph returns the keys/values of the new tokens, and the runtime writes them into its blocks:

    inputs   input_ids [T] int64, positions [T] int64 (past tokens hold positions 0..P-1),
             past_k, past_v [L, P, kv_heads, head_dim] float32 (P may be 0)
    outputs  logits [T, vocab] float32, new_k, new_v [L, T, kv_heads, head_dim] float32

Quantization happens on the float graph with onnxruntime's own tool for weight blocks
(MatMulNBits): int8 is 8-bit weights in blocks of INT8_BLOCK input columns with float activations,
w8a8 the same weights with each row's activations rounded to int8 per block (integer products),
int4 4-bit weights with the export's group size. Activations are never quantized once per tensor:
one outlier column would then set the step of every token (docs/perf/2026-12-01-real-models.md,
"Export quality on real models"). Graph optimizations are applied once at export and the optimized
model is what the engine directory ships.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmd.runtime.models.llama import HalfRope, LlamaForCausalLM
from llmd.runtime.errors import ModelLoadError
from llmd.runtime.models.loader import load_model

INPUTS = ("input_ids", "positions", "past_k", "past_v")
MAX_STEP_TOKENS = 8192      # the most new tokens one call of a compiled step takes (ONNX graph, AOT prefill)
OUTPUTS = ("logits", "new_k", "new_v")
INT8_BLOCK = 32          # input columns per int8 weight scale in the graph (MatMulNBits' 8-bit blocks)
ACCURACY_FLOAT = 0       # MatMulNBits accuracy_level: float activations
ACCURACY_INT8 = 4        # activations rounded to int8 per block of each row, integer products


class OnnxStep(nn.Module):
    """The model's forward with attention over (gathered past ++ new) keys/values. Also the graph
    the AOT packages compile (llmd.export.aot), there with llmd's quantized modules inside."""

    def __init__(self, model: LlamaForCausalLM, separate_embedding: bool = True):
        super().__init__()
        plan = model.config.plan
        if not plan.plain():       # this graph computes the Llama plan's layer only
            raise ModelLoadError(f"the ONNX step graph does not compute {model.config.architecture}'s "
                                 f"{', '.join(plan.features())} yet; serve this model from its directory")
        self.model = model
        # For ONNX a tied table gets its own copy for the lookup: the quantizers rewrite the head's
        # matmul weight, which must not be the initializer the embedding Gather reads.
        self.embed_table = None
        if separate_embedding:
            self.embed_table = nn.Parameter(model.embed_tokens.weight.detach().clone(), requires_grad=False)

    def forward(self, input_ids, positions, past_k, past_v):
        m = self.model
        x = m.embed(input_ids) if self.embed_table is None else F.embedding(input_ids, self.embed_table)
        cos, sin = m.rotary.lookup(positions, x.dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(m.layers):
            h = layer.input_layernorm(x)
            q, k, v = layer.self_attn.project(h, HalfRope(cos, sin))    # [T, H, D], [T, kvh, D]
            new_k.append(k)
            new_v.append(v)
            keys = torch.cat([past_k[i], k], dim=0)                      # [P+T, kvh, D]
            values = torch.cat([past_v[i], v], dim=0)
            x = x + layer.self_attn.o_proj(attend(q, keys, values, positions).flatten(-2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.compute_logits(m.norm(x)), torch.stack(new_k), torch.stack(new_v)


def attend(q, keys, values, positions):
    """Causal attention of T queries at ``positions`` over keys at positions 0..P+T-1."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)             # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / q.shape[-1] ** 0.5  # [H, T, L]
    key_pos = torch.arange(keys.shape[0], device=q.device)
    scores = scores.masked_fill(key_pos[None, None, :] > positions[None, :, None], float("-inf"))
    return (F.softmax(scores, dim=-1) @ v).transpose(0, 1)               # [T, H, D]


def example_inputs(model: LlamaForCausalLM, t: int = 3, p: int = 2):
    c = model.config
    return (torch.arange(t, dtype=torch.long), torch.arange(p, p + t, dtype=torch.long),
            torch.zeros(c.num_layers, p, c.num_kv_heads, c.head_dim), torch.zeros(c.num_layers, p, c.num_kv_heads, c.head_dim))


def export_float_graph(model: LlamaForCausalLM, file: Path) -> None:
    from torch.export import Dim
    step = OnnxStep(model).eval()
    t, p = Dim("T", min=1, max=MAX_STEP_TOKENS), Dim("P", min=0, max=model.config.max_position_embeddings)
    dynamic = {"input_ids": {0: t}, "positions": {0: t}, "past_k": {1: p}, "past_v": {1: p}}
    with torch.no_grad():
        torch.onnx.export(step, example_inputs(model), str(file), input_names=list(INPUTS),
                          output_names=list(OUTPUTS), dynamic_shapes=dynamic, dynamo=True,
                          external_data=False, optimize=True, verbose=False)
    # The exporter's recorded intermediate shapes can disagree with onnx's own inference (split
    # outputs); drop them so the quantizers re-infer from the graph itself.
    import onnx
    graph = onnx.load(str(file))
    del graph.graph.value_info[:]
    onnx.save(graph, str(file))


def head_nodes(model) -> list[str]:
    """The output head's product nodes: those reading the head's weight (lm_head, or the embedding it is
    tied to), directly or through a Transpose."""
    weights = {i.name for i in model.graph.initializer if "lm_head.weight" in i.name or "embed_tokens.weight" in i.name}
    transposed = {o for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in weights for o in n.output}
    return [n.name for n in model.graph.node
            if n.op_type in ("MatMul", "Gemm") and any(i in weights | transposed for i in n.input[1:2])]


def quantize_graph(src: Path, dst: Path, spec) -> None:
    """Quantize the graph's products as ``spec`` says; a float head (``--head float``) stays float."""
    if spec.method not in ("int8", "w8a8", "int4"):
        dst.write_bytes(src.read_bytes())
        return
    import onnx
    graph = onnx.load(str(src))
    gemm_to_matmul(graph)                 # the quantizers take MatMul; the head is then found by its weight
    keep_float = head_nodes(graph) if spec.head == "float" else []
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    if spec.method == "int4":
        q = MatMulNBitsQuantizer(graph, block_size=spec.group_size, is_symmetric=spec.symmetric,
                                 nodes_to_exclude=keep_float)
    else:       # int8 weights in blocks along the input; w8a8 also rounds the input (ACCURACY_INT8)
        level = ACCURACY_INT8 if spec.method == "w8a8" else ACCURACY_FLOAT
        q = MatMulNBitsQuantizer(graph, bits=8, block_size=INT8_BLOCK, is_symmetric=True, accuracy_level=level,
                                 nodes_to_exclude=keep_float)
    q.process()
    q.model.save_model_to_file(str(dst))


def graph_quantization(spec) -> str:
    """What ``quantize_graph`` does to the products, in words, for the manifest: onnxruntime's
    quantizers differ from llmd's torch modules of the same --quant (int8 there also quantizes the
    activations, and the head is quantized like every other product unless it is kept float)."""
    if spec.method in ("int8", "w8a8"):
        body = (f"symmetric int8 weights in blocks of {INT8_BLOCK} (MatMulNBits), "
                + ("activations rounded to int8 per block of each row" if spec.method == "w8a8" else "float activations"))
    elif spec.method == "int4":
        body = (f"{'symmetric' if spec.symmetric else 'asymmetric'} int4 weights in blocks of {spec.group_size} "
                "(MatMulNBits), float activations")
    else:
        return "float"
    return body + ("; head float" if spec.head == "float" else "; head quantized the same way") + "; embedding float"


def gemm_to_matmul(model) -> None:
    """Rewrite Gemm(x, W, b; transB=1) with a constant W as MatMul(x, W^T) + b: the n-bit
    quantizer handles MatMul only. Other Gemms are left alone."""
    from onnx import helper, numpy_helper
    inits = {i.name: i for i in model.graph.initializer}
    nodes = []
    for n in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        plain = attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
        if n.op_type != "Gemm" or not plain or n.input[1] not in inits:
            nodes.append(n)
            continue
        w = numpy_helper.to_array(inits[n.input[1]])
        wt = w.T.copy() if attrs.get("transB", 0) else w
        name = n.input[1] + "_kn"
        model.graph.initializer.append(numpy_helper.from_array(wt, name))
        out = n.output[0] if len(n.input) < 3 or not n.input[2] else n.output[0] + "_nobias"
        nodes.append(helper.make_node("MatMul", [n.input[0], name], [out], name=n.name + "_matmul"))
        if out != n.output[0]:
            nodes.append(helper.make_node("Add", [out, n.input[2]], [n.output[0]], name=n.name + "_bias"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {i for n in model.graph.node for i in n.input}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def optimize_graph(src: Path, dst: Path) -> None:
    """Run onnxruntime's portable (extended) graph optimizations once and keep the result."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])


def export_onnx(source: Path, out: Path, spec, portable: bool = False) -> str:
    """Export the float model at ``source`` to out/onnx/target.onnx: quantized and optimized for
    onnxruntime, or (portable=True, for TensorRT) the plain float graph with standard ops only."""
    model = load_model(source, "float32")
    model.requires_grad_(False)
    work = out / "onnx"
    work.mkdir(parents=True, exist_ok=True)
    if portable:
        export_float_graph(model, work / "target.onnx")
        return "onnx/target.onnx"
    raw, quant = work / "float.tmp.onnx", work / "quant.tmp.onnx"
    export_float_graph(model, raw)
    quantize_graph(raw, quant, spec)
    optimize_graph(quant, work / "target.onnx")
    for f in work.glob("*.tmp.onnx*"):
        f.unlink()
    return "onnx/target.onnx"
