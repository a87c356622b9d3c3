"""One benchmark run: every workload on llmd and each peer, interleaved, then a concurrency sweep.

For each workload the peers take turns (the order rotates from one workload to the next) so that
machine noise falls on all alike. llmd's prefix cache is emptied before each of its turns, and its
counters are taken over that turn only, so the doctor's evidence describes one workload.
"""
from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, field
from typing import Mapping, Optional

from llmd.runtime.llm import LLM
from llmd.sentences import SentenceSplitter

from . import evidence
from .peers import LLMDPeer, Missing, Peer, Timing, load_peer
from .workloads import Scale, build

COUNTERS = ("prefix_tokens_hit", "prefix_tokens_queried", "prefix_evictions", "steps", "step_tokens",
            "spec_proposed", "spec_accepted", "spec_draft_s", "spec_verify_s", "preemptions")
SENTENCE_KINDS = ("voice", "stamped")


@dataclass(frozen=True)
class BenchConfig:
    model: str
    workloads: tuple[str, ...]
    peers: tuple[str, ...] = ()
    seed: int = 0
    scale: str = "full"                      # full | short
    rate: float = 4.0                        # mixed workload: arrivals per second
    draft: Optional[str] = None
    num_speculative_tokens: Optional[int] = None   # None: the engine's default for the proposer
    engine: Mapping = field(default_factory=dict)     # further LLM(...) options
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    sweep_prompt: int = 128
    sweep_gen: int = 32
    socket: Optional[str] = None             # the daemon for the `daemon` peer (default: the usual path)


def run(cfg: BenchConfig, log=print) -> dict:
    """Run the benchmark; converted peer weights live in a temporary folder removed at the end."""
    with tempfile.TemporaryDirectory(prefix="llmd-bench-peers-") as work_dir:
        return _run(cfg, work_dir, log)


def _run(cfg: BenchConfig, work_dir: str, log) -> dict:
    opts = dict(cfg.engine, num_speculative_tokens=cfg.num_speculative_tokens)
    llm = LLM(cfg.model, draft=cfg.draft or "none", **opts)
    k = llm.engine.num_speculative_tokens             # resolved: peers propose as many
    peers: list[Peer] = [LLMDPeer(llm)]
    if cfg.draft:                                    # speculation is judged against plain decoding
        peers.append(LLMDPeer(LLM(cfg.model, draft="none", **opts), "llmd-plain"))
    status: dict = {p.name: "ok" for p in peers}
    max_len = llm.engine.max_model_len
    for name in cfg.peers:
        p = load_peer(name, cfg.model, draft=cfg.draft, num_speculative_tokens=k,
                      threads=cfg.engine.get("threads"), n_ctx=max_len, work_dir=work_dir, socket=cfg.socket)
        if isinstance(p, Missing):
            status[name] = {"missing": p.reason}
            log(f"peer {name} missing: {p.reason}")
        else:
            status[p.name] = "ok"
            peers.append(p)
    for p in peers:                                  # warm-up: first calls pay one-time costs
        p.sweep([[1, 2, 3, 4, 5, 6, 7, 8]], 2)
    scale = Scale.named(cfg.scale)
    out = {"model": cfg.model, "seed": cfg.seed, "scale": cfg.scale, "rate": cfg.rate, "draft": cfg.draft,
           "threads": _threads(), "peers": status, "workloads": {}, "concurrency": {}}
    for i, name in enumerate(cfg.workloads):
        wl = build(name, llm.tokenizer, seed=cfg.seed, scale=scale, rate=cfg.rate)
        _check_fits(wl, max_len)
        log(f"workload {name}: {len(wl.requests)} requests")
        out["workloads"][name] = _run_workload(wl, peers[i % len(peers):] + peers[:i % len(peers)], llm)
    out["concurrency"] = sweep(peers, cfg, llm)
    return out


def _run_workload(wl, peers: list[Peer], llm) -> dict:
    res: dict = {"requests": len(wl.requests), "peers": {}, "samples": {}}
    decode = llm.tokenizer.decode
    spec = None
    for p in peers:
        if isinstance(p, LLMDPeer):
            p.llm.engine.block_manager.reset_prefix_cache()
            before = p.llm.stats()
        timings = p.run(wl)
        res["peers"][p.name] = summarize(timings, decode)
        res["samples"][p.name] = {"ttft_s": [_ttft(t) for t in timings if t.stamps],
                                  "e2e_s": [t.stamps[-1][0] - t.arrival_s for t in timings if t.stamps]}
        if p.name == "llmd":
            stats = _delta(before, p.llm.stats())
            llmd_timings, llmd_samples = timings, p.samples
    plain = res["peers"].get("llmd-plain")
    if plain:
        spec = {"spec_tok_s": res["peers"]["llmd"]["decode_tok_s"]["p50"], "plain_tok_s": plain["decode_tok_s"]["p50"]}
    res["evidence"] = evidence.measure(llm, stats, wl, llmd_timings, llmd_samples, decode=decode, spec=spec)
    res["ratios"] = ratios(res["peers"])
    return res


def _delta(before: dict, after: dict) -> dict:
    d = dict(after)
    for k in COUNTERS:
        if isinstance(after.get(k), (int, float)) and isinstance(before.get(k), (int, float)):
            d[k] = after[k] - before[k]
    q = d.get("prefix_tokens_queried")
    d["prefix_hit_rate"] = d["prefix_tokens_hit"] / q if q else 0.0
    d["spec_acceptance_rate"] = d["spec_accepted"] / d["spec_proposed"] if d.get("spec_proposed") else None
    return d


