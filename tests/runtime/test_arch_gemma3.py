"""Gemma 3, text only (Gemma3ForCausalLM): sandwich norms of (1 + w), q/k norms, a local rotary base
for sliding layers, scaled embeddings, a scale of its own: identical greedy tokens to transformers on
random weights in float32."""
import pytest

from optional import need  # noqa: E402

transformers = need("transformers")

from plan_parity import assert_logprobs_match, hf_checkpoint, hf_greedy, llmd_greedy  # noqa: E402

GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=24,
              sliding_window=128, sliding_window_pattern=2, hidden_activation="gelu_pytorch_tanh",
              tie_word_embeddings=True, rope_theta=1000000.0, rope_local_base_freq=10000.0)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return hf_checkpoint(tmp_path_factory.mktemp("gemma3"), GEMMA3, offset_norms=True)


def test_gemma3_greedy_tokens_match_transformers(gemma3_dir):
    assert llmd_greedy(gemma3_dir) == hf_greedy(gemma3_dir)


def test_gemma3_logprobs_match_transformers(gemma3_dir):
    assert_logprobs_match(gemma3_dir)
