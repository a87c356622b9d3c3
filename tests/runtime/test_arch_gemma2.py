"""Gemma 2 (sandwich norms stored as w of (1 + w), gelu, scaled embeddings, a scale of its own,
soft-capped scores and logits, alternating sliding layers): identical greedy tokens to transformers
on random weights in float32, on llmd's torch path."""
import logging

import pytest

from optional import need  # noqa: E402

transformers = need("transformers")

from plan_parity import assert_logprobs_match, hf_checkpoint, hf_greedy, llmd_greedy  # noqa: E402

GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16, query_pre_attn_scalar=24,
              sliding_window=128, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
              attn_logit_softcapping=2.0, final_logit_softcapping=5.0)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    return hf_checkpoint(tmp_path_factory.mktemp("gemma2"), GEMMA2, offset_norms=True)


def test_gemma2_greedy_tokens_match_transformers(gemma2_dir, caplog):
    with caplog.at_level(logging.INFO, logger="llmd.models"):
        ours = llmd_greedy(gemma2_dir)
    assert "runs llmd's torch path" in caplog.text and "attention soft-capping" in caplog.text
    assert ours == hf_greedy(gemma2_dir)


def test_gemma2_logprobs_match_transformers(gemma2_dir):
    assert_logprobs_match(gemma2_dir)
