"""`llmd bench --against llama-bench | llamacpp-server | llamacpp-quality`: flags, llama-bench's output, the closed loop,
and (slow) both against the real llama.cpp binaries on a GGUF of the bundled code model."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from llmd.bench import cli, load_test
from llmd.bench.llama_bench import LlamaBenchError, decode_command, parse_decode
from llmd.bench.llama_server import CACHE
from llmd.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "code-target"


def bench_row(**over) -> dict:
    row = {"n_prompt": 0, "n_gen": 64, "n_depth": 128, "n_threads": 2, "type_k": "f16", "type_v": "f16",
           "model_type": "llama 135M Q8_0", "samples_ts": [171.5], "avg_ts": 171.5}
    row.update(over)
    return row


def test_parse_decode_reads_the_one_sample():
    r = parse_decode(json.dumps([bench_row()]))
    assert r["decode_tok_s"] == 171.5 and r["tokens"] == 64 and r["depth"] == 128 and r["kv"] == "f16/f16"


@pytest.mark.parametrize("text, message", [
    ("not json", "no JSON"),
    (json.dumps([]), "expected one"),
    (json.dumps([bench_row(), bench_row()]), "expected one"),
    (json.dumps([bench_row(n_prompt=128, n_gen=0)]), "not a decode test"),
    (json.dumps([bench_row(samples_ts=[1.0, 2.0])]), "one positive sample"),
    (json.dumps([bench_row(samples_ts=[0.0])]), "one positive sample"),
])
def test_parse_decode_refuses_other_output(text, message):
    with pytest.raises(LlamaBenchError, match=message):
        parse_decode(text)


def test_decode_command_times_decode_after_a_context_once():
    cmd = decode_command("/bin/llama-bench", "m.gguf", threads=2, depth=128, gen=64)
    args = dict(zip(cmd[1::2], cmd[2::2]))
    assert args == {"-m": "m.gguf", "-p": "0", "-n": "64", "-d": "128", "-t": "2", "-r": "1", "-o": "json"}
    with pytest.raises(ValueError):
        decode_command("b", "m.gguf", threads=2, depth=128, gen=0)


def bench_args(*argv):
    return build_parser().parse_args(["bench", *argv])


@pytest.mark.parametrize("argv, message", [
    (["m.gguf", "--against", "llamacpp-server,hf"], "give it alone"),
    (["m.gguf", "--against", "llamacpp-server", "--workload", "batch"], "without --workload"),
    (["m.gguf", "--against", "llama-bench", "--workload", "batch"], "does not run --workload"),
    (["m.gguf", "--against", "hf", "--bandwidth"], "add --against llama-bench"),
    (["m.gguf", "--against", "llamacpp-server", "--sweep", "1,x"], "integers"),
    (["m.gguf", "--against", "llamacpp-server", "--sweep", "0,4"], "between 1 and 256"),
    (["m.gguf", "--against", "llamacpp-server", "--requests-per-client", "0"], "requests_per_client must be"),
    (["m.gguf", "--against", "llama-bench", "--gen", "1"], "--gen of at least 2"),
    (["e", "--against", "llamacpp-quality,llama-bench"], "give it alone"),
    (["e", "--against", "llamacpp-quality", "--workload", "batch"], "without --workload"),
    (["--against", "llamacpp-quality"], "give it as MODEL"),
])
def test_bad_flags_are_refused_with_the_reason(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(cli, "resolve_model_path", lambda path, dtype: str(path))   # m.gguf does not exist
    assert cli.run_bench(bench_args(*argv)) == 2
    assert message in capsys.readouterr().err


def test_the_llama_gguf_is_the_model_file_or_asked_for(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert cli.llama_gguf(bench_args(str(gguf)), "/cache/import") == str(gguf)
    engine = tmp_path / "engine"
    engine.mkdir()
    with pytest.raises(cli.BenchArgumentError, match="--llama-gguf"):
        cli.llama_gguf(bench_args(str(engine)), str(engine))
    assert cli.llama_gguf(bench_args(str(engine), "--llama-gguf", str(gguf)), str(engine)) == str(gguf)
    with pytest.raises(cli.BenchArgumentError, match="no such file"):
        cli.llama_gguf(bench_args(str(engine), "--llama-gguf", str(tmp_path / "absent.gguf")), str(engine))


def test_llama_bench_summary_compares_best_and_median():
    singles = [{"decode_tok_s": x} for x in (100.0, 120.0, 90.0)]
    llamas = [{"decode_tok_s": x, "kv": "f16/f16", "model_type": "t"} for x in (80.0, 60.0, 100.0)]
    s = cli.llama_bench_summary(singles, llamas, "m.gguf")
    assert s["ratio_best"] == pytest.approx(1.2) and s["ratio_median"] == pytest.approx(100 / 80)


def test_bandwidth_summary_is_each_rounds_share_of_the_reading_before_it():
    singles = [{"decode_tok_s": x} for x in (100.0, 50.0, 80.0)]
    llamas = [{"decode_tok_s": x} for x in (90.0, 45.0, 60.0)]
    readings = {"llmd": [40e9, 20e9, 40e9], "llama": [36e9, 18e9, 30e9]}
    s = cli.bandwidth_summary(singles, llamas, readings, llmd_bytes=300_000_000, llama_bytes=400_000_000)
    assert s["llmd_shares"] == [0.75, 0.75, 0.6] and s["llmd_share"] == pytest.approx(0.75)
    assert s["llama_shares"] == [1.0, 1.0, 0.8] and s["llama_share"] == pytest.approx(1.0)
    # 1.25x llama.cpp's median rate (60 tok/s) at llmd's 300 MB a token
    assert s["needed_for_1_25x_gb_s"] == pytest.approx(22.5) and s["best_reading_gb_s"] == pytest.approx(40.0)


def test_decode_bytes_counts_the_fused_steps_weights_once():
    from llmd.runtime.llm import LLM
    llm = LLM(str(MODEL), draft="none")
    fused = llm.engine.runner.model.fused_decode
    if fused is None:
        pytest.skip("llmd's kernels are not built here: no fused step to count")
    stored = sum(p.stat().st_size for p in MODEL.glob("*.safetensors"))     # float32, tied head
    n = cli.decode_bytes(llm, "unused.gguf")
    # the step reads the layers' products and the head (the tied table, once): about the stored weights
    assert 0.9 * stored < n < 1.01 * stored


def test_decode_bytes_counts_the_head_screens_reads_where_it_ran():
    from types import SimpleNamespace

    import torch

    from llmd.runtime import kernels
    from llmd.runtime.formats.head_screen import HeadScreen
    from llmd.runtime.formats.quantized import Int8GroupLinear
    if not kernels.available():
        pytest.skip("llmd's kernels are not built here: no head screen")
    head = Int8GroupLinear(256, 5000)
    head.load_weight(torch.randn(5000, 256) * 0.02)
    head.prepare()
    screen = HeadScreen.build(head, torch.ones(256))
    model = SimpleNamespace(fused_decode=SimpleNamespace(weight_bytes=lambda: 10_000_000), head_screen=screen)
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(model=model)))
    assert cli.decode_bytes(llm, "unused.gguf") == 10_000_000          # nothing screened yet: the whole head
    screen.stats.rows, screen.stats.candidates = 4, 400                  # 100 exact rows a screened row
    row = 256 + 4 * (256 // 64)                                          # int8 values and float32 scales
    want = 10_000_000 - head._kernel_form.data.numel() + screen.nbytes() + 100 * row
    assert cli.decode_bytes(llm, "unused.gguf") == pytest.approx(want)


def test_load_config_bounds_and_request_counts():
    cfg = load_test.LoadConfig(levels=(1, 4, 16), requests_per_client=3, min_requests=8)
    assert [cfg.requests(n) for n in cfg.levels] == [8, 12, 48] and cfg.slots == 16
    for bad in ({"levels": ()}, {"levels": (0,)}, {"gen": 0}, {"repeat": 0}):
        with pytest.raises(ValueError):
            load_test.LoadConfig(**bad)


class FakeServer:
    """Answers after a short sleep and records how many requests were in flight at once."""
    name = "fake"

    def __init__(self):
        self.in_flight = self.most = 0
        self.seen: list[tuple] = []

    async def complete(self, ids, gen):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        self.seen.append(tuple(ids))
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return gen


@pytest.mark.parametrize("clients", [1, 3])
def test_closed_loop_sends_each_prompt_once_with_n_clients(clients):
    prompts = [[i, i + 1] for i in range(7)]
    server = FakeServer()
    tokens, wall, latencies = asyncio.run(load_test.closed_loop(server, prompts, clients, 5))
    assert sorted(server.seen) == sorted(map(tuple, prompts))
    assert server.most == clients and tokens == 35 and len(latencies) == 7
    assert all(0.005 < x <= wall for x in latencies)


def test_rounds_merge_and_the_goal_needs_twice_the_rate_and_no_worse_p95():
    merged = load_test.merge_rounds([(64, 1.0, [0.5, 1.0]), (64, 1.0, [0.6, 2.0])])
    assert merged["tok_s"] == 64 and merged["requests"] == 4 and merged["latency_p95_s"] == 2.0
    peer = load_test.level_summary([1.0, 2.0], 64, 2.0)
    assert load_test.compare(merged, peer)["goal_met"] is True           # 2x the rate, p95 equal: met
    fast = load_test.level_summary([0.4, 1.0], 128, 1.0)
    assert load_test.compare(fast, peer) == {"tok_s": 4.0, "latency_p50_s": 0.4, "latency_p95_s": 0.5,
                                             "goal_met": True}
    slow_tail = load_test.level_summary([0.4, 3.0], 128, 1.0)
    assert load_test.compare(slow_tail, peer)["goal_met"] is False


def test_llama_server_requests_and_answers():
    body = load_test.completion_body([5, 6, 7], 64)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 64 and body["ignore_eos"] is True
    assert body["stream"] is False and body["temperature"] == 0.0
    assert load_test.predicted_tokens({"tokens_predicted": 64}) == 64
    assert load_test.predicted_tokens({"timings": {"predicted_n": 63}}) == 63
    with pytest.raises(RuntimeError, match="no token count"):
        load_test.predicted_tokens({"content": "x"})


def test_daemon_flags_follow_the_engine_settings():
    flags = load_test.daemon_flags({"dtype": "bfloat16", "prefix_cache": False, "threads": 2, "draft": None})
    assert flags == ["--dtype", "bfloat16", "--no-prefix-cache", "--threads", "2"]


def test_heldout_prompts_are_distinct_windows_of_the_length():
    from llmd.runtime.tokenizer import Tokenizer
    prompts = load_test.heldout_prompts(Tokenizer.from_dir(MODEL), 12, 40, seed=0)
    assert len(prompts) == 12 and all(len(p) == 40 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 12


# --- the real binaries (slow) ---

LLAMA_SERVER = CACHE / "bin" / "llama-server"
LLAMA_BENCH = CACHE / "build" / "bin" / "llama-bench"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from llmd.bench.to_gguf import convert
    return convert(MODEL, tmp_path_factory.mktemp("gguf") / "code-target.gguf")


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason=f"llama-server is not built at {LLAMA_SERVER}: run "
                    "bench/build_llama_server.sh")
def test_load_test_runs_the_daemon_and_llama_server(tiny_gguf, capsys):
    t0 = time.monotonic()
    assert cli.run_bench(bench_args(str(MODEL), "--against", "llamacpp-server", "--llama-gguf", str(tiny_gguf),
                                    "--sweep", "1,2", "--requests-per-client", "1", "--threads", "1",
                                    "--prompt-len", "24", "--gen", "6", "--repeat", "1", "--json")) == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res["levels"]) == ["1", "2"]
    for level in res["levels"].values():
        for name in ("llmd", "llama.cpp"):
            # min_requests of 8 per level, every one answered with all its tokens
            assert level[name]["requests"] == 8 and level[name]["tokens"] == 48, (name, level)
            assert 0 < level[name]["latency_p50_s"] <= level[name]["latency_p95_s"] < time.monotonic() - t0
        assert level["llmd/llama.cpp"]["tok_s"] == pytest.approx(level["llmd"]["tok_s"] / level["llama.cpp"]["tok_s"])


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_BENCH.exists(), reason=f"llama-bench is not built at {LLAMA_BENCH}")
def test_one_stream_against_llama_bench(tiny_gguf, capsys):
    assert cli.run_bench(bench_args(str(MODEL), "--against", "llama-bench", "--llama-gguf", str(tiny_gguf),
                                    "--concurrency", "0", "--shared-prefix", "0", "--prompt-len", "16", "--gen", "5",
                                    "--repeat", "2", "--threads", "1", "--draft", "none", "--json")) == 0
    res = json.loads(capsys.readouterr().out)
    b = res["llama_bench"]
    assert len(b["llama_runs"]) == 2 and len(b["llmd_runs"]) == 2 and min(b["llama_runs"]) > 0
    assert b["ratio_best"] == pytest.approx(b["llmd_best"] / b["llama_best"])
    assert "llmd_concurrent" not in res
