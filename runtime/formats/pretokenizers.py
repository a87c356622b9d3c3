"""How byte-level BPE text is cut into words before merging, per GGUF `tokenizer.ggml.pre`.

Each pre-tokenizer is a list of regular expressions applied in turn: every piece left by the
previous ones is split again, each match and each stretch between matches becoming a piece of its
own. The words are then spelled in the byte alphabet and merged. The expressions are those the
vocabularies were trained with, in the form llama.cpp evaluates them, so that the two cut text the
same way (where llama.cpp rewrites an expression for its regex engine, its rewrite is used).

``ignore_merges``: a word that is a whole token is that token, before any merge (Llama 3 style).
``add_bos``: whether the tokenizer adds BOS when the file does not say (`add_bos_token` absent).
"""
from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# Upper case is "a letter but not a-z" and lower case "a letter but not A-Z", so a letter outside
# ASCII counts as both (llama.cpp's reading of Tekken's \p{Lu}/\p{Ll} classes).
TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Spaces outside ASCII never match a class of listed characters, only \s (as in llama.cpp, which
# reads them as a vertical tab there); hence "&&[^\s]".
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&[^\\s]]+"
# DeepSeek-LLM's letters: the cased letters of an older Unicode, listed range by range.
_CASED = ("A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
          "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
          "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
          "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
          "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
          "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
          "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
          "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
          "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
          "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
          "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
_WIDE_PUNCT = "!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002"


@dataclass(frozen=True)
class PreTokenizer:
    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_LLAMA3 = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2 = PreTokenizer((GPT2,))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", GPT2))
_QWEN2 = PreTokenizer((QWEN2,))

# "default" (or no `tokenizer.ggml.pre`) is GPT-2's split. llama.cpp's own converter writes a named
# pre-tokenizer for every byte-level vocabulary, so "default" comes from other writers, llmd's own
# GGUF writer among them, which mean GPT-2's; llama.cpp instead applies its fallback there
# (punctuation runs, then GPT-2, then digits in threes) and warns that quality degrades.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3, "falcon-h1": _LLAMA3,
    "pixtral": _LLAMA3, "midm-2.0": _LLAMA3, "lfm2": _LLAMA3,
    "dbrx": PreTokenizer((LLAMA3,)), "smaug-bpe": PreTokenizer((LLAMA3,)),
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "stablelm2": _QWEN2,
    "qwen35": PreTokenizer((QWEN35,)),
    "deepseek-llm": PreTokenizer(("[\r\n]", r"\s?[" + _CASED + "]+", r"\s?[" + _WIDE_PUNCT + r"&&[^\s]]+", r"\s+$",
                                  _CJK, r"\p{N}+")),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2, "command-r": _DIGITS_THEN_GPT2,
    "smollm": _DIGITS_THEN_GPT2, "codeshell": _DIGITS_THEN_GPT2,
    "gpt-2": _GPT2, "gpt2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "tekken": PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True),
}


def lookup(name: str) -> PreTokenizer | None:
    return PRE_TOKENIZERS.get(name)


def build(pre: PreTokenizer, missing: str = ""):
    """The `tokenizers` pre-tokenizer: the splits in order, then the byte-level spelling. ``missing``:
    the byte-level letters the vocabulary has no token for; each is cut out as a word of its own, so
    that it is dropped and the letters on either side of it never merge."""
    from tokenizers import Regex, pre_tokenizers
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    if missing:
        steps.append(pre_tokenizers.Split(Regex("[" + "".join(f"\\x{{{ord(c):x}}}" for c in missing) + "]"),
                                          behavior="isolated"))
    return pre_tokenizers.Sequence(steps)


def byte_alphabet() -> dict[int, str]:
    """Byte-level BPE spells each byte as one printable character: printable Latin-1 bytes as
    themselves, the others shifted past U+0100 in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table
