"""The `llmd` command line: one dispatcher, each subcommand's module imported only when used."""
from __future__ import annotations

import argparse
import sys

from llmd.runtime.config import DEVICES, KV_DTYPES


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--dtype", default="float32", choices=("float32", "bfloat16"), help="weight and activation dtype (default float32)")
    a("--kv-memory", default="512MiB", help="memory for the paged KV cache, e.g. 256MiB or 2GiB (default 512MiB)")
    a("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    a("--max-batch-tokens", type=int, default=512, help="token budget of one engine step (default 512)")
    a("--threads", type=int, default=None, help="CPU threads for the engine (default: torch's choice)")
    a("--device", default="auto", choices=DEVICES, help="where the model runs: auto (default: llmd's own model code on the CPU; an ONNX Runtime engine on "
           "its CUDA provider when onnxruntime-gpu is installed; a TensorRT engine on the GPU), cpu, or cuda "
           "(an engine exported with --backend onnxruntime and llmd[gpu], or --backend tensorrt)")
    a("--no-prefix-cache", action="store_true", help="disable reuse of cached prompt prefixes")
    a("--kv-dtype", default="auto", choices=KV_DTYPES,
      help="KV cache storage: the model dtype (auto, exact), bfloat16 (half a float32 model's bytes: faster "
           "with many streams, twice the tokens per budget) or int8 with per-block, per-head scales (approximate: a "
           "block's scale grows with what is written to it, so greedy text may vary with batching and speculation)")
    a("--draft", default=None, help="speculative decoding: a draft model directory, or 'ngram' for prompt lookup")
    a("--num-speculative-tokens", type=int, default=None,
      help="most tokens proposed per step when speculating (default: 8 for ngram, 4 for a draft model)")


def engine_options(args) -> dict:
    opts = dict(dtype=args.dtype, kv_memory=args.kv_memory, block_size=args.block_size,
                max_batch_tokens=args.max_batch_tokens, threads=args.threads,
                enable_prefix_cache=not args.no_prefix_cache, num_speculative_tokens=args.num_speculative_tokens,
                kv_dtype=args.kv_dtype, device=args.device)
    if args.draft:
        opts["draft"] = args.draft
    return opts


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt with a local model, streaming to the terminal",
                       description="Load MODEL in this process and stream a completion of PROMPT (or of standard "
                       "input when PROMPT is '-').")
    p.add_argument("model", help="model directory (Hugging Face layout), llmd engine directory or GGUF file")
    p.add_argument("prompt", help="the prompt text, or '-' to read it from standard input")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (default), higher for more random")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print timings and cache figures after the text")
    add_engine_flags(p)
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from llmd.runtime.errors import LLMDError
    from llmd.runtime.llm import LLM
    from llmd.runtime.request import SamplingParams
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
        llm = LLM(args.model, **engine_options(args))
        last = None
        for out in llm.stream_outputs(prompt, params):
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            last = out
    except LLMDError as e:
        print(f"llmd generate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    print()
    if args.stats and last is not None and last.metrics:
        m = last.metrics
        print(f"[{m['output_tokens']} tokens, finish={last.finish_reason}, ttft={1000 * (m['ttft_s'] or 0):.1f} ms, "
              f"{m['tokens_per_s'] or 0:.1f} tok/s, cached={m['cached_tokens']}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from llmd import __version__
    parser = argparse.ArgumentParser(prog="llmd", description="llmd: a local low-latency LLM inference daemon.")
    parser.add_argument("--version", action="version", version=f"llmd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_generate_parser(sub)
    from llmd.runtime.bench_cli import add_bench_parser
    add_bench_parser(sub)
    for module, adders in (("llmd.daemon.cli", ("add_serve_parser", "add_status_parser")),
                           ("llmd.export.distill", ("add_distill_parser",)),
                           ("llmd.export.cli", ("add_export_parser",)),
                           ("llmd.clients.cli", ("add_client_parsers",)),
                           ("llmd.bench.doctor_cli", ("add_doctor_parser",)),
                           ("llmd.import_cli", ("add_import_parser",)),
                           ("llmd.models_real", ("add_models_parser",))):
        try:
            mod = __import__(module, fromlist=list(adders))
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        for name in adders:
            if hasattr(mod, name):
                getattr(mod, name)(sub)
    return parser


CLIENT_COMMANDS = ("run", "complete", "lsp", "voice", "batch")


def build_client_parser() -> argparse.ArgumentParser:
    """Only the client commands: they start fast and never import torch."""
    parser = argparse.ArgumentParser(prog="llmd")
    from llmd.clients.cli import add_client_parsers
    add_client_parsers(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    light = bool(argv) and argv[0] in CLIENT_COMMANDS
    parser = build_client_parser() if light else build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
