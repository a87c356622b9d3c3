"""GGUF import: a tiny model written as GGUF in the test, imported back exactly; refusals name the
field and the file; hostile files (truncated, lying counts and offsets, bad UTF-8, unknown types,
random mutations) give a GGUFError within bounded memory."""
from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file

from llmd.bench.to_gguf import convert
from llmd.export.gguf_engine import import_engine
from llmd.runtime.errors import ModelLoadError
from llmd.runtime.formats.gguf_check import GGUFError
from llmd.runtime.formats.gguf_import import import_gguf, imported_dir
from llmd.runtime.tokenizer import Tokenizer

from gguf_hostile import hostile
from modelfactory import CORPUS, make_model_dir


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("gguf") / "src", seed=3, tie=False)


@pytest.fixture(scope="module")
def gguf_file(source, tmp_path_factory):
    return convert(source, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def imported(gguf_file, tmp_path_factory):
    return import_gguf(gguf_file, tmp_path_factory.mktemp("gguf") / "imported", progress=False)


def test_float32_import_restores_every_tensor_exactly(source, imported):
    want, got = load_file(str(source / "model.safetensors")), load_file(str(imported / "model.safetensors"))
    assert set(got) == set(want)
    for name in want:          # q and k rows went through llama.cpp's order and back
        assert torch.equal(got[name], want[name].float()), name
    cfg, src = json.loads((imported / "config.json").read_text()), json.loads((source / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "intermediate_size", "tie_word_embeddings"):
        assert cfg[key] == src[key], key


def test_imported_tokenizer_encodes_like_the_source(source, imported):
    a, b = Tokenizer.from_dir(source), Tokenizer.from_dir(imported)
    for text in CORPUS + ["<|fim_prefix|>x<|endoftext|>", "  \n\t 12345 ünï 🙂"]:
        assert b.encode(text) == a.encode(text)
        assert b.encode(text, allow_special=True) == a.encode(text, allow_special=True)


def test_greedy_text_of_the_import_equals_the_source(source, imported):
    from llmd import LLM, SamplingParams
    params = SamplingParams(max_tokens=12)
    want = LLM(str(source), kv_memory="16MiB").generate(CORPUS[:2], params)
    got = LLM(str(imported), kv_memory="16MiB").generate(CORPUS[:2], params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_quantized_blocks_dequantize_to_the_quantized_values(source, tmp_path):
    import gguf
    path = convert(source, tmp_path / "q8.gguf", quant="q8_0")
    out = import_gguf(path, tmp_path / "q8", progress=False)
    got, want = load_file(str(out / "model.safetensors")), load_file(str(source / "model.safetensors"))
    w = want["model.layers.0.mlp.up_proj.weight"].numpy()
    expect = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                    gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got["model.layers.0.mlp.up_proj.weight"].numpy(), expect)


def test_model_path_may_be_a_gguf_file(gguf_file, imported, tmp_path, monkeypatch):
    from llmd import LLM, SamplingParams
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = imported_dir(gguf_file, progress=False)
    assert first.parent == tmp_path / "llmd" / "gguf"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    a = LLM(str(gguf_file), kv_memory="16MiB").generate(["def f"], SamplingParams(max_tokens=6))[0]
    b = LLM(str(imported), kv_memory="16MiB").generate(["def f"], SamplingParams(max_tokens=6))[0]
    assert a.token_ids == b.token_ids
    assert imported_dir(gguf_file, progress=False) == first          # imported once
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.heavy
def test_import_cli(gguf_file, tmp_path, capsys):
    from llmd.cli import main
    assert main(["import", str(gguf_file), "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert main(["import", str(gguf_file), "--out", str(tmp_path / "m")]) == 2     # not empty
    assert "not empty" in capsys.readouterr().err


# ---- refusals and hostile files --------------------------------------------------------------------

def _write(path: Path, arch: str = "llama", tokenizer_model: str = "gpt2", pre: Optional[str] = "default") -> Path:
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.add_tensor("token_embd.weight", np.zeros((3, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kwargs, field, named", [
    ({"arch": "gpt2"}, "general.architecture", "gpt2"),
    ({"tokenizer_model": "t5"}, "tokenizer.ggml.model", "'t5'"),
    ({"pre": "mystery-bpe"}, "tokenizer.ggml.pre", "'mystery-bpe'"),
    ({"tokenizer_model": "llama", "pre": None}, "tokenizer.ggml.scores", "SentencePiece")])
def test_unsupported_things_are_refused_with_field_name_and_file(tmp_path, kwargs, field, named):
    from llmd.runtime.formats.gguf import open_gguf
    from llmd.runtime.formats.gguf_tokenizer import tokenizer_files
    path = _write(tmp_path / "x.gguf", **kwargs)
    with pytest.raises(GGUFError) as e:
        f = open_gguf(path)
        tokenizer_files(f) if field.startswith("tokenizer") else import_gguf(path, tmp_path / "out")
    assert field in str(e.value) and named in str(e.value) and str(path) in str(e.value)


def _import_bounded(path: Path, out: Path, keep_blocks: bool = False) -> None:
    """Import ``path`` (as floats, or keeping its blocks in an engine directory); assert that Python's
    allocations stayed under 64 MiB meanwhile."""
    tracemalloc.start()
    try:
        if keep_blocks:
            import_engine(path, out, progress=False)
        else:
            import_gguf(path, out, progress=False)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 64 << 20, f"peak {peak} bytes"


@pytest.mark.parametrize("keep_blocks", [False, True])
def test_hostile_files_give_typed_errors(gguf_file, quantized_gguf, tmp_path, keep_blocks):
    for name, data in hostile((quantized_gguf if keep_blocks else gguf_file).read_bytes()).items():
        path = tmp_path / "hostile.gguf"
        path.write_bytes(data)
        with pytest.raises(GGUFError) as e:
            _import_bounded(path, tmp_path / name, keep_blocks)
        assert str(path) in str(e.value), name


@pytest.fixture(scope="module")
def quantized_gguf(source, tmp_path_factory):
    """The tiny model with its matrices in blocks llmd keeps (Q4_1, Q8_0, Q5_0)."""
    return convert(source, tmp_path_factory.mktemp("gguf") / "tiny-q.gguf",
                   quant={"*": "q4_1", "token_embd": "q8_0", "ffn_down": "q5_0"})


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """A smaller real GGUF (one layer, narrow), so each fuzz example is quick."""
    src = make_model_dir(tmp_path_factory.mktemp("fuzz") / "src", hidden=32, layers=1, heads=2, kv_heads=1,
                         intermediate=32)
    return convert(src, tmp_path_factory.mktemp("fuzz") / "small.gguf")


@pytest.fixture(scope="module")
def small_quantized_gguf(tmp_path_factory):
    src = make_model_dir(tmp_path_factory.mktemp("fuzz") / "src", hidden=32, layers=1, heads=2, kv_heads=1,
                         intermediate=32)
    return convert(src, tmp_path_factory.mktemp("fuzz") / "small-q.gguf", quant={"*": "q4_1", "ffn_up": "q8_0"})


FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=120, **FUZZ)
@given(data=st.data())
def test_fuzzed_files_import_or_fail_typed(small_gguf, tmp_path_factory, data):
    _fuzz_once(small_gguf, tmp_path_factory, data, keep_blocks=False)


@settings(max_examples=60, **FUZZ)
@given(data=st.data())
def test_fuzzed_files_keep_blocks_or_fail_typed(small_quantized_gguf, tmp_path_factory, data):
    _fuzz_once(small_quantized_gguf, tmp_path_factory, data, keep_blocks=True)


def _fuzz_once(small_gguf: Path, tmp_path_factory, data, keep_blocks: bool) -> None:
    blob = bytearray(small_gguf.read_bytes())
    header = min(len(blob), 4096)
    for _ in range(data.draw(st.integers(1, 8))):
        if not blob:
            break
        kind = data.draw(st.sampled_from(["byte", "word", "cut", "insert"]))
        at = data.draw(st.integers(0, header - 1))
        if kind == "byte":
            blob[at] = data.draw(st.integers(0, 255))
        elif kind == "word":
            blob[at:at + 8] = struct.pack("<Q", data.draw(st.sampled_from([0, 1, 255, 1 << 31, 1 << 32, 1 << 63,
                                                                           (1 << 64) - 1])))
        elif kind == "cut":
            del blob[data.draw(st.integers(0, len(blob) - 1)):]
        else:
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        if len(blob) < header:
            header = max(len(blob), 1)
    tmp = tmp_path_factory.mktemp("fz")
    path = tmp / "m.gguf"
    path.write_bytes(bytes(blob))
    try:
        _import_bounded(path, tmp / "out", keep_blocks)
    except ModelLoadError:
        pass
