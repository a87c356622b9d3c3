"""llmd doctor: every branch of the decision tree on stated numbers, then real runs on the tiny model
(a workload whose prompts open with a timestamp; a live daemon's stats)."""
from __future__ import annotations

import argparse
import json

import pytest

from llmd.bench.doctor import Evidence, diagnose, recommended_flags, render

MIB = 1 << 20


def finding(question: str, **sections):
    return next(f for f in diagnose(Evidence(**sections)) if f.question.endswith(question))


# ---- 1 memory -------------------------------------------------------------------------------------
def test_memory_fits():
    f = finding("memory", memory=dict(weights_bytes=500 * MIB, kv_bytes_total=512 * MIB, mem_available_bytes=8192 * MIB))
    assert f.status == "ok" and not f.flags


def test_memory_tight_with_idle_kv_shrinks_the_cache():
    f = finding("memory", memory=dict(weights_bytes=3000 * MIB, kv_bytes_total=1024 * MIB, mem_available_bytes=300 * MIB),
                kv=dict(usage_peak=0.1, kv_bytes_total=1024 * MIB))
    assert f.status == "problem" and f.symptom == "does not fit comfortably"
    assert f.flags == {"--kv-memory": "192MiB"}           # twice the 10% peak of 1 GiB, in 16 MiB steps


def test_memory_tight_with_busy_kv_asks_for_smaller_weights():
    f = finding("memory", memory=dict(weights_bytes=3000 * MIB, kv_bytes_total=1024 * MIB, mem_available_bytes=300 * MIB),
                kv=dict(usage_peak=0.9, kv_bytes_total=1024 * MIB))
    assert f.status == "problem" and f.flags == {"--dtype": "bfloat16"}


def test_memory_unknown_without_measurements():
    assert finding("memory").status == "unknown"


# ---- 2 prefix -------------------------------------------------------------------------------------
STAMP = dict(position=27, shared_run_start=32, shared_run_len=199, a="[09:26:00.706] You are",
             b="[09:26:02.290] You are", context_start=3)


def test_dynamic_content_before_shared_prefix_shows_position_and_example():
    f = finding("prefix", prefix=dict(prefix_hit_rate=0.02, potential_hit_rate=0.05, common_prefix_median=27,
                                      first_difference=STAMP))
    assert f.symptom == "dynamic content before the shared prefix"
    text = "\n".join(f.evidence)
    assert "token 27" in text and "09:26:00.706" in text and "09:26:02.290" in text


def test_shared_run_after_a_long_common_prefix_is_not_dynamic_content():
    f = finding("prefix", prefix=dict(prefix_hit_rate=0.02, potential_hit_rate=0.05,
                                      first_difference=dict(STAMP, position=150)))
    assert f.symptom != "dynamic content before the shared prefix"


def test_good_hit_rate_is_not_a_symptom_even_with_a_late_shared_run():
    f = finding("prefix", prefix=dict(prefix_hit_rate=0.6, potential_hit_rate=0.7, first_difference=STAMP))
    assert f.status == "ok" and f.symptom is None


def test_prefix_cache_disabled():
    f = finding("prefix", prefix=dict(enabled=False, prefix_hit_rate=0.0, potential_hit_rate=0.7))
    assert f.symptom == "prefix cache disabled" and f.flags == {"--no-prefix-cache": "remove"}


def test_prefix_blocks_evicted_too_early_doubles_the_cache():
    f = finding("prefix", prefix=dict(prefix_hit_rate=0.1, potential_hit_rate=0.7, prefix_evictions=40),
                kv=dict(kv_bytes_total=64 * MIB))
    assert f.symptom == "prefix blocks evicted too early" and f.flags == {"--kv-memory": "128MiB"}


def test_missed_prefixes_without_evictions_are_not_blamed_on_eviction():
    f = finding("prefix", prefix=dict(prefix_hit_rate=0.3, potential_hit_rate=0.7, prefix_evictions=0))
    assert f.status == "ok" and f.symptom is None


def test_unrelated_prompts():
    f = finding("prefix", prefix=dict(prefix_hit_rate=0.0, potential_hit_rate=0.0))
    assert f.status == "ok" and "do not share" in f.summary


def test_prefix_unknown():
    assert finding("prefix", prefix=dict(potential_hit_rate=0.5)).status == "unknown"


# ---- 3 overlap ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mean,cv,words", [(1.0, 0.9, "one at a time"), (4.0, 0.9, "uneven"), (4.0, 0.1, "even lengths")])
def test_overlap_branches(mean, cv, words):
    f = finding("overlap", overlap=dict(requests=10, mean_concurrency=mean, max_concurrency=6, prompt_len_cv=cv,
                                        output_len_cv=0.0))
    assert words in f.summary


def test_overlap_unknown():
    assert finding("overlap").status == "unknown"


