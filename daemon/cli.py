"""The `llmd serve` and `llmd status` subcommands, for the main command line to mount.

    sub = parser.add_subparsers()
    add_serve_parser(sub); add_status_parser(sub)
    args = parser.parse_args(); sys.exit(args.func(args))
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from llmd.runtime.config import DEVICES, KV_DTYPES


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the llmd daemon on a local ZeroMQ socket",
                              description="Run the llmd daemon. Settings come from /etc/llmd/llmd.toml, "
                              "$XDG_CONFIG_HOME/llmd/llmd.toml, LLMD_* variables and these flags, in "
                              "increasing precedence.")
    a = p.add_argument
    a("--model", "--engine", dest="model",
      help="model directory (Hugging Face layout) or engine directory from `llmd export` (setting `model`)")
    a("--socket", help="ipc socket path (default $XDG_RUNTIME_DIR/llmd/llmd.sock, or /run/llmd/llmd.sock)")
    a("--group", help="let this group's members connect: socket 0660 in a 0750 directory, both the group's "
                      "(default: no group, the socket is the owner's alone, 0600 in 0700); a directory that "
                      "already exists is left as it is")
    a("--tcp", metavar="tcp://HOST:PORT", help="also listen on this TCP endpoint (off unless given)")
    a("--dtype", help="weight and activation dtype, e.g. float32, bfloat16")
    a("--device", choices=DEVICES,
      help="where the model runs: auto (default: llmd's own model code on the CPU; an ONNX Runtime engine on "
           "its CUDA provider when onnxruntime-gpu is installed; a TensorRT engine on the GPU), cpu, or cuda "
           "(an engine exported with --backend onnxruntime and llmd[gpu], or --backend tensorrt)")
    a("--threads", type=int, help="CPU threads for the engine (default: torch's choice)")
    a("--kv-memory", help="memory for the KV cache, e.g. 256MiB or 4GiB")
    a("--block-size", type=int, help="tokens per KV cache block")
    a("--max-batch-tokens", type=int, help="token budget of one engine step")
    a("--no-prefix-cache", dest="prefix_cache", action="store_const", const=False,
      help="disable reuse of cached prompt prefixes")
    a("--kv-dtype", choices=KV_DTYPES, help="KV cache storage: the model dtype (auto, exact), bfloat16 (half a float32 "
      "model's bytes: faster with many streams) or int8 with per-block scales (approximate: greedy text may "
      "vary with batching and speculation)")
    a("--draft", help="speculative decoding: a draft model directory (same tokenizer), 'ngram' (prompt lookup for "
                      "every request), 'none', or 'auto' (default: an engine directory's own draft, else prompt "
                      "lookup for greedy requests only, whose output it cannot change)")
    a("--num-speculative-tokens", type=int,
      help="most tokens proposed per step when speculating (default: 8 for ngram, 4 for a draft model)")
    a("--no-adaptive-speculation", dest="adaptive_speculation", action="store_const", const=False,
      help="always propose --num-speculative-tokens instead of letting measured costs decide")
    a("--max-queue", type=int, help="requests in flight before new ones are refused with `busy`")
    a("--drain-grace", dest="drain_grace_s", type=float, metavar="SECONDS",
      help="on SIGTERM, time to let in-flight requests finish before cancelling them")
    a("--config", metavar="FILE", help="user configuration file instead of $XDG_CONFIG_HOME/llmd/llmd.toml")
    a("--log-level", choices=("debug", "info", "warning", "error"), help="log verbosity")
    a("--print-config", action="store_true", help="print the merged settings and where each came from, then exit")
    p.set_defaults(func=run_serve)
    return p


def add_status_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("status", help="show the state of a running llmd daemon",
                              description="Ask the daemon for its state, model, uptime, requests, KV cache "
                              "use, prefix hit rate, speculative acceptance and latency percentiles.")
    p.add_argument("--socket", help="ipc socket path of the daemon (default: the usual location)")
    p.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    p.set_defaults(func=run_status)
    return p


_FLAGS = ("model", "socket", "group", "tcp", "dtype", "device", "threads", "kv_memory", "block_size", "max_batch_tokens",
          "prefix_cache", "kv_dtype", "draft", "num_speculative_tokens", "adaptive_speculation", "max_queue", "drain_grace_s", "log_level")


def run_serve(args) -> int:
    """Load settings and run the daemon; once it has started, this ends the process itself."""
    from pathlib import Path

    from . import settings as settings_mod
    flags = {k: getattr(args, k, None) for k in _FLAGS}
    try:
        s, source = settings_mod.load(flags, user_file=Path(args.config) if args.config else None)
    except settings_mod.SettingsError as e:
        print(f"llmd serve: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(settings_mod.describe(s, source))
        return 0
    from .serve import serve
    code = serve(s)
    # Exit at once: interpreter teardown with torch loaded takes seconds, which would eat into
    # systemd's stop timeout after the drain is already complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_status(args) -> int:
    from llmd.clients.client import Client, ClientError
    try:
        with Client(args.socket, timeout=args.timeout) as c:
            stats = c.stats()
    except ClientError as e:
        print(f"llmd status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True) if args.json else format_status(stats))
    return 0


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def format_status(s: dict) -> str:
    e = s.get("engine") or {}
    lat = s.get("latency_ms", {})

    def row(name):
        p = lat.get(name, {})
        return " / ".join("-" if p.get(q) is None else f"{p[q]:.1f}" for q in ("p50", "p90", "p99"))

    acceptance = e.get("spec_acceptance", e.get("spec_acceptance_rate"))
    lines = [
        f"state:        {s.get('state')} ({s.get('status')})",
        f"model:        {s.get('model')}",
        f"uptime:       {s.get('uptime_s', 0):.0f} s",
        f"requests:     {e.get('running', '-')} running, {e.get('waiting', '-')} queued, "
        f"{s.get('in_flight', 0)} in flight",
        f"kv cache:     {_pct(e.get('kv_usage'))} used ({e.get('kv_blocks_used', '-')}/{e.get('kv_blocks_total', '-')} blocks)",
        f"prefix hits:  {_pct(e.get('prefix_hit_rate'))}",
        f"spec accept:  {_pct(acceptance)}",
        f"ttft ms:      {row('ttft')}   (p50 / p90 / p99)",
        f"e2e ms:       {row('e2e')}",
        f"finished:     {', '.join(f'{k} {v}' for k, v in sorted(s.get('finished', {}).items())) or 'none'}",
    ]
    return "\n".join(lines)
