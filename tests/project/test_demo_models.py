"""The committed demo pair (models/code-target, models/code-draft) and the pieces that made it.

Nothing here trains a model; the pair is read from the repository."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.training import bpe, corpus
from llmd.training.distill import check_same_tokenizer
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.loader import load_model
from llmd.runtime.tokenizer import Tokenizer

MODELS = Path(os.environ.get("LLMD_DEMO_MODELS", Path(__file__).resolve().parents[2] / "models"))
TARGET, DRAFT = MODELS / "code-target", MODELS / "code-draft"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TARGET)


# ---- the model directories ---------------------------------------------------------------------
@pytest.mark.parametrize("model_dir", [TARGET, DRAFT], ids=["target", "draft"])
def test_model_directory_is_complete_and_small(model_dir):
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", "MODEL_CARD.md"):
        assert (model_dir / name).is_file(), name
    assert (model_dir / "model.safetensors").stat().st_size <= 40 * 2**20
    card = (model_dir / "MODEL_CARD.md").read_text()
    for fact in ("python -m llmd.training.train_demo", "Held-out", "accepted fraction", "ast.parse"):
        assert fact in card


def test_pair_shapes_and_shared_tokenizer():
    target, draft = ModelConfig.from_dir(TARGET), ModelConfig.from_dir(DRAFT)
    assert target.architecture == draft.architecture == "LlamaForCausalLM"
    assert target.num_parameters() >= 10_000_000
    assert draft.flops_per_token() * 6 <= target.flops_per_token()
    assert draft.vocab_size == target.vocab_size
    check_same_tokenizer(TARGET, DRAFT)


def test_target_completes_python_through_the_public_api():
    from llmd import LLM, SamplingParams
    llm = LLM(str(TARGET), kv_memory="64MiB")
    prompt = "import os\n\n\ndef main():\n    path = os.path."
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.finish_reason in ("length", "stop") and out.error is None
    assert 1 <= len(out.token_ids) <= 8
    # greedy through the engine equals greedy through the dense reference model
    model = load_model(TARGET)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
    with torch.no_grad():
        for expected in out.token_ids:
            nxt = model.forward_dense(torch.tensor([ids]))[0, -1].argmax().item()
            assert nxt == expected
            ids.append(nxt)


def test_draft_generates_through_the_public_api():
    from llmd import LLM, SamplingParams
    out = LLM(str(DRAFT), kv_memory="64MiB").generate(["class Point:\n    def __init__(self"],
                                                      SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out.error is None and 1 <= len(out.token_ids) <= 6


def test_transformers_loads_the_target_with_the_same_logits():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    ids = torch.tensor([Tokenizer.from_dir(TARGET).encode("for i in range(10):\n    print(i)\n")])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, load_model(TARGET).forward_dense(ids),
                                   rtol=1e-4, atol=1e-4)


# ---- tokenizer -----------------------------------------------------------------------------------
def test_control_tokens_are_declared(tok):
    config = json.loads((TARGET / "tokenizer_config.json").read_text())
    declared = {v["content"]: int(k) for k, v in config["added_tokens_decoder"].items() if v["special"]}
    assert set(declared) == set(corpus.SPECIAL_TOKENS)
    for name, tid in declared.items():
        assert tok.token_id(name) == tid
    assert tok.fim_prefix_id == declared["<|fim_prefix|>"]
    assert tok.eos_token_ids == (declared["<|endoftext|>"],)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_tokenizer_round_trips_any_unicode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert not set(ids) & tok.special_token_ids or not text


@pytest.mark.parametrize("name", corpus.SPECIAL_TOKENS)
def test_control_token_spelled_in_a_prompt_stays_text(tok, name):
    text = f"s = '{name}'\n"
    ids = tok.encode(text)
    assert tok.token_id(name) not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    # training data treats it the same way
    raw = bpe.encode_pieces(_hf_tokenizer(), [corpus.Piece(((False, text), (True, corpus.EOT)))])
    assert raw.tolist()[:-1] == ids and raw[-1] == tok.token_id(corpus.EOT)


def _hf_tokenizer():
    from tokenizers import Tokenizer as HF
    return HF.from_file(str(TARGET / "tokenizer.json"))


def test_code_is_compressed(tok):
    source = Path(corpus.__file__).read_text()
    assert len(source) / len(tok.encode(source)) > 2.5      # bytes would be 1.0


# ---- corpus ----------------------------------------------------------------------------------------
def test_split_is_stable_by_path_and_about_five_percent():
    files = corpus.list_sources()
    train, held = corpus.split(files)
    assert not {f.rel for f in train} & {f.rel for f in held}
    assert 0.02 < len(held) / len(files) < 0.09
    assert all("site-packages" not in f.rel.split("/") for f in files)
    shuffled = random.Random(1).sample(files, len(files))
    assert sorted(f.rel for f in corpus.split(shuffled)[1]) == sorted(f.rel for f in held)


def test_fim_pieces_hold_the_whole_chunk_in_psm_order(tmp_path):
    text = "".join(f"x{i} = {i}\n" for i in range(50))
    (tmp_path / "m.py").write_text(text)
    pieces = list(corpus.make_pieces(corpus.list_sources(tmp_path) * 40, seed=3, max_chars=2000, min_chars=2000))
    fim = [p for p in pieces if p.parts[0] == (True, corpus.FIM_PREFIX)]
    assert 10 < len(fim) < 30                                      # about half of 40
    for p in fim:
        parts = dict((marker[1], text_part[1]) for marker, text_part in zip(p.parts, p.parts[1:])
                     if marker[0] and not text_part[0])
        assert parts.get(corpus.FIM_PREFIX, "") + parts.get(corpus.FIM_MIDDLE, "") + parts.get(corpus.FIM_SUFFIX, "") == text
        assert p.parts[-1] == (True, corpus.EOT)
    plain = [p for p in pieces if p not in fim]
    assert all(p.parts == ((False, text), (True, corpus.EOT)) for p in plain)


def test_about_half_the_fim_middles_are_whole_lines():
    rng = random.Random(0)
    text = "".join(f"x{i} = {i}\n" for i in range(50))
    cuts = [corpus.fim_rearrange(text, rng) for _ in range(400)]
    assert all(pre + mid + suf == text for pre, mid, suf in cuts)
    whole = [mid for pre, mid, suf in cuts if (not pre or pre.endswith("\n")) and mid.endswith("\n")
             and 1 <= mid.count("\n") <= 4 and len(mid) < 40]
    assert 150 < len(whole) < 260      # the line-span half, plus the odd character cut that lands on lines