# ---- 4 kv -----------------------------------------------------------------------------------------
KV = dict(kv_bytes_total=512 * MIB, usage_mean=0.5, preemptions=0, evictions=0, slots_used_peak=1000,
          slots_unused_peak=50)


def test_kv_too_small_when_preempted():
    f = finding("kv", kv=dict(KV, usage_peak=0.7, preemptions=3))
    assert f.symptom == "KV cache full" and f.flags == {"--kv-memory": "1024MiB"}


def test_kv_too_small_in_float32_asks_for_bfloat16_first():
    f = finding("kv", kv=dict(KV, usage_peak=0.97, pool_dtype="float32"))
    assert f.symptom == "KV cache full" and f.flags == {"--kv-dtype": "bfloat16"}
    f = finding("kv", kv=dict(KV, usage_peak=0.97, pool_dtype="bfloat16"))
    assert f.flags == {"--kv-memory": "1024MiB"}


def test_kv_slots_unused_inside_blocks():
    f = finding("kv", kv=dict(KV, usage_peak=0.6, slots_unused_peak=600))
    assert f.symptom == "reserved but unused KV slots" and f.flags == {"--block-size": "8"}


def test_kv_reserved_but_unused_memory():
    f = finding("kv", kv=dict(KV, usage_peak=0.05))
    assert f.symptom == "reserved but unused KV memory"
    assert f.flags == {"--kv-memory": "48MiB"}            # 2 x 5% of 512 MiB, in 16 MiB steps


def test_kv_sized_right():
    assert finding("kv", kv=dict(KV, usage_peak=0.6)).status == "ok"


def test_kv_unknown():
    assert finding("kv", kv=dict(kv_bytes_total=1)).status == "unknown"


# ---- 5 speculation --------------------------------------------------------------------------------
SINGLE = dict(mean_concurrency=1.0)
BUSY = dict(mean_concurrency=6.0)
SPEC = dict(draft="ngram", k=4, spec_acceptance_rate=0.12, spec_draft_s=0.4, spec_verify_s=2.0)


def test_speculation_slower_than_plain_shows_alpha():
    f = finding("speculation", spec=dict(SPEC, spec_tok_s=20.0, plain_tok_s=30.0), overlap=SINGLE)
    assert f.symptom == "speculation slower than plain decoding" and f.flags == {"--draft": "remove"}
    assert "alpha=0.12" in "\n".join(f.evidence)


def test_speculation_that_pays():
    f = finding("speculation", spec=dict(SPEC, spec_acceptance_rate=0.8, spec_tok_s=45.0, plain_tok_s=30.0),
                overlap=SINGLE)
    assert f.status == "ok" and "1.50x" in f.summary


def test_speculation_within_noise_is_not_called_a_gain():
    f = finding("speculation", spec=dict(SPEC, spec_tok_s=30.5, plain_tok_s=30.0), overlap=SINGLE)
    assert f.status == "warn" and "barely" in f.summary


def test_speculation_under_many_users_is_questioned():
    f = finding("speculation", spec=SPEC, overlap=BUSY)
    assert f.status == "warn" and f.flags == {"--draft": "remove"}


def test_speculation_gain_not_measured():
    assert finding("speculation", spec=SPEC, overlap=SINGLE).status == "unknown"


def test_no_draft_single_user_copying_prompt_recommends_ngram():
    f = finding("speculation", spec=dict(draft=None, copy_rate=0.6), overlap=SINGLE)
    assert f.flags == {"--draft": "ngram"}


def test_no_draft_single_user_not_copying():
    f = finding("speculation", spec=dict(draft=None, copy_rate=0.05), overlap=SINGLE)
    assert f.status == "ok" and not f.flags


def test_no_draft_many_users():
    f = finding("speculation", spec=dict(draft=None, copy_rate=0.6), overlap=BUSY)
    assert f.status == "ok" and not f.flags


def test_speculation_unknown():
    assert finding("speculation").status == "unknown"


# ---- 6 contention ---------------------------------------------------------------------------------
def test_decode_spikes_while_prompts_run_halve_the_step_budget():
    f = finding("contention", contention=dict(gaps_during_prompts=40, itl_p50_calm_s=0.010, itl_p95_during_s=0.080,
                                              max_batch_tokens=512))
    assert f.symptom == "prefill and decode contend" and f.flags == {"--max-batch-tokens": "256"}


def test_decode_keeps_pace():
    f = finding("contention", contention=dict(gaps_during_prompts=40, itl_p50_calm_s=0.010, itl_p95_during_s=0.015))
    assert f.status == "ok" and f.symptom is None


def test_too_few_gaps_to_judge():
    f = finding("contention", contention=dict(gaps_during_prompts=2, itl_p50_calm_s=0.010, itl_p95_during_s=0.2))
    assert f.status == "ok" and f.symptom is None


def test_contention_unknown():
    assert finding("contention").status == "unknown"


