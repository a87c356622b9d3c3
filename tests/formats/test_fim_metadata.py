"""Fill-in-the-middle tokens from a GGUF file's metadata, with names only as a fallback, and each known
family's infill prompt checked id for id against the format the family was trained on.

The files are llama.cpp's vocabulary-only GGUFs (DeepSeek-Coder, StarCoder2, Llama's SentencePiece),
rewritten by the `gguf` package's writer with the FIM keys and tokens each test needs (a CodeLlama or a
Codestral vocabulary is Llama's with its FIM tokens appended). References are built apart from
llmd's Tokenizer: the file's `tokenizers` tokenizer on the family's documented prompt text, or the
family's prompt assembled from its definition.
"""
from __future__ import annotations

import functools
import json

import pytest
from tokenizers import Tokenizer as HFTokenizer

from llamacpp_vocab import vocab_dir
from llmd.runtime import fim
from llmd.runtime.errors import InvalidRequest
from llmd.runtime.formats.gguf import open_gguf
from llmd.runtime.formats.gguf_check import GGUFError
from llmd.runtime.formats.gguf_tokenizer import CONTROL, NORMAL, tokenizer_files
from llmd.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.heavy          # llama.cpp's vocabulary files rewritten and built into tokenizers

PREFIX = "def mean(values):\n    \"\"\"Average.\"\"\"\n    total = "
SUFFIX = "\n    return total / len(values)\n"
CODELLAMA = ["\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>"]
CODESTRAL = ["[PREFIX]", "[SUFFIX]", "[MIDDLE]"]


@functools.cache
def _folder():
    return vocab_dir()


@pytest.fixture
def models():
    """The folder of llama.cpp's vocabulary files (fetched once where missing), or the test is skipped."""
    path, why = _folder()
    return path if path is not None else pytest.skip(why)


def rewrite(models, kind: str, out, extra: tuple[list[str], int] = ([], NORMAL), keys: dict | None = None):
    """llama.cpp's ``kind`` vocabulary as a new GGUF: ``extra`` tokens (spellings, type) appended, ``keys``
    (name: int) added; returns the path."""
    import gguf
    meta = {k: v for k, v in open_gguf(models / f"ggml-vocab-{kind}.gguf", reader=False).meta.items()
            if k.startswith("tokenizer.")}
    spellings, kind_of = extra
    grown = {"tokenizer.ggml.tokens": spellings, "tokenizer.ggml.token_type": [kind_of] * len(spellings),
             "tokenizer.ggml.scores": [0.0] * len(spellings)}
    w = gguf.GGUFWriter(str(out), "llama")
    for name, (vtype, value) in meta.items():
        if isinstance(value, list):
            w.add_array(name, value + grown.get(name, []))
        else:
            w.add_key_value(name, value, gguf.GGUFValueType(vtype))
    for name, value in (keys or {}).items():
        w.add_uint32(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def load(path):
    """(llmd's Tokenizer, the file's `tokenizers` tokenizer with special tokens parsed, the config JSON)."""
    files = tokenizer_files(open_gguf(path, reader=False))
    hf = HFTokenizer.from_str(files["tokenizer.json"])
    hf.encode_special_tokens = False
    return Tokenizer.from_texts(files, path), hf, json.loads(files["tokenizer_config.json"])


def vocab(models, kind: str):
    return load(models / f"ggml-vocab-{kind}.gguf")


def text_ids(hf: HFTokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def joined_ids(hf: HFTokenizer, text: str) -> list[int]:
    """SentencePiece ids of ``text`` without the leading space, the way CodeLlama's own code encodes a
    suffix: after a character that is no token (a byte, which merges with nothing), then dropped."""
    ids = text_ids(hf, "\n" + text)
    assert ids[:2] == [hf.token_to_id("\u2581"), hf.token_to_id("<0x0A>")]
    return ids[2:]


# ---- the families ----------------------------------------------------------------------------------

def test_deepseek_coder_by_its_spellings_gives_its_documented_prompt(models):
    tok, hf, _ = vocab(models, "deepseek-coder")
    assert (tok.fim.style, tok.can_infill) == ("plain", True)
    assert [hf.id_to_token(i) for i in (tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id)] == \
        ["<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"]
    text = f"<\uff5cfim\u2581begin\uff5c>{PREFIX}<\uff5cfim\u2581hole\uff5c>{SUFFIX}<\uff5cfim\u2581end\uff5c>"
    want = hf.encode(text, add_special_tokens=True).ids
    assert want[0] == tok.bos_token_id == 32013 and want[1] == 32016
    assert tok.build_infill(PREFIX, SUFFIX) == want


def test_starcoder2_by_its_spellings(models):
    tok, hf, _ = vocab(models, "starcoder")
    assert (tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id, tok.file_sep_id) == (1, 3, 2, 6)
    want = hf.encode(f"<file_sep>a.py\nx = 1\n<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>").ids
    assert tok.build_infill(PREFIX, SUFFIX, [("a.py", "x = 1")]) == want
    spm = hf.encode(f"<fim_suffix>{SUFFIX}<fim_prefix>{PREFIX}<fim_middle>").ids
    assert tok.build_infill(PREFIX, SUFFIX, layout="spm") == spm


@pytest.mark.parametrize("keys", [False, True], ids=["by-name", "by-metadata"])
def test_codellama_layout_spaces_the_prefix_and_joins_the_suffix(models, tmp_path, keys):
    meta = {"tokenizer.ggml.fim_pre_token_id": 32000, "tokenizer.ggml.fim_suf_token_id": 32001,
            "tokenizer.ggml.fim_mid_token_id": 32002} if keys else {}
    tok, hf, _ = load(rewrite(models, "llama-spm", tmp_path / "codellama.gguf", (CODELLAMA, NORMAL), meta))
    pre, suf, mid, eot = range(32000, 32004)
    assert (tok.fim.style, tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id) == ("codellama", pre, suf, mid)
    assert eot in tok.eos_token_ids                                     # an infill ends at <EOT>
    # "<PRE> {prefix} <SUF>{suffix} <MID>": the prefix with SentencePiece's leading space, the suffix without
    want = [1, pre] + text_ids(hf, PREFIX) + [suf] + joined_ids(hf, SUFFIX) + [mid]
    assert tok.build_infill(PREFIX, SUFFIX) == want
    # suffix first: "<PRE> <SUF>{suffix} <MID> {prefix}", and the middle already typed joins on
    typed = "if not"
    assert tok.build_infill(PREFIX, SUFFIX, layout="spm", middle=typed) == \
        [1, pre, suf] + joined_ids(hf, SUFFIX) + [mid] + text_ids(hf, PREFIX) + joined_ids(hf, typed)


def test_codestral_puts_the_suffix_first_without_a_middle_token(models, tmp_path):
    tok, hf, _ = load(rewrite(models, "llama-spm", tmp_path / "codestral.gguf", (CODESTRAL, CONTROL)))
    pre, suf = 32000, 32001
    assert (tok.fim.style, tok.fim_prefix_id, tok.fim_suffix_id) == ("codestral", pre, suf)
    want = [1, suf] + text_ids(hf, SUFFIX) + [pre] + text_ids(hf, PREFIX)
    assert tok.build_infill(PREFIX, SUFFIX) == tok.build_infill(PREFIX, SUFFIX, layout="spm") == want


# ---- metadata first --------------------------------------------------------------------------------

@pytest.mark.parametrize("names", [("fim_pre", "fim_suf", "fim_mid"), ("prefix", "suffix", "middle")],
                         ids=["current-keys", "older-keys"])
def test_metadata_wins_over_names(models, tmp_path, names):
    keys = {f"tokenizer.ggml.{n}_token_id": i for n, i in zip(names, (7, 8, 9))}     # <issue_start> ...
    tok, hf, config = load(rewrite(models, "starcoder", tmp_path / "sc.gguf", keys=keys))
    assert (tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id) == (7, 8, 9)
    assert tok.file_sep_id == 6                                          # a role the file leaves to names
    assert config["fim_token_ids"] == {"prefix": 7, "suffix": 8, "middle": 9}
    assert tok.build_infill("a", "b") == [7] + text_ids(hf, "a") + [8] + text_ids(hf, "b") + [9]


def test_metadata_names_tokens_of_any_spelling_and_makes_them_control(models, tmp_path):
    spelled = ["\u27e8P\u27e9", "\u27e8S\u27e9", "\u27e8M\u27e9", "\u27e8F\u27e9"]
    keys = {"tokenizer.ggml.fim_pre_token_id": 32000, "tokenizer.ggml.fim_suf_token_id": 32001,
            "tokenizer.ggml.fim_mid_token_id": 32002, "tokenizer.ggml.fim_sep_token_id": 32003}
    tok, hf, _ = load(rewrite(models, "llama-spm", tmp_path / "odd.gguf", (spelled, NORMAL), keys))
    assert (tok.fim.style, tok.fim_prefix_id, tok.file_sep_id) == ("plain", 32000, 32003)
    assert set(range(32000, 32004)) <= tok.special_token_ids
    assert not set(range(32000, 32004)) & set(tok.encode("".join(spelled)))     # text stays text
    assert tok.build_infill("x", "y") == [1, 32000] + text_ids(hf, "x") + [32001] + text_ids(hf, "y") + [32002]


def test_an_engine_directory_keeps_the_metadata(models, tmp_path):
    keys = {"tokenizer.ggml.fim_pre_token_id": 7, "tokenizer.ggml.fim_suf_token_id": 8,
            "tokenizer.ggml.fim_mid_token_id": 9}
    files = tokenizer_files(open_gguf(rewrite(models, "starcoder", tmp_path / "sc.gguf", keys=keys), reader=False))
    out = tmp_path / "engine"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    assert Tokenizer.from_dir(out).fim == Tokenizer.from_texts(files, out).fim == fim.FimTokens(7, 8, 9, 4, 5, 6)


def test_a_metadata_id_outside_the_vocabulary_is_refused(models, tmp_path):
    path = rewrite(models, "starcoder", tmp_path / "bad.gguf", keys={"tokenizer.ggml.fim_mid_token_id": 10 ** 6})
    with pytest.raises(GGUFError, match="fim_mid_token_id"):
        tokenizer_files(open_gguf(path, reader=False))


def test_a_vocabulary_without_fim_tokens_is_refused_for_infill(models):
    tok, _, _ = vocab(models, "llama-spm")
    assert not tok.can_infill and tok.encode_fim_markers("<PRE> a <SUF>b <MID>") is None
    with pytest.raises(InvalidRequest, match="fill-in-the-middle tokens.*DeepSeek-Coder, CodeLlama"):
        tok.build_infill("a", "b")


def test_extra_files_need_a_file_separator(models):
    tok, _, _ = vocab(models, "deepseek-coder")
    with pytest.raises(InvalidRequest, match="file separator"):
        tok.build_infill("a", "b", [("x.py", "1")])


# ---- markers written in a prompt's text ------------------------------------------------------------

def test_deepseek_markers_in_text_give_the_infill_prompt(models):
    tok, _, _ = vocab(models, "deepseek-coder")
    text = f"<\uff5cfim\u2581begin\uff5c>{PREFIX}<\uff5cfim\u2581hole\uff5c>{SUFFIX}<\uff5cfim\u2581end\uff5c>"
    assert tok.encode_fim_markers(text) == tok.build_infill(PREFIX, SUFFIX)
    # only FIM markers are read: the end-of-sentence spelling stays text
    ids = tok.encode_fim_markers(text + "<\uff5cend\u2581of\u2581sentence\uff5c>")
    assert 32014 not in ids and ids[:len(tok.build_infill(PREFIX, SUFFIX))] == tok.build_infill(PREFIX, SUFFIX)


def test_codellama_markers_in_text_give_the_infill_prompt(models, tmp_path):
    tok, _, _ = load(rewrite(models, "llama-spm", tmp_path / "codellama.gguf", (CODELLAMA, NORMAL)))
    want = tok.build_infill(PREFIX, SUFFIX)
    assert tok.encode_fim_markers(f"<PRE> {PREFIX} <SUF>{SUFFIX} <MID>") == want         # as editors write it
    assert tok.encode_fim_markers(f"\u2581<PRE> {PREFIX}\u2581<SUF>{SUFFIX}\u2581<MID>") == want   # as spelled
    assert tok.encode_fim_markers("PRE and MID") is None


def test_starcoder_markers_in_text_in_either_order_with_files(models):
    tok, _, _ = vocab(models, "starcoder")
    files = [("a.py", "x = 1\n")]
    assert tok.encode_fim_markers(f"<file_sep>a.py\nx = 1\n<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>") \
        == tok.build_infill(PREFIX, SUFFIX, files)
    assert tok.encode_fim_markers(f"<fim_suffix>{SUFFIX}<fim_prefix>{PREFIX}<fim_middle>if x") == \
        tok.build_infill(PREFIX, SUFFIX, layout="spm", middle="if x")
