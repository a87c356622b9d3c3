"""`llmd import --keep-blocks`: GGUF quantized blocks kept as llmd's int8g and int4 layouts. Every kept
tensor, dequantized by llmd's own formulas, equals the `gguf` package's float32 dequantization (the
float32 import) bit for bit; types without an llmd form, and fused modules whose parts share none,
are float32; the engine directory runs."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from llmd.bench.to_gguf import convert
from llmd.export.gguf_engine import import_engine
from llmd.runtime.formats.gguf_blocks import common_form, decode, exact_form
from llmd.runtime.formats.gguf_import import import_gguf
from llmd.runtime.formats.quantized import QuantSpec, dequantize_int4, dequantize_int8, unpack_nibbles
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.loader import checkpoint_layout

from modelfactory import CORPUS, make_model_dir

MODELS = Path(os.environ.get("LLMD_MODELS", Path.home() / ".cache" / "llmd" / "models"))


def engine_weights(engine: Path) -> dict[str, torch.Tensor]:
    """llmd name -> float32 weight, dequantized by llmd's formulas from the engine's stored tensors."""
    spec = QuantSpec.from_dict(json.loads((engine / "manifest.json").read_text())["quantization"])
    state = load_file(str(engine / "target" / "weights.safetensors"))
    out = {}
    for module, form in spec.modules.items():
        key = "embed_tokens.table" if module == "embed_tokens" else module
        q, s = state.pop(f"{key}.qweight"), state.pop(f"{key}.scales")
        out[f"{module}.weight"] = (dequantize_int8(q, s) if form.startswith("int8") else
                                   dequantize_int4(unpack_nibbles(q), s, state.pop(f"{key}.zeros")))
    return out | {k: v for k, v in state.items() if k.endswith(".weight")}


def float_weights(imported: Path) -> dict[str, torch.Tensor]:
    """llmd name -> the float32 import's values, its parts joined as llmd fuses them."""
    layout = checkpoint_layout(ModelConfig.from_dir(imported))
    parts = defaultdict(list)
    for name, t in load_file(str(imported / "model.safetensors")).items():
        if name.endswith(".weight"):
            dst, offset, _ = layout[name]
            parts[dst].append((offset, t))
    return {k: torch.cat([t for _, t in sorted(v, key=lambda x: x[0])]) for k, v in parts.items()}


def assert_bit_identical(engine: Path, imported: Path) -> None:
    got, want = engine_weights(engine), float_weights(imported)
    if "lm_head.weight" in got and "lm_head.weight" not in want:       # a tied table kept quantized
        want["lm_head.weight"] = want.pop("embed_tokens.weight")
    assert set(got) == set(want)
    for name, w in want.items():
        # + 0.0 turns -0.0 into 0.0: llmd's int4 adds its offset (0 for Q4_0) where gguf multiplies only
        a, b = (got[name].float() + 0.0).view(torch.int32), (w + 0.0).view(torch.int32)
        assert torch.equal(a, b), name


def routes(summary: dict) -> dict[str, str]:
    return {r["type"]: r["route"] for r in summary["routes"]}


@pytest.fixture(scope="module")
def tied_source(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("blocks") / "src", seed=5, tie=True)


def test_q4_1_and_q8_0_keep_their_blocks_bit_for_bit(tied_source, tmp_path):
    """The SmolLM2 file's types: Q4_1 matrices, a Q8_0 tied embedding."""
    path = convert(tied_source, tmp_path / "m.gguf", quant={"*": "q4_1", "token_embd": "q8_0"})
    summary = import_engine(path, tmp_path / "engine", progress=False)
    assert routes(summary) == {"F32": "float32 (1-D)", "Q4_1": "int4/32", "Q8_0": "int8g/32"}
    spec = QuantSpec.from_dict(json.loads((tmp_path / "engine" / "manifest.json").read_text())["quantization"])
    assert spec.method == "mixed" and spec.modules["lm_head"] == "int8g/32"
    assert spec.modules["layers.1.self_attn.qkv_proj"] == "int4/32" and not summary["demoted_modules"]
    assert_bit_identical(tmp_path / "engine", import_gguf(path, tmp_path / "float", progress=False))


