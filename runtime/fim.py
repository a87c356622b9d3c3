"""Fill-in-the-middle: which tokens a model marks the prefix, suffix and middle with, and how its
infill prompt is laid out.

The ids are taken, most trusted first, from:

1. the model's metadata: a GGUF file's ``tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id`` (or the
   older ``tokenizer.ggml.{prefix,suffix,middle}_token_id``), carried in tokenizer_config.json as
   ``fim_token_ids``; a Hugging Face directory's ``prefix_token`` / ``suffix_token`` / ``middle_token``;
2. the known spellings below, looked up among the tokenizer's special tokens only.

The family of the prefix token's spelling sets the layout (P prefix, S suffix, M the start of the
middle, already written; ``_`` a SentencePiece text without its leading space)::

    plain (Qwen, StarCoder, DeepSeek-Coder ...)   psm  [BOS] <pre> P <suf> S <mid> M
                                                  spm  [BOS] <suf> S <pre> P <mid> M
    codellama                                     psm  [BOS] <PRE> P <SUF> _S <MID> _M
                                                  spm  [BOS] <PRE> <SUF> _S <MID> P _M
    codestral (one order, no middle token)        any  [BOS] [SUFFIX] S [PREFIX] P _M

CodeLlama's tokens carry the space before them ("▁<PRE>"): written as text its prompt reads
``<PRE> P <SUF>S <MID>``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

from .errors import ModelLoadError

ROLES = ("prefix", "suffix", "middle", "pad", "repo", "file_sep")
STYLES = ("plain", "codellama", "codestral")
# GGUF metadata keys of each role: the current spelling, then the older one
GGUF_KEYS = {
    "prefix": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suffix": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "middle": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "pad": ("tokenizer.ggml.fim_pad_token_id",),
    "repo": ("tokenizer.ggml.fim_rep_token_id",),
    "file_sep": ("tokenizer.ggml.fim_sep_token_id",),
}
# tokenizer_config.json keys naming a role's token by its spelling (CodeLlama's tokenizer writes these)
CONFIG_NAMES = {"prefix": "prefix_token", "suffix": "suffix_token", "middle": "middle_token"}
CONFIG_IDS = "fim_token_ids"

# Known spellings of each role, most common first; the family decides the layout.
SPELLINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "plain": {
        "prefix": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<\uff5cfim\u2581begin\uff5c>", "<|code_prefix|>",
                   "<|prefix|>"),
        "suffix": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<\uff5cfim\u2581hole\uff5c>", "<|code_suffix|>",
                   "<|suffix|>"),
        "middle": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<\uff5cfim\u2581end\uff5c>", "<|code_middle|>",
                   "<|middle|>"),
        "pad": ("<|fim_pad|>", "<fim_pad>", "<fim-pad>"),
        "repo": ("<|repo_name|>", "<|fim_repo|>", "<reponame>", "<fim-repo>", "<repo_name>"),
        "file_sep": ("<|file_sep|>", "<file_sep>"),
    },
    "codellama": {"prefix": ("\u2581<PRE>", "<PRE>"), "suffix": ("\u2581<SUF>", "<SUF>"),
                  "middle": ("\u2581<MID>", "<MID>")},
    "codestral": {"prefix": ("[PREFIX]",), "suffix": ("[SUFFIX]",), "middle": ("[MIDDLE]",)},
}


def all_spellings(role: str) -> tuple[str, ...]:
    """Every known spelling of ``role``, over the families."""
    return tuple(s for family in SPELLINGS.values() for s in family.get(role, ()))


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle token ids (None where it has none) and its family's layout."""

    prefix: Optional[int] = None
    suffix: Optional[int] = None
    middle: Optional[int] = None
    pad: Optional[int] = None
    repo: Optional[int] = None
    file_sep: Optional[int] = None
    style: str = "plain"

    @property
    def can_infill(self) -> bool:
        return self.prefix is not None and self.suffix is not None and \
            (self.middle is not None or self.style == "codestral")

    def markers(self) -> dict[int, str]:
        """{id: role} of the tokens a prompt's text may write as markers."""
        return {i: r for r in ROLES if (i := getattr(self, r)) is not None}


def style_of(spelling: Optional[str]) -> str:
    """The family whose prefix token is spelled ``spelling``."""
    return next((s for s in ("codellama", "codestral") if spelling in SPELLINGS[s]["prefix"]), "plain")


