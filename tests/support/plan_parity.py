"""Random-weight checkpoints written by transformers itself, and the greedy check every architecture
of the layer plan is held to: 8 prompts x 32 tokens, identical to transformers in float32."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from modelfactory import write_tokenizer

PROMPTS = [[11, 12, 13, 14, 15, 90, 91], [230, 231, 5, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
           [200], [17, 17, 17, 17, 17], [99, 98, 97, 96, 95, 94], [160, 120, 33, 180, 2, 71, 6, 8, 150],
           [1, 2, 3]]
NEW_TOKENS = 32
LONG = [[(7 * i + 3) % 250 + 2 for i in range(40)], [(11 * i) % 240 + 5 for i in range(23)]]   # past tiny windows


def hf_checkpoint(path: Path, config: dict, *, seed: int = 0, offset_norms: bool = False,
                  centred_biases: bool = False) -> Path:
    """A transformers model of ``config`` (plus the test vocabulary and small shapes) with random
    weights, saved by transformers in ``path``. Matrices get std 0.5/sqrt(inputs), which keeps greedy
    choices far from ties; norm weights scatter around 1 (around 0 where ``offset_norms``: stored w of a
    (1 + w) scale); biases likewise, or around 0 where ``centred_biases``."""
    import transformers
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    raw = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-6, "eos_token_id": 0, "bos_token_id": None, "pad_token_id": 0, **config}
    (path / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.from_pretrained(str(path))
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 / p.shape[-1] ** 0.5)
            else:
                p.normal_(0.0 if offset_norms or centred_biases and name.endswith("bias") else 1.0, 0.1)
    hf.save_pretrained(str(path))
    return path


def hf_greedy(path: Path, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(gen[0, len(ids):].tolist())
    return out


def llmd_greedy(path, prompts=PROMPTS, new_tokens: int = NEW_TOKENS, **llm_args) -> list[list[int]]:
    from llmd import LLM, SamplingParams
    llm = LLM(str(path), kv_memory="4MiB", **llm_args)
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


def assert_logprobs_match(path: Path, ids=tuple(range(10, 43)), atol: float = 1e-4) -> None:
    """The top-5 log-probabilities after a prompt (chunked in 8s) match transformers'."""
    import transformers
    from llmd import LLM, SamplingParams
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([list(ids)])).logits[0, -1], -1).topk(5)
    out = LLM(str(path), kv_memory="4MiB", max_batch_tokens=8).generate(
        [list(ids)], SamplingParams(max_tokens=1, logprobs=5))[0]
    assert [t for t, _ in out.logprobs[0]["top"]] == ref.indices.tolist()
    assert torch.allclose(torch.tensor([lp for _, lp in out.logprobs[0]["top"]]), ref.values, atol=atol)
