"""llama.cpp's figures beside an export's: llmd.export.llamacpp runs llama.cpp's own `llama-quantize` and
llmd's `llama-windows` (bench/llama_windows.cpp) on the gate's token windows. The real programs run where
bench/build_llama_server.sh has built them; the tests that need them are skipped with the reason otherwise."""
from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import pytest
import torch

from llmd.export import llamacpp, quality
from llmd.export.cli import ExportOptions, export_engine, format_summary
from llmd.runtime.models.loader import load_model

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "code-target"
TOOLS = llamacpp.find_tools()
needs_tools = pytest.mark.skipif(TOOLS is None, reason=f"llama.cpp's tools are not built ({llamacpp.BUILD_HINT})")


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from llmd.bench.to_gguf import convert
    return convert(MODEL, tmp_path_factory.mktemp("gguf") / "code-target.f32.gguf")


def windows(count=4, tokens=64):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 1000, (count, tokens), generator=g)


def test_find_tools_reads_the_folder_named_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "CHECKOUT_BIN", tmp_path / "absent")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("LLMD_LLAMA_CPP", str(tmp_path))
    assert llamacpp.find_tools() is None
    for name in llamacpp.PROGRAMS:
        (tmp_path / name).write_text("#!/bin/sh\nexit 1\n")
    assert llamacpp.find_tools() is None          # not executable: not a program
    for name in llamacpp.PROGRAMS:
        (tmp_path / name).chmod(stat.S_IRWXU)
    assert llamacpp.find_tools() == llamacpp.Tools(tmp_path / "llama-quantize", tmp_path / "llama-windows")


def test_export_says_why_llamacpp_was_not_compared(tmp_path, monkeypatch, f32_gguf):
    monkeypatch.setattr(llamacpp, "find_tools", lambda: None)
    s = export_engine(ExportOptions(str(MODEL), str(tmp_path / "e"), quant="int8", eval_windows=2, eval_tokens=32,
                                    compare_gguf=str(f32_gguf)))
    assert "build_llama_server.sh" in s["llamacpp"]["skipped"]
    assert "not compared: llama.cpp's tools were not found" in format_summary(s)
    off = export_engine(ExportOptions(str(MODEL), str(tmp_path / "f"), quant="int8", eval_windows=2, eval_tokens=32,
                                      compare_gguf=str(f32_gguf), llamacpp="off"))
    assert "llamacpp" not in off


@needs_tools
def test_llamacpp_windows_match_llmd_on_the_same_float_weights(f32_gguf):
    """The bundled target through llama.cpp (its GGUF holds the weights as F16) and llmd (float32): the
    windows line up token for token (a shifted or mis-read window would disagree almost everywhere)."""
    w = windows()
    ours = quality.predict(load_model(str(MODEL), "float32"), w)
    theirs = llamacpp.predict(TOOLS, f32_gguf, w, threads=1)
    assert theirs.nll.shape == ours.nll.shape and theirs.top1.shape == ours.top1.shape
    assert (theirs.top1 == ours.top1).float().mean().item() >= 0.97
    assert abs(theirs.nll.mean().item() - ours.nll.mean().item()) < 0.02
    assert math.isclose(math.exp(theirs.nll.mean().item()), math.exp(ours.nll.mean().item()), rel_tol=0.02)


@needs_tools
def test_llamacpp_rejects_ids_outside_its_vocabulary(f32_gguf):
    w = windows(1, 8)
    w[0, 3] = 10 ** 6
    with pytest.raises(llamacpp.LlamaCppError, match="outside the vocabulary"):
        llamacpp.predict(TOOLS, f32_gguf, w, threads=1)


@needs_tools
def test_export_prints_llamacpp_beside_its_own_figures(tmp_path, f32_gguf, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    s = export_engine(ExportOptions(str(MODEL), str(tmp_path / "e"), quant="int8", eval_windows=4, eval_tokens=64,
                                    compare_gguf=str(f32_gguf)))
    (row,) = s["llamacpp"]["rows"]
    assert row["format"] == "Q8_0" and Path(row["file"]).parent == tmp_path / "cache" / "llmd" / "llamacpp"
    # Q8_0 of float32 weights stays close to the float reference, as llmd's int8 does
    assert abs(row["ppl_increase"]) < 0.05 and row["top1_agreement"] > 0.9
    assert "llama.cpp Q8_0" in format_summary(s)
    mtime = os.stat(row["file"]).st_mtime_ns
    again = llamacpp.quantize(TOOLS, f32_gguf, "Q8_0")          # made once, then reused
    assert again == Path(row["file"]) and os.stat(again).st_mtime_ns == mtime
