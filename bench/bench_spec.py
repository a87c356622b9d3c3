"""Speculative decoding benchmark: off, each fixed depth and the adaptive controller, side by side.

    python -m llmd.bench.bench_spec --threads 1 --prompts 20 --max-tokens 64 --rounds 3

1. The draft model (--draft) on code completion (the first lines of held-out stdlib functions): one
   stream, the engines taking turns prompt by prompt (decode tok/s after the first token), then
   --streams requests at once (output tok/s over wall time), --passes batches a round, the engines
   taking turns batch by batch in an order that rotates.
2. N-gram lookup on code edits (the answer copies the prompt), the same two ways.
3. Instead (--replicas N): --streams requests on N engines with speculation off and N adaptive ones,
   made in turn, to show how far apart engines of one kind run in one process.

Each engine's ratio to speculation off is the median of the rounds' ratios (their range beside it).
Engines made apart differ by a few per cent by where their memory lands (--control shows it), so
--paired also runs the adaptive engine with its controller set aside (off_paired) and reports the
adaptive ratio to that as well (paired_ratio): the same weights, memory and KV pool.
The detail gives each fixed depth's per-token acceptance (from its mean accepted tokens per step; see
alpha_from_accepted) and the adaptive controller's steps by depth and its depth in force per batch size.
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import random
import re
import statistics
import time

import torch

from llmd import LLM, SamplingParams
from llmd.runtime.spec.controller import expected_tokens
from llmd.training.corpus import list_sources, read_source, split


def heldout_functions(n: int, seed: int = 0, min_lines: int = 6) -> list[str]:
    """Source of function definitions from held-out stdlib files (parsable, not too long)."""
    out = list(_heldout_definitions(min_lines))
    random.Random(seed).shuffle(out)
    return out[:n]


@functools.lru_cache(maxsize=None)
def _heldout_definitions(min_lines: int) -> tuple[str, ...]:
    """Every such definition, in file order: parsed once a process (each call read and parsed them all)."""
    _, held = split(list_sources())
    out = []
    for f in held:
        text = read_source(f)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = _LINE.findall(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 >= min_lines:
                src = _segment(lines, node)
                if src and len(src) < 1500:
                    out.append(src)
    return tuple(out)


# a line and its end, split where the parser splits (not at form feeds, as str.splitlines does)
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def _segment(lines: list[str], node: ast.AST) -> str:
    """``ast.get_source_segment`` from lines split once a file (it splits the whole text each call):
    offsets are UTF-8 bytes."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset:].decode()
    tail = lines[last].encode()[:node.end_col_offset].decode()
    return head + "".join(lines[first + 1:last]) + tail


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


