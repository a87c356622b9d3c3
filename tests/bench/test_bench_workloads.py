"""Bench workloads are seeded and shaped as documented; a short run reports every workload for llmd and
every available peer (a missing one is named, never faked), and writes a complete JSON and a PNG."""
from __future__ import annotations

import importlib.util

import pytest

from llmd.bench.workloads import WORKLOADS, Scale, build

SHORT = Scale.named("short")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from llmd.runtime.tokenizer import Tokenizer
    return Tokenizer.from_dir(tiny_model_dir)


def lcp(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("name", WORKLOADS)
def test_seeded_and_rebuildable(tok, name):
    a, b = build(name, tok, seed=3, scale=SHORT), build(name, tok, seed=3, scale=SHORT)
    assert a == b and len(a.requests) >= 3
    assert build(name, tok, seed=4, scale=SHORT) != a
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    assert len({r.rid for r in a.requests}) == len(a.requests)


def test_completion_is_fim_over_heldout_files_with_shared_prefixes(tok):
    from llmd.training.corpus import is_heldout
    wl = build("completion", tok, scale=Scale(requests=6, sessions=2, prompt_chars=400, max_tokens=8))
    fim_prefix = tok.token_id("<|fim_prefix|>")
    assert all(r.prompt_ids[0] == fim_prefix for r in wl.requests)
    sessions: dict = {}
    for r in wl.requests:
        sessions.setdefault(r.rid.rsplit("-", 1)[0], []).append(r)
    for reqs in sessions.values():
        for a, b in zip(reqs, reqs[1:]):          # a keystroke later, the prompt keeps the earlier one's prefix
            assert lcp(a.prompt_ids, b.prompt_ids) >= len(a.prompt_ids) // 2
            assert b.arrival_s > a.arrival_s
    import random
    from llmd.bench.workloads import heldout_texts
    assert all(is_heldout(rel) for rel, _ in heldout_texts(random.Random(0), 5, 1000))


def test_stamped_prompts_differ_early_then_share(tok):
    wl = build("stamped", tok, scale=SHORT)
    p = [r.prompt_ids for r in wl.requests]
    assert max(lcp(a, b) for a, b in zip(p, p[1:])) < 40
    assert "2025-03-14" in tok.decode(list(p[0][:60]))
    voice = build("voice", tok, scale=SHORT).requests
    assert min(lcp(a.prompt_ids, b.prompt_ids) for a, b in zip(voice, voice[1:])) > 100


def test_batch_all_at_start_and_edit_copies(tok):
    assert {r.arrival_s for r in build("batch", tok, scale=SHORT).requests} == {0.0}
    for r in build("edit", tok, scale=SHORT).requests:
        text = tok.decode(list(r.prompt_ids))
        assert text.count("```python\n") == 2 and r.max_tokens == SHORT.max_tokens


def test_mixed_holds_all_three_kinds_at_the_given_rate(tok):
    wl = build("mixed", tok, scale=Scale(requests=30, prompt_chars=200, max_tokens=4, sessions=2), rate=20.0)
    assert {r.kind for r in wl.requests} == {"voice", "completion", "batch"}
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(wl.requests, wl.requests[1:])]
    mean = sum(gaps) / len(gaps)
    assert 0.5 / 20 < mean < 2 / 20
    with pytest.raises(ValueError):
        build("mixed", tok, rate=0)


def test_unknown_workload(tok):
    with pytest.raises(ValueError, match="unknown workload"):
        build("nope", tok)


