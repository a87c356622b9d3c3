"""A Hugging Face tokenizer (tokenizer.json, tokenizer_config.json, generation_config.json) built
from a GGUF file's `tokenizer.*` metadata with the `tokenizers` library.

Two kinds of `tokenizer.ggml.model` are read:

- ``gpt2``, byte-level BPE: the vocabulary and merges come from the file, and text is cut into words
  before BPE the way the vocabulary was trained, as named by `tokenizer.ggml.pre`
  (pretokenizers.py);
- ``llama``, SentencePiece BPE: merges by token score, byte fallback and the leading "▁"
  (spm_tokenizer.py).

Token types (`tokenizer.ggml.token_type`): control (3) and unknown (2) tokens become special added
tokens, user-defined ones (4) plain added tokens, so that each matches whole in text; byte tokens
(6) spell the bytes of SentencePiece's fallback. BOS and EOS are added as `add_bos_token` and
`add_eos_token` say, and otherwise as each kind does by default.

The fill-in-the-middle tokens the file names (`tokenizer.ggml.fim_*_token_id`, runtime/fim.py) are
control tokens whatever their type, and go to tokenizer_config.json as `fim_token_ids`.
"""
from __future__ import annotations

import json

from .. import fim
from . import pretokenizers
from .gguf import GGUFFile
from .spm_tokenizer import spm_model

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODELS = ("gpt2", "llama")
_RSTRIP_NAMES = ("phi-3", "phi3")       # models whose special tokens swallow the spaces after them
# Spellings that are control tokens whatever type the file gives them (some files type them normal or
# user-defined): those that end a turn or the text, always; the fill-in-the-middle ones where the file
# names no token of their role.
END_NAMES = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|calls|>", "<|flush|>",
    "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<turn|>", "<|tool_response>", "<EOT>",
    "_<EOT>", "\u2581<EOT>", "[EOT]", "[EOS]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
    "[e~["})
# Where an infill ends, for a file that names no end-of-turn token: CodeLlama's.
INFILL_ENDS = ("\u2581<EOT>", "<EOT>")
# Control tokens by spelling where the file names no token of the role: every known FIM spelling, and a
# few more that llama.cpp treats so.
FIM_NAMES = {role: fim.all_spellings(role) + extra for role, extra in
             (("prefix", ()), ("suffix", ()), ("middle", ()), ("pad", ("<PAD>", "[PAD]")), ("repo", ("<REPO>",)),
              ("file_sep", ()))}


def tokenizer_files(f: GGUFFile) -> dict[str, str]:
    """{file name: JSON text} for tokenizer.json, tokenizer_config.json and generation_config.json."""
    from tokenizers import processors
    model = f.get("tokenizer.ggml.model", str)
    if model not in MODELS:
        f.fail("tokenizer.ggml.model", f"tokenizer model {model!r} is not supported (llmd reads byte-level BPE, "
               "'gpt2', and SentencePiece, 'llama')")
    tokens = f.get("tokenizer.ggml.tokens", list)
    types = f.get("tokenizer.ggml.token_type", list, [NORMAL] * len(tokens))
    if not tokens or len(types) != len(tokens):
        f.fail("tokenizer.ggml.token_type", f"{len(types)} types for {len(tokens)} tokens")
    tok, add_bos_default = _spm(f, tokens) if model == "llama" else _byte_level(f, tokens)
    fim_ids = fim_token_ids(f, len(tokens))
    _add_tokens(f, tok, tokens, types, fim_ids)
    ids = _special_ids(f, len(tokens))
    if ids["eot"] is None:
        ids["eot"] = next((i for i, t in enumerate(tokens) if t in INFILL_ENDS), None)
    add_bos = f.get("tokenizer.ggml.add_bos_token", bool, add_bos_default) and ids["bos"] is not None
    add_eos = f.get("tokenizer.ggml.add_eos_token", bool, False) and ids["eos"] is not None
    if add_bos or add_eos:
        tok.post_processor = _template(tokens, ids, add_bos, add_eos)
    elif model == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    name = lambda key: tokens[ids[key]] if ids[key] is not None else None     # noqa: E731
    config = {"add_bos_token": add_bos, "add_eos_token": add_eos, "bos_token": name("bos"), "eos_token": name("eos"),
              "pad_token": name("padding"), "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    if fim_ids:
        config[fim.CONFIG_IDS] = fim_ids
    template = f.get("tokenizer.chat_template", str, None)
    if template is not None:
        config["chat_template"] = template
    ends = (ids["eos"], ids["eot"], *_generation_ends(tokens, types, fim_ids))
    eos = [i for i in dict.fromkeys(ends) if i is not None]
    generation = {"bos_token_id": ids["bos"], "eos_token_id": eos, "do_sample": False}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=1),
            "generation_config.json": json.dumps(generation, indent=1)}


