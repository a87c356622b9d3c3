"""bench/bench_engines.py: formats of one model side by side in one process."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import bench_engines  # noqa: E402

TARGET, DRAFT = REPO / "models" / "code-target", REPO / "models" / "code-draft"


@pytest.mark.heavy
@pytest.mark.slow     # the benchmark itself, on the bundled pair: `make bench` runs it
def test_every_engine_runs_each_round_and_ratios_are_to_the_first(capsys):
    assert bench_engines.main([str(TARGET), str(DRAFT), "--rounds", "2", "--gen", "6", "--prompt-len", "16",
                               "--kv-memory", "32MiB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["models"] == [str(TARGET), str(DRAFT)]
    assert [len(x) for x in r["rates"]] == [2, 2] and all(x > 0 for row in r["rates"] for x in row)
    assert r["ratios"][0] == [1.0, 1.0]
    assert r["ratios"][1] == pytest.approx([d / t for d, t in zip(r["rates"][1], r["rates"][0])])


@pytest.mark.parametrize("argv", [[str(TARGET)], [str(TARGET), str(DRAFT), "--gen", "1"],
                                  [str(TARGET), str(DRAFT), "--rounds", "0"],
                                  [str(TARGET), str(DRAFT), "--streams", "0"],
                                  [str(TARGET), str(DRAFT), "--streams", "4,x"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        bench_engines.main(argv)
    assert e.value.code == 2


@pytest.mark.heavy
@pytest.mark.slow     # the benchmark itself, on the bundled pair: `make bench` runs it
def test_the_collector_is_handed_back(capsys):
    import gc
    before = gc.get_freeze_count()
    bench_engines.main([str(TARGET), str(TARGET), "--rounds", "1", "--gen", "3", "--prompt-len", "8",
                        "--kv-memory", "32MiB"])
    assert gc.get_freeze_count() == before
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "x the first" in lines[1]


def test_settings_after_a_path_load_that_engine_with_them(monkeypatch):
    seen = []
    real = bench_engines.LLM

    def spy(model, **options):
        seen.append(options)
        return real(model, **options)
    monkeypatch.setattr(bench_engines, "LLM", spy)
    bench_engines.load(f"{TARGET}::head_screen=false,max_num_seqs=4", "32MiB")
    assert seen[-1] == {"draft": "none", "kv_memory": "32MiB", "head_screen": False, "max_num_seqs": 4}


@pytest.mark.heavy
@pytest.mark.slow     # the benchmark itself, on the bundled pair: `make bench` runs it
def test_streams_time_each_count_of_streams_decoding_together(capsys, monkeypatch):
    """--streams 1,3: one comparison per count; a count of N runs N prompts at once (every engine's
    steps hold N rows)."""
    rows = []
    real = bench_engines.concurrent

    def spy(llm, prompts, gen):
        rows.append(len(prompts))
        return real(llm, prompts, gen)
    monkeypatch.setattr(bench_engines, "concurrent", spy)
    assert bench_engines.main([str(TARGET), str(TARGET), "--rounds", "1", "--gen", "4", "--prompt-len", "8",
                               "--kv-memory", "32MiB", "--streams", "1,3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [x["streams"] for x in r] == [1, 3]
    assert all(len(x["rates"]) == 2 and all(v > 0 for row in x["rates"] for v in row) for x in r)
    assert rows and set(rows) == {3}            # the one-stream count times single streams


def test_fused_rows_caps_the_engines_fused_step():
    """fused_rows=3: four streams decode in the Python forward; the engine as loaded fuses them."""
    from llmd import SamplingParams
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for spec, fuses in ((f"{TARGET}::fused_rows=3", False), (str(TARGET), True)):
        llm = bench_engines.load(spec, "32MiB")
        fused = llm.engine.runner.model.fused_decode
        if fused is None:
            pytest.skip("no fused step here (llmd kernels unavailable)")
        llm.generate([[5, 6, 7], [8, 9], [10, 11, 12], [13]], params)
        assert (fused.steps > 0) == fuses


def test_f32_rows_keeps_float32_blocks_to_n_rows_with_a_onednn_copy():
    from llmd.runtime.kernels import ops
    from llmd.runtime.models.layers import Linear, can_pack
    if not can_pack(torch.float32):
        pytest.skip("oneDNN is not available in this torch build")
    from llmd.runtime import kernels
    if not kernels.available():
        pytest.skip("llmd kernels unavailable: no blocked weights")
    for path, f32_rows in ((DRAFT, None), (DRAFT, 16)):         # the bundled draft: float32 values
        spec = str(path) if f32_rows is None else f"{path}::f32_rows={f32_rows}"
        llm = bench_engines.load(spec, "32MiB")
        blocked = [m for m in llm.engine.runner.model.modules() if type(m) is Linear and m.plan.layout == "blocked"]
        assert blocked and all(m.stored.dtype == torch.float32 for m in blocked)
        assert all((m.packed is not None) == (f32_rows is not None) for m in blocked)
        fused = llm.engine.runner.model.fused_decode
        assert fused.max_rows == (16 if f32_rows else ops.fused_rows())