def test_mixed_types_fused_modules_and_an_untied_head(tmp_path):
    """q and k Q4_1 beside a Q8_0 v share no form (the whole qkv module is float32); Q5_0 gate and up
    become int8g; a lone Q4_0 down stays int4; untied Q5_0 embedding and Q8_0 head stay int8g."""
    src = make_model_dir(tmp_path / "src", seed=7, tie=False, architecture="Qwen2ForCausalLM")
    path = convert(src, tmp_path / "m.gguf", quant={"attn_q": "q4_1", "attn_k": "q4_1", "attn_v": "q8_0",
                                                   "attn_output": "q8_0", "ffn_gate": "q5_0", "ffn_up": "q5_0",
                                                   "ffn_down": "q4_0", "token_embd": "q5_0", "output": "q8_0"})
    summary = import_engine(path, tmp_path / "engine", progress=False)
    assert routes(summary)["Q4_0"] == "int4/32" and routes(summary)["Q5_0"] == "int8g/32"
    assert routes(summary)["F32"] == "float32 (1-D)"              # norms and q, k, v biases
    assert summary["demoted_modules"] == ["layers.0.self_attn.qkv_proj", "layers.1.self_attn.qkv_proj"]
    modules = QuantSpec.from_dict(json.loads((tmp_path / "engine" / "manifest.json").read_text())
                                  ["quantization"]).modules
    assert modules["layers.0.mlp.gate_up_proj"] == "int8g/32" and modules["layers.0.mlp.down_proj"] == "int4/32"
    assert modules["embed_tokens"] == "int8g/32" and modules["lm_head"] == "int8g/32"
    assert "layers.0.self_attn.qkv_proj" not in modules
    assert_bit_identical(tmp_path / "engine", import_gguf(path, tmp_path / "float", progress=False))


def test_the_engine_runs_like_the_float32_import(tied_source, tmp_path):
    """Greedy text from the kept blocks against the float32 import of the same file."""
    from llmd import LLM, SamplingParams
    path = convert(tied_source, tmp_path / "m.gguf", quant={"*": "q8_0"})
    import_engine(path, tmp_path / "engine", progress=False)
    imported = import_gguf(path, tmp_path / "float", progress=False)
    params = SamplingParams(max_tokens=8)
    want = LLM(str(imported), kv_memory="16MiB").generate(CORPUS[:3], params)
    got = LLM(str(tmp_path / "engine"), kv_memory="16MiB").generate(CORPUS[:3], params)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g.token_ids, w.token_ids))
    assert same >= 0.8 * sum(len(w.token_ids) for w in want)


def _k_blocks(kind: str, n_blocks: int, rng, d_scale: float = 1e-2, dmin_scale: float = 1e-2) -> np.ndarray:
    """Random blocks of a K type with sane float16 super-block scales."""
    import gguf
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    d = (rng.random(n_blocks) * d_scale).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if kind == "Q6_K":
        raw[:, -2:] = d
    else:
        raw[:, 0:2] = d
        raw[:, 2:4] = (rng.random(n_blocks) * dmin_scale).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw


@pytest.mark.parametrize("kind, form", [("Q4_K", "int4/32"), ("Q6_K", "int8g/16")])
def test_k_quant_blocks_decode_to_the_gguf_values(kind, form):
    import gguf
    rng = np.random.default_rng(0)
    raw = _k_blocks(kind, 64, rng)                        # a [16, 1024] tensor
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(16, 1024)
    blocks, why = exact_form(kind, raw, (16, 1024), reference)
    assert blocks is not None, why
    assert blocks.form == form
    assert np.array_equal((blocks.dequantize() + 0.0).view(np.int32), (reference + 0.0).view(np.int32))


def test_an_offset_that_is_no_float32_makes_the_tensor_float():
    """Q4_K with a huge scale and a tiny minimum: z = 8 s - m needs more than float32's 24 bits, so the
    int4 form would round a second time; the tensor is refused the form, not rounded."""
    rng = np.random.default_rng(1)
    raw = _k_blocks("Q4_K", 4, rng, d_scale=1000.0, dmin_scale=1e-6)
    blocks, why = decode("Q4_K", raw, (1, 1024))
    assert blocks is None and "offset" in why


