"""A SentencePiece vocabulary (GGUF `tokenizer.ggml.model` = llama) as a `tokenizers` BPE model.

SentencePiece's BPE tokenizes a text as follows: spaces become U+2581 ("▁"), one is put in front
when `add_space_prefix` is set, and the text starts as one symbol per character. Then, as long as
two neighbouring symbols spell a token, the pair whose token has the highest score is merged (the
leftmost among equals). A character that is no token is spelled as its UTF-8 bytes, tokens
``<0x00>`` .. ``<0xFF>`` (byte fallback).

That is a BPE whose merges are every split of every token into two tokens, ranked by the token's
score, with byte fallback. The text between two added tokens is tokenized alone, and gets its own
leading "▁", as SentencePiece does after a control or user-defined token.

Decoding turns "▁" back into spaces, joins byte tokens into characters and drops the one leading
space the prefix added.
"""
from __future__ import annotations

SPACE = "\u2581"


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a token, both parts tokens, best score first.
    Among equal scores the lower token id comes first."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, token in enumerate(tokens):
        if ids.get(token) != i:
            continue                         # a duplicate spelling: the last id wins, as in lookups
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], i, cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def spm_model(tokens: list[str], scores: list[float], unknown: str | None, add_space_prefix: bool):
    """A `tokenizers.Tokenizer` with the vocabulary, merges, normalizer and decoder; added tokens and
    the post-processor are the caller's."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, spm_merges(tokens, scores), unk_token=unknown, byte_fallback=True))
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok
