"""A Hugging Face tokenizer (tokenizer.json, tokenizer_config.json, generation_config.json) built
from a GGUF file's `tokenizer.*` metadata with the `tokenizers` library.

Byte-level BPE (`tokenizer.ggml.model` = gpt2) is supported: the vocabulary, merges and token types
come from the file, and text is split before BPE the way the vocabulary was trained, as named by
`tokenizer.ggml.pre`. Control tokens (type 3) become special added tokens and user-defined ones
(type 4) plain added tokens, so both match whole.
"""
from __future__ import annotations

import json

from .gguf import GGUFFile

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# How text is cut into words before BPE, per `tokenizer.ggml.pre`.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
GPT2_STYLE = ("default", "gpt2", "gpt-2")                   # the byte-level regex alone
DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")        # each digit alone, then the byte-level regex


def tokenizer_files(f: GGUFFile) -> dict[str, str]:
    """{file name: JSON text} for tokenizer.json, tokenizer_config.json and generation_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    model = f.get("tokenizer.ggml.model", str)
    if model != "gpt2":
        f.fail("tokenizer.ggml.model", f"{model!r} is not supported (llmd imports byte-level BPE, 'gpt2')")
    tokens = f.get("tokenizer.ggml.tokens", list)
    types = f.get("tokenizer.ggml.token_type", list, [NORMAL] * len(tokens))
    merges = f.get("tokenizer.ggml.merges", list)
    if not tokens or len(types) != len(tokens):
        f.fail("tokenizer.ggml.token_type", f"{len(types)} types for {len(tokens)} tokens")
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        f.fail("tokenizer.ggml.merges", f"{bad!r} is not two tokens separated by one space")
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {t if set(t) <= letters else _byte_spelling(t, alphabet): i for i, t in enumerate(tokens)}
    try:
        tok = Tokenizer(models.BPE(vocab, pairs))
    except Exception as e:                       # tokenizers raises a bare Exception for a merge of unknown tokens
        f.fail("tokenizer.ggml.merges", f"not a valid BPE vocabulary: {e}")
    tok.pre_tokenizer = _pre_tokenizer(f)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL and set(t) <= letters])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])
    ids = {k: f.get(f"tokenizer.ggml.{k}_token_id", int, None) for k in ("bos", "eos", "eot", "padding", "unknown")}
    for key, value in ids.items():
        if value is not None and not 0 <= value < len(tokens):
            f.fail(f"tokenizer.ggml.{key}_token_id", f"{value} is not a token id (vocabulary of {len(tokens)})")
    add_bos = f.get("tokenizer.ggml.add_bos_token", bool, False) and ids["bos"] is not None
    if add_bos:
        bos = tokens[ids["bos"]]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, ids["bos"])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    name = lambda key: tokens[ids[key]] if ids[key] is not None else None     # noqa: E731
    config = {"add_bos_token": add_bos, "add_eos_token": False, "bos_token": name("bos"), "eos_token": name("eos"),
              "pad_token": name("padding"), "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    template = f.get("tokenizer.chat_template", str, None)
    if template is not None:
        config["chat_template"] = template
    eos = [i for i in dict.fromkeys((ids["eos"], ids["eot"])) if i is not None]
    generation = {"bos_token_id": ids["bos"], "eos_token_id": eos, "do_sample": False}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=1),
            "generation_config.json": json.dumps(generation, indent=1)}


def _pre_tokenizer(f: GGUFFile):
    from tokenizers import Regex, pre_tokenizers
    pre = f.get("tokenizer.ggml.pre", str, "default")
    if pre in SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in GPT2_STYLE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    known = sorted([*SPLITS, *GPT2_STYLE, *DIGITS_THEN_GPT2])
    f.fail("tokenizer.ggml.pre", f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(known)})")


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE spells each byte as one printable character: printable Latin-1 bytes as
    themselves, the others shifted past U+0100 in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


def _byte_spelling(token: str, alphabet: dict[int, str]) -> str:
    """A token outside the byte alphabet (a mislabelled added token with a real space, say) spelled
    byte by byte, so BPE can still reach it."""
    return "".join(alphabet[b] for b in token.encode("utf-8"))