# ---- quantization ---------------------------------------------------------------------------------
def test_quantization_at_compute_bound_batch_size():
    f = finding("quantization", quant=dict(quantization="int8 weight-only", mean_step_tokens=200, speedup=0.98))
    assert f.symptom == "quantization without a throughput gain"


def test_quantization_memory_bound_is_fine():
    assert finding("quantization", quant=dict(quantization="int8", mean_step_tokens=3)).status == "ok"


def test_no_quantization_no_question():
    assert not [f for f in diagnose(Evidence(quant=dict(quantization=None))) if "quant" in f.question]


# ---- report ---------------------------------------------------------------------------------------
def test_report_ends_with_merged_flags():
    ev = Evidence(kv=dict(KV, usage_peak=0.05), overlap=SINGLE, spec=dict(draft=None, copy_rate=0.9))
    text = render(diagnose(ev))
    assert text.splitlines()[-1] == "recommended: --kv-memory 48MiB --draft ngram"
    assert recommended_flags(diagnose(Evidence())) == {}
    assert render(diagnose(Evidence())).splitlines()[-1] == "recommended: keep the current settings"


def test_bad_evidence_is_refused():
    with pytest.raises(ValueError):
        Evidence.from_dict({"prefix": [1, 2]})
    with pytest.raises(ValueError):
        Evidence.from_dict([1])


# ---- real runs on the tiny model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def stamped_run(tiny_model_dir):
    from llmd.bench.runner import BenchConfig, run
    cfg = BenchConfig(model=str(tiny_model_dir), workloads=("stamped", "voice"), scale="short", concurrency=(1,),
                      sweep_prompt=16, sweep_gen=2, engine={"kv_memory": "64MiB"})
    return run(cfg, log=lambda m: None)


def test_timestamped_prompts_are_diagnosed_with_the_position(stamped_run, tiny_model_dir):
    from llmd.bench.workloads import Scale, build
    from llmd.runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(tiny_model_dir)
    wl = build("stamped", tok, scale=Scale.named("short"))
    p = [r.prompt_ids for r in wl.requests]
    first_diff = min(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(p, p[1:]))
    assert "2025-03-14" in tok.decode(list(p[0][:first_diff + 12]))          # it is the timestamp that differs

    findings = diagnose(Evidence.from_dict(stamped_run["workloads"]["stamped"]["evidence"]))
    f = next(f for f in findings if f.question == "2 prefix")
    assert f.symptom == "dynamic content before the shared prefix"
    pos = stamped_run["workloads"]["stamped"]["evidence"]["prefix"]["first_difference"]["position"]
    assert first_diff <= pos < first_diff + 16
    assert f"token {pos}" in f.summary

    voice = diagnose(Evidence.from_dict(stamped_run["workloads"]["voice"]["evidence"]))
    g = next(f for f in voice if f.question == "2 prefix")
    assert g.symptom is None and g.status == "ok"                          # same turns without the stamp: cached
    assert stamped_run["workloads"]["voice"]["evidence"]["prefix"]["prefix_hit_rate"] > 0.3


def test_doctor_cli_on_bench_json(stamped_run, tmp_path, capsys):
    from llmd.bench.doctor_cli import add_doctor_parser
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(stamped_run))
    parser = argparse.ArgumentParser()
    add_doctor_parser(parser.add_subparsers())
    args = parser.parse_args(["doctor", "--bench-json", str(path), "--workload", "stamped"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "dynamic content before the shared prefix" in out and out.strip().splitlines()[-1].startswith("recommended:")
    args = parser.parse_args(["doctor", "--bench-json", str(path), "--workload", "nope"])
    assert args.func(args) == 2
    (tmp_path / "bad.json").write_text("[1]")
    args = parser.parse_args(["doctor", "--bench-json", str(tmp_path / "bad.json")])
    assert args.func(args) == 2


@pytest.mark.heavy
def test_doctor_on_a_live_daemon(tiny_model_dir, tmp_path):
    from daemon_fixtures import daemon_settings, running_daemon
    from llmd.bench.doctor_cli import from_daemon
    from llmd.clients import Client
    settings = daemon_settings(tiny_model_dir, tmp_path)
    head = "You are a helpful assistant who answers briefly. " * 4
    with running_daemon(settings):
        with Client(settings.socket) as c:
            for q in ("one", "two", "three"):
                c.generate(head + q, max_tokens=4).text()
        ev = from_daemon(settings.socket, watch=0.2, interval=0.1)
    assert ev.memory["weights_bytes"] > 0 and ev.memory["kv_bytes_total"] == 64 * MIB
    assert ev.prefix["prefix_hit_rate"] > 0.3                       # the shared head was served from cache
    findings = {f.question: f for f in diagnose(ev)}
    assert findings["1 memory"].status == "ok"
    assert findings["2 prefix"].status == "ok"
    assert findings["6 contention"].status == "unknown"            # not visible over the socket