class ControllerAside:
    """The adaptive engine with its controller set aside for a call: speculation off on the same
    weights, in the same memory, with the same KV pool. Engines made apart run a few per cent apart
    from where their memory lands (the control engine shows it), so this is the adaptive engine's own
    reference: its ratio to it is what the controller does, and nothing else."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def generate(self, prompts, params):
        scheduler = self.llm.engine.scheduler
        controller, scheduler.spec = scheduler.spec, None
        try:
            return self.llm.generate(prompts, params)
        finally:
            scheduler.spec = controller


def engines(target: str, draft: str, depths: list[int], kv_memory: str, control: bool = False,
            paired: bool = False, **adaptive_kw) -> dict:
    """Speculation off, the proposer at each fixed depth, and the adaptive controller over it;
    ``control``: a second engine with speculation off, made last (its ratio to the first shows what
    two identical engines differ by in this run); ``paired``: the adaptive engine with its controller
    set aside (off_paired, see ControllerAside)."""
    out = {"off": LLM(target, draft="none", kv_memory=kv_memory)}
    for k in depths:
        out[f"k{k}"] = LLM(target, draft=draft, kv_memory=kv_memory, num_speculative_tokens=k, adaptive_speculation=False)
    out["adaptive"] = LLM(target, draft=draft, kv_memory=kv_memory, **adaptive_kw)
    if paired:
        out["off_paired"] = ControllerAside(out["adaptive"])
    if control:
        out["off_again"] = LLM(target, draft="none", kv_memory=kv_memory)
    return out


def rotated(llms: dict, r: int) -> list:
    """The engines in a different order each round: none always runs right after the same one."""
    items = list(llms.items())
    shift = r % len(items)
    items = items[shift:] + items[:shift]
    return items if r % 2 == 0 else items[::-1]


def ratios(rates: dict[str, list[float]]) -> dict:
    """Per engine: tok/s (median over rounds) and its ratio to speculation off (median of the rounds'
    ratios, and their range); the adaptive engine's also to itself with its controller set aside
    (``paired_ratio``), where that ran."""
    out = {}
    for name, rs in rates.items():
        per_round = [x / o for x, o in zip(rs, rates["off"])]
        out[name] = {"tok_s": round(statistics.median(rs), 1), "ratio": round(statistics.median(per_round), 3),
                     "ratio_min": round(min(per_round), 3), "ratio_max": round(max(per_round), 3)}
    if "off_paired" in rates and "adaptive" in rates:
        paired = [a / o for a, o in zip(rates["adaptive"], rates["off_paired"])]
        out["adaptive"].update(paired_ratio=round(statistics.median(paired), 3), paired_min=round(min(paired), 3))
    return out


def warm(llms: dict, prompts: list[str]) -> None:
    """A short answer to the first prompt on each engine; where an engine shares its prefix cache with
    another (off_paired), every prompt, so that neither of the two finds the other's prompts cached
    in the first round only."""
    shared = any(isinstance(llm, ControllerAside) for llm in llms.values())
    for llm in llms.values():
        for p in prompts if shared else prompts[:1]:
            llm.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))


def one_stream(llms: dict, prompts: list[str], max_tokens: int, rounds: int) -> dict:
    """Decode tok/s of each engine, one request at a time, the engines taking turns prompt by prompt."""
    warm(llms, prompts)
    toks = {name: [0] * rounds for name in llms}
    secs = {name: [0.0] * rounds for name in llms}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for r in range(rounds):
        for i, p in enumerate(prompts):
            for name, llm in rotated(llms, r + i):
                m = llm.generate([p], params)[0].metrics
                toks[name][r] += m["output_tokens"] - 1
                secs[name][r] += m["decode_s"]
    return ratios({name: [t / s for t, s in zip(toks[name], secs[name])] for name in llms})


def streams(llms: dict, prompts: list[str], max_tokens: int, rounds: int, passes: int = 1) -> dict:
    """Output tok/s of each engine over all prompts at once (wall time), the order rotating each pass;
    a round's rate is its ``passes`` batches' tokens over their seconds (a batch of 16 short answers
    is a fraction of a second, so one batch a round leaves each ratio a few per cent of noise).
    Beside it, ``cpu_ratio``: the same ratio from the process's CPU time, which other processes'
    load moves much less than the wall time (one torch thread: CPU time is the work done)."""
    warm(llms, prompts)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    cpu: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(rounds):
        tokens = dict.fromkeys(llms, 0)
        wall = dict.fromkeys(llms, 0.0)
        busy = dict.fromkeys(llms, 0.0)
        for p in range(passes):
            for name, llm in rotated(llms, r * passes + p):
                t0, c0 = time.perf_counter(), time.process_time()
                outs = llm.generate(prompts, params)
                wall[name] += time.perf_counter() - t0
                busy[name] += time.process_time() - c0
                tokens[name] += sum(len(o.token_ids) for o in outs)
        for name in llms:
            rates[name].append(tokens[name] / wall[name])
            cpu[name].append(tokens[name] / busy[name])
    out = ratios(rates)
    for name, got in ratios(cpu).items():
        out[name]["cpu_ratio"] = got["ratio"]
    return out


def describe(llms: dict) -> dict:
    """Acceptance and the adaptive controller's choices, for the report."""
    out = {}
    for name, llm in llms.items():
        if isinstance(llm, ControllerAside):
            continue
        st, ctrl = llm.stats(), llm.engine.spec
        if ctrl is None:
            continue
        k = llm.engine.num_speculative_tokens
        accepted = st["spec_mean_accepted_len"]
        out[name] = {"alpha": round(alpha_from_accepted(accepted, k), 3) if accepted is not None and name != "adaptive" else None,
                     "accepted_per_step": accepted and round(accepted, 3)}
        if ctrl.adaptive:
            out[name].update(depth_steps=st["spec_depth_steps"], alpha_estimate=round(ctrl.global_alpha, 3),
                             best_by_batch={str(key): b.best for key, b in ctrl.batches.items()})
    return out


