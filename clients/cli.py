"""The client subcommands of `llmd`: run, complete, lsp, voice, batch, status.

The editor, voice and batch modules (and pygls, wyoming, tqdm, optional dependencies) are imported
when their command runs, so `llmd serve` never pays for them.
"""
from __future__ import annotations

import argparse
import json
import sys

from llmd.protocol import Done, Error, Token
from llmd.sampling_fields import PARAMS

from .backend import backend_of, blocking_client
from .client import Client, ClientError, RequestError

_SOCKET_HELP = "daemon socket (default: $LLMD_SOCKET or the usual location)"
_BACKEND_HELP = ("where to send requests: ipc://PATH (the llmd daemon, the default) or http(s)://HOST[:PORT] (any "
                 "OpenAI-compatible server: llmd http, vLLM, SGLang, llama.cpp, Ollama; key from $LLMD_API_KEY or "
                 "$OPENAI_API_KEY). Replace keys and sentence events are emulated there, priorities are off")


def add_client_parsers(subparsers) -> None:
    for add in (add_run_parser, add_complete_parser, add_lsp_parser, add_voice_parser, add_batch_parser,
                add_status_parser, add_http_parser):
        add(subparsers)


_KNOBS = tuple(p for p in PARAMS if p.fronts)     # temperature, the filters, the penalties: a flag each


def _sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    a = p.add_argument
    a("--socket", help=_SOCKET_HELP)
    a("--backend", metavar="URL", help=_BACKEND_HELP)
    a("--max-tokens", type=int, default=max_tokens, help=f"most tokens per answer (default {max_tokens})")
    for knob in _KNOBS:
        a("--" + knob.name.replace("_", "-"), type=float if knob.kind == "float" else int, default=None,
          help=f"{knob.help} ({knob.range_text()}; default {knob.default})")
    a("--seed", type=int, default=None, help="seed for reproducible sampling")
    a("--stop", action="append", default=None, help="stop string (repeatable)")
    a("--ignore-eos", action="store_true", help="keep generating past the end-of-text token (for load tests)")


def sampling_from_args(args) -> dict:
    s = {"max_tokens": args.max_tokens, **{k.name: getattr(args, k.name) for k in _KNOBS}, "seed": args.seed,
         "stop": args.stop, "ignore_eos": True if args.ignore_eos else None}
    return {k: v for k, v in s.items() if v is not None}


def add_run_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="interactive chat with the daemon's model (Ctrl-C stops an answer)",
                              description="Chat with the daemon's model, streaming each answer. Ctrl-C stops the "
                              "current answer and keeps the conversation; Ctrl-D ends it; /reset forgets it. "
                              "With standard input not a terminal, it is read as one message and answered once.")
    _sampling_flags(p, 512)
    p.add_argument("--system", help="system message")
    p.add_argument("--interactive", action="store_true", help="chat even when standard input is not a terminal")
    p.add_argument("--stats", action="store_true", help="after each answer, print its token counts and timings")
    p.set_defaults(func=run_chat)


def add_complete_parser(subparsers) -> None:
    p = subparsers.add_parser("complete", help="one completion from the daemon, streamed to standard output",
                              description="Complete PROMPT (or standard input when PROMPT is '-' or missing) "
                              "once and exit.")
    p.add_argument("prompt", nargs="?", default="-", help="the prompt, or '-' for standard input (default)")
    _sampling_flags(p, 128)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--stats", action="store_true", help="after the answer, print its token counts and timings")
    p.set_defaults(func=run_complete)


