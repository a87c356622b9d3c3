"""Editor workload: keystrokes through a held-out file, an inline completion after each.

    .venv/bin/python bench/bench_editor.py --model models/code-target --threads 2
    .venv/bin/python bench/bench_editor.py --socket /run/user/1000/llmd/llmd.sock   # a running daemon

The daemon runs as a separate process (``python -m llmd.daemon serve``) unless --socket names a
running one; ``llmd lsp`` runs as an editor would start it, and pygls's client drives it over
stdio. The document is a held-out stdlib file (the demo models never trained on it) with
--lines lines removed at its middle; the benchmark types them back one character at a time and,
after each keystroke, asks for an inline completion of up to --max-tokens tokens, waiting for
the answer before the next key (so no request is superseded). It reports p50/p95 of the time from
the LSP request to its response, as the editor sees it, for all keystrokes, for those the model
served and for those the language server's own cache served, and the server's outcome counts.
Then it opens --first-in-file other held-out files, one at a time, and asks a completion in the
middle of each right away (the first completion in a newly opened file).

--baseline runs everything twice, each against its own fresh daemon: first the language server
without prefill and without the speed-sized cold window (``--no-prefill --target-ms 1e9``), then as
configured, and prints both with their ratios.

    .venv/bin/python bench/bench_editor.py --model /path/to/hf-dir --baseline --keystrokes 40

--against llamacpp-server runs the same keystrokes, through the same language server, against
llama.cpp's server on --gguf (``bench/build_llama_server.sh``'s binary, on 127.0.0.1 and a free port,
``--cache-reuse 256``, one slot; the language server's HTTP backend asks its ``/infill`` with
``cache_prompt``), started before and stopped after its run, and prints llama.cpp / llmd ratios.
--run NAME:FLAGS adds a run against a fresh daemon with more language-server flags, e.g.
``--run "spm:--fim-layout spm"``.

    .venv/bin/python bench/bench_editor.py --model ENGINE_DIR --gguf FILE.gguf --against llamacpp-server

Targets (the real coder): model-served p50 <= 150 ms, p95 <= 400 ms; keystrokes p50 <= 50 ms,
p95 <= 250 ms; first completion in a file <= 500 ms.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmd import LLM
from llmd.clients.client import Client, ClientError
from llmd.clients.lsp_probe import LspProbe
from llmd.bench.llama_server import LlamaServer, binary as llama_binary
from llmd.clients.lsp_service import percentile
from llmd.runtime.request import SamplingParams
from llmd.training.corpus import list_sources, split

REPO = Path(__file__).resolve().parents[1]


def start_daemon(model: str, socket: str, threads: int, extra: list[str]) -> subprocess.Popen:
    """`llmd serve` as a separate process; waits until it answers health with state ready."""
    cmd = [sys.executable, "-m", "llmd.daemon", "serve", "--model", model, "--socket", socket,
           "--threads", str(threads), *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "XDG_CONFIG_HOME": str(Path(socket).parent)})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited: {proc.stderr.read()[-2000:]}")
        try:
            with Client(socket, connect_timeout=1.0) as c:
                if c.health()["state"] == "ready":
                    return proc
        except ClientError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the daemon did not become ready within 300 s")


@contextlib.contextmanager
def daemon_socket(args):
    """The language server's flags for the daemon to benchmark: --socket as given, or a daemon started
    here from --model (stopped after)."""
    with tempfile.TemporaryDirectory() as tmp:
        socket = args.socket or str(Path(tmp) / "llmd.sock")
        daemon = None if args.socket else start_daemon(args.model, socket, args.threads, args.serve_arg)
        try:
            yield ["--socket", socket]
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(30)


LLAMA_ARGS = ["--cache-reuse", "256", "-c", "8192", "-np", "1"]


@contextlib.contextmanager
def llama_backend(args):
    """The language server's flags for a llama.cpp server started here on --gguf (127.0.0.1, a free
    port; its own prompt cache: ``--cache-reuse 256``, and the client sends ``cache_prompt``)."""
    with LlamaServer() as server:
        url = server.start(llama_binary(), args.gguf, args.threads, [*LLAMA_ARGS, *args.llama_arg])
        yield ["--backend", url]


def default_file() -> Path:
    """A held-out stdlib file of a few kilobytes."""
    held = split(list_sources())[1]
    sized = [f for f in held if 3000 <= f.path.stat().st_size <= 20000]
    return (sized or held)[0].path


def typing_session(text: str, lines: int) -> tuple[str, list[tuple[int, int, str]]]:
    """The document with ``lines`` lines cut at its middle, and the keystrokes (line, col, char)
    that type them back."""
    all_lines = text.splitlines(keepends=True)
    start = max(0, len(all_lines) // 2 - lines // 2)
    cut = all_lines[start:start + lines]
    doc = "".join(all_lines[:start]) + "".join(all_lines[start + lines:])
    keys, line, col = [], start, 0
    for ch in "".join(cut):
        keys.append((line, col, ch))
        line, col = (line + 1, 0) if ch == "\n" else (line, col + 1)
    return doc, keys


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": percentile(values, 50), "p95_ms": percentile(values, 95),
            "mean_ms": sum(values) / len(values) if values else None}


async def run_editor(where: list[str], path: Path, args, extra_lsp_args: list[str] = ()) -> dict:
    doc, keys = typing_session(path.read_text(encoding="utf-8", errors="ignore"), args.lines)
    keys = keys[:args.keystrokes]
    uri = path.resolve().as_uri()
    lsp_args = [*where, "--max-tokens", str(args.max_tokens), "--debounce-ms", str(args.debounce_ms),
                "--log-file", args.log_file or os.devnull, *args.lsp_arg, *extra_lsp_args]
    latencies, model, cached, answered = [], [], [], 0
    first = []
    async with LspProbe(lsp_args, cwd=str(REPO)) as lsp:
        lsp.open(uri, doc)
        for _ in range(args.warmup):
            await lsp.inline(uri, keys[0][0], keys[0][1])
        hits = (await lsp.stats())["cache_hit"]
        for line, col, ch in keys:
            lsp.insert(uri, line, col, ch)
            at = (line + 1, 0) if ch == "\n" else (line, col + 1)
            t = time.perf_counter()
            text = await lsp.inline(uri, *at)
            ms = 1000 * (time.perf_counter() - t)
            latencies.append(ms)
            answered += text is not None
            now = (await lsp.stats())["cache_hit"]          # outside the timed part
            (cached if now > hits else model).append(ms)
            hits = now
            if args.interval_ms:
                await asyncio.sleep(args.interval_ms / 1000)
        for other in other_files(path, args.first_in_file):
            body = other.read_text(encoding="utf-8", errors="ignore")
            other_uri = other.resolve().as_uri()
            lsp.open(other_uri, body)
            if args.open_pause_ms:
                await asyncio.sleep(args.open_pause_ms / 1000)
            mid = body.count("\n") // 2
            t = time.perf_counter()
            await lsp.inline(other_uri, mid, 0)
            first.append(1000 * (time.perf_counter() - t))
        server = await lsp.stats()
    return {"file": str(path), "keystrokes": len(latencies), "with_suggestion": answered,
            **summary(latencies), "model_served": summary(model), "cache_served": summary(cached),
            "first_in_file": summary(first), "server": server}


def other_files(path: Path, n: int) -> list[Path]:
    """``n`` held-out files other than ``path``, for first-in-file completions."""
    held = [f.path for f in split(list_sources())[1] if f.path.resolve() != path.resolve()]
    return [f for f in held if 2000 <= f.stat().st_size <= 40000][:n]


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def report(name: str, r: dict) -> None:
    s = r["server"]
    print(f"[{name}] {r['keystrokes']} keystrokes through {r['file']}: p50 {fmt(r['p50_ms'])} ms, "
          f"p95 {fmt(r['p95_ms'])} ms, mean {fmt(r['mean_ms'])} ms")
    for key in ("model_served", "cache_served", "first_in_file"):
        v = r[key]
        print(f"[{name}]   {key.replace('_', '-')}: n {v['n']}, p50 {fmt(v['p50_ms'])} ms, p95 {fmt(v['p95_ms'])} ms")
    print(f"[{name}]   suggestions shown {r['with_suggestion']}; server: completed {s['completed']}, cache hits "
          f"{s['cache_hit']}, empty {s['empty']}, errors {s['error']}, prefilled {s.get('prefilled', 0)}, "
          f"prefills replaced {s.get('prefill_replaced', 0)}, prefill errors {s.get('prefill_error', 0)}")


def ratio(base, new) -> str:
    return "-" if not base or not new else f"{base / new:.2f}x"


def speedup(name: str, b: dict, n: dict) -> str:
    """One line of ``b`` / ``n`` ratios (above 1: llmd is faster)."""
    return (f"speed-up over {name} ({name} / llmd): keystroke p50 {ratio(b['p50_ms'], n['p50_ms'])}, p95 "
            f"{ratio(b['p95_ms'], n['p95_ms'])}; model-served p50 "
            f"{ratio(b['model_served']['p50_ms'], n['model_served']['p50_ms'])}, p95 "
            f"{ratio(b['model_served']['p95_ms'], n['model_served']['p95_ms'])}; first-in-file p50 "
            f"{ratio(b['first_in_file']['p50_ms'], n['first_in_file']['p50_ms'])}, p95 "
            f"{ratio(b['first_in_file']['p95_ms'], n['first_in_file']['p95_ms'])}")


def partial_reuse(model: str, threads: int, rounds: int = 7) -> None:
    """Partial-block reuse on its own, in one process: after a prompt-only request for a prompt of
    250-256 tokens (a partly filled last block), the same prompt again and the prompt extended by 3
    tokens, with partly matching blocks copied and without (full blocks only)."""
    llm = LLM(model, threads=threads, kv_memory="64MiB")
    ids = llm.tokenizer.encode(default_file().read_text(encoding="utf-8", errors="ignore"))[:270]
    one = SamplingParams(max_tokens=1)

    def timed(prompt):
        t = time.perf_counter()
        out = llm.generate(prompt, one)[0]
        return 1000 * (time.perf_counter() - t), len(prompt) - out.metrics["cached_tokens"]

    def run(on: bool):
        llm.engine.block_manager.reuse_partial_blocks = on
        rows = []
        for r in range(rounds):
            llm.engine.block_manager.reset_prefix_cache()
            p = ids[:250 + r]
            llm.generate(p, SamplingParams(max_tokens=1, prompt_only=True))
            rows.append(timed(p) + timed(p + ids[260:263]))
        return [statistics.median(col) for col in zip(*rows)]

    for _ in range(2):
        off, on = run(False), run(True)
        print(f"same prompt again: {off[0]:.1f} -> {on[0]:.1f} ms ({off[0] / on[0]:.2f}x), computed tokens "
              f"{off[1]:.0f} -> {on[1]:.0f}; extended by 3 tokens: {off[2]:.1f} -> {on[2]:.1f} ms "
              f"({off[2] / on[2]:.2f}x), computed tokens {off[3]:.0f} -> {on[3]:.0f}")


def main() -> int:
    # a plain kill should still stop the servers started here (their context managers' exits)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory for a daemon started here (e.g. models/code-target)")
    p.add_argument("--socket", help="use the daemon already running at this socket instead")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `llmd serve` flag (repeatable), "
                   "e.g. --serve-arg=--kv-memory=256MiB")
    p.add_argument("--threads", type=int, default=2, help="engine threads of the daemon started here (default 2)")
    p.add_argument("--file", help="the file to type through (default: a held-out stdlib file)")
    p.add_argument("--lines", type=int, default=12, help="lines removed and typed back (default 12)")
    p.add_argument("--keystrokes", type=int, default=300, help="most keystrokes (default 300)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default 16)")
    p.add_argument("--debounce-ms", type=float, default=15.0, help="the server's debounce (default 15)")
    p.add_argument("--interval-ms", type=float, default=0.0, help="pause between keystrokes (default 0)")
    p.add_argument("--warmup", type=int, default=3, help="requests before measuring (default 3)")
    p.add_argument("--first-in-file", type=int, default=3,
                   help="other held-out files opened for a first completion each (default 3)")
    p.add_argument("--open-pause-ms", type=float, default=0.0,
                   help="pause between opening a file and asking its first completion (default 0)")
    p.add_argument("--lsp-arg", action="append", default=[], help="extra `llmd lsp` flag (repeatable), "
                   "e.g. --lsp-arg=--target-ms=300")
    p.add_argument("--baseline", action="store_true", help="first run the language server without prefill and "
                   "cold windows (--no-prefill --target-ms 1e9), each run against its own fresh daemon")
    p.add_argument("--partial-reuse", action="store_true", help="instead of typing: time partial-block reuse "
                   "on its own (in this process, with --model), copied blocks on and off side by side")
    p.add_argument("--against", choices=["llamacpp-server"], help="also run the same keystrokes against "
                   "llama.cpp's server (its /infill, on --gguf, started here) and report llama.cpp / llmd ratios")
    p.add_argument("--gguf", help="the GGUF file llama.cpp serves (default: --model when it is a .gguf file)")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-server flag (repeatable), after "
                   f"the defaults {' '.join(LLAMA_ARGS)}")
    p.add_argument("--run", action="append", default=[], metavar="NAME:FLAGS", help="one more run (repeatable) "
                   "against a fresh daemon, with these language-server flags, e.g. --run 'spm:--fim-layout spm'")
    p.add_argument("--log-file", help="the language server's log (default: none)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    if not (args.model or args.socket):
        p.error("give --model (start a daemon) or --socket (use a running one)")
    if args.partial_reuse:
        if not args.model:
            p.error("--partial-reuse runs the model in this process: give --model")
        partial_reuse(args.model, args.threads)
        return 0
    if args.baseline and args.socket:
        p.error("--baseline starts a fresh daemon per run: give --model, not --socket")
    if args.against:
        args.gguf = args.gguf or (args.model if args.model and args.model.endswith(".gguf") else None)
        if not args.gguf:
            p.error("--against llamacpp-server needs the GGUF file it serves: give --gguf")
    path = Path(args.file) if args.file else default_file()
    runs = [("baseline", daemon_socket, ["--no-prefill", "--target-ms", "1e9"])] if args.baseline else []
    runs += [(args.against, llama_backend, [])] if args.against else []
    runs.append(("llmd", daemon_socket, []))
    for spec in args.run:
        name, _, flags = spec.partition(":")
        runs.append((name, daemon_socket, flags.split()))
    results = {}
    for name, backend, extra in runs:
        with backend(args) as where:
            results[name] = asyncio.run(run_editor(where, path, args, extra))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for name, r in results.items():
        report(name, r)
    for name in [n for n in results if n != "llmd"]:
        print(speedup(name, results[name], results["llmd"]))
    if args.against:
        for name in [n for n in results if n not in ("llmd", args.against)]:
            print(speedup(args.against, results[args.against], results[name]).replace("llmd", name, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
