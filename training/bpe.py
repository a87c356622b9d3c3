"""Train the demo models' byte-level BPE tokenizer and write it as a Hugging Face tokenizer.

Byte-level: every string round-trips, whatever its characters. The control tokens take the first
ids, in the order of ``corpus.SPECIAL_TOKENS``, so ``<|endoftext|>`` is id 0.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .corpus import EOT, SPECIAL_TOKENS, Piece, SourceFile, read_source

MODEL_MAX_LENGTH = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:{% endif %}")


def train_bpe(files: list[SourceFile], vocab_size: int = 8192) -> Tokenizer:
    """Deterministic for a file list: the tokenizers BPE trainer breaks ties by pair order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read_source(f) for f in files), trainer=trainer, length=len(files))
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    """tokenizer.json plus a tokenizer_config.json that declares every control token."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    decoder = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                                         "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != EOT],
        "bos_token": EOT, "eos_token": EOT, "pad_token": EOT, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def text_encoder(tok: Tokenizer) -> Tokenizer:
    """A copy that treats control-token spellings in text as plain text."""
    enc = Tokenizer.from_str(tok.to_str())
    enc.encode_special_tokens = True
    return enc


def encode_pieces(tok: Tokenizer, pieces: Iterable[Piece], batch: int = 2048) -> np.ndarray:
    """One token stream (uint16, or uint32 for a vocabulary past 65,536 ids): text parts encoded as
    text, control tokens by id."""
    enc = text_encoder(tok)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    out: list[np.ndarray] = []
    pending: list[tuple[bool, str]] = []

    def flush():
        texts = [t for c, t in pending if not c]
        encoded = iter(enc.encode_batch(texts, add_special_tokens=False))
        for control, text in pending:
            out.append(np.array([ids[text]] if control else next(encoded).ids, dtype=dtype))
        pending.clear()

    for piece in pieces:
        pending.extend(piece.parts)
        if len(pending) >= batch:
            flush()
    flush()
    return np.concatenate(out) if out else np.zeros(0, dtype=dtype)
