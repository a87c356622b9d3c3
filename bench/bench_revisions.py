"""Two installs of llmd side by side (e.g. a branch and a `git worktree` of the commit before it, each
with its own .venv), runs alternating so that a shared machine's load hits both alike; medians and
new/base ratios.

    python bench/bench_revisions.py --base /tmp/base/.venv/bin/python --new .venv/bin/python --rounds 6
    python bench/bench_revisions.py ... --llmd-bench -- --repeat 1 --gen 32     # `llmd bench --shape tiny`

The default measure, per engine step of the tiny random model on one thread: Python calls (a count,
free of noise), CPU seconds per token (less sensitive to other processes than wall time) and wall
seconds per token, for one decode stream (the fused step), eight streams, and a 400-token prompt
(the layer-by-layer forward).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure() -> dict:
    from llmd import LLM, SamplingParams
    from llmd.runtime.models.random_model import write_random_model
    from llmd.runtime.config import EngineConfig
    names = {f.name for f in dataclasses.fields(EngineConfig)}      # the option's name differs by revision
    no_cache = {"prefix_cache" if "prefix_cache" in names else "enable_prefix_cache": False}
    llm = LLM(str(write_random_model(Path(tempfile.mkdtemp()) / "tiny", "tiny")), kv_memory="64MiB", threads=1,
              draft="none", **no_cache)      # plain decoding in every revision, whatever its default draft
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out = {}
    for name, prompts, n in (("decode1", [[5] * 16], 64), ("decode8", [[5 + i] * 16 for i in range(8)], 32),
                             ("prefill400", [list(range(20, 420))], 1)):
        llm.generate(prompts, greedy(n))                     # warm
        tokens = n * len(prompts) if n > 1 else 400
        cpu = wall = float("inf")
        for _ in range(5):
            c, w = time.process_time(), time.perf_counter()
            llm.generate(prompts, greedy(n))
            cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
        out[f"{name}_cpu_ms_per_tok"] = 1e3 * cpu / tokens
        out[f"{name}_wall_ms_per_tok"] = 1e3 * wall / tokens
        out[f"{name}_python_calls_per_step"] = python_calls(llm.engine, prompts, n)
    return out


def python_calls(engine, prompts: list[list[int]], n: int) -> float:
    """Python function calls per engine step, counted over the steps after the prompt's."""
    from llmd import SamplingParams
    for i, p in enumerate(prompts):
        engine.add_request(f"count-{i}-{time.monotonic_ns()}", p, SamplingParams(max_tokens=n, temperature=0.0,
                                                                                  ignore_eos=True))
    if n > 1:
        engine.step()                        # the prompts: decode steps are counted
    calls, steps = [0], 0

    def tracer(frame, event, arg):
        if event == "call":
            calls[0] += 1
    sys.setprofile(tracer)
    try:
        for _ in range(min(8, n)):
            engine.step()
            steps += 1
    finally:
        sys.setprofile(None)
    while engine.has_unfinished():
        engine.step()
    return calls[0] / steps


def run(python: str, llmd_bench: list[str] | None) -> dict:
    if llmd_bench is None:
        done = subprocess.run([python, __file__, "--measure"], capture_output=True, text=True)
    else:
        llmd = str(Path(python).with_name("llmd"))
        done = subprocess.run([llmd, "bench", "--shape", "tiny", "--json", *llmd_bench], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{python}: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1] if llmd_bench is None else done.stdout)
    if llmd_bench is not None:
        single, many = result["llmd_single"], result["llmd_concurrent"]
        result = {"ttft_s": single["ttft_s"], "itl_p50_s": single["itl_p50_s"], "decode_tok_s": single["decode_tok_s"],
                  "aggregate_tok_s": many["aggregate_tok_s"]}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the baseline install's python")
    p.add_argument("--new", help="the new install's python")
    p.add_argument("--rounds", type=int, default=6, help="runs of each install, alternating (default 6)")
    p.add_argument("--llmd-bench", action="store_true", help="time `llmd bench --shape tiny` (arguments after --)")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    if not (args.base and args.new):
        p.error("--base and --new are required")
    extra = [a for a in rest if a != "--"] if args.llmd_bench else None
    runs = {"base": [], "new": []}
    for r in range(args.rounds):
        for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
            runs[name].append(run(getattr(args, name), extra))
            print(r, name, json.dumps(runs[name][-1]), file=sys.stderr, flush=True)
    report = {}
    for key in runs["base"][0]:
        base, new = (statistics.median(x[key] for x in runs[n]) for n in ("base", "new"))
        report[key] = {"base": base, "new": new, "new/base": new / base if base else None}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