def test_short_bench_is_complete(tiny_model_dir, tmp_path):
    from llmd.bench.report import read_json, write_json, write_png
    from llmd.bench.runner import BenchConfig, run
    cfg = BenchConfig(model=str(tiny_model_dir), workloads=WORKLOADS, peers=("hf", "llamacpp"), scale="short",
                      concurrency=(1, 2), sweep_prompt=16, sweep_gen=4, engine={"kv_memory": "64MiB"})
    res = run(cfg, log=lambda m: None)
    for peer, module in (("hf", "transformers"), ("llamacpp", "llama_cpp")):
        if importlib.util.find_spec(module) is None:
            assert module in res["peers"][peer]["missing"]
    available = [p for p, s in res["peers"].items() if s == "ok"]
    assert "llmd" in available and ("hf" in available) == (importlib.util.find_spec("transformers") is not None)
    assert set(res["workloads"]) == set(WORKLOADS)
    for name, w in res["workloads"].items():
        assert set(w["peers"]) == set(available), name
        for peer, s in w["peers"].items():
            assert s["completed"] == s["requests"] == w["requests"], (name, peer)
            assert s["output_tokens"] == sum(r.max_tokens for r in build(name, _tok(tiny_model_dir), scale=SHORT).requests)
            for key in ("ttft_s", "itl_s", "e2e_s"):
                assert all(v is not None and v >= 0 for v in s[key].values()), (name, peer, key)
            assert s["ttft_s"]["p50"] <= s["e2e_s"]["p50"] and s["tokens_per_s"] > 0
            if name in ("voice", "stamped"):
                assert s["first_sentence_s"]["p50"] > 0
        assert set(w["ratios"]) == set(available) - {"llmd"}
        assert w["evidence"]["prefix"]["prefix_tokens_queried"] > 0
    assert set(res["concurrency"]) == set(available)
    assert all(set(c) == {"1", "2"} and all(v > 0 for v in c.values()) for c in res["concurrency"].values())
    assert read_json(write_json(res, tmp_path / "b.json")) == res
    if importlib.util.find_spec("matplotlib"):
        png = write_png(res, tmp_path / "b.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _tok(model_dir):
    from llmd.runtime.tokenizer import Tokenizer
    return Tokenizer.from_dir(model_dir)


@pytest.mark.heavy
def test_gguf_conversion_gives_llama_cpp_the_same_logits(tiny_model_dir, tmp_path):
    """llama.cpp on the converted file against transformers on the source: the same next-token logits
    (up to float rounding) at every position; a wrong rotary row order is off by ~10%."""
    pytest.importorskip("gguf")
    llama_cpp = pytest.importorskip("llama_cpp")
    transformers = pytest.importorskip("transformers")
    import numpy as np
    import torch
    from llmd.bench.to_gguf import convert
    prompt = [(7 * j) % 200 + 20 for j in range(24)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    cpp = llama_cpp.Llama(model_path=str(convert(tiny_model_dir, tmp_path / "m.gguf")), n_ctx=256, logits_all=True,
                          verbose=False, n_threads=1)
    cpp.eval(prompt)
    got = np.array(cpp.scores[:len(prompt)])
    centred = lambda x: x - x.mean(-1, keepdims=True)     # noqa: E731  (logits are defined up to a constant)
    assert np.abs(centred(ref) - centred(got)).max() < 1e-2 * np.abs(centred(ref)).max()


@pytest.mark.heavy
def test_daemon_peer_replays_the_workload(tiny_model_dir, tmp_path):
    from daemon_fixtures import daemon_settings, running_daemon
    from llmd.bench.runner import BenchConfig, run
    settings = daemon_settings(tiny_model_dir, tmp_path)
    cfg = BenchConfig(model=str(tiny_model_dir), workloads=("mixed",), peers=("daemon",), scale="short",
                      concurrency=(2,), sweep_prompt=16, sweep_gen=4, engine={"kv_memory": "64MiB"},
                      socket=settings.socket)
    with running_daemon(settings):
        res = run(cfg, log=lambda m: None)
    assert res["peers"]["llmd-daemon"] == "ok"
    w = res["workloads"]["mixed"]
    d, me = w["peers"]["llmd-daemon"], w["peers"]["llmd"]
    assert d["completed"] == d["requests"] == w["requests"] and d["output_tokens"] == me["output_tokens"]
    assert d["ttft_s"]["p50"] > 0 and "tokens_per_s" in w["ratios"]["llmd-daemon"]
    assert res["concurrency"]["llmd-daemon"]["2"] > 0


def test_missing_daemon_is_reported_missing(tiny_model_dir, tmp_path):
    from llmd.bench.runner import BenchConfig, run
    cfg = BenchConfig(model=str(tiny_model_dir), workloads=("batch",), peers=("daemon", "nope"), scale="short",
                      concurrency=(1,), sweep_prompt=8, sweep_gen=2, socket=str(tmp_path / "none.sock"))
    res = run(cfg, log=lambda m: None)
    assert "no usable llmd daemon" in res["peers"]["daemon"]["missing"]
    assert "unknown peer" in res["peers"]["nope"]["missing"]
    assert set(res["workloads"]["batch"]["peers"]) == {"llmd"}


def test_bench_cli_workload_and_classic_modes(tiny_model_dir, tmp_path, capsys):
    import argparse
    import json
    from llmd.bench.cli import add_bench_parser
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    base = ["bench", str(tiny_model_dir), "--kv-memory", "32MiB"]
    args = parser.parse_args(base + ["--workload", "batch", "--scale", "short", "--sweep", "1", "--json",
                                     "--out", str(tmp_path / "r")])
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res["workloads"]) == ["batch"] and (tmp_path / "r.json").exists()
    args = parser.parse_args(base + ["--workload", "batch,typing"])
    assert args.func(args) == 2 and "unknown workload typing" in capsys.readouterr().err
    args = parser.parse_args(base + ["--prompt-len", "16", "--gen", "4", "--concurrency", "2", "--shared-prefix", "32",
                                     "--repeat", "1", "--json"])
    assert args.func(args) == 0                      # without --workload: the single-stream/concurrency/prefix report
    res = json.loads(capsys.readouterr().out)
    assert res["llmd_single"]["tokens"] == 4 and res["llmd_concurrent"]["streams"] == 2


@pytest.mark.heavy
def test_shape_bench_compares_decode_with_decode(capsys):
    """`llmd bench --shape tiny`: the concurrent figure it sets against one stream's decode tok/s is
    measured with the prompts cached (decode only); the end-to-end figure is reported beside it."""
    import json

    from llmd.cli import main
    assert main(["bench", "--shape", "tiny", "--gen", "8", "--prompt-len", "32", "--concurrency", "4",
                 "--shared-prefix", "0", "--repeat", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    c = res["llmd_concurrent"]
    assert c["cached_prompt_tokens"] >= 4 * 16             # every prompt's full blocks came from the cache
    assert c["decode_aggregate_tok_s"] > 0 and c["aggregate_tok_s"] > 0
    assert res["concurrency_gain"] == c["decode_aggregate_tok_s"] / res["llmd_single"]["decode_tok_s"]
