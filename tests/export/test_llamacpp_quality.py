"""llama.cpp's quality beside an engine's: `llmd bench ENGINE --against llamacpp-quality`
(llmd.bench.llama_quality) runs llama.cpp's own `llama-quantize` and llmd's `llama-windows`
(bench/llama_windows.cpp) on the export's quality-gate windows, against the export's float reference.
`llmd export` itself runs nothing of llama.cpp. The real programs run where bench/build_llama_server.sh
has built them; the tests that need them are skipped with the reason otherwise."""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch

from llmd.bench import cli, llama_quality
from llmd.cli import build_parser
from llmd.export import quality
from llmd.export.cli import ExportOptions, export_engine
from llmd.export.stream import float_reference, open_source
from llmd.runtime.models.loader import load_model

pytestmark = pytest.mark.heavy          # exports

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "code-target"
TOOLS = llama_quality.find_tools()
needs_tools = pytest.mark.skipif(TOOLS is None, reason=f"llama.cpp's tools are not built ({llama_quality.BUILD_HINT})")


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from llmd.bench.to_gguf import convert
    return convert(MODEL, tmp_path_factory.mktemp("gguf") / "code-target.f32.gguf")


@pytest.fixture(scope="module")
def int8_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "int8"
    export_engine(ExportOptions(str(MODEL), str(out), quant="int8", eval_windows=3, eval_tokens=48))
    return out


def windows(count=4, tokens=64):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 1000, (count, tokens), generator=g)


def bench(*argv):
    return cli.run_bench(build_parser().parse_args(["bench", *argv]))


def test_export_has_no_llamacpp_flags_and_points_to_bench(capsys):
    assert not {"compare_gguf", "llamacpp"} & set(ExportOptions.__dataclass_fields__)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--compare-gguf" not in text and "--llamacpp" not in text
    assert "llmd bench OUT --against llamacpp-quality" in text


def test_find_tools_reads_the_folder_named_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_quality, "CHECKOUT_BIN", tmp_path / "absent")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("LLMD_LLAMA_CPP", str(tmp_path))
    assert llama_quality.find_tools() is None
    for name in llama_quality.PROGRAMS:
        (tmp_path / name).write_text("#!/bin/sh\nexit 1\n")
    assert llama_quality.find_tools() is None          # not executable: not a program
    for name in llama_quality.PROGRAMS:
        (tmp_path / name).chmod(stat.S_IRWXU)
    assert llama_quality.find_tools() == llama_quality.Tools(tmp_path / "llama-quantize", tmp_path / "llama-windows")


def test_the_float_reference_is_the_gates_own(int8_engine):
    """float_reference repeats the reference the export's gate measured against, number for number."""
    manifest = json.loads((int8_engine / "manifest.json").read_text())
    gate = manifest["quality"]["gate"]
    assert (gate["eval_file"], gate["eval_windows"], gate["eval_tokens"]) == (None, 3, 48)
    source = open_source(MODEL)
    w = quality.token_windows(source.tokenizer(), quality.heldout_texts()[0], 48, 3)
    ref = float_reference(source, w)
    assert quality.perplexity(ref.nll) == manifest["quality"]["ppl_reference"]
    whole = quality.predict(load_model(str(MODEL), "float32"), w)      # the model whole, not a layer at a time
    assert (whole.top1 == ref.top1).float().mean().item() > 0.99
    assert torch.allclose(whole.nll, ref.nll, atol=1e-3)


def test_comparison_says_what_it_needs(int8_engine, tmp_path, monkeypatch, capsys):
    assert bench(str(int8_engine), "--against", "llamacpp-quality") == 2      # exported from a directory
    assert "give a GGUF of the same model with --llama-gguf" in capsys.readouterr().err
    assert bench(str(int8_engine), "--against", "llamacpp-quality", "--llama-gguf", str(tmp_path / "x.gguf")) == 2
    assert "x.gguf: no such file" in capsys.readouterr().err
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(llama_quality, "find_tools", lambda: None)
    assert bench(str(int8_engine), "--against", "llamacpp-quality", "--llama-gguf", str(tmp_path / "m.gguf")) == 2
    assert "build_llama_server.sh" in capsys.readouterr().err
    assert bench(str(tmp_path), "--against", "llamacpp-quality") == 2
    assert "not an llmd engine directory" in capsys.readouterr().err


def test_an_unquantized_engine_has_nothing_to_compare(tmp_path, capsys):
    out = tmp_path / "none"
    export_engine(ExportOptions(str(MODEL), str(out), quant="none", eval_windows=2, eval_tokens=32))
    assert bench(str(out), "--against", "llamacpp-quality") == 2
    assert "holds none weights" in capsys.readouterr().err


@needs_tools
def test_llamacpp_windows_match_llmd_on_the_same_float_weights(f32_gguf):
    """The bundled target through llama.cpp (its GGUF holds the weights as F16) and llmd (float32): the
    windows line up token for token (a shifted or mis-read window would disagree almost everywhere)."""
    w = windows()
    ours = quality.predict(load_model(str(MODEL), "float32"), w)
    theirs = llama_quality.predict(TOOLS, f32_gguf, w, threads=1)
    assert theirs.nll.shape == ours.nll.shape and theirs.top1.shape == ours.top1.shape
    assert (theirs.top1 == ours.top1).float().mean().item() >= 0.97
    assert abs(theirs.nll.mean().item() - ours.nll.mean().item()) < 0.02
    assert math.isclose(math.exp(theirs.nll.mean().item()), math.exp(ours.nll.mean().item()), rel_tol=0.02)


@needs_tools
def test_llamacpp_rejects_ids_outside_its_vocabulary(f32_gguf):
    w = windows(1, 8)
    w[0, 3] = 10 ** 6
    with pytest.raises(llama_quality.LlamaCppError, match="outside the vocabulary"):
        llama_quality.predict(TOOLS, f32_gguf, w, threads=1)


@needs_tools
def test_bench_sets_llamacpp_beside_the_engines_own_figures(int8_engine, f32_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert bench(str(int8_engine), "--against", "llamacpp-quality", "--llama-gguf", str(f32_gguf), "--threads", "1",
                 "--json", "--out", str(tmp_path / "q")) == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "q.json").read_text()) == res
    mine, theirs = res["rows"]
    # llmd's row is what the export's gate printed: the same windows, the same float reference
    gate = json.loads((int8_engine / "manifest.json").read_text())["quality"]
    assert mine["engine"] == "llmd int8" and (res["windows"], res["tokens"]) == (3, 48)
    for key in ("ppl_reference", "ppl_quantized", "top1_agreement", "num_tokens", "measured_on"):
        assert mine[key] == gate[key], key
    assert theirs["engine"] == "llama.cpp Q8_0" and theirs["ppl_reference"] == gate["ppl_reference"]
    assert Path(theirs["file"]).parent == tmp_path / "cache" / "llmd" / "llamacpp"
    # Q8_0 of float32 weights stays close to the float reference, as llmd's int8 does
    assert abs(theirs["ppl_increase"]) < 0.05 and theirs["top1_agreement"] > 0.9
    assert "| llama.cpp Q8_0 |" in llama_quality.table(res)
    mtime = os.stat(theirs["file"]).st_mtime_ns
    again = llama_quality.quantize(TOOLS, f32_gguf, "Q8_0")          # made once, then reused
    assert again == Path(theirs["file"]) and os.stat(again).st_mtime_ns == mtime
