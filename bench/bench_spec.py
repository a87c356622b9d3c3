"""Speculative decoding benchmark: measured against predicted speedup, side by side in one process.

    python -m llmd.bench.bench_spec --target models/code-target --draft models/code-draft

1. Code completion, single stream, held-out stdlib files: plain decoding and the draft at a fixed depth
   k, interleaved. Reports the per-token acceptance a (from the mean accepted tokens per step; see
   alpha_from_accepted), the draft's cost c (one draft forward / one plain
   target step), the verification cost v (a target step over k+1 tokens / a plain step), the predicted
   speedup E(a, k) / (k c + v) with E = (1 - a^(k+1)) / (1 - a), the measured speedup, and their ratio;
   then the same draft under the adaptive controller (depth up to k, per request and per step).
2. Code edit (output copies the input), single stream: n-gram lookup (at most --ngram-k proposals,
   fixed and adaptive) against plain decoding.
3. 16 concurrent streams: adaptive speculation (the draft, and n-gram lookup) against none, the order
   reversed each round.
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import statistics
import time

import torch

from llmd import LLM, SamplingParams
from llmd.runtime.config import DRAFT_K, NGRAM_K
from llmd.runtime.model_runner import Feed
from llmd.runtime.spec.controller import expected_tokens
from llmd.training.corpus import list_sources, read_source, split


def heldout_functions(n: int, seed: int = 0, min_lines: int = 6) -> list[str]:
    """Source of function definitions from held-out stdlib files (parsable, not too long)."""
    _, held = split(list_sources())
    out = []
    for f in held:
        text = read_source(f)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 >= min_lines:
                src = ast.get_source_segment(text, node)
                if src and len(src) < 1500:
                    out.append(src)
    random.Random(seed).shuffle(out)
    return out[:n]


def completion_prompts(n: int) -> list[str]:
    """The first lines of held-out functions: the model completes the body."""
    return ["\n".join(f.splitlines()[:3]) + "\n" for f in heldout_functions(n, seed=1)]


def edit_prompts(n: int) -> list[str]:
    """Rewrite a function with one rename: the answer copies most of the prompt."""
    out = []
    for f in heldout_functions(n, seed=2):
        name = f.split("(")[0].replace("def ", "").strip()
        out.append(f"# Original:\n{f}\n\n# The same function, renamed to {name}_v2:\n"
                   f"{f.splitlines()[0].replace(name, name + '_v2', 1)}\n")
    return out


def decode_rate(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, dict]:
    """Total output tokens / total decode time (after the first token), one request at a time."""
    toks, secs = 0, 0.0
    for p in prompts:
        out = llm.generate([p], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
        m = out.metrics
        toks += m["output_tokens"] - 1
        secs += m["decode_s"]
    return toks / secs, llm.stats()


def forward_time(llm: LLM, tokens: int, repeat: int = 20, draft: bool = False) -> float:
    """Median seconds of one forward over `tokens` rows at a context of about 100 tokens."""
    e = llm.engine
    runner = e.draft_runner if draft else e.runner
    blocks = list(range(-(-(100 + tokens) // e.config.block_size)))
    feed = Feed(list(range(10, 10 + tokens)), 100, blocks, tokens)
    times = []
    for _ in range(repeat):
        batch = runner.prepare_feeds([feed])
        t0 = time.perf_counter()
        runner.run(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mean_rates(llms: dict, prompts: list, max_tokens: int) -> dict[str, float]:
    """Mean decode tokens/s of each engine, interleaved prompt by prompt."""
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for p in prompts:
        for name, llm in llms.items():
            rates[name].append(decode_rate(llm, [p], max_tokens)[0])
    return {name: statistics.mean(r) for name, r in rates.items()}


def alpha_from_accepted(mean_accepted: float, k: int) -> float:
    """The per-token acceptance a of the speedup model: the a whose expected accepted tokens per step,
    a + a^2 + ... + a^k = E(a, k) - 1, equal the measured mean. (The fraction of proposed tokens
    accepted is a different figure: it counts the tokens after a rejection, never verified, as
    failures too, and put into E(a, k) it predicted speedups a third below the measured ones.)"""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) - 1 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return lo


def completion(target: str, draft: str, k: int, n: int, max_tokens: int) -> dict:
    prompts = completion_prompts(n)
    llms = {"plain": LLM(target, draft="none", kv_memory="256MiB"),
            "spec": LLM(target, draft=draft, kv_memory="256MiB", num_speculative_tokens=k, adaptive_speculation=False),
            "adaptive": LLM(target, draft=draft, kv_memory="256MiB", num_speculative_tokens=k)}
    mean = mean_rates(llms, prompts, max_tokens)
    spec = llms["spec"]
    stats = spec.stats()
    alpha = alpha_from_accepted(stats["spec_mean_accepted_len"], k)
    t1 = forward_time(spec, 1)
    c = forward_time(spec, 1, draft=True) / t1
    v = forward_time(spec, k + 1) / t1
    predicted = expected_tokens(alpha, k) / (k * c + v)
    measured = mean["spec"] / mean["plain"]
    return {"k": k, "prompts": len(prompts), "alpha": alpha, "accepted_fraction": stats["spec_acceptance_rate"],
            "mean_accepted_per_step": stats["spec_mean_accepted_len"], "draft_cost_c": c, "verify_cost_v": v,
            "plain_tok_s": mean["plain"], "spec_tok_s": mean["spec"],
            "predicted_speedup": predicted, "measured_speedup": measured, "measured_over_predicted": measured / predicted,
            "adaptive_tok_s": mean["adaptive"], "adaptive_speedup": mean["adaptive"] / mean["plain"]}


def code_edit(target: str, n: int, max_tokens: int, k: int) -> dict:
    """Plain decoding, n-gram lookup at a fixed depth k, and n-gram under the adaptive controller,
    interleaved prompt by prompt."""
    prompts = edit_prompts(n)
    llms = {"plain": LLM(target, draft="none", kv_memory="256MiB"),
            "ngram_fixed": LLM(target, draft="ngram", kv_memory="256MiB", num_speculative_tokens=k,
                               adaptive_speculation=False),
            "ngram_adaptive": LLM(target, draft="ngram", kv_memory="256MiB", num_speculative_tokens=k)}
    mean = mean_rates(llms, prompts, max_tokens)
    return {"prompts": len(prompts), "k": k, "plain_tok_s": mean["plain"],
            "ngram_fixed_tok_s": mean["ngram_fixed"], "ngram_adaptive_tok_s": mean["ngram_adaptive"],
            "speedup_fixed": mean["ngram_fixed"] / mean["plain"],
            "speedup_adaptive": mean["ngram_adaptive"] / mean["plain"],
            "alpha_fixed": llms["ngram_fixed"].stats()["spec_acceptance_rate"],
            "alpha_adaptive": llms["ngram_adaptive"].stats()["spec_acceptance_rate"]}


def concurrent(target: str, draft: str, streams: int, max_tokens: int, rounds: int = 2) -> dict:
    prompts = completion_prompts(streams)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    off = LLM(target, draft="none", kv_memory="512MiB")
    adaptive = LLM(target, draft=draft, kv_memory="512MiB", num_speculative_tokens=4)
    ngram = LLM(target, draft="ngram", kv_memory="512MiB")
    rates = {"off": [], "adaptive": [], "ngram": []}
    order = (("off", off), ("adaptive", adaptive), ("ngram", ngram))
    for r in range(rounds):     # the order reverses each round: none always runs on a warmer cache
        for name, llm in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    ctrl, nctrl = adaptive.engine.spec, ngram.engine.spec
    med = {name: statistics.median(r) for name, r in rates.items()}
    return {"streams": streams, "off_tok_s": med["off"], "adaptive_tok_s": med["adaptive"],
            "ratio": med["adaptive"] / med["off"],
            "spec_enabled_steps": ctrl.enabled_steps, "spec_disabled_steps": ctrl.disabled_steps,
            "ngram_tok_s": med["ngram"], "ngram_ratio": med["ngram"] / med["off"],
            "ngram_enabled_steps": nctrl.enabled_steps, "ngram_disabled_steps": nctrl.disabled_steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="models/code-target", help="target model directory (default %(default)s)")
    ap.add_argument("--draft", default="models/code-draft", help="draft model directory (default %(default)s)")
    ap.add_argument("--k", type=int, default=DRAFT_K, help="fixed depth for the predicted-vs-measured test")
    ap.add_argument("--ngram-k", type=int, default=NGRAM_K, help="most n-gram proposals per step (the engine's default)")
    ap.add_argument("--prompts", type=int, default=20, help="held-out completion prompts per workload (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default %(default)s)")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams in the batched comparison (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the 16-stream comparison; medians reported")
    ap.add_argument("--only", choices=("completion", "edit", "concurrent"), action="append",
                    help="run only this workload (repeatable; default all three)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = args.only or ["completion", "edit", "concurrent"]
    res = {}
    if "completion" in parts:
        res["completion"] = completion(args.target, args.draft, args.k, args.prompts, args.max_tokens)
    if "edit" in parts:
        res["code_edit_ngram"] = code_edit(args.target, args.prompts, args.max_tokens, args.ngram_k)
    if "concurrent" in parts:
        res["concurrent"] = concurrent(args.target, args.draft, args.streams, args.max_tokens, args.rounds)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