def test_types_without_an_llmd_form_are_float():
    import gguf
    w = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_1)
    blocks, why = exact_form("Q5_1", raw, (4, 64), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_1))
    assert blocks is None and "no llmd form" in why


def test_fused_parts_meet_in_the_form_that_holds_them_all():
    import gguf
    rng = np.random.default_rng(3)

    def form(kind, rows=8, cols=256):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if kind in ("Q4_K", "Q6_K"):
            raw = _k_blocks(kind, rows * cols // 256, rng)
        else:
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
        return exact_form(kind, raw, (rows, cols), ref)[0], ref

    (q8, r8), (q6, r6), (q40, r40), (q41, _), (q4k, _) = (form(k) for k in ("Q8_0", "Q6_K", "Q4_0", "Q4_1", "Q4_K"))
    mixed = common_form([q8, q6, q40])           # int8g/32, int8g/16 and symmetric int4 -> int8g/16
    assert [p.form for p in mixed] == ["int8g/16"] * 3
    assert all(np.array_equal(p.dequantize(), r) for p, r in zip(mixed, (r8, r6, r40)))
    assert [p.form for p in common_form([q41, q4k])] == ["int4/32", "int4/32"]
    assert common_form([q41, q8]) is None         # an offset has no int8g form
    assert common_form([q8, None]) is None


@pytest.mark.heavy
def test_cli_prints_the_routes(tied_source, tmp_path, capsys):
    from llmd.cli import main
    path = convert(tied_source, tmp_path / "m.gguf", quant={"*": "q4_0"})
    assert main(["import", str(path), "--out", str(tmp_path / "e"), "--keep-blocks"]) == 0
    out = capsys.readouterr().out
    # the tied Q4_0 table has 446 rows, no multiple of 16: int4 does not take it, int8g holds it exactly
    assert "Q4_0" in out and "int4/32" in out and "int8g/32" in out and "engine weights" in out
    assert (tmp_path / "e" / "manifest.json").is_file()


# ---- the two real models (fetched by `make models-real`) --------------------------------------------

def _real(name: str) -> Path:
    path = MODELS / name
    if not path.is_file():
        pytest.skip(f"{path} is absent: run `make models-real` to fetch it")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name, expected", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", {"Q4_1": "int4/32", "Q8_0": "int8g/32"}),
    ("Qwen2.5-Coder-0.5B-Instruct.gguf", {"Q4_K": "int4/32", "Q5_0": "int8g/32", "Q6_K": "int8g/16",
                                          "Q8_0": "int8g/32"})])
def test_real_models_keep_every_quantized_tensor(name, expected, tmp_path):
    from llmd import LLM, SamplingParams
    path = _real(name)
    summary = import_engine(path, tmp_path / "engine", progress=False)
    assert routes(summary) == {"F32": "float32 (1-D)", **expected} and not summary["demoted_modules"]
    assert_bit_identical(tmp_path / "engine", import_gguf(path, tmp_path / "float", progress=False))
    llm = LLM(str(tmp_path / "engine"), kv_memory="64MiB")
    text = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(max_tokens=16)).text
    assert "Paris" in text


def test_int8g_groups_under_64_columns_give_a_row_the_numbers_it_gets_alone():
    """No llmd int8g kernel takes groups of 32 or 16: such modules multiply through the float32 kernel
    on their weight widened to bfloat16, x in float32, the same numbers for a row alone or in a prompt."""
    from llmd.runtime import kernels
    from llmd.runtime.formats.quantized import Int8GroupLinear
    if not kernels.available():
        pytest.skip("llmd's kernels do not run on this machine")
    torch.manual_seed(0)
    m = Int8GroupLinear(256, 128, group_size=32)
    m.load_weight(torch.randn(128, 256))
    m.prepare()
    x = torch.randn(40, 256)
    with torch.inference_mode():
        many = m(x)
        alone = torch.cat([m(x[i:i + 1]) for i in range(40)])
    assert torch.equal(many, alone)
    want = x @ m.dense_weight().to(torch.bfloat16).float().t()
    assert torch.allclose(many, want, rtol=1e-4, atol=1e-4)
