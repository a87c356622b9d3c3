"""GGUF files of the layer plan's architectures (phi3, gemma2, gemma3, and mistral and qwen3 beside
them), written by llmd's writer from random-weight checkpoints that transformers saved: read back as
llama.cpp names and stores them (phi3's fused attn_qkv and ffn_up, Gemma's four norms stored as 1 + w,
soft-caps, windows, the local rotary base, the scores' scale), and served with greedy tokens identical
to transformers in float32, 8 prompts x 32 tokens and two longer than the windows (tiny ones, so
that they slide), both through the float import and from the file's own blocks."""
from __future__ import annotations

import numpy as np
import pytest

from optional import need  # noqa: E402

transformers = need("transformers")

from plan_parity import LONG, PROMPTS, hf_checkpoint, hf_greedy, llmd_greedy  # noqa: E402

from llmd.bench.to_gguf import convert  # noqa: E402
from llmd.runtime import kernels  # noqa: E402
from llmd.runtime.formats.gguf import hf_config, open_gguf  # noqa: E402
from llmd.runtime.models.config import ModelConfig  # noqa: E402
from llmd.runtime.models import registry  # noqa: E402

pytestmark = pytest.mark.heavy          # transformers checkpoints written, converted and served against transformers

GELU = dict(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, head_dim=16)
CONFIGS = {
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_act="silu", tie_word_embeddings=False,
                 sliding_window=9),
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", query_pre_attn_scalar=24,
                   sliding_window=8, attn_logit_softcapping=20.0, final_logit_softcapping=15.0, **GELU),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", query_pre_attn_scalar=24,
                   sliding_window=8, sliding_window_pattern=2, rope_theta=1000000.0, rope_local_base_freq=20000.0,
                   num_hidden_layers=3, **GELU),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=12,
                    tie_word_embeddings=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16, tie_word_embeddings=True),
}
FILE_ARCH = {"mistral": "LLAMA"}          # llama.cpp names mistral's tensors as llama's


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def written(request, tmp_path_factory):
    """(architecture, checkpoint directory, its GGUF, transformers' greedy tokens)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    src = hf_checkpoint(root / "hf", CONFIGS[arch], offset_norms=arch.startswith("gemma"), centred_biases=True)
    return arch, src, convert(src, root / f"{arch}.gguf"), hf_greedy(src, PROMPTS + LONG)


def test_the_file_reads_back_as_the_checkpoints_plan(written):
    arch, src, path, _ = written
    want = ModelConfig.from_dir(src)
    got = ModelConfig.from_dict(hf_config(open_gguf(path)))
    assert (got.architecture, got.plan) == (want.architecture, want.plan)
    assert got.max_position_embeddings == want.max_position_embeddings


def test_tensor_names_and_norms_are_llama_cpps(written):
    import gguf
    from safetensors.torch import load_file
    arch, src, path, _ = written
    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[FILE_ARCH.get(arch, arch.upper())]]}
    assert {n.rsplit(".", 1)[0].replace("blk.0.", "blk.{bid}.").replace("blk.1.", "blk.{bid}.")
            .replace("blk.2.", "blk.{bid}.") for n in names} <= allowed
    if arch == "phi3":
        assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= names and "blk.0.ffn_gate.weight" not in names
    if not arch.startswith("gemma"):
        return
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    hf = load_file(str(src / "model.safetensors"))
    for file_name, hf_name in (("blk.1.post_ffw_norm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
                               ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
                               ("output_norm.weight", "model.norm.weight")):
        assert np.array_equal(stored[file_name], hf[hf_name].numpy() + np.float32(1))


def test_float_import_gives_transformers_greedy_tokens(written):
    arch, _, path, want = written
    assert llmd_greedy(path, PROMPTS + LONG, dtype="float32") == want


@pytest.mark.skipif(not kernels.available(), reason="llmd's CPU kernels are not built here")
def test_the_files_own_blocks_give_transformers_greedy_tokens(written):
    arch, _, path, want = written
    assert llmd_greedy(path, PROMPTS + LONG) == want


class Metadata:
    """A GGUF file's metadata alone, for the reader's key rules (GGUFFile's get / has / fail)."""

    def __init__(self, path: str, meta: dict, names=()):
        from llmd.runtime.formats.gguf import GGUFFile
        self.file = GGUFFile(path, {k: (0, v) for k, v in meta.items()}, [])
        self.names = list(names)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def tensor_names(self):
        return self.names


def gemma_keys(arch: str, meta: dict, layers: int = 4) -> dict:
    cfg = {"num_hidden_layers": layers, "hidden_size": 64, "num_attention_heads": 2, "head_dim": 16,
           "rope_theta": 10000.0}
    registry.by_gguf()[arch].gguf.config(Metadata("m.gguf", meta), cfg)
    return cfg


def test_gemma_files_without_llmds_keys_read_as_llama_cpp_reads_them():
    """Keys llama.cpp's converter leaves out take llama.cpp's defaults: gemma2's caps 50 and 30, window
    4096 on every other layer from the first, the scale of the head size (of hidden / heads at the
    27B sizes); gemma3 slides five layers in six, with a local base of 10000, or none without a window."""
    g2 = gemma_keys("gemma2", {})
    assert (g2["attn_logit_softcapping"], g2["final_logit_softcapping"], g2["sliding_window"]) == (50.0, 30.0, 4096)
    assert g2["layer_types"] == ["sliding_attention", "full_attention"] * 2 and g2["query_pre_attn_scalar"] == 16
    assert gemma_keys("gemma2", {}, layers=46)["query_pre_attn_scalar"] == 32
    g3 = gemma_keys("gemma3", {"gemma3.attention.sliding_window": 512}, layers=7)
    assert g3["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]
    assert g3["rope_local_base_freq"] == 10000.0 and g3["final_logit_softcapping"] is None
    assert gemma_keys("gemma3", {})["layer_types"] == ["full_attention"] * 4
    flags = [True, False, False, True]
    g3 = gemma_keys("gemma3", {"gemma3.attention.sliding_window": 8, "gemma3.attention.sliding_window_pattern": flags})
    assert g3["layer_types"] == ["sliding_attention" if f else "full_attention" for f in flags]


@pytest.mark.parametrize("arch,meta,message", [
    ("gemma2", {"gemma2.rope.freq_base_swa": 500.0}, "local rotary base"),
    ("gemma3", {"gemma3.attention.sliding_window": 8, "gemma3.attention.sliding_window_pattern": [True]},
     "4 true/false flags"),
    ("gemma2", {"gemma2.attention.scale": -1.0}, "must be positive"),
])
def test_gemma_keys_llmd_cannot_honour_are_refused(arch, meta, message):
    from llmd.runtime.formats.gguf_check import GGUFError
    with pytest.raises(GGUFError, match=message):
        gemma_keys(arch, meta)
