"""Sliding windows per layer: a sliding layer sees the last ``window`` positions from each query, full
layers everything, and the context is no longer capped at the window. Tiny windows (8-12) keep the
checks cheap: greedy tokens identical to transformers in float32 on prompts and generations longer
than the window, for every architecture with sliding layers; a row's tokens do not depend on the rows
batched with it; the kernel's windowed rows, torch's masked groups, int8 pools and the reference
agree; prefix caching still serves a repeated long prompt."""
from __future__ import annotations

import pytest
import torch

from llmd.runtime import attention as A
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.random_model import hf_config

from optional import need  # noqa: E402

transformers = need("transformers")

from plan_parity import LONG, PROMPTS, hf_checkpoint, hf_greedy, llmd_greedy  # noqa: E402

pytestmark = pytest.mark.heavy          # transformers checkpoints of five architectures against transformers

GELU = dict(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, head_dim=16, query_pre_attn_scalar=16)
SLIDING = {
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=12,
                    tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True, sliding_window=10,
                  num_hidden_layers=3, max_window_layers=0, tie_word_embeddings=True,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=9, tie_word_embeddings=False),
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=8, **GELU),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=8,
                   sliding_window_pattern=2, rope_local_base_freq=10000.0, rope_theta=100000.0, **GELU),
}


@pytest.fixture(scope="module", params=sorted(SLIDING))
def sliding(request, tmp_path_factory):
    """(architecture, checkpoint, transformers' greedy tokens for PROMPTS + LONG)."""
    arch = request.param
    path = hf_checkpoint(tmp_path_factory.mktemp(arch), SLIDING[arch], offset_norms=arch.startswith("gemma"),
                         centred_biases=True)
    return arch, path, hf_greedy(path, PROMPTS + LONG)


def test_the_context_is_not_capped_at_the_window(sliding):
    arch, path, _ = sliding
    cfg = ModelConfig.from_dir(path)
    assert cfg.max_position_embeddings == 256
    assert cfg.window_cap == SLIDING[arch]["sliding_window"]
    assert any(cfg.plan.windows(cfg.num_layers))


def test_greedy_tokens_match_transformers_past_the_window(sliding):
    _, path, want = sliding
    assert llmd_greedy(path, PROMPTS + LONG) == want


def test_chunked_prompts_and_the_reference_attention_match_too(sliding):
    """Prompt chunks of 8 (rows whose windows start at different positions) and the per-request
    reference attention give the same tokens."""
    _, path, want = sliding
    assert llmd_greedy(path, LONG, max_batch_tokens=8) == want[-2:]
    assert llmd_greedy(path, LONG, attention="reference") == want[-2:]


def test_a_rows_tokens_do_not_depend_on_its_batch(sliding):
    _, path, want = sliding
    alone = [llmd_greedy(path, [p], new_tokens=12)[0] for p in LONG + PROMPTS[:2]]
    assert alone == [w[:12] for w in want[-2:] + want[:2]]


def test_prefix_cache_serves_a_repeated_long_prompt(sliding):
    from llmd import LLM, SamplingParams
    _, path, want = sliding
    llm = LLM(str(path), kv_memory="4MiB")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    first = llm.generate([LONG[0]], params)[0].token_ids
    again = llm.generate([LONG[0]], params)[0]
    assert first == again.token_ids == want[-2]


@pytest.mark.parametrize("kernel,kv", [(True, "float32"), (False, "float32"), (True, "bfloat16"), (False, "int8")])
def test_windowed_attention_paths_match_the_reference(kernel, kv):
    """Decode rows, verification rows and prompt chunks past the window, in one step: the kernel's
    flat-table rows, torch's masked groups and int8 pools equal the reference with the window; a
    window no request reaches past changes nothing."""
    g = torch.Generator().manual_seed(3)
    bs, heads, kvh, dim, window = 16, 4, 2, 64, 21
    layout = [(1, 70, [3, 4, 5, 6, 7]), (5, 40, [8, 9, 10]), (30, 64, [0, 1, 2, 11]), (12, 12, [12])]
    spans, start = [], 0
    for nq, ctx, ids in layout:
        spans.append(A.SeqSpan(start, nq, ctx, ids))
        start += nq
    slots = torch.cat([s.kv_slots(bs)[s.ctx_len - s.num_q:] for s in spans])
    q, k, v = (torch.randn(start, h, dim, generator=g) for h in (heads, kvh, kvh))
    pools = [torch.randn(1, 13 * bs, kvh, dim, generator=g) for _ in range(2)]
    scales = None
    if kv == "int8":
        pools = [torch.zeros(1, 13 * bs, kvh, dim, dtype=torch.int8) for _ in range(2)]
        scales = (torch.zeros(1, 13, kvh), torch.zeros(1, 13, kvh))
    elif kv == "bfloat16":
        pools = [p.to(torch.bfloat16) for p in pools]

    def run(w, reference=False):
        attn = A.PagedAttention(*(p.clone() for p in pools), bs, reference=reference, kernel=kernel,
                                scales=None if scales is None else tuple(s.clone() for s in scales))
        attn.prepare(slots, spans)
        return attn.attend(0, q, k, v, window=w)

    want = run(window, reference=True)
    torch.testing.assert_close(run(window), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(run(None, reference=True), want, atol=1e-3)
    assert torch.equal(run(70), run(None))


def test_windowed_kernel_rows_read_exactly_the_window():
    spans = [A.SeqSpan(0, 3, 20, [4, 2]), A.SeqSpan(3, 1, 5, [7])]
    kr = A.KernelRows.build_window(spans, 16, 6)
    table = kr.table.view(-1).tolist()
    seen = [table[s:s + n] for s, n in zip(kr.spans.tolist(), kr.lengths.tolist())]
    assert kr.rows.tolist() == [0, 1, 2, 3] and kr.block_size == 1
    assert seen[0] == [4 * 16 + p for p in range(12, 16)] + [2 * 16, 2 * 16 + 1]      # positions 12..17
    assert seen[2] == [4 * 16 + 14, 4 * 16 + 15] + [2 * 16 + p for p in range(4)]     # positions 14..19
    assert seen[3] == [7 * 16 + p for p in range(5)]                                 # all of a short context


def test_qwen2_slides_from_max_window_layers_on():
    cfg = ModelConfig.from_dict(hf_config("tiny", architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                          use_sliding_window=True, sliding_window=64, max_window_layers=1))
    assert cfg.plan.windows(cfg.num_layers) == (None,) + (64,) * (cfg.num_layers - 1)


def test_the_fused_step_slides_every_layer_alike(sliding):
    """The fused step reads a window's flat table where every layer slides alike (mistral, phi3: each
    decode step of a prompt longer than the window runs fused), and steps aside where some layers slide
    and others do not (qwen2); the tokens stay transformers'."""
    from llmd import LLM, SamplingParams
    from fused_step import force_fused
    arch, path, want = sliding
    if not ModelConfig.from_dir(path).plan.plain():
        pytest.skip("the fused step computes the Llama plan only")
    llm = LLM(str(path), kv_memory="4MiB")
    fused = force_fused(llm.engine.runner.model)
    got = [o.token_ids for o in llm.generate(LONG, SamplingParams(max_tokens=32, ignore_eos=True))]
    assert got == want[-2:]
    assert (fused.steps > 0) == (arch != "qwen2")
