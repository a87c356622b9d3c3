"""Training for the demo models and ``llmd distill``: whole documents packed into windows, padding never
trained on, and a gradient for every weight (llmd's inference kernels have no backward)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmd.training import corpus
from llmd.training.model_dir import hf_config, new_model
from llmd.training.distill import kl_loss
from llmd.training.train_loop import PAD, DocSampler, documents, next_token_loss, pack

END = 0


def stream(seed: int, docs: int = 300, vocab: int = 50) -> tuple[np.ndarray, list[list[int]]]:
    """Documents of 1 to 40 tokens (ids 1..vocab-1), each ending with END."""
    rng = np.random.default_rng(seed)
    out = [list(rng.integers(1, vocab, rng.integers(1, 40))) + [END] for _ in range(docs)]
    return np.array([t for d in out for t in d], dtype=np.uint16), out


def row_documents(row: np.ndarray) -> list[list[int]]:
    """Split a batch row back into documents; PAD may only follow the last one."""
    real = row[row != PAD]
    assert (row[len(real):] == PAD).all(), "padding only at the end of a window"
    ends = np.flatnonzero(real == END)
    assert len(real) == 0 or ends[-1] == len(real) - 1, "a window ends with a whole document"
    return [list(map(int, d)) for d in np.split(real, ends[:-1] + 1)] if len(real) else []


def test_documents_end_at_the_end_token_and_long_ones_are_cut():
    tokens = np.array([5, 6, END, 7, END, 1, 2, 3, 4, 5, 6, 7, END], dtype=np.uint16)
    assert documents(tokens, 4, END).tolist() == [[0, 3], [3, 5], [5, 9], [9, 13]]
    assert documents(np.array([3, 4, END, 9, 9]), 8, END).tolist() == [[0, 3], [3, 5]]   # an unterminated tail


def test_every_document_appears_once_an_epoch_whole_and_in_one_window():
    tokens, docs = stream(0)
    s = DocSampler(tokens, seq_len=63, batch_size=4, seed=7, end_id=END)
    seen = []
    for step in range(s.windows_per_epoch // 4):
        for row in s.batch(step).numpy():
            seen.extend(row_documents(row))
    # Windows past the last whole batch wait for the next epoch: with theirs, every document exactly once.
    left = [list(map(int, tokens[a:b])) for w in s._epoch(0)[len(seen_windows(s)):] for a, b in (s.spans[d] for d in w)]
    assert sorted(map(tuple, seen + left)) == sorted(map(tuple, docs))
    assert len(left) < 4 * 64
    assert s.fill() > 0.9


def seen_windows(s: DocSampler) -> range:
    return range((s.windows_per_epoch // 4) * 4)


def test_batches_are_fixed_by_seed_and_step_and_epochs_reshuffle():
    tokens, _ = stream(1)
    a, b = DocSampler(tokens, 63, 4, 3, END), DocSampler(tokens, 63, 4, 3, END)
    per_epoch = a.windows_per_epoch // 4
    for step in (0, 1, per_epoch + 1, 3 * per_epoch):
        assert torch.equal(a.batch(step), b.batch(step))
    assert not torch.equal(a.batch(0), a.batch(per_epoch))
    assert not torch.equal(a.batch(0), DocSampler(tokens, 63, 4, 4, END).batch(0))


def test_packing_fills_windows_first_fit():
    lengths = np.array([5, 5, 3, 6, 2, 10])
    windows = pack(lengths, np.arange(6), width=10, open_limit=2)
    # 3 opens a second window; 6 fits there; 2 fits nowhere, so the fullest open window ([0, 1]) closes
    assert windows == [[0, 1], [2, 3], [4], [5]]
    assert all(lengths[w].sum() <= 10 for w in windows)


def test_padding_is_not_trained_on():
    model = new_model(hf_config(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1), 50, END, 64), seed=0)
    batch = torch.tensor([[3, 4, 5, END, PAD, PAD], [6, 7, END, 8, 9, END]])
    with torch.no_grad():
        got = next_token_loss(model, batch)
        logits = model.forward_dense(batch[:, :-1].clamp(min=0))
        targets = batch[:, 1:]
        want = F.cross_entropy(logits[targets != PAD].float(), targets[targets != PAD])
    assert torch.allclose(got, want)


def test_chunk_lengths_are_drawn_between_the_limits():
    text = "".join(f"value_{i} = {i} * 2\n" for i in range(2000))
    sizes = [len(c) for c in corpus.chunks(text, 800, random.Random(0), 200)]
    assert "".join(corpus.chunks(text, 800, random.Random(0), 200)) == text
    assert all(c <= 800 for c in sizes) and min(sizes[:-1]) >= 200 - 30
    assert np.std(sizes[:-1]) > 100                # lengths spread, not all at the limit


def tiny(seed: int, hidden: int = 32):
    shape = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)
    return new_model(hf_config(shape, 50, END, 64), seed=seed)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bfloat16-autocast"])
@pytest.mark.heavy
def test_every_weight_gets_a_gradient(autocast):
    """A batch's rows (8) are fewer than the decode kernels' row limit: the kernels must stay out of a
    forward that records gradients, or every layer silently stops learning."""
    model = tiny(0)
    batch = torch.randint(1, 50, (8, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        next_token_loss(model, batch).backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []


@pytest.mark.heavy
def test_distillation_reaches_every_draft_weight():
    target, draft = tiny(1, hidden=64), tiny(2)
    target.requires_grad_(False)
    batch = torch.randint(1, 50, (8, 33))
    batch[0, 20:] = PAD
    kl_loss(target)(draft, batch).backward()
    assert [n for n, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


def test_serving_never_asks_for_kernels_while_gradients_are_recorded(tiny_model_dir, monkeypatch):
    """The engine runs without gradients: a kernel asked for while gradients are recorded is refused,
    and torch's fallback would run instead."""
    from llmd import LLM, SamplingParams
    from llmd.runtime import kernels
    from llmd.runtime.models.layers import matvec_plan
    asked = []
    real = kernels.usable

    def spy(x, has_gradient=True):
        if has_gradient and torch.is_grad_enabled():
            asked.append(tuple(x.shape))
        return real(x, has_gradient)

    monkeypatch.setattr(kernels, "usable", spy)
    matvec_plan.cache_clear()
    llm = LLM(str(tiny_model_dir), kv_memory="16MiB")
    out = llm.generate(["hello", [1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert all(o.error is None for o in out)
    assert asked == []


def test_token_streams_keep_ids_past_65536():
    """A target with a large vocabulary (Qwen's has 151,936 ids): its corpus stream is uint32, ids intact."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from llmd.training import bpe
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    stream = bpe.encode_pieces(tok, [corpus.Piece(((False, "w69999 w1 w65536"),))])
    assert stream.dtype == np.uint32 and stream.tolist() == [69999, 1, 65536]