def add_lsp_parser(subparsers) -> None:
    p = subparsers.add_parser("lsp", help="language server (stdio) with inline code completion from the daemon",
                              description="Run a language server on standard input/output that suggests code "
                              "through the daemon (textDocument/inlineCompletion, textDocument/completion). "
                              "Token budgets are measured in characters, --chars-per-token to one token.")
    a = p.add_argument
    a("--socket", help=_SOCKET_HELP)
    a("--backend", metavar="URL", help=_BACKEND_HELP)
    a("--max-tokens", type=int, default=16, help="most tokens per suggestion (default 16)")
    a("--max-lines", type=int, default=8, help="most lines per suggestion (default 8)")
    a("--prefix-tokens", type=int, default=1024, help="budget for the text before the cursor (default 1024)")
    a("--suffix-tokens", type=int, default=256, help="budget for the text after the cursor (default 256)")
    a("--context-tokens", type=int, default=1024, help="budget for the other open files together (default 1024)")
    a("--chars-per-token", type=float, default=3.0, help="characters counted as one token (default 3)")
    a("--debounce-ms", type=float, default=15.0, help="wait this long for a newer keystroke first (default 15)")
    a("--cache-size", type=int, default=64, help="recent suggestions kept for reuse (default 64)")
    a("--no-prefill", action="store_true", help="do not send a document's prompt ahead on open and on each edit "
      "(prompt-only requests that put it in the daemon's cache before the completion is asked for)")
    a("--shift-reuse", action="store_true", help="let the daemon move the keys and values of the text after an "
      "edit to their new positions instead of computing them again (approximate: they were computed before the "
      "edit, and fill-in-the-middle models read the gap from them; costly in completions, see "
      "docs/perf/2026-12-01-quantized-kernels.md, 'Completion quality of the prompt layouts')")
    a("--fim-split", default="line", choices=("line", "cursor"), help="where the prompt's prefix ends: at the "
      "start of the cursor's line, the line up to the cursor going after the middle token (default: a keystroke "
      "computes only the line's new tokens), or at the cursor")
    a("--target-ms", type=float, default=150.0, help="until a document's window is cached, cut its prompt to what "
      "the daemon computes in this many milliseconds, at its measured prompt rate (default 150)")
    a("--timeout", type=float, default=10.0, help="seconds to wait for the server's next event before a "
      "completion fails (default 10)")
    a("--fim-layout", default="psm", choices=("psm", "spm"), help="order of the fill-in-the-middle prompt: psm "
      "(prefix, suffix, middle; default) or spm (suffix first, so a keystroke at the cursor changes only the "
      "prompt's end and the rest stays cached; the model must know the order: see "
      "docs/perf/2026-12-01-real-models.md, 'Suffix first')")
    a("--log-file", help="write the log (each request's outcome and latency) here instead of standard error")
    a("--log-level", default="info", choices=("debug", "info", "warning", "error"),
      help="how much the language server logs to standard error (default info)")
    p.set_defaults(func=_lazy("llmd.clients.lsp", "run_lsp"))