def sweep(target: str, draft: str, depths: list[int], n: int, max_tokens: int, rounds: int, batch: int,
          prompts: list[str], max_k: int | None, control: bool = False, passes: int = 1, paired: bool = False) -> dict:
    """Off, each fixed depth and adaptive, for one stream and for ``batch`` streams (fresh engines each)."""
    res = {}
    llms = engines(target, draft, depths, "64MiB", control, paired, num_speculative_tokens=max_k)
    res["one_stream"] = one_stream(llms, prompts[:n], max_tokens, rounds)
    res["one_stream_detail"] = describe(llms)
    llms = engines(target, draft, depths, "128MiB", control, paired, num_speculative_tokens=max_k)
    res[f"streams_{batch}"] = streams(llms, prompts[:batch], max_tokens, rounds, passes)
    res[f"streams_{batch}_detail"] = describe(llms)
    return res


def replicas(target: str, draft: str, n: int, batch: int, prompts: list[str], max_tokens: int, rounds: int,
             max_k: int | None, passes: int = 1) -> dict:
    """``batch`` streams on n engines with speculation off and n adaptive ones, made in turn (off,
    adaptive, off2, adaptive2, ...): how far apart engines of one kind run, so how much of a ratio
    is which engine was made when rather than what it does."""
    llms = {}
    for i in range(1, n + 1):
        tag = "" if i == 1 else str(i)
        llms[f"off{tag}"] = LLM(target, draft="none", kv_memory="128MiB")
        llms[f"adaptive{tag}"] = LLM(target, draft=draft, kv_memory="128MiB", num_speculative_tokens=max_k)
    return {f"streams_{batch}": streams(llms, prompts[:batch], max_tokens, rounds, passes),
            f"streams_{batch}_detail": describe(llms)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="models/code-target", help="target model directory (default %(default)s)")
    ap.add_argument("--draft", default="models/code-draft", help="draft model directory (default %(default)s)")
    ap.add_argument("--depths", default="1,2,3,4,5,6", help="fixed depths to run beside off and adaptive (default %(default)s)")
    ap.add_argument("--max-k", type=int, default=None,
                    help="deepest the adaptive controller may go (default: the engine's, by proposer)")
    ap.add_argument("--ngram-depths", default="2,4,8", help="fixed n-gram depths for the edit workload (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=20, help="prompts per round, one stream (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default %(default)s)")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams in the batched runs (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; ratios are medians of the rounds' (default %(default)s)")
    ap.add_argument("--passes", type=int, default=1,
                    help="batches of --streams requests per engine and round, the engines taking turns batch by "
                         "batch; a round's rate is over all of them (default %(default)s)")
    ap.add_argument("--only", choices=("draft", "edit"), action="append",
                    help="run only this workload (repeatable; default both)")
    ap.add_argument("--control", action="store_true",
                    help="add a second engine with speculation off (off_again): the run's noise floor")
    ap.add_argument("--paired", action="store_true",
                    help="add off_paired: the adaptive engine itself with its controller set aside, so that its "
                         "ratio is also taken on the same weights in the same memory (paired_ratio)")
    ap.add_argument("--replicas", type=int, default=0,
                    help="instead: --streams streams on this many engines with speculation off and as many "
                         "adaptive ones, made in turn (the spread between engines of one kind)")
    args = ap.parse_args(argv)
    if args.passes < 1 or args.rounds < 1:
        ap.error("--passes and --rounds take 1 or more")
    torch.set_num_threads(args.threads)
    parts = args.only or ["draft", "edit"]
    if args.replicas:
        res = {}
        if "draft" in parts:
            res["draft"] = replicas(args.target, args.draft, args.replicas, args.streams,
                                    completion_prompts(args.streams), args.max_tokens, args.rounds, args.max_k,
                                    args.passes)
        if "edit" in parts:
            res["ngram_edit"] = replicas(args.target, "ngram", args.replicas, args.streams, edit_prompts(args.streams),
                                         args.max_tokens, args.rounds, None, args.passes)
        print(json.dumps(res, indent=1), flush=True)
        return 0
    ints = lambda text: [int(x) for x in text.split(",") if x]        # noqa: E731
    res = {}
    if "draft" in parts:
        res["draft"] = sweep(args.target, args.draft, ints(args.depths), args.prompts, args.max_tokens, args.rounds,
                             args.streams, completion_prompts(max(args.prompts, args.streams)), args.max_k,
                             args.control, args.passes, args.paired)
        print(json.dumps(res["draft"], indent=1), flush=True)
    if "edit" in parts:
        res["ngram_edit"] = sweep(args.target, "ngram", ints(args.ngram_depths), args.prompts, args.max_tokens,
                                  args.rounds, args.streams, edit_prompts(max(args.prompts, args.streams)), None,
                                  args.control, args.passes, args.paired)
        print(json.dumps(res["ngram_edit"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