def _generation_ends(tokens: list[str], types: list[int], fim_ids: dict[str, int]) -> list[int]:
    """Control tokens that end generation besides EOS: the end-of-turn and end-of-text spellings, and
    the FIM tokens that pad a file or start another (a Qwen-coder instruct model, whose EOS is
    <|im_end|>, ends an infill with <|endoftext|>). A plain token of such a spelling ("</s>", an HTML
    tag in a byte-level vocabulary) is text."""
    names = END_NAMES.union(*(fim.all_spellings(r) for r in ("pad", "repo", "file_sep") if r not in fim_ids))
    ends = [i for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL and t in names]
    return ends + [fim_ids[r] for r in ("pad", "repo", "file_sep") if r in fim_ids]


def _byte_level(f: GGUFFile, tokens: list[str]):
    """(tokenizer, whether BOS is added by default). Every token keeps its spelling in the file: one
    outside the byte alphabet (an added token with a real space, say) is matched whole in text and
    never made by a merge."""
    from tokenizers import Tokenizer, decoders, models
    pre = f.get("tokenizer.ggml.pre", str, "default")
    spec = pretokenizers.lookup(pre)
    if spec is None:
        f.fail("tokenizer.ggml.pre", f"pre-tokenizer {pre!r} is not supported (supported: "
               f"{', '.join(sorted(pretokenizers.PRE_TOKENIZERS))})")
    merges = f.get("tokenizer.ggml.merges", list)
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        f.fail("tokenizer.ggml.merges", f"{bad!r} is not two tokens separated by one space")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [p for p in pairs if p[0] + p[1] in vocab]      # a merge into no token cannot apply
    try:
        tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=spec.ignore_merges))
    except Exception as e:                       # tokenizers raises a bare Exception for a merge of unknown tokens
        f.fail("tokenizer.ggml.merges", f"not a valid BPE vocabulary: {e}")
    missing = "".join(c for c in pretokenizers.byte_alphabet().values() if c not in vocab)
    tok.pre_tokenizer = pretokenizers.build(spec, missing)
    tok.decoder = decoders.ByteLevel()
    return tok, spec.add_bos


def _spm(f: GGUFFile, tokens: list[str]):
    """(tokenizer, True: SentencePiece adds BOS unless the file says not to)."""
    if not f.has("tokenizer.ggml.scores"):
        f.fail("tokenizer.ggml.scores", "missing: a SentencePiece vocabulary (tokenizer.ggml.model 'llama') "
               "merges by token score")
    scores = f.get("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens):
        f.fail("tokenizer.ggml.scores", f"{len(scores)} scores for {len(tokens)} tokens")
    unknown = f.get("tokenizer.ggml.unknown_token_id", int, None)
    unk = tokens[unknown] if unknown is not None and 0 <= unknown < len(tokens) else None
    add_space = f.get("tokenizer.ggml.add_space_prefix", bool, True)
    return spm_model(tokens, [float(s) for s in scores], unk, add_space), True


def fim_token_ids(f: GGUFFile, n: int) -> dict[str, int]:
    """{role: id} of the fill-in-the-middle tokens the file names (the current key of a role first)."""
    found = {}
    for role, keys in fim.GGUF_KEYS.items():
        key = next((k for k in keys if f.has(k)), None)
        if key is None:
            continue
        value = f.get(key, int)
        if not 0 <= value < n:
            f.fail(key, f"{value} is not a token id (vocabulary of {n})")
        found[role] = value
    return found


def _add_tokens(f: GGUFFile, tok, tokens: list[str], types: list[int], fim_ids: dict[str, int]) -> None:
    """Control and unknown tokens (and the spellings above, and the FIM tokens the file names) as
    special added tokens, user-defined ones as plain added tokens."""
    from tokenizers import AddedToken
    rstrip = any(n in f.get("general.name", str, "").lower() for n in _RSTRIP_NAMES)
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    control = END_NAMES.union(*(names for role, names in FIM_NAMES.items() if role not in fim_ids),
                              (tokens[i] for i in fim_ids.values()))
    special = [AddedToken(t, special=True, normalized=False, rstrip=rstrip and t not in keep)
               for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN) or t in control]
    plain = [AddedToken(t, special=False, normalized=False, rstrip=rstrip)
             for t, k in zip(tokens, types) if k == USER_DEFINED and t not in control]
    tok.add_special_tokens(special)
    tok.add_tokens(plain)


def _special_ids(f: GGUFFile, n: int) -> dict:
    ids = {k: f.get(f"tokenizer.ggml.{k}_token_id", int, None) for k in ("bos", "eos", "eot", "padding", "unknown")}
    for key, value in ids.items():
        if value is not None and not 0 <= value < n:
            f.fail(f"tokenizer.ggml.{key}_token_id", f"{value} is not a token id (vocabulary of {n})")
    return ids


def _template(tokens: list[str], ids: dict, add_bos: bool, add_eos: bool):
    from tokenizers import processors
    bos, eos = (tokens[ids[k]] if ids[k] is not None else None for k in ("bos", "eos"))
    head, tail = (f"{bos} " if add_bos else ""), (f" {eos}" if add_eos else "")
    used = [(t, ids[k]) for t, k, on in ((bos, "bos", add_bos), (eos, "eos", add_eos)) if on]
    return processors.TemplateProcessing(single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B{tail}",
                                         special_tokens=list(dict(used).items()))