def add_voice_parser(subparsers) -> None:
    p = subparsers.add_parser("voice", help="Wyoming 'handle' service (Home Assistant voice) answering via the daemon",
                              description="Answer Wyoming transcripts with the daemon's chat model, streaming the "
                              "answer a sentence at a time; a new transcript from a satellite interrupts its answer.")
    a = p.add_argument
    a("--uri", default="tcp://127.0.0.1:10700",
      help="where to listen: tcp://HOST:PORT or unix://PATH (default tcp://127.0.0.1:10700)")
    a("--socket", help=_SOCKET_HELP)
    a("--backend", metavar="URL", help=_BACKEND_HELP)
    a("--system-prompt", default=None, help="system message of every conversation")
    a("--max-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    a("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    a("--history-turns", type=int, default=8, help="exchanges remembered per conversation (default 8)")
    a("--language", default="en", help="language advertised in info (default en)")
    p.set_defaults(func=_lazy("llmd.clients.voice", "run_voice"))


def add_batch_parser(subparsers) -> None:
    p = subparsers.add_parser("batch", help="run a JSONL file of requests at batch priority (resumable)",
                              description="Run every request of INPUT (JSON lines: id plus prompt, messages or "
                              "prefix/suffix, and sampling keys) at batch priority and append the answers to "
                              "OUTPUT. Ids already in OUTPUT are skipped, so an interrupted run resumes; a bad "
                              "line becomes an error line.")
    p.add_argument("input", help="input JSONL file")
    p.add_argument("output", help="output JSONL file (appended)")
    p.add_argument("--socket", help=_SOCKET_HELP)
    p.add_argument("--backend", metavar="URL", help=_BACKEND_HELP)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--progress", action="store_true", help="progress bar even when standard error is not a terminal")
    p.set_defaults(func=_lazy("llmd.clients.batch", "run_batch"))


def add_http_parser(subparsers) -> None:
    p = subparsers.add_parser("http", help="OpenAI- and llama.cpp-compatible HTTP server in front of the daemon",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /infill and "
                              "/health over HTTP, translated to the daemon's ZeroMQ protocol. Listens on 127.0.0.1 "
                              "or a unix socket only, unless --allow-remote and --api-key-file are both given.")
    a = p.add_argument
    a("--socket", help=_SOCKET_HELP)
    a("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    a("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    a("--unix", metavar="PATH", help="listen on this unix socket (mode 0600) instead of TCP")
    a("--allow-remote", action="store_true", help="allow a non-loopback --host (needs --api-key-file)")
    a("--api-key-file", metavar="FILE", help="require 'Authorization: Bearer KEY' with the key in FILE")
    a("--cors-origin", action="append", metavar="ORIGIN",
      help="allow browser pages from ORIGIN (repeatable; '*' for any). Default: no CORS")
    a("--max-body-bytes", type=int, default=2 << 20, help="largest request body (default 2 MiB)")
    a("--max-connections", type=int, default=64, help="open connections at once; more get 503 (default 64)")
    a("--head-timeout", type=float, default=10.0, help="seconds a request's headers may take (default 10)")
    a("--body-timeout", type=float, default=30.0, help="seconds a request's body may take (default 30)")
    a("--keepalive", type=float, default=15.0, help="seconds an idle connection stays open (default 15)")
    a("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level (default info)")
    p.set_defaults(func=_lazy("llmd.clients.http_serve", "run_http"))


def _lazy(module: str, name: str):
    def run(args) -> int:
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError as e:
            print(f"llmd {args.command}: missing dependency: {e.name} (pip install 'llmd[editor,voice]')",
                  file=sys.stderr)
            return 2
        return getattr(mod, name)(args)
    return run


# -- run and complete ---------------------------------------------------------------------------


def _print_error(command: str, e: Exception) -> int:
    print(f"llmd {command}: {e}", file=sys.stderr)
    return 1


def stream_answer(stream, out=sys.stdout) -> tuple[str, bool]:
    """Write a stream's text as it arrives; returns (text, whether it was stopped by Ctrl-C).
    Ctrl-C closes the stream, which cancels the request in the daemon."""
    parts = []
    try:
        for event in stream:
            if isinstance(event, Token):
                parts.append(event.text)
                out.write(event.text)
                out.flush()
    except KeyboardInterrupt:
        stream.close()
        return "".join(parts), True
    if isinstance(stream.final, Error):
        raise RequestError(stream.final)
    return "".join(parts), False


def print_stats(stream) -> None:
    d = stream.final
    if isinstance(d, Done):
        print(f"[{d.usage.get('prompt_tokens')} prompt tokens ({d.usage.get('cached_tokens')} cached), "
              f"{d.usage.get('completion_tokens')} generated, finish={d.finish_reason}, "
              f"{d.timings.get('total_ms')} ms]", file=sys.stderr, flush=True)


def _read_message(prompt: str) -> str | None:
    """One line typed by the user; None at end of input. Ctrl-C at the prompt gives an empty line."""
    sys.stderr.write(prompt)
    sys.stderr.flush()
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return ""
    return line if line else None


def run_chat(args) -> int:
    sampling = sampling_from_args(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = args.interactive or sys.stdin.isatty()
    try:
        with blocking_client(backend_of(args), timeout=120.0) as client:
            if not interactive:
                stream = client.chat(system + [{"role": "user", "content": sys.stdin.read()}], **sampling)
                stream_answer(stream)
                print(flush=True)
                if args.stats:
                    print_stats(stream)
                return 0
            while (line := _read_message("> ")) is not None:
                text = line.strip()
                if text in ("/exit", "/quit"):
                    break
                if text == "/reset":
                    history.clear()
                    continue
                if not text:
                    continue
                history.append({"role": "user", "content": text})
                stream = client.chat(system + history, **sampling)
                try:
                    answer, stopped = stream_answer(stream)
                except RequestError as e:          # this message was refused; the session goes on
                    print(f"\n[error: {e}]", file=sys.stderr, flush=True)
                    history.pop()
                    continue
                history.append({"role": "assistant", "content": answer})
                print(flush=True)
                if stopped:
                    print("[stopped]", file=sys.stderr, flush=True)
                elif args.stats:
                    print_stats(stream)
    except ClientError as e:
        return _print_error("run", e)
    return 0


def run_complete(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = sampling_from_args(args)
    try:
        with blocking_client(backend_of(args), timeout=120.0) as client:
            if args.chat:
                system = [{"role": "system", "content": args.system}] if args.system else []
                stream = client.chat(system + [{"role": "user", "content": prompt}], **sampling)
            else:
                stream = client.generate(prompt, **sampling)
            _, stopped = stream_answer(stream)
            print(flush=True)
            if args.stats:
                print_stats(stream)
    except ClientError as e:
        return _print_error("complete", e)
    return 130 if stopped else 0


# -- status ------------------------------------------------------------------------------------


def add_status_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("status", help="show the state of a running llmd daemon",
                              description="Ask the daemon for its state, model, uptime, requests, KV cache "
                              "use, prefix hit rate, speculative acceptance and latency percentiles.")
    p.add_argument("--socket", help="ipc socket path of the daemon (default: the usual location)")
    p.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    p.set_defaults(func=run_status)
    return p


def run_status(args) -> int:
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


def _screen(e: dict) -> str:
    """The head screen's line: on or off (its trial's verdict), greedy rows served, exact scores a row."""
    state = "on" if e.get("head_screen_on") else "off (no faster than the whole head)"
    mean = e.get("head_screen_candidates_mean")
    return (f"{state}, {e.get('head_screen_rows', 0)} rows screened, "
            f"{'-' if mean is None else mean} tokens scored exactly a row, {e.get('head_screen_whole', 0)} read whole")


def _amx_bf16_rows(e: dict) -> int:
    """Rows of bfloat16 blocks past which the daemon's products take AMX: a count, or True from a daemon
    of an earlier release (16 then)."""
    rows = e.get("cpu_amx_bf16")
    return 16 if rows is True else int(rows)


def _kernels(name: str) -> str:
    return {"avx512": "AVX-512 VNNI", "avx2": "AVX2 (same numbers as AVX-512, slower)",
            "none": "none: torch's ops (no compiler, or neither AVX-512 VNNI nor AVX2)"}.get(name, name)


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
        *([f"head screen:  {_screen(e)}"] if "head_screen_on" in e else []),
        *([f"cpu kernels:  {_kernels(e['cpu_kernels'])}"
           + (f", AMX for int8 products of {e['cpu_amx_rows']} rows or more (int4: {2 * e['cpu_amx_rows']})"
              if e.get("cpu_amx_rows") else "")
           + (f", and for bfloat16 blocks of more than {_amx_bf16_rows(e)} rows" if e.get("cpu_amx_bf16") else "")]
          if "cpu_kernels" in e else []),
        f"ttft ms:      {row('ttft')}   (p50 / p90 / p99)",
        f"e2e ms:       {row('e2e')}",
        f"finished:     {', '.join(f'{k} {v}' for k, v in sorted(s.get('finished', {}).items())) or 'none'}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m llmd.clients.cli COMMAND``: the client commands alone, without the engine's imports."""
    parser = argparse.ArgumentParser(prog="llmd", description="llmd client commands")
    add_client_parsers(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
