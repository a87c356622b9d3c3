"""Phi-3 (fused qkv_proj and gate_up_proj in its checkpoints): identical greedy tokens to
transformers' Phi3ForCausalLM on random weights in float32, and a clear refusal of rotary scaling
llmd does not compute."""
import pytest

from optional import need  # noqa: E402

transformers = need("transformers")

from plan_parity import assert_logprobs_match, hf_checkpoint, hf_greedy, llmd_greedy  # noqa: E402

from llmd.runtime.errors import ModelLoadError  # noqa: E402
from llmd.runtime.models.config import ModelConfig  # noqa: E402
from llmd.runtime.models.random_model import hf_config  # noqa: E402

PHI3 = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_act="silu", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return hf_checkpoint(tmp_path_factory.mktemp("phi3"), PHI3)


def test_phi3_greedy_tokens_match_transformers(phi3_dir):
    assert llmd_greedy(phi3_dir) == hf_greedy(phi3_dir)


def test_phi3_logprobs_match_transformers(phi3_dir):
    assert_logprobs_match(phi3_dir)


def test_phi3_fused_checkpoint_tensors_are_split_by_the_plan():
    from llmd.runtime.models.loader import checkpoint_layout
    cfg = ModelConfig.from_dict(hf_config("tiny", **PHI3))
    layout = checkpoint_layout(cfg)
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    assert layout["model.layers.0.self_attn.qkv_proj.weight"] == ("layers.0.self_attn.qkv_proj.weight", 0,
                                                                  (q + 2 * kv, cfg.hidden_size))
    assert layout["model.layers.0.mlp.gate_up_proj.weight"] == ("layers.0.mlp.gate_up_proj.weight", 0,
                                                                (2 * i, cfg.hidden_size))
    assert "model.layers.0.self_attn.q_proj.weight" not in layout


@pytest.mark.parametrize("rope", [{"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
                                  {"type": "su", "short_factor": [1.0], "long_factor": [1.0]}])
def test_phi3_refuses_rope_scaling_llmd_lacks(rope):
    with pytest.raises(ModelLoadError, match="rope type .* is not supported"):
        ModelConfig.from_dict(hf_config("tiny", **PHI3, rope_scaling=rope))


def test_phi3_window_slides_every_layer_without_capping_the_context():
    cfg = ModelConfig.from_dict(hf_config("tiny", **PHI3, sliding_window=2047))
    assert cfg.max_position_embeddings == 4096 and cfg.plan.windows(cfg.num_layers) == (2047,) * cfg.num_layers
