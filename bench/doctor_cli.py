"""`llmd doctor [--socket S | --bench-json F]`: diagnose a running daemon or a bench run.

From a bench JSON (`llmd bench --workload W --out F`) every question has its measurements. From a
daemon, the doctor samples `stats` for --watch seconds while it serves its usual load: memory, prefix
cache, KV usage, request overlap and speculation counters are measured; the prompts' layout and the
inter-token spikes are not visible over the socket, and are reported as not measured.
Imports no torch.
"""
from __future__ import annotations

import statistics
import sys
import time

from llmd.clients import Client

from . import evidence
from .doctor import Evidence, diagnose, render
from .report import read_json


def add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose settings from measurements (a running daemon or a bench run)",
                       description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--socket", help="the daemon's socket (default: the usual path)", nargs="?", const="")
    src.add_argument("--bench-json", help="a JSON written by `llmd bench --workload W --out F`")
    p.add_argument("--workload", help="with --bench-json: diagnose only this workload")
    p.add_argument("--watch", type=float, default=5.0, help="with --socket: seconds of stats sampling (default 5)")
    p.set_defaults(func=run_doctor)


def run_doctor(args) -> int:
    try:
        if args.bench_json:
            reports = from_bench(args.bench_json, args.workload)
        else:
            reports = [("daemon", from_daemon(args.socket or None, args.watch))]
    except (ValueError, KeyError) as e:
        print(f"llmd doctor: {e}", file=sys.stderr)
        return 2
    except Exception as e:                 # the daemon is not there (a client error names why)
        print(f"llmd doctor: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print("\n\n".join(render(diagnose(ev), f"llmd doctor: {name} ({ev.source})") for name, ev in reports))
    return 0


def from_bench(path: str, workload: str | None = None) -> list[tuple[str, Evidence]]:
    res = read_json(path)
    names = [workload] if workload else list(res["workloads"])
    missing = [w for w in names if w not in res["workloads"]]
    if missing:
        raise ValueError(f"{path} has no workload {', '.join(missing)} (it has {', '.join(res['workloads'])})")
    return [(w, Evidence.from_dict(res["workloads"][w].get("evidence") or {}, source=path)) for w in names]


def from_daemon(socket: str | None, watch: float, interval: float = 0.25) -> Evidence:
    with Client(socket) as c:
        first = c.stats()
        samples = [first]
        end = time.monotonic() + max(0.0, watch)
        while time.monotonic() < end:
            time.sleep(interval)
            samples.append(c.stats())
        models = c.models()
    return evidence_from_stats(samples, models[0].get("path") if models else None, source=socket or "default socket")


def evidence_from_stats(samples: list[dict], model_path: str | None, source: str = "daemon") -> Evidence:
    """Evidence from successive `stats` replies (oldest first) of one daemon."""
    engines = [s.get("engine") or {} for s in samples]
    eng = engines[-1]
    if not eng:
        raise ValueError("the daemon has no engine stats yet (still loading?)")
    done = sum((samples[-1].get("finished") or {}).values()) - sum((samples[0].get("finished") or {}).values())
    running = [e.get("running", 0) for e in engines]
    memory = {"kv_bytes_total": eng.get("kv_bytes_total"), "weights_bytes": None}
    if model_path:
        memory = evidence.memory(model_path, eng)
    busy = [e for e in engines if e.get("running")]
    return Evidence(
        source=source, memory=memory,
        prefix={k: eng.get(k) for k in ("prefix_hit_rate", "prefix_tokens_hit", "prefix_tokens_queried",
                                        "prefix_evictions")},
        overlap={"requests": done, "mean_concurrency": statistics.fmean(running),
                 "max_concurrency": max(running)} if busy or done else None,
        kv={"usage_peak": max(e.get("kv_usage", 0.0) for e in engines),
            "usage_mean": statistics.fmean([e.get("kv_usage", 0.0) for e in busy]) if busy else 0.0,
            "kv_bytes_total": eng.get("kv_bytes_total"), "preemptions": eng.get("preemptions", 0),
            "evictions": eng.get("prefix_evictions", 0),
            "slots_unused_peak": max((e.get("kv_slots_unused") or 0) for e in engines)} if busy else None,
        spec={"draft": "on" if eng.get("spec_proposed") else None,
              **{k: eng.get(k) for k in ("spec_acceptance_rate", "spec_draft_s", "spec_verify_s")}},
        quant={"quantization": evidence.quantization(model_path) if model_path else None,
               "mean_step_tokens": eng["step_tokens"] / eng["steps"] if eng.get("steps") else None},
    )
