"""Numeric parity with Hugging Face transformers on tiny random models of each architecture.

Tolerance: float32 logits through llmd's paged serving path agree with transformers to 1e-4 absolute
(observed: about 1e-6); greedy continuations of 64 tokens are identical.
"""
import pytest
import torch

from optional import need  # noqa: E402

transformers = need("transformers")

from llmd import LLM, SamplingParams  # noqa: E402

ATOL = 1e-4

ARCHS = {
    "llama3": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralForCausalLM", {"tie": False, "sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {"tie": True}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32, "tie": False}),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, model_factory):
    arch, extra = ARCHS[request.param]
    extra = dict(extra)
    tie = extra.pop("tie", True)
    path = model_factory(request.param, architecture=arch, tie=tie, heads=4, kv_heads=2, layers=2, **extra)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


def test_logprobs_match_after_chunked_prompt(pair):
    path, hf = pair
    llm = LLM(str(path), kv_memory="4MiB", max_batch_tokens=8)     # prompt split into chunks of 8
    ids = list(range(40, 70))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    out = llm.generate([ids], SamplingParams(max_tokens=1, logprobs=5))[0]
    ours = torch.tensor([lp for _, lp in out.logprobs[0]["top"]])
    ref_top = torch.log_softmax(ref, -1).topk(5)
    assert [t for t, _ in out.logprobs[0]["top"]] == ref_top.indices.tolist()
    assert torch.allclose(ours, ref_top.values, atol=ATOL)


def test_full_logits_match(pair):
    path, hf = pair
    llm = LLM(str(path), kv_memory="4MiB")
    e = llm.engine
    ids = list(range(10, 43))
    e.add_request("x", ids, SamplingParams(max_tokens=1))
    sched = e.scheduler.schedule()
    batch = e.runner.prepare(sched.scheduled)
    batch.sample_rows = torch.arange(len(ids))                        # every position's logits
    ours = e.runner.run(batch)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < ATOL


def test_greedy_64_tokens_identical(pair):
    path, hf = pair
    ids = [11, 12, 13, 14, 15, 90, 91]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, min_new_tokens=64,
                          pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    llm = LLM(str(path), kv_memory="4MiB")
    ours = llm.generate([ids], SamplingParams(max_tokens=64, ignore_eos=True))[0].token_ids
    assert ours == ref


@pytest.mark.parametrize("arch, extra", [
    ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("Qwen3ForCausalLM", {"attention_bias": True, "head_dim": 32}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "head_dim": 32}),
])
def test_checkpoints_written_by_transformers_load_and_match(model_factory, arch, extra):
    """Weights saved by transformers itself (every tensor it writes, e.g. o_proj's bias under
    attention_bias), not by llmd: the names llmd expects are the names checkpoints hold."""
    import json
    path = model_factory(f"hf-{arch}-{len(extra)}", architecture=arch, heads=4, kv_heads=2, layers=2, tie=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(extra)
    (path / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(path)),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.5)
    hf.save_pretrained(str(path))
    ids = list(range(10, 43))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    out = LLM(str(path), kv_memory="4MiB").generate([ids], SamplingParams(max_tokens=1, logprobs=5))[0]
    ref_top = torch.log_softmax(ref, -1).topk(5)
    assert [t for t, _ in out.logprobs[0]["top"]] == ref_top.indices.tolist()
    assert torch.allclose(torch.tensor([lp for _, lp in out.logprobs[0]["top"]]), ref_top.values, atol=ATOL)
