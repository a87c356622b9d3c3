"""`llmd distill` on tiny models: tokenizer checks, resuming, and that KL distillation moves the draft
towards the target. Everything here is built in a temporary directory in a few seconds."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from llmd.training import bpe, corpus
from llmd.training.distill import add_distill_parser, kl_loss
from llmd.training.model_dir import hf_config, new_model, write_model_dir
from llmd.training.train_loop import DocSampler
from llmd.runtime.models.loader import load_model

pytestmark = pytest.mark.heavy          # training runs

SOURCE = '''
def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count
'''
TARGET_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1)
DRAFT_ARGS = ["--hidden-size", "32", "--intermediate-size", "64", "--layers", "1", "--heads", "1",
              "--kv-heads", "1", "--seq-len", "32", "--batch-size", "2", "--threads", "1", "--minutes", "5"]


def make_corpus(root: Path, n: int = 12) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"mod{i}.py").write_text(SOURCE.replace("add", f"add{i}").replace("Counter", f"Counter{i}") * 3)
    return root


def make_tokenizer(corpus_dir: Path, out: Path, vocab_size: int) -> Path:
    files = corpus.list_sources(corpus_dir)
    bpe.save_tokenizer(bpe.train_bpe(files, vocab_size=vocab_size), out)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    src = make_corpus(tmp / "corpus")
    tok_dir = make_tokenizer(src, tmp / "tok", vocab_size=400)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    config = hf_config(TARGET_SHAPE, tok.get_vocab_size(), tok.token_to_id(corpus.EOT), 64)
    torch.manual_seed(0)
    target = new_model(config, seed=7)
    write_model_dir(target, config, tok_dir, tmp / "target")
    return tmp, src


def run_distill(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="llmd")
    add_distill_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["distill", *argv])
    return args.func(args)


def test_refuses_a_draft_with_another_tokenizer(setup, capsys):
    tmp, src = setup
    other_tok = make_tokenizer(src, tmp / "other-tok", vocab_size=300)
    other = tmp / "other-draft"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((other_tok / name).read_bytes())
    assert run_distill("--target", str(tmp / "target"), "--out", str(other), "--corpus", str(src),
                       "--steps", "2", *DRAFT_ARGS) == 2
    err = capsys.readouterr().err
    assert re.search("llmd distill: .*different tokenizers.*vocabulary sizes differ", err) and "Traceback" not in err
    assert not (other / "model.safetensors").exists()


def test_resumed_run_equals_uninterrupted_run(setup):
    tmp, src = setup
    common = ["--target", str(tmp / "target"), "--corpus", str(src), "--steps", "4", *DRAFT_ARGS]
    run_distill("--out", str(tmp / "straight"), *common)
    run_distill("--out", str(tmp / "resumed"), "--session-steps", "2", *common)
    state = json.loads((tmp / "resumed.ckpt" / "train_state.json").read_text())
    assert state["step"] == 2
    run_distill("--out", str(tmp / "resumed"), *common)
    state = json.loads((tmp / "resumed.ckpt" / "train_state.json").read_text())
    assert state["step"] == 4
    a = load_file(str(tmp / "straight" / "model.safetensors"))
    b = load_file(str(tmp / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    # the draft shares the target's tokenizer files byte for byte
    assert (tmp / "resumed" / "tokenizer.json").read_bytes() == (tmp / "target" / "tokenizer.json").read_bytes()


def test_distillation_lowers_kl_to_target(setup):
    tmp, src = setup
    out = tmp / "learned"
    common = ["--target", str(tmp / "target"), "--out", str(out), "--corpus", str(src), "--steps", "40",
              "--lr", "1e-2", *DRAFT_ARGS]
    run_distill(*common, "--session-steps", "0")        # writes the untrained draft
    before = load_model(out)
    run_distill(*common)
    after = load_model(out)
    target = load_model(tmp / "target")
    tokens = np.load(tmp / "learned.ckpt" / "tokens.npy")
    batch = DocSampler(tokens, 32, 4, seed=99, end_id=0).batch(0)
    loss = kl_loss(target)
    with torch.no_grad():
        assert loss(after, batch).item() < 0.8 * loss(before, batch).item()


def test_on_policy_samples_are_the_targets_greedy_continuations(setup):
    """`--on-policy N`: N corpus windows without control tokens, each followed by the target's own greedy
    continuation (llmd's engine) and <|endoftext|>, cached and mixed half and half with corpus text."""
    from tokenizers import Tokenizer

    from llmd import LLM, SamplingParams
    tmp, src = setup
    out = tmp / "onp"
    run_distill("--target", str(tmp / "target"), "--out", str(out), "--corpus", str(src), "--steps", "2",
                "--on-policy", "6", *DRAFT_ARGS)
    stream = np.load(tmp / "onp.ckpt" / "onpolicy-6.npy")
    tok = Tokenizer.from_file(str(tmp / "target" / "tokenizer.json"))
    end = tok.token_to_id(corpus.EOT)
    control = set(tok.get_added_tokens_decoder())
    docs = np.split(stream, np.flatnonzero(stream == end) + 1)[:-1]
    assert len(docs) == 6
    llm = LLM(str(tmp / "target"), kv_memory="4MiB")
    prompt_len = 2 * 32 // 3                     # two thirds of the 32-token training window, then 10 tokens
    for doc in docs[:3]:
        prompt = doc[:prompt_len].tolist()
        assert not control & set(prompt)
        want = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0].token_ids
        assert doc.tolist() == prompt + want + ([] if want[-1] == end else [end])
    assert json.loads((tmp / "onp.ckpt" / "train_state.json").read_text())["step"] == 2
    assert run_distill("--target", str(tmp / "target"), "--out", str(out), "--corpus", str(src), "--on-policy", "-1",
                       *DRAFT_ARGS) == 2


def test_out_must_be_new_empty_or_an_earlier_draft(setup, capsys):
    tmp, src = setup
    notes = tmp / "notes"
    notes.mkdir(exist_ok=True)
    (notes / "keep.txt").write_text("mine")
    for out in (notes, tmp / "target"):
        assert run_distill("--target", str(tmp / "target"), "--out", str(out), "--corpus", str(src),
                           "--steps", "2", *DRAFT_ARGS) == 2
    err = capsys.readouterr().err
    assert "is not a model directory" in err and "would replace the target model" in err
    assert (notes / "keep.txt").read_text() == "mine" and (tmp / "target" / "config.json").is_file()
