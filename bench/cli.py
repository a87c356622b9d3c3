"""`llmd bench`: measure the engine (and transformers side by side) on one machine, in one run.

Reports time to first token, inter-token latency and tokens/s for one stream, aggregate tokens/s for
N concurrent streams, and the time to first token of a request whose long prefix is already cached.
Peers are interleaved with llmd in the same process so machine noise hits both alike.

llama.cpp on the same GGUF file: `--against llama-bench` runs llama.cpp's `llama-bench` between llmd's
one-stream rounds (llmd.bench.llama_bench); `--against llamacpp-server` is a load test of its own,
llmd's daemon against llama.cpp's server, both started and stopped here (llmd.bench.load_test);
`--against llamacpp-quality` sets an engine directory's quality beside llama.cpp's quantization of
the same model to the same width, on the export's quality-gate windows (llmd.bench.llama_quality).
"""
from __future__ import annotations

import gc
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from llmd.options import add_flags, given
from llmd.runtime.config import EngineConfig
from llmd.runtime.errors import LLMDError
from llmd.runtime.formats.gguf_import import resolve_model_path, source_gguf
from llmd.runtime.formats.gguf_check import is_gguf_file
from llmd.runtime.llm import LLM
from llmd.runtime.loading import native_gguf
from llmd.runtime.model_names import resolve_model
from llmd.runtime.models.random_model import write_random_model
from llmd.runtime.request import SamplingParams

