"""`llmd doctor`: six questions answered from measurements, ending with recommended flags.

    1 memory      do weights + KV cache fit comfortably in the RAM that is available?
    2 prefix      do prompts share exact prefixes, and does the cache catch them?
    3 overlap     do requests overlap, with uneven lengths (what continuous batching is for)?
    4 kv          does the KV cache hold memory that is reserved but never used (or too little)?
    5 speculation is one user's speed the goal, and does speculation pay here?
    6 contention  do prompt processing and decoding contend (inter-token spikes while prompts run)?

`diagnose` is pure: it reads an Evidence (sections of numbers, any of which may be absent: then the
answer is "not measured", never a guess) and returns Findings. A finding may name a failure
symptom with its evidence. Thresholds are module constants, stated once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

HEADROOM_MIN = 0.15        # free RAM left, as a share of (need + free), below which memory is tight
HIT_NEAR_ZERO = 0.10       # a prefix hit rate below this is "near zero"
MISSED_SHARE = 0.20        # potential - measured hit rate above this: blocks lost before reuse
OVERLAP_MIN = 1.5          # mean requests in flight at or above this: requests overlap
UNEVEN_CV = 0.5            # coefficient of variation of lengths above this: uneven
KV_IDLE = 0.30             # peak KV usage below this: memory reserved for nothing
KV_FULL = 0.95             # peak KV usage above this (or any preemption): too small
SLOT_WASTE = 0.25          # unused slots inside allocated blocks, as a share of used slots
SPEC_GAIN_MIN = 1.05       # speculation must beat plain decoding by this factor to count as a gain
COPY_RATE_MIN = 0.30       # output 4-grams found in the prompt: prompt lookup can guess them
SPIKE_RATIO = 3.0          # inter-token p95 during prompts against the calm p50
MIN_GAPS = 5               # fewer inter-token gaps than this during prompts: too few to judge
COMPUTE_BOUND_TOKENS = 64  # mean tokens per engine step at which a CPU matmul is compute bound
MIB = 1 << 20

SECTIONS = ("memory", "prefix", "overlap", "kv", "spec", "contention", "quant")


@dataclass(frozen=True)
class Evidence:
    """Measured numbers by section (see bench/evidence.py for how each is taken); None: not measured."""
    source: str = ""
    memory: Optional[Mapping] = None
    prefix: Optional[Mapping] = None
    overlap: Optional[Mapping] = None
    kv: Optional[Mapping] = None
    spec: Optional[Mapping] = None
    contention: Optional[Mapping] = None
    quant: Optional[Mapping] = None

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "") -> "Evidence":
        if not isinstance(d, Mapping):
            raise ValueError(f"evidence must be a mapping, got {type(d).__name__}")
        bad = [k for k in SECTIONS if d.get(k) is not None and not isinstance(d[k], Mapping)]
        if bad:
            raise ValueError(f"evidence sections must be mappings: {', '.join(bad)}")
        return cls(source=source, **{k: (d.get(k) or None) for k in SECTIONS})


@dataclass(frozen=True)
class Finding:
    question: str
    status: str                          # ok | warn | problem | unknown
    summary: str
    evidence: tuple[str, ...] = ()
    symptom: Optional[str] = None        # a named failure, when one is seen
    flags: Mapping[str, Optional[str]] = field(default_factory=dict)   # flag -> value (None: bare flag)


def diagnose(ev: Evidence) -> list[Finding]:
    return [memory(ev), prefix(ev), overlap(ev), kv_cache(ev), speculation(ev), contention(ev)] + \
        ([q] if (q := quantization(ev)) else [])


def _unknown(question: str, what: str) -> Finding:
    return Finding(question, "unknown", f"not measured ({what} missing)")


def _mib(n) -> str:
    return f"{n / MIB:.0f} MiB" if n is not None else "?"


def _size_flag(n_bytes: float) -> str:
    return f"{max(16, int(n_bytes // MIB) // 16 * 16 or 16)}MiB"


def memory(ev: Evidence) -> Finding:
    q = "1 memory"
    m = ev.memory or {}
    if m.get("weights_bytes") is None or m.get("kv_bytes_total") is None or m.get("mem_available_bytes") is None:
        return _unknown(q, "weights, KV or available RAM")
    need = m["weights_bytes"] + m["kv_bytes_total"]
    free = m["mem_available_bytes"]
    headroom = free / (need + free) if need + free else 0.0
    lines = (f"weights {_mib(m['weights_bytes'])} + KV {_mib(m['kv_bytes_total'])} = {_mib(need)}",
             f"available after loading {_mib(free)} (headroom {100 * headroom:.0f}%)")
    if headroom >= HEADROOM_MIN:
        return Finding(q, "ok", "the model and its KV cache fit with room to spare", lines)
    kv = ev.kv or {}
    flags = {}
    if kv.get("usage_peak") is not None and kv["usage_peak"] < KV_IDLE:
        flags["--kv-memory"] = _size_flag(max(2 * kv["usage_peak"] * m["kv_bytes_total"], 16 * MIB))
    else:
        flags["--dtype"] = "bfloat16"
    return Finding(q, "problem", "memory is tight: the system may swap or kill the daemon", lines,
                   "does not fit comfortably", flags)


def prefix(ev: Evidence) -> Finding:
    q = "2 prefix"
    p = ev.prefix or {}
    if p.get("prefix_hit_rate") is None:
        return _unknown(q, "prefix hit rate")
    hit, pot = p["prefix_hit_rate"], p.get("potential_hit_rate")
    lines = [f"measured hit rate {100 * hit:.0f}% of prompt tokens"
             f" ({p.get('prefix_tokens_hit', '?')} of {p.get('prefix_tokens_queried', '?')})"]
    if pot is not None:
        lines.append(f"exact shared prefixes: median {p.get('common_prefix_median')} tokens, longest "
                     f"{p.get('common_prefix_max')}; whole-block reuse possible for {100 * pot:.0f}%")
    if p.get("enabled") is False and (pot or 0) >= MISSED_SHARE:
        return Finding(q, "problem", "prompts share prefixes but the prefix cache is off", tuple(lines),
                       "prefix cache disabled", {"--no-prefix-cache": "remove"})
    diff = p.get("first_difference")
    if diff and hit < HIT_NEAR_ZERO and diff["shared_run_len"] >= 2 * max(diff["position"], 1):
        lines += [f"prompts first differ at token {diff['position']}, then share {diff['shared_run_len']} tokens "
                  f"from token {diff['shared_run_start']}",
                  f"example, tokens {diff['context_start']}..: {diff['a']!r}",
                  f"                        vs {diff['b']!r}"]
        return Finding(q, "problem", f"dynamic content before the shared prefix: move what changes (at token "
                       f"{diff['position']}) after the stable text", tuple(lines),
                       "dynamic content before the shared prefix")
    if pot is not None and pot - hit >= MISSED_SHARE and (p.get("prefix_evictions") or 0) > 0:
        lines.append(f"{p['prefix_evictions']} cached blocks evicted")
        kv = (ev.kv or {}).get("kv_bytes_total")
        return Finding(q, "problem", "useful prefix blocks are evicted before they are reused", tuple(lines),
                       "prefix blocks evicted too early", {"--kv-memory": _size_flag(2 * kv)} if kv else {})
    if hit >= HIT_NEAR_ZERO:
        return Finding(q, "ok", "prompts share exact prefixes and the cache reuses them", tuple(lines))
    return Finding(q, "ok", "prompts do not share prefixes; the cache cannot help here (and costs nothing)",
                   tuple(lines))


def overlap(ev: Evidence) -> Finding:
    q = "3 overlap"
    o = ev.overlap or {}
    if o.get("mean_concurrency") is None:
        return _unknown(q, "request timings")
    uneven = max(o.get("prompt_len_cv", 0), o.get("output_len_cv", 0)) > UNEVEN_CV
    lines = (f"{o.get('requests')} requests, mean {o['mean_concurrency']:.1f} in flight, peak {o.get('max_concurrency')}",
             f"prompt lengths {o.get('prompt_len_min')}..{o.get('prompt_len_max')} (cv {o.get('prompt_len_cv', 0):.2f}), "
             f"output cv {o.get('output_len_cv', 0):.2f}")
    if o["mean_concurrency"] < OVERLAP_MIN:
        return Finding(q, "ok", "requests mostly run one at a time: a single user, latency is the goal", lines)
    if uneven:
        return Finding(q, "ok", "requests overlap with uneven lengths: continuous batching is doing its job", lines)
    return Finding(q, "ok", "requests overlap with even lengths: batching helps, padding would too", lines)


def kv_cache(ev: Evidence) -> Finding:
    q = "4 kv"
    k = ev.kv or {}
    if k.get("usage_peak") is None or not k.get("kv_bytes_total"):
        return _unknown(q, "KV usage samples")
    peak = k["usage_peak"]
    lines = [f"KV reserved {_mib(k['kv_bytes_total'])}, peak use {100 * peak:.0f}%, mean {100 * k.get('usage_mean', 0):.0f}%",
             f"preemptions {k.get('preemptions', 0)}, prefix evictions {k.get('evictions', 0)}"]
    if k.get("preemptions") or peak >= KV_FULL:
        if k.get("pool_dtype") == "float32":      # twice the tokens in the same memory, before asking for more
            lines.append("keys and values are stored in float32: a bfloat16 cache holds twice the tokens in the "
                         "same memory (and many streams decode faster: half the bytes to read)")
            flags = {"--kv-dtype": "bfloat16"}
        else:
            flags = {"--kv-memory": _size_flag(2 * k["kv_bytes_total"])}
        return Finding(q, "problem", "the KV cache is too small: requests were preempted or it ran full",
                       tuple(lines), "KV cache full", flags)
    used, unused = k.get("slots_used_peak") or 0, k.get("slots_unused_peak") or 0
    if used and unused / used > SLOT_WASTE:
        lines.append(f"{unused} token slots allocated but unused at peak ({100 * unused / used:.0f}% of used)")
        return Finding(q, "warn", "blocks are large for these requests: slots sit unused inside them",
                       tuple(lines), "reserved but unused KV slots", {"--block-size": "8"})
    if peak < KV_IDLE and not k.get("evictions"):
        size = max(2 * peak * k["kv_bytes_total"], 16 * MIB)
        return Finding(q, "warn", f"most of the KV cache stays empty; {_size_flag(size)} would hold this load twice",
                       tuple(lines), "reserved but unused KV memory", {"--kv-memory": _size_flag(size)})
    return Finding(q, "ok", "the KV cache is sized to the load", tuple(lines))


def speculation(ev: Evidence) -> Finding:
    q = "5 speculation"
    s, o = ev.spec or {}, ev.overlap or {}
    single = o.get("mean_concurrency") is not None and o["mean_concurrency"] < OVERLAP_MIN
    if not s:
        return _unknown(q, "speculation counters")
    if s.get("draft"):
        alpha = s.get("spec_acceptance_rate")
        lines = [f"draft {s['draft']}, k={s.get('k')}, acceptance alpha="
                 f"{'?' if alpha is None else f'{alpha:.2f}'}",
                 f"draft time {s.get('spec_draft_s') or 0:.3f} s, verify time {s.get('spec_verify_s') or 0:.3f} s"]
        if s.get("spec_tok_s") and s.get("plain_tok_s"):
            lines.append(f"decode {s['spec_tok_s']:.1f} tok/s with speculation, {s['plain_tok_s']:.1f} without "
                         "(median per request)")
            if s["spec_tok_s"] < s["plain_tok_s"]:
                return Finding(q, "problem", "speculation is slower than plain decoding: acceptance too low",
                               tuple(lines), "speculation slower than plain decoding", {"--draft": "remove"})
            gain = s["spec_tok_s"] / s["plain_tok_s"]
            if gain < SPEC_GAIN_MIN:
                return Finding(q, "warn", f"speculation barely pays ({gain:.2f}x plain decoding): it spends "
                               "compute for no measurable gain", tuple(lines))
            return Finding(q, "ok", f"speculation pays: {gain:.2f}x plain decoding", tuple(lines))
        if not single and o:
            return Finding(q, "warn", "many requests at once: speculation spends compute the batch could use",
                           tuple(lines), None, {"--draft": "remove"})
        return Finding(q, "unknown", "speculation is on but its gain was not measured against plain decoding",
                       tuple(lines))
    cr = s.get("copy_rate")
    lines = (f"no draft; {'?' if cr is None else f'{100 * cr:.0f}%'} of output 4-grams appear in the prompt",)
    if single and cr is not None and cr >= COPY_RATE_MIN:
        return Finding(q, "warn", "one user waits and answers copy the prompt: prompt lookup would pay",
                       lines, None, {"--draft": "ngram"})
    if single:
        return Finding(q, "ok", "one user, but answers do not copy the prompt: only a trained draft could help", lines)
    return Finding(q, "ok", "throughput is the goal: speculation off is right", lines)


def contention(ev: Evidence) -> Finding:
    q = "6 contention"
    c = ev.contention or {}
    if not c:
        return _unknown(q, "request timings")
    if not c.get("itl_p50_calm_s") or (c.get("gaps_during_prompts") or 0) < MIN_GAPS:
        return Finding(q, "ok", f"decoding seldom ran while a prompt was processed "
                       f"({c.get('gaps_during_prompts') or 0} inter-token gaps): no contention to see")
    ratio = (c["itl_p95_during_s"] or 0) / c["itl_p50_calm_s"]
    lines = (f"inter-token p95 {1000 * c['itl_p95_during_s']:.1f} ms while prompts run "
             f"({c['gaps_during_prompts']} gaps), calm p50 {1000 * c['itl_p50_calm_s']:.1f} ms: {ratio:.1f}x",)
    if ratio >= SPIKE_RATIO:
        mbt = c.get("max_batch_tokens")
        return Finding(q, "problem", "prompt processing stalls decoding: inter-token latency spikes while prompts run",
                       lines, "prefill and decode contend",
                       {"--max-batch-tokens": str(max(64, mbt // 2))} if mbt else {})
    return Finding(q, "ok", "decoding keeps its pace while prompts run", lines)


def quantization(ev: Evidence) -> Optional[Finding]:
    qz = ev.quant or {}
    if not qz.get("quantization"):
        return None
    steps = qz.get("mean_step_tokens")
    lines = [f"quantization {qz['quantization']}",
             f"mean tokens per engine step {'?' if steps is None else f'{steps:.0f}'}"]
    if qz.get("speedup") is not None:
        lines.append(f"measured throughput against the float model: {qz['speedup']:.2f}x")
    if steps is not None and steps >= COMPUTE_BOUND_TOKENS and (qz.get("speedup") is None or qz["speedup"] < 1.05):
        return Finding("7 quantization", "warn", "weights-only quantization at a compute-bound batch size: it saves "
                       "memory, not time", tuple(lines), "quantization without a throughput gain")
    return Finding("7 quantization", "ok", "quantized weights at a memory-bound batch size", tuple(lines))


def recommended_flags(findings: list[Finding]) -> dict:
    flags: dict = {}
    for f in findings:
        flags.update(f.flags)
    return flags


def render(findings: list[Finding], title: str = "") -> str:
    mark = {"ok": "ok", "warn": "WARN", "problem": "PROBLEM", "unknown": "?"}
    out = [title] if title else []
    for f in findings:
        out.append(f"{f.question:14} {mark[f.status]:8} {f.summary}")
        out += [f"{'':23}{line}" for line in f.evidence]
    symptoms = [f.symptom for f in findings if f.symptom]
    if symptoms:
        out.append("symptoms: " + "; ".join(symptoms))
    flags = recommended_flags(findings)
    words = []
    for k, v in flags.items():
        words.append(f"(drop {k})" if v == "remove" else k if v is None else f"{k} {v}")
    out.append("recommended: " + (" ".join(words) if words else "keep the current settings"))
    return "\n".join(out)
