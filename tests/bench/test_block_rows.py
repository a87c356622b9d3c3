"""The block-product benchmark: a real child process per library, its table and its refusals."""
from __future__ import annotations

import pytest

from llmd.bench import block_rows
from llmd.runtime import kernels

pytestmark = pytest.mark.heavy          # child processes that build or load the kernel library


def test_each_library_runs_in_its_own_process_and_the_table_gives_ratios(capsys):
    if not kernels.available():
        pytest.skip(kernels.why())
    libs = ["avx512", "avx2"] if kernels.variant() == "avx512" else ["avx2"]      # an AVX2 host has one
    assert block_rows.main(["--types", "Q8_0,Q4_K", "--rows", "1,9", "--libraries", ",".join(libs), "--n", "16",
                            "--k", "256", "--reps", "1", "--rounds", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "16 x 256" in lines[0]
    peak = lines[1].startswith("int8 peak of this host: ")        # where a C compiler builds it
    cells = [line.split() for line in lines[2 + peak:]]
    assert [(c[0], c[1]) for c in cells] == [("Q8_0", "1"), ("Q8_0", "9"), ("Q4_K", "1"), ("Q4_K", "9")]
    for c in cells:
        assert len(c) == 2 + len(libs) + len(libs) - 1 + 1 + peak
        ms = [float(v) for v in c[2:2 + len(libs)]]
        assert all(v > 0 for v in ms) and all(v.endswith("x") for v in c[2 + len(libs):1 + 2 * len(libs)])
        # the rate from the printed milliseconds (rounded to a microsecond: a loose match)
        assert float(c[1 + 2 * len(libs)]) == pytest.approx(2 * 16 * 256 * int(c[1]) / ms[0] / 1e6, rel=0.35, abs=1)


def test_the_table_divides_by_the_first_library_and_gives_its_rate():
    lines = block_rows.table({"avx512": {"Q8_0": {4: 0.002}}, "avx2": {"Q8_0": {4: 0.005}}}, ["Q8_0"], [4],
                             8960, 1536)
    assert lines[1].split() == ["Q8_0", "4", "2.000", "5.000", "2.50x", "55"]         # 2 x 8960 x 1536 x 4 / 2 ms
    lines = block_rows.table({"avx2": {"Q8_0": {4: 0.002}}}, ["Q8_0"], [4], 8960, 1536, peak=110.1)
    assert lines[0].split()[-2:] == ["of", "peak"] and lines[1].split()[-2:] == ["55", "50%"]


def test_the_int8_peak_is_measured_on_this_host():
    got = block_rows.int8_peak(1, seconds=0.2)
    if got is None:
        pytest.skip("no C compiler built bench/int8_peak.c")
    form, rate = got
    assert form in ("vpdpbusd", "vpmaddubsw") and rate > 1.0


@pytest.mark.parametrize("args", [["--types", "Q9_K"], ["--rows", "0"], ["--rows", "a"], ["--libraries", "sse"],
                                  ["--n", "12"], ["--k", "100"],
                                  ["--libraries", "avx2,avx2"]])
def test_bad_arguments_are_refused(args):
    with pytest.raises(SystemExit) as e:
        block_rows.main(args)
    assert e.value.code == 2