from .llama_bench import LlamaBenchError, decode_rate, llama_bench_binary
from .llama_quality import LlamaCppError, compare_engine, table as quality_table
from .llama_server import LlamaServerError
from .membw import read_bandwidth, weight_bytes
from .load_test import LoadConfig, run_load, table as load_table
from .report import write_json, write_png
from .runner import BenchConfig, headline, run
from .workloads import WORKLOADS


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure latency and throughput of the engine (optionally against transformers)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="model directory or GGUF file; omit and use --shape for random weights")
    p.add_argument("--shape", choices=("tiny", "qwen2-0.5b"), help="benchmark a random-weight model of this shape")
    p.add_argument("--against", default="", help="comma-separated peers to run side by side: hf, llamacpp, "
                   "daemon (llamacpp and daemon only with --workload); llama-bench (llama.cpp's one-stream decode "
                   "on the same GGUF, alternating with llmd's); or alone, llamacpp-server (a closed-loop load test: "
                   "llmd's daemon against llama.cpp's server, both started here, at each --sweep concurrency); or alone, "
                   "llamacpp-quality (MODEL an engine directory from llmd export: its perplexity change and top-1 "
                   "agreement beside llama.cpp's quantization of --llama-gguf to the same width, Q8_0 for int8 and "
                   "w8a8, Q4_0 and Q4_1 for int4, on the export's quality-gate windows against its float reference; "
                   "llama.cpp's llama-quantize and llama-windows from $LLMD_LLAMA_CPP, .cache/llama-server/bin or "
                   "PATH, built by bench/build_llama_server.sh)")
    p.add_argument("--llama-gguf", default=None, help="the GGUF file llama-bench, llama-server or llama-quantize reads "
                   "(default: MODEL when it is a GGUF file, else the file MODEL was imported from; for llamacpp-quality, the "
                   "GGUF file the engine directory was exported from)")
    p.add_argument("--workload", default=None, help="run shipped workloads instead: comma-separated among "
                   "completion, voice, edit, batch, mixed, stamped, or 'all'")
    p.add_argument("--scale", choices=("short", "full"), default="full", help="workload size (short: seconds)")
    p.add_argument("--workload-seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--rate", type=float, default=4.0, help="mixed workload: arrivals per second (default 4)")
    p.add_argument("--sweep", default=None, help="concurrency levels of the throughput sweep (default 1,2,4,8; "
                   "1,4,8,16 for llamacpp-server)")
    p.add_argument("--requests-per-client", type=int, default=4, help="llamacpp-server: requests per client at each "
                   "level (default 4)")
    p.add_argument("--min-requests", type=int, default=8, help="llamacpp-server: requests per level, at least "
                   "(default 8)")
    p.add_argument("--socket", default=None, help="the daemon for the `daemon` peer (it must serve the same model)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.png (workload runs)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--gen", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent streams for the throughput test (default 16; 0 skips it)")
    p.add_argument("--shared-prefix", type=int, default=1000, help="length of the cached prefix test (0 skips it)")
    p.add_argument("--repeat", type=int, default=3, help="rounds of the single-stream, peer and concurrent tests, taken in turn; medians reported "
                   "(llamacpp-server: rounds of each level, new prompts each round, pooled)")
    p.add_argument("--spec", action="store_true", help="also run the single stream with speculation (needs --draft)")
    p.add_argument("--bandwidth", action="store_true", help="with llama-bench: read the memory bandwidth before each "
                   "round and report what share of it each engine's decode reads (weight bytes x tokens/s): how "
                   "close one stream is to the memory's ceiling")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_flags(p.add_argument_group("engine"), EngineConfig, skip=("model",))
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    """With --shape, the random-weight model lives in a temporary folder removed at the end."""
    try:
        return _run_bench(args)
    except (LLMDError, BenchArgumentError, LlamaBenchError, LlamaServerError, LlamaCppError) as e:
        print(f"llmd bench: {e}", file=sys.stderr)
        return 2


class BenchArgumentError(ValueError):
    """A flag of `llmd bench` that cannot be used as given."""


def peer_names(args) -> list[str]:
    names = [p for p in args.against.split(",") if p]
    for alone in ("llamacpp-server", "llamacpp-quality"):
        if alone in names and (len(names) > 1 or args.workload):
            raise BenchArgumentError(f"--against {alone} is a comparison of its own; give it alone, without --workload")
    if "llama-bench" in names and args.workload:
        raise BenchArgumentError("--against llama-bench compares one stream; it does not run --workload")
    if getattr(args, "bandwidth", False) and "llama-bench" not in names:
        raise BenchArgumentError("--bandwidth compares one stream's decode with llama-bench's: add --against llama-bench")
    if "llama-bench" in names and args.gen < 2:
        raise BenchArgumentError("--against llama-bench needs --gen of at least 2 (the decode steps follow the "
                                 "first token)")
    return names


def parse_levels(text: str | None, default: str) -> tuple[int, ...]:
    """--sweep: concurrency levels, each in [1, 256]."""
    try:
        levels = tuple(int(n) for n in (text or default).split(",") if n.strip())
    except ValueError:
        raise BenchArgumentError(f"--sweep takes integers separated by commas, got {text!r}") from None
    if not levels or any(not 1 <= n <= 256 for n in levels):
        raise BenchArgumentError(f"--sweep levels must be between 1 and 256, got {text!r}")
    return levels


def llama_gguf(args, model: str) -> str:
    """The GGUF file llama.cpp reads: --llama-gguf, MODEL itself, or the file MODEL was imported from."""
    path = args.llama_gguf or (args.model if is_gguf_file(args.model or "") else source_gguf(model))
    if not path:
        raise BenchArgumentError(f"{model} was not imported from a GGUF file: give the file llama.cpp should read "
                                 "with --llama-gguf FILE")
    if not Path(path).is_file():
        raise BenchArgumentError(f"--llama-gguf {path}: no such file")
    return str(path)


def against_llama_server(args, model: str) -> int:
    """`--against llamacpp-server`: the closed-loop load test (llmd.bench.load_test)."""
    try:
        cfg = LoadConfig(levels=parse_levels(args.sweep, "1,4,8,16"), prompt_len=args.prompt_len, gen=args.gen,
                         requests_per_client=args.requests_per_client, min_requests=args.min_requests,
                         repeat=args.repeat, threads=args.threads or torch.get_num_threads(), seed=args.workload_seed)
    except ValueError as e:
        raise BenchArgumentError(f"llamacpp-server: {e}") from None
    engine = given(args, EngineConfig, skip=("model", "threads"))
    gguf = llama_gguf(args, model)
    # a terminated bench still stops the two servers it started (the finally blocks run on SystemExit)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        res = run_load(model, gguf, engine, cfg, log=lambda m: print(m, file=sys.stderr))
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.out:
        write_json(res, f"{args.out}.json")
    print(json.dumps(res, indent=1) if args.json else load_table(res))
    return 0


def against_llama_quality(args) -> int:
    """`--against llamacpp-quality`: an engine directory's quality beside llama.cpp's (llmd.bench.llama_quality)."""
    if args.model is None:
        raise BenchArgumentError("--against llamacpp-quality compares an engine directory: give it as MODEL "
                                 "(llmd export writes one)")
    res = compare_engine(args.model, args.llama_gguf, args.threads or torch.get_num_threads(),
                         log=lambda m: print(m, file=sys.stderr))
    if args.out:
        write_json(res, f"{args.out}.json")
    print(json.dumps(res, indent=1) if args.json else quality_table(res))
    return 0


def _run_bench(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    peers = peer_names(args)                                  # refuses bad combinations before any import
    if args.model is not None:
        args.model = resolve_model(args.model)                              # a model by name: its path
    if "llamacpp-quality" in peers:
        return against_llama_quality(args)
    if args.model is not None:
        native = native_gguf(args.model, args.dtype or "auto")              # served from its own blocks
        model = args.model if native else resolve_model_path(args.model, args.dtype or "float32")
        if "llamacpp-server" in peers:
            return against_llama_server(args, model)
        return bench_model(args, model)
    if not args.shape:
        print("llmd bench: give a model directory or --shape", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="llmd-bench-") as tmp:
        return bench_model(args, str(write_random_model(Path(tmp) / args.shape, args.shape)))


def bench_model(args, model: str) -> int:
    opts = given(args, EngineConfig, skip=("model",))
    draft = opts.pop("draft", None)
    if args.workload:
        return run_workloads(args, model, draft, opts)
    llm = LLM(model, draft="none", **opts)
    spec_llm = LLM(model, draft=draft, **opts) if (args.spec and draft) else None
    with collector_frozen():
        return measure(args, model, llm, spec_llm)


@contextmanager
def collector_frozen():
    """What is alive now (torch's own objects, the engines) kept out of the garbage collector's full
    passes for the block, which would otherwise stall a round at random, as `llmd serve` keeps its
    engine; handed back after (a caller in the same process may build engines again)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def measure(args, model: str, llm, spec_llm) -> int:
    """The one-stream rounds with their peers, the concurrent and shared-prefix tests, and the report."""
    peers = peer_names(args)
    device = getattr(llm.engine.runner, "device", torch.device("cpu"))
    hf = load_hf(model, device, args.dtype or "float32") if "hf" in peers else None
    llama = llama_bench_peer(args, model) if "llama-bench" in peers else None
    vocab = min(llm.engine.model_config.vocab_size, llm.tokenizer.vocab_size)
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    res: dict = {"model": model, "threads": torch.get_num_threads(), "prompt_len": args.prompt_len, "gen": args.gen,
                 "device": str(device), "dtype": args.dtype or "auto"}
    singles, hfs, specs, concurrents, llamas = [], [], [], [], []
    # warm-up: a full-length prompt, so that the timed rounds compile nothing (the prompt chunks' kernel
    # variants, on a GPU) and the peer's first call pays no start-up either
    single_stream(llm, prompt, min(8, args.gen))
    if hf is not None:
        hf_single(hf, prompt, 2)
    streams = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
    # one stream, its peers and many streams take turns, so a slow spell of the machine falls on
    # all of them alike; each figure is the median of its repeats (llama-bench's: the best too)
    readings: dict[str, list[float]] = {"llmd": [], "llama": []}   # --bandwidth: read just before each round

    def read(who: str) -> None:
        if args.bandwidth:
            readings[who].append(read_bandwidth(res["threads"], 512, 3))
    for i in range(args.repeat):
        if llama and i % 2:
            read("llama")
            llamas.append(llama())
        read("llmd")
        singles.append(single_stream(llm, prompt, args.gen))
        if llama and not i % 2:
            read("llama")
            llamas.append(llama())
        if spec_llm:
            specs.append(single_stream(spec_llm, prompt, args.gen))
        if hf is not None:
            hfs.append(hf_single(hf, prompt, args.gen))
        if streams:
            concurrents.append(concurrent(llm, streams, args.gen))
    res["llmd_single"] = median_dict(singles)
    if specs:
        res["llmd_spec_single"] = median_dict(specs)
    if hfs:
        res["hf_single"] = median_dict(hfs)
        res["ratio_decode_vs_hf"] = res["llmd_single"]["decode_tok_s"] / res["hf_single"]["decode_tok_s"]
        res["ratio_ttft_vs_hf"] = res["llmd_single"]["ttft_s"] / res["hf_single"]["ttft_s"]
    if llamas:
        res["llama_bench"] = llama_bench_summary(singles, llamas, llama.gguf)
        if args.bandwidth:
            res["bandwidth"] = bandwidth_summary(singles, llamas, readings, decode_bytes(llm, llama.gguf),
                                                 weight_bytes(Path(llama.gguf)))
    if concurrents:
        res["llmd_concurrent"] = median_dict(concurrents)
        # decode against decode: the single-stream figure leaves its prompt out, so the concurrent one does too
        res["concurrency_gain"] = res["llmd_concurrent"]["decode_aggregate_tok_s"] / res["llmd_single"]["decode_tok_s"]
        res["concurrency_gain_end_to_end"] = res["llmd_concurrent"]["aggregate_tok_s"] / res["llmd_single"]["decode_tok_s"]
    if args.shared_prefix:
        res["prefix"] = shared_prefix(llm, vocab, args.shared_prefix, rng)
    res["engine_stats"] = {k: v for k, v in llm.stats().items() if not isinstance(v, dict)}
    print(json.dumps(res, indent=1) if args.json else table(res))
    return 0


def llama_bench_peer(args, model: str):
    """One llama-bench run per call on the GGUF llama.cpp reads: as many decode steps as llmd's one
    stream takes (its first token comes from the prompt), after a context of the prompt's length."""
    gguf, binary = llama_gguf(args, model), llama_bench_binary()
    threads = args.threads or torch.get_num_threads()

    def run() -> dict:
        return decode_rate(binary, gguf, threads, depth=args.prompt_len, gen=args.gen - 1)
    run.gguf = gguf
    return run


def llama_bench_summary(singles: list[dict], llamas: list[dict], gguf: str) -> dict:
    """Best and median decode tokens/s of llmd's one stream and of llama-bench, and llmd / llama.cpp."""
    mine = [s["decode_tok_s"] for s in singles]
    theirs = [r["decode_tok_s"] for r in llamas]
    return {"gguf": gguf, "kv": llamas[0]["kv"], "model_type": llamas[0]["model_type"], "llama_runs": theirs,
            "llmd_runs": mine, "llmd_best": max(mine), "llama_best": max(theirs),
            "ratio_best": max(mine) / max(theirs),
            "ratio_median": statistics.median(mine) / statistics.median(theirs)}


def decode_bytes(llm, gguf: str) -> int:
    """The weight bytes one decode step of llmd reads: its fused step's tensors and its head's kernel
    form, or the head screen's reads where it ran (its parts and its exact rows, per row); the GGUF
    file's size where the step is not fused (the same weights, as llama.cpp reads them)."""
    model = llm.engine.runner.model
    fused = getattr(model, "fused_decode", None)
    read = fused.weight_bytes() if fused is not None else None
    screen = getattr(model, "head_screen", None)
    if read is not None and screen is not None and screen.stats.on and screen.stats.rows:
        read += screen.bytes_per_row() - screen.head_bytes()
    return weight_bytes(Path(gguf)) if read is None else read


def bandwidth_summary(singles: list[dict], llamas: list[dict], readings: dict, llmd_bytes: int,
                      llama_bytes: int) -> dict:
    """Each engine's decode as a share of the read bandwidth measured just before its round (median over
    rounds), and the bandwidth 1.25x llama.cpp's median rate would need at llmd's bytes per token."""
    def shares(runs, bws, nbytes):
        return [r["decode_tok_s"] * nbytes / bw for r, bw in zip(runs, bws)]
    every = readings["llmd"] + readings["llama"]
    llama_rate = statistics.median(r["decode_tok_s"] for r in llamas)
    mine, theirs = shares(singles, readings["llmd"], llmd_bytes), shares(llamas, readings["llama"], llama_bytes)
    return {"readings_gb_s": [round(b / 1e9, 1) for b in every], "llmd_bytes": llmd_bytes, "llama_bytes": llama_bytes,
            "llmd_shares": [round(x, 3) for x in mine], "llama_shares": [round(x, 3) for x in theirs],
            "llmd_share": statistics.median(mine), "llama_share": statistics.median(theirs),
            "needed_for_1_25x_gb_s": 1.25 * llama_rate * llmd_bytes / 1e9, "best_reading_gb_s": max(every) / 1e9}


def run_workloads(args, model, draft, opts) -> int:
    """`--workload`: the shipped workloads on llmd and each peer, interleaved (llmd.bench.runner)."""
    names = WORKLOADS if args.workload == "all" else tuple(w for w in args.workload.split(",") if w)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        print(f"llmd bench: unknown workload {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    levels = parse_levels(args.sweep, "1,2,4,8")
    k = opts.pop("num_speculative_tokens", None)
    cfg = BenchConfig(model=model, workloads=names, peers=tuple(p for p in args.against.split(",") if p),
                      seed=args.workload_seed, scale=args.scale, rate=args.rate, draft=draft, num_speculative_tokens=k,
                      engine=opts, concurrency=levels, socket=args.socket)
    res = run(cfg, log=lambda m: print(m, file=sys.stderr))
    if args.out:
        write_json(res, f"{args.out}.json")
        try:
            write_png(res, f"{args.out}.png")
        except ImportError:
            print("llmd bench: matplotlib is not installed (pip install 'llmd[bench]'); no PNG written",
                  file=sys.stderr)
    print(json.dumps(res, indent=1) if args.json else headline(res))
    return 0


def single_stream(llm, prompt, gen) -> dict:
    llm.engine.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    first = None
    stamps = []
    for out in llm.stream_outputs(prompt, SamplingParams(max_tokens=gen, ignore_eos=True)):
        now = time.perf_counter()
        if first is None:
            first = now - t0
        stamps.append((now, len(out.new_token_ids)))
    total = time.perf_counter() - t0
    n = sum(k for _, k in stamps)
    gaps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    return {"ttft_s": first, "decode_tok_s": (n - 1) / (total - first) if n > 1 else 0.0,
            "itl_p50_s": statistics.median(gaps) if gaps else None, "e2e_s": total, "tokens": n}


def concurrent(llm, prompts, gen) -> dict:
    """n streams at once, twice: cold (prompts computed in the run: end-to-end tokens/s) and with the
    prompts already in the prefix cache. The second gives the decode tokens/s comparable with one
    stream's: like that figure it counts from the first token (the cache serves whole blocks, so the
    streams' first step still computes each prompt's last block) and leaves that token out."""
    llm.engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    ttfts = sorted(o.metrics["ttft_s"] for o in outs)
    t0 = time.perf_counter()                      # the same prompts again: now served from the cache
    warm = llm.generate(prompts, params)
    warm_wall = time.perf_counter() - t0
    first = max(o.metrics["ttft_s"] for o in warm)   # every stream has its first token
    return {"streams": len(prompts), "aggregate_tok_s": toks / wall, "wall_s": wall, "ttft_p50_s": ttfts[len(ttfts) // 2],
            "decode_aggregate_tok_s": sum(len(o.token_ids) - 1 for o in warm) / (warm_wall - first),
            "warm_first_token_s": first, "cached_prompt_tokens": sum(o.metrics.get("cached_tokens", 0) for o in warm)}


def shared_prefix(llm, vocab, length, rng) -> dict:
    llm.engine.block_manager.reset_prefix_cache()
    prefix = [rng.randrange(vocab) for _ in range(length)]
    p = SamplingParams(max_tokens=1)
    first = llm.generate([prefix + [rng.randrange(vocab) for _ in range(8)]], p)[0].metrics["ttft_s"]
    second = llm.generate([prefix + [rng.randrange(vocab) for _ in range(8)]], p)[0]
    return {"prefix_len": length, "first_ttft_s": first, "second_ttft_s": second.metrics["ttft_s"],
            "second_cached_tokens": second.metrics["cached_tokens"], "ratio": second.metrics["ttft_s"] / first}


def load_hf(model, device, dtype: str):
    """transformers on the device and in the dtype llmd runs in (its eager attention: what ships)."""
    try:
        import transformers
    except ImportError:
        print("llmd bench: transformers is not installed (pip install 'llmd[bench]'); skipping the hf peer",
              file=sys.stderr)
        return None
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()


def hf_single(hf, prompt, gen) -> dict:
    ids = torch.tensor([prompt], device=hf.device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    done = torch.cuda.synchronize if hf.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        done()
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=gen, min_new_tokens=gen, **kw)
        done()
        total = time.perf_counter() - t0
    return {"ttft_s": ttft, "decode_tok_s": (gen - 1) / max(total - ttft, 1e-9), "e2e_s": total, "tokens": gen}


def median_dict(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) if rows[0][k] is not None else None for k in rows[0]}


def table(r: dict) -> str:
    ms = lambda s: "-" if s is None else f"{1000 * s:.1f} ms"   # noqa: E731
    lines = [f"model {r['model']}  threads {r['threads']}  prompt {r['prompt_len']}  gen {r['gen']}", ""]
    lines.append(f"{'':24}{'ttft':>12}{'decode tok/s':>14}{'itl p50':>12}")
    for key, name in (("llmd_single", "llmd 1 stream"), ("llmd_spec_single", "llmd 1 stream, spec"),
                      ("hf_single", "transformers 1 stream")):
        if key in r:
            s = r[key]
            lines.append(f"{name:24}{ms(s['ttft_s']):>12}{s['decode_tok_s']:>14.1f}{ms(s.get('itl_p50_s')):>12}")
    if "ratio_decode_vs_hf" in r:
        lines.append(f"llmd / transformers: decode {r['ratio_decode_vs_hf']:.2f}x, ttft {r['ratio_ttft_vs_hf']:.2f}x "
                     "(ttft: lower is better)")
    if "llama_bench" in r:
        b = r["llama_bench"]
        lines.append(f"llama-bench {b['model_type']} (KV {b['kv']}): decode best {b['llama_best']:.1f} tok/s; llmd best "
                     f"{b['llmd_best']:.1f}; llmd / llama.cpp {b['ratio_best']:.2f}x best, {b['ratio_median']:.2f}x median")
    if "bandwidth" in r:
        w = r["bandwidth"]
        lines.append(f"memory: read {min(w['readings_gb_s']):.1f}-{max(w['readings_gb_s']):.1f} GB/s before the rounds; "
                     f"decode reads {100 * w['llmd_share']:.0f}% of it in llmd ({w['llmd_bytes'] / 1e6:.1f} MB a token), "
                     f"{100 * w['llama_share']:.0f}% in llama.cpp ({w['llama_bytes'] / 1e6:.1f} MB); 1.25x llama.cpp "
                     f"needs {w['needed_for_1_25x_gb_s']:.1f} GB/s")
    c = r.get("llmd_concurrent")
    if c:
        lines.append(f"llmd {c['streams']} streams: {c['decode_aggregate_tok_s']:.1f} tok/s aggregate decode, prompts "
                     f"cached ({r['concurrency_gain']:.1f}x one stream); {c['aggregate_tok_s']:.1f} tok/s end to end "
                     f"with their prompts ({r['concurrency_gain_end_to_end']:.1f}x), ttft p50 {ms(c['ttft_p50_s'])}")
    if "prefix" in r:
        p = r["prefix"]
        lines.append(f"shared prefix {p['prefix_len']}: ttft {ms(p['first_ttft_s'])} cold, {ms(p['second_ttft_s'])} "
                     f"cached ({100 * p['ratio']:.0f}%, {p['second_cached_tokens']} tokens from cache)")
    return "\n".join(lines)