def find_fim(config: dict, token_id: Callable[[str], Optional[int]], spelling: Callable[[int], Optional[str]],
             specials: frozenset[int], vocab_size: int, where: str) -> FimTokens:
    """The FIM tokens of a tokenizer: metadata first, then known spellings among ``specials``.
    ``where`` names tokenizer_config.json in errors."""
    by_id = config.get(CONFIG_IDS) or {}
    if not isinstance(by_id, dict) or any(r not in ROLES or not _is_id(i, vocab_size) for r, i in by_id.items()):
        raise ModelLoadError(f"{where}: {CONFIG_IDS} must map roles ({', '.join(ROLES)}) to token ids below "
                             f"{vocab_size}, got {by_id!r}")
    found = dict(by_id)
    for role, key in CONFIG_NAMES.items():
        name = config.get(key)
        if role not in found and isinstance(name, str) and (tid := token_id(name)) is not None:
            found[role] = tid
    prefix_spelling = spelling(found["prefix"]) if "prefix" in found else None
    style = style_of(prefix_spelling) if prefix_spelling else _style_by_names(token_id, specials)
    for role in ROLES:
        if role not in found:
            names = SPELLINGS[style].get(role, ()) + (SPELLINGS["plain"][role] if style != "plain" else ())
            found[role] = _first_special(names, token_id, specials)
    return FimTokens(style=style, **found)


def _is_id(value, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _first_special(names: Iterable[str], token_id, specials: frozenset[int]) -> Optional[int]:
    return next((i for n in names if (i := token_id(n)) is not None and i in specials), None)


def _style_by_names(token_id, specials: frozenset[int]) -> str:
    """The first family whose prefix token the tokenizer has among its special tokens."""
    for style in ("plain", "codellama", "codestral"):
        if _first_special(SPELLINGS[style]["prefix"], token_id, specials) is not None:
            return style
    return "plain"


# ---- prompt layout -----------------------------------------------------------------------------------
# A prompt is a list of parts: a token id, or (text, joined). A joined text continues what is before it:
# a SentencePiece tokenizer gives it no leading space.
Part = Union[int, tuple[str, bool]]


def layout(fim: FimTokens, prefix: str, suffix: str, middle: str, order: str) -> list[Part]:
    """The parts of an infill prompt (after BOS and extra files) in the model's family's layout."""
    pre, suf, mid = fim.prefix, fim.suffix, fim.middle
    tail: list[Part] = [(middle, True)] if middle else []
    if fim.style == "codestral":
        return [suf, (suffix, False), pre, (prefix, False), *tail]
    if fim.style == "codellama":
        if order == "spm":
            return [pre, suf, (suffix, True), mid, (prefix, False), *tail]
        return [pre, (prefix, False), suf, (suffix, True), mid, *tail]
    if order == "spm":
        return [suf, (suffix, False), pre, (prefix, False), mid, *tail]
    return [pre, (prefix, False), suf, (suffix, False), mid, *tail]


def marker_pattern(fim: FimTokens, spelling: Callable[[int], Optional[str]]) -> Optional[re.Pattern]:
    """A pattern that finds the model's FIM tokens written as text, or None where it has none. CodeLlama's
    "▁<PRE>" is found as "<PRE>" with the space before it, if any."""
    alternatives = []
    for tid in fim.markers():
        text = spelling(tid)
        if not text:
            continue
        if text.startswith("\u2581") and len(text) > 1:
            alternatives.append(" ?" + re.escape(text[1:]))
        alternatives.append(re.escape(text))
    if not alternatives:
        return None
    return re.compile("|".join(sorted(alternatives, key=len, reverse=True)))


def split_markers(text: str, fim: FimTokens, pattern: re.Pattern, token_id: Callable[[str], Optional[int]]
                  ) -> Optional[list[Part]]:
    """The parts of a prompt whose text writes FIM markers, or None where it writes none. Text after a
    middle marker continues the prompt (joined); so does every text of CodeLlama's, whose markers
    carry the spaces around them."""
    roles = fim.markers()
    parts: list[Part] = []
    last, joined = 0, False
    for m in pattern.finditer(text):
        if m.start() > last:
            parts.append((text[last:m.start()], joined))
        marker = m.group()
        tid = token_id(marker)
        if tid is None or tid not in roles:
            tid = token_id("\u2581" + marker.lstrip(" "))
        parts.append(tid)
        joined = fim.style == "codellama" or roles[tid] == "middle"
        last = m.end()
    if not parts:
        return None
    if last < len(text):
        parts.append((text[last:], joined))
    return parts
