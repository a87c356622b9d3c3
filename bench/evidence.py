"""Measurements for `llmd doctor`, taken from one llmd run of a workload.

Everything here is computed from what happened: the prompts' tokens, the time of every output
chunk, the engine's stats sampled once per step, /proc/meminfo and the weight files. The result is
a plain dict (stored in the bench JSON) that `doctor.Evidence.from_dict` reads back.
"""
from __future__ import annotations

import difflib
import json
import statistics
from pathlib import Path
from typing import Optional

HEAD = 2048            # prompt tokens compared per request
MIN_BLOCK = 32         # a shared run of tokens shorter than this is noise, not reusable content


def measure(llm, stats: dict, workload, timings, samples, *, decode, spec: Optional[dict] = None) -> dict:
    """`stats`: the engine's stats with counters taken over this workload's run only."""
    cfg = llm.engine.config
    prompts = [list(r.prompt_ids[:HEAD]) for r in workload.requests]
    return {
        "workload": workload.name,
        "memory": memory(cfg.model, stats),
        "prefix": {"enabled": cfg.prefix_cache, "block_size": cfg.block_size,
                   **{k: stats.get(k) for k in ("prefix_hit_rate", "prefix_tokens_hit", "prefix_tokens_queried",
                                                 "prefix_evictions")},
                   **prefix_layout(prompts, cfg.block_size, decode)},
        "overlap": overlap(timings),
        "kv": kv(samples, stats, cfg.block_size),
        "spec": {"draft": cfg.draft, "k": cfg.num_speculative_tokens,
                 **{k: stats.get(k) for k in ("spec_acceptance_rate", "spec_draft_s", "spec_verify_s",
                                              "spec_proposed", "spec_accepted")},
                 "copy_rate": copy_rate(workload, timings), **(spec or {})},
        "contention": {**contention(timings), "max_batch_tokens": cfg.max_batch_tokens},
        "quant": {"quantization": quantization(cfg.model),
                  "mean_step_tokens": stats["step_tokens"] / stats["steps"] if stats.get("steps") else None},
    }


def memory(model_dir: str, stats: dict) -> dict:
    info = meminfo()
    return {"weights_bytes": sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")),
            "kv_bytes_total": stats.get("kv_bytes_total"),
            "mem_total_bytes": info.get("MemTotal"), "mem_available_bytes": info.get("MemAvailable")}


def meminfo() -> dict:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024
    return out


def prefix_layout(prompts: list[list[int]], block_size: int, decode) -> dict:
    """How much the prompts could share, and where sharing breaks.

    For each prompt, against the previous prompt most like it: the exact common prefix (what a prefix
    cache can reuse) and the longest common run anywhere (content that is shared but not at the front).
    `potential_hit_rate` counts whole blocks of exact prefix, as the cache does.
    """
    if len(prompts) < 2:
        return {"pairs": 0}
    lcps, runs, total, reusable, worst = [], [], 0, 0, None
    for i in range(1, len(prompts)):
        best = max(range(i), key=lambda j: _lcp(prompts[i], prompts[j]))
        a, b = prompts[best], prompts[i]
        lcp = _lcp(a, b)
        m = difflib.SequenceMatcher(None, a, b, autojunk=False).find_longest_match(0, len(a), 0, len(b))
        lcps.append(lcp)
        runs.append(m.size)
        total += len(b)
        reusable += lcp // block_size * block_size
        if m.size >= MIN_BLOCK and m.b > lcp and (worst is None or m.size - lcp > worst[0]):
            worst = (m.size - lcp, lcp, a, b, m)
    out = {"pairs": len(lcps), "common_prefix_median": statistics.median(lcps),
           "common_prefix_max": max(lcps), "shared_run_median": statistics.median(runs),
           "potential_hit_rate": reusable / total if total else 0.0}
    if worst:
        _, lcp, a, b, m = worst
        out["first_difference"] = {"position": lcp, "shared_run_start": m.b, "shared_run_len": m.size,
                                   "a": decode(a[max(0, lcp - 24):lcp + 24]), "b": decode(b[max(0, lcp - 24):lcp + 24]),
                                   "context_start": max(0, lcp - 24)}
    return out


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def overlap(timings) -> dict:
    """Mean and peak number of requests in flight, and the spread of prompt and output lengths."""
    spans = [(t.arrival_s, t.stamps[-1][0]) for t in timings if t.stamps]
    if not spans:
        return {}
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return {"requests": len(spans), "mean_concurrency": sum(e - s for s, e in spans) / max(end - start, 1e-9),
            "max_concurrency": peak, "prompt_len_cv": _cv([t.prompt_tokens for t in timings]),
            "output_len_cv": _cv([len(t.output_ids) for t in timings]),
            "prompt_len_min": min(t.prompt_tokens for t in timings),
            "prompt_len_max": max(t.prompt_tokens for t in timings)}


def _cv(xs: list) -> float:
    mean = statistics.fmean(xs) if xs else 0.0
    return statistics.pstdev(xs) / mean if mean else 0.0


def kv(samples: list[dict], stats: dict, block_size: int) -> dict:
    busy = [s for s in samples if s.get("running")]
    slots = (stats.get("kv_blocks_total") or 0) * block_size
    return {"usage_peak": max((s["kv_usage"] for s in busy), default=0.0),
            "usage_mean": statistics.fmean([s["kv_usage"] for s in busy]) if busy else 0.0,
            "slots_unused_peak": max((s["kv_slots_unused"] for s in busy), default=0),
            "slots_used_peak": max((s["kv_blocks_used"] * block_size for s in busy), default=0),
            "slots_total": slots, "kv_bytes_total": stats.get("kv_bytes_total"),
            "preemptions": stats.get("preemptions", 0), "evictions": stats.get("prefix_evictions", 0),
            "pool_dtype": stats.get("kv_pool_dtype")}


def copy_rate(workload, timings, n: int = 4) -> Optional[float]:
    """Share of output n-grams that occur in the prompt: what prompt-lookup speculation can guess."""
    prompts = {r.rid: r.prompt_ids for r in workload.requests}
    hits = total = 0
    for t in timings:
        grams = {tuple(prompts[t.rid][i:i + n]) for i in range(len(prompts[t.rid]) - n + 1)}
        out = t.output_ids
        for i in range(len(out) - n + 1):
            total += 1
            hits += tuple(out[i:i + n]) in grams
    return hits / total if total else None


def contention(timings) -> dict:
    """Inter-token gaps of decoding requests while another request waits for its first token (its
    prompt is queued or being processed) against gaps while none does."""
    windows = [(t.arrival_s, t.stamps[0][0]) for t in timings if t.stamps]
    during, calm = [], []
    for t in timings:
        for (a, _), (b, k) in zip(t.stamps, t.stamps[1:]):
            gap = (b - a) / k
            busy = any(s < b and e > a and (s, e) != (t.arrival_s, t.stamps[0][0]) for s, e in windows)
            (during if busy else calm).append(gap)
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else None   # noqa: E731
    return {"gaps_during_prompts": len(during), "gaps_calm": len(calm),
            "itl_p50_calm_s": q(calm, 0.5), "itl_p95_calm_s": q(calm, 0.95),
            "itl_p50_during_s": q(during, 0.5), "itl_p95_during_s": q(during, 0.95)}


def quantization(model_dir: str) -> Optional[str]:
    path = Path(model_dir) / "manifest.json"
    try:
        q = json.loads(path.read_text()).get("quantization")
    except (OSError, ValueError):
        return None
    return json.dumps(q, sort_keys=True) if isinstance(q, dict) else (str(q) if q else None)
