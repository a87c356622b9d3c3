"""The layer plan each architecture declares, and what reads it: the checkpoint map, the model, the
fused step (Llama plans only), column equalization; every architecture's greedy tokens identical to
transformers' (8 prompts x 32 tokens, float32)."""
import json

import pytest
import torch

from plan_parity import hf_checkpoint, hf_greedy, llmd_greedy

from llmd.runtime.errors import ModelLoadError
from llmd.runtime.formats.quantized import equalize_layer, norm_pairs
from llmd.runtime.models import registry
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.loader import checkpoint_layout, load_model
from llmd.runtime.models.random_model import hf_config

GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=24,
              sliding_window=128, sliding_window_pattern=2, hidden_activation="gelu_pytorch_tanh",
              tie_word_embeddings=True)
GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16, sliding_window=128,
              hidden_activation="gelu_pytorch_tanh")


def config(arch: str, **extra) -> ModelConfig:
    return ModelConfig.from_dict(hf_config("tiny", **{"architectures": [arch], **extra}))


def test_every_architecture_declares_a_plan():
    assert registry.supported() == ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM",
                                    "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"):
        assert config(arch).plan.plain(), arch          # the Llama plan: the fused step's
    gemma2, gemma3 = config("Gemma2ForCausalLM", **GEMMA2), config("Gemma3ForCausalLM", **GEMMA3)
    assert gemma2.plan.attn_softcap == 50.0 and gemma2.plan.final_softcap == 30.0
    assert gemma2.plan.sliding_layers == (True, False, True, False)
    assert gemma3.plan.qk_norm and gemma3.plan.rope_local_theta == 10000.0 and gemma3.plan.attn_softcap is None
    assert gemma3.plan.attention_scale == pytest.approx(24 ** -0.5)
    for cfg in (gemma2, gemma3):
        assert not cfg.plan.plain() and cfg.plan.sandwich and cfg.plan.activation == "gelu_tanh"
        assert cfg.max_position_embeddings == 4096 and cfg.window_cap == 128   # windows slide; no cap


def test_the_llama_checkpoint_map_is_unchanged():
    cfg = config("LlamaForCausalLM", attention_bias=True, mlp_bias=True)
    layout = checkpoint_layout(cfg)
    q, kv, h = cfg.q_size, cfg.kv_size, cfg.hidden_size
    p = "model.layers.3."
    assert layout[p + "self_attn.k_proj.weight"] == ("layers.3.self_attn.qkv_proj.weight", q, (kv, h))
    assert layout[p + "self_attn.v_proj.bias"] == ("layers.3.self_attn.qkv_proj.bias", q + kv, (kv,))
    assert layout[p + "self_attn.o_proj.bias"] == ("layers.3.self_attn.o_proj.bias", 0, (h,))
    assert layout[p + "mlp.up_proj.bias"] == ("layers.3.mlp.gate_up_proj.bias", cfg.intermediate_size,
                                              (cfg.intermediate_size,))
    assert len(layout) == 3 + cfg.num_layers * (2 * 3 + 2 * 1 + 2 * 2 + 2 * 1 + 2)


@pytest.mark.parametrize("extra, match", [
    ({"layer_types": ["sliding_attention"]}, "'layer_types' must list"),
    ({"hidden_activation": "relu"}, "hidden activation 'relu' is not supported"),
    ({"attn_logit_softcapping": -1}, "'attn_logit_softcapping' must be a positive number"),
    ({"query_pre_attn_scalar": "big"}, "'query_pre_attn_scalar' must be a positive number"),
    ({"sliding_window_pattern": 0}, "sliding window pattern must be a positive integer"),
])
def test_a_plan_llmd_cannot_compute_is_refused(extra, match):
    with pytest.raises(ModelLoadError, match=match):
        config("Gemma3ForCausalLM", **{**GEMMA3, **extra})


def test_gemma_norms_hold_their_scale_and_save_what_they_load(tmp_path):
    path = hf_checkpoint(tmp_path / "g3", GEMMA3, offset_norms=True)
    model = load_model(path)
    from safetensors.torch import load_file
    stored = load_file(str(path / "model.safetensors"))
    w = stored["model.layers.1.pre_feedforward_layernorm.weight"]
    assert torch.equal(model.layers[1].pre_feedforward_layernorm.weight, w + 1)
    assert torch.equal(model.layers[0].self_attn.q_norm.weight, stored["model.layers.0.self_attn.q_norm.weight"] + 1)
    from llmd.runtime.models.loader import save_model
    save_model(model, tmp_path / "again")
    again = load_model(tmp_path / "again", cfg=model.config)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_the_fused_step_serves_llama_plans_only(tmp_path, caplog):
    from llmd.runtime import kernels
    llama = load_model(hf_checkpoint(tmp_path / "llama", dict(architectures=["LlamaForCausalLM"],
                                                                model_type="llama")))
    gemma = load_model(hf_checkpoint(tmp_path / "g3", GEMMA3, offset_norms=True))
    with caplog.at_level("INFO", logger="llmd.models"):
        llama.prepare_for_inference()
        gemma.prepare_for_inference()
    assert gemma.fused_decode is None and not gemma._interleaved
    assert "Gemma3ForCausalLM runs llmd's torch path" in caplog.text and "local rotary base" in caplog.text
    if kernels.available():
        assert llama.fused_decode is not None and llama._interleaved


@torch.no_grad()
def test_equalization_pairs_each_norm_with_the_product_it_feeds(tmp_path):
    """Sandwich norms: the MLP's input norm is pre_feedforward_layernorm; equalizing keeps the function."""
    model = load_model(hf_checkpoint(tmp_path / "g2", {**GEMMA2, "num_hidden_layers": 2}, offset_norms=True))
    layer = model.layers[0]
    assert norm_pairs(layer) == (("input_layernorm", "self_attn.qkv_proj"),
                                 ("pre_feedforward_layernorm", "mlp.gate_up_proj"))
    ids = torch.tensor([[5, 9, 40, 41, 7]])
    before = model.forward_dense(ids)
    for layer in model.layers:
        equalize_layer(layer)
    assert torch.allclose(model.forward_dense(ids), before, atol=1e-4)


FAMILIES = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_family_greedy_tokens_match_transformers(tmp_path, family):
    pytest.importorskip("transformers")
    path = hf_checkpoint(tmp_path / family, FAMILIES[family])
    assert llmd_greedy(path) == hf_greedy(path)
    assert json.loads((path / "config.json").read_text())["architectures"] == FAMILIES[family]["architectures"]