def _ttft(t: Timing) -> float:
    return t.stamps[0][0] - t.arrival_s


def pct(xs: list, qs=(50, 95, 99)) -> dict:
    if not xs:
        return {f"p{q}": None for q in qs}
    s = sorted(xs)
    return {f"p{q}": s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] for q in qs}


def summarize(timings: list[Timing], decode) -> dict:
    """TTFT, inter-token and end-to-end latency percentiles, tokens/s; time to first sentence for speech."""
    done = [t for t in timings if t.stamps]
    itl = [(b - a) / k for t in done for (a, _), (b, k) in zip(t.stamps, t.stamps[1:]) for _ in range(k)]
    tokens = sum(len(t.output_ids) for t in done)
    span = max((t.stamps[-1][0] for t in done), default=0.0) - min((t.arrival_s for t in done), default=0.0)
    out = {"requests": len(timings), "completed": len(done), "output_tokens": tokens,
           "ttft_s": pct([_ttft(t) for t in done]), "itl_s": pct(itl),
           "e2e_s": pct([t.stamps[-1][0] - t.arrival_s for t in done]),
           "tokens_per_s": tokens / span if span > 0 else None,
           "decode_tok_s": pct([(len(t.output_ids) - t.stamps[0][1]) / (t.stamps[-1][0] - t.stamps[0][0])
                                for t in done if t.stamps[-1][0] > t.stamps[0][0]])}
    speech = [t for t in done if t.kind in SENTENCE_KINDS]
    if speech:
        out["first_sentence_s"] = pct([first_sentence(t, decode) for t in speech])
    return out


def first_sentence(t: Timing, decode) -> float:
    """Seconds from arrival until the answer holds a complete sentence (or ends, if it never does)."""
    split, ids, seen = SentenceSplitter(), [], ""
    for stamp, k in t.stamps:
        ids.extend(t.output_ids[len(ids):len(ids) + k])
        text = decode(ids)
        if split.feed(text[len(seen):]):
            return stamp - t.arrival_s
        seen = text
    return t.stamps[-1][0] - t.arrival_s


def ratios(peers: dict) -> dict:
    """llmd / peer for each peer: latencies (lower is better for llmd) and tokens/s (higher is better)."""
    me = peers.get("llmd")
    out = {}
    for name, s in peers.items():
        if name == "llmd" or not me:
            continue
        r = {}
        for key in ("ttft_s", "itl_s", "e2e_s", "first_sentence_s"):
            a, b = (me.get(key) or {}).get("p50"), (s.get(key) or {}).get("p50")
            if a is not None and b:
                r[f"{key}_p50"] = a / b
        if me.get("tokens_per_s") and s.get("tokens_per_s"):
            r["tokens_per_s"] = me["tokens_per_s"] / s["tokens_per_s"]
        out[name] = r
    return out


def sweep(peers: list[Peer], cfg: BenchConfig, llm) -> dict:
    """Aggregate tokens/s of N equal requests served together, for each N in cfg.concurrency."""
    rng = random.Random(cfg.seed)
    vocab = min(llm.engine.model_config.vocab_size, llm.tokenizer.vocab_size)
    out: dict = {p.name: {} for p in peers}
    for n in cfg.concurrency:
        prompts = [[rng.randrange(vocab) for _ in range(cfg.sweep_prompt)] for _ in range(n)]
        for p in peers:
            if isinstance(p, LLMDPeer):
                p.llm.engine.block_manager.reset_prefix_cache()
            out[p.name][str(n)] = p.sweep(prompts, cfg.sweep_gen)
    return out


def _check_fits(wl, max_len: int) -> None:
    long = [r for r in wl.requests if len(r.prompt_ids) + r.max_tokens > max_len]
    if long:
        raise ValueError(f"workload {wl.name}: {len(long)} requests exceed the model's context of {max_len} "
                         f"tokens (longest {max(len(r.prompt_ids) for r in long)}); use --scale short")


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def headline(res: dict) -> str:
    """The side-by-side table: p50/p95 latencies and tokens/s per workload and peer, with ratios."""
    ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"     # noqa: E731
    lines = [f"model {res['model']}  scale {res['scale']}  seed {res['seed']}  threads {res['threads']}"]
    for name, st in res["peers"].items():
        if st != "ok":
            lines.append(f"peer {name}: MISSING ({st['missing']})")
    head = f"{'workload':11}{'peer':12}{'ttft p50/p95/p99 ms':>24}{'itl p50/p95 ms':>18}{'e2e p50/p95 ms':>18}{'tok/s':>9}"
    lines += ["", head]
    for w, r in res["workloads"].items():
        for peer, s in r["peers"].items():
            t, i, e = s["ttft_s"], s["itl_s"], s["e2e_s"]
            tps = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.1f}"
            lines.append(f"{w:11}{peer:12}{ms(t['p50']) + '/' + ms(t['p95']) + '/' + ms(t['p99']):>24}"
                         f"{ms(i['p50']) + '/' + ms(i['p95']):>18}{ms(e['p50']) + '/' + ms(e['p95']):>18}{tps:>9}")
        for peer, rr in r["ratios"].items():
            parts = ", ".join(f"{k} {v:.2f}x" for k, v in rr.items())
            lines.append(f"{'':11}llmd/{peer}: {parts}")
    if res.get("concurrency"):
        lines += ["", "aggregate tok/s by concurrency: " + "; ".join(
            f"{p}: " + " ".join(f"{n}={v:.0f}" for n, v in c.items()) for p, c in res["concurrency"].items())]
    return "\n".join(lines)
