"""int4 by the model's widths and the data: the group size chosen from the widths and measured quality,
and the activation-aware scale search, which leaves the float function as it was."""
import pytest
import torch

from llmd.export import awq
from llmd.export.cli import ExportOptions, export_engine, format_summary
from llmd.export.group_size import choose_group_size, dividing
from llmd.runtime.formats.manifest import read_manifest
from llmd.export.quality import predict
from llmd.runtime.formats.quantized import QuantizationError, QuantSpec
from llmd.runtime.models.loader import load_model


@pytest.fixture(scope="module")
def source(model_factory):
    return model_factory("int4-src", hidden=64, intermediate=128, layers=2)


def windows(n=4, t=24, seed=0):
    return torch.randint(1, 300, (n, t), generator=torch.Generator().manual_seed(seed))


def test_only_group_sizes_dividing_every_width_are_candidates(model_factory, source):
    assert dividing(load_model(source)) == [64, 32]
    odd = load_model(model_factory("odd", hidden=96, intermediate=160, layers=1, heads=3, kv_heads=1))
    assert dividing(odd) == [32]
    with pytest.raises(QuantizationError, match="divides every input width"):
        dividing(load_model(model_factory("none", hidden=80, intermediate=144, layers=1, heads=5, kv_heads=1)))


def test_the_largest_group_within_the_budget_is_chosen_and_else_the_best():
    measured = {128: (3.0, 95.0), 64: (1.0, 97.0), 32: (0.5, 98.0)}
    assert choose_group_size(measured, 1e9, 0) == 128                 # anything passes: the largest
    assert choose_group_size(measured, 2.0, 96.0) == 64
    assert choose_group_size(measured, -1.0, 101) == 32               # nothing passes: the smallest rise
    assert choose_group_size({64: (2.0, 90.0), 32: (4.0, 99.0)}, -1.0, 101) == 64


@pytest.mark.heavy
def test_an_export_measures_every_dividing_group_in_one_pass(source, tmp_path):
    """Every candidate is rounded and measured on the calibration text in the one pass over the layers;
    the manifest records them all, and the budget picks among them."""
    s = export_engine(ExportOptions(str(source), str(tmp_path / "e"), quant="int4", eval_windows=2, eval_tokens=32,
                                    max_ppl_increase=1e9, min_top1_agreement=0, accept_loss=True))
    tried = s["int4_calibration"]["tried"]
    assert sorted(tried) == ["32", "64"] and s["quantization"]["group_size"] == 64
    assert all(t["top1_pct"] > 0 for t in tried.values())
    assert sorted(p.name for p in (tmp_path / "e" / "target").glob("weights*")) == ["weights.safetensors"]


def test_the_scale_search_keeps_the_float_function(source, monkeypatch):
    """Scales folded into norms and producer rows change nothing in float (clipping, which does,
    is switched off here)."""
    monkeypatch.setattr(awq, "CLIPS", (1.0,))
    model, w = load_model(source), windows()
    before = model.forward_dense(w)
    with torch.no_grad():
        awq.apply_awq(model, w, 32, False)
    assert torch.allclose(model.forward_dense(w), before, atol=1e-4, rtol=1e-4)


@pytest.mark.heavy
def test_an_int4_export_records_the_chosen_group_size(source, tmp_path):
    s = export_engine(ExportOptions(str(source), str(tmp_path / "e"), quant="int4", eval_windows=2, eval_tokens=32,
                                    accept_loss=True))
    m = read_manifest(tmp_path / "e")
    assert m["quantization"]["group_size"] == s["quantization"]["group_size"] in (32, 64)
    assert m["int4_calibration"]["chosen"] and m["int4_calibration"]["scale_search"]
    assert "int4 groups" in format_summary(s) and "chosen on calibration text" in format_summary(s)
