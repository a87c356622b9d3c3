"""Incremental detokenization: deltas equal a full decode, no broken characters, stop strings."""
import json

import pytest
from hypothesis import example, given, settings, strategies as st
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from llmd.runtime.detokenizer import IncrementalDetokenizer
from llmd.runtime.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>",
            "<|file_sep|>", "<|repo_name|>"]
CORPUS = ["def add(a, b):\n    return a + b\n", "hello world, hello there", "日本語のテキスト",
          "the quick brown fox jumps over the lazy dog", "STOP here and END there"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(CORPUS * 20, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return Tokenizer.from_dir(path)


def stream(tok, ids, prompt=(), stop=(), step=1, skip=True):
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=skip, stop=stop)
    deltas, hit = [], None
    for i in range(0, len(ids), step):
        delta, hit = detok.add(ids[i:i + step])
        deltas.append(delta)
        if hit:
            break
    if not hit:
        deltas.append(detok.flush())
    return deltas, hit


@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_concatenate_to_decode(tok, step):
    prompt = tok.encode("def add(a, b):")
    out = tok.encode("\n    return a + b  # 日本 😀 done", add_special_tokens=False)
    deltas, hit = stream(tok, out, prompt, step=step)
    assert hit is None
    assert "".join(deltas) == tok.decode(out)
    assert len([d for d in deltas if d]) > 3          # streamed, not all at the end


def test_special_tokens_skipped_or_kept(tok):
    out = tok.encode("a<|endoftext|>b", add_special_tokens=False, allow_special=True)
    assert "".join(stream(tok, out)[0]) == "ab"
    assert "".join(stream(tok, out, skip=False)[0]) == "a<|endoftext|>b"


def test_emoji_split_over_byte_tokens_is_held_back(tok):
    out = tok.encode("x😀", add_special_tokens=False)
    assert len(out) == 5                               # 'x' and four byte tokens
    deltas, _ = stream(tok, out)
    assert deltas[:5] == ["x", "", "", "", "😀"]


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40), step=st.integers(1, 3))
@example(text="0\x80\x80\U00010000", step=2)    # partial characters chained across chunks
def test_never_emits_partial_characters(tok, text, step):
    out = tok.encode(text, add_special_tokens=False)
    deltas, _ = stream(tok, out, prompt=tok.encode("hello"), step=step)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_invalid_bytes_are_not_held_forever(tok):
    lead_byte = tok.encode("😀", add_special_tokens=False)[:1]     # 0xF0 alone never completes
    out = lead_byte * 12 + tok.encode("a", add_special_tokens=False)
    deltas, _ = stream(tok, out)
    assert "".join(deltas) == tok.decode(out) == "\ufffd" * 12 + "a"
    assert deltas[:8] == [""] * 7 + ["\ufffd" * 8]                 # released after MAX_HELD_TOKENS


def test_stop_string_spanning_tokens(tok):
    out = tok.encode("hello there STOP here", add_special_tokens=False)
    deltas, hit = stream(tok, out, stop=("STOP",))
    assert hit == "STOP"
    assert "".join(deltas) == "hello there "


def test_stop_string_split_inside_a_token(tok):
    # The stop string ends in the middle of a token: text before it still comes out, nothing after.
    out = tok.encode("the quick brown fox", add_special_tokens=False)
    deltas, hit = stream(tok, out, stop=("ck bro", "zzz"))
    assert hit == "ck bro" and "".join(deltas) == "the qui"


def test_earliest_stop_string_wins(tok):
    out = tok.encode("hello world, hello there", add_special_tokens=False)
    deltas, hit = stream(tok, out, stop=("there", "world"))
    assert hit == "world" and "".join(deltas) == "hello "


def test_possible_stop_prefix_is_released(tok):
    # "EN" could start "END!" until the next token shows it does not.
    out = tok.encode("END there", add_special_tokens=False)
    deltas, hit = stream(tok, out, stop=("END!",))
    assert hit is None and "".join(deltas) == "END there"
    detok = IncrementalDetokenizer(tok, [], stop=("END!",))
    assert detok.add(tok.encode("x E", add_special_tokens=False)) == ("x ", None)
    assert detok.flush() == "E"


def test_after_stop_nothing_more(tok):
    detok = IncrementalDetokenizer(tok, [], stop=("lo",))
    assert detok.add(tok.encode("hello", add_special_tokens=False)) == ("hel", "lo")
    assert detok.finished
    assert detok.add(tok.encode(" more", add_special_tokens=False)) == ("", None)
    assert detok.flush() == ""


def test_long_output_keeps_window_small(tok):
    piece = tok.encode("hello world 日本 ", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    text = ""
    for _ in range(200):
        for t in piece:
            text += detok.add([t])[0]
        assert len(detok._ids) < 300
    assert text + detok.flush() == "hello world 日本 " * 200


@pytest.mark.parametrize("cut", [1, 2])
def test_a_character_begun_in_a_token_id_prompt_is_emitted_when_the_output_completes_it(tok, cut):
    """A prompt given as token ids may end inside a character (byte-level tokens). The output token that
    completes it used to be swallowed: the delta was cut after the prompt's replacement character."""
    ids = tok.encode("price 😀 ok", add_special_tokens=False)
    start = next(i for i in range(len(ids)) if "\ufffd" in tok.decode(ids[:i + 1]))   # the emoji's first byte token
    prompt, out = ids[:start + cut], ids[start + cut:]
    assert tok.decode(prompt).endswith("\ufffd")
    deltas, _ = stream(tok, out, prompt)
    assert "".join(deltas) == "😀 ok"
