"""`llmd generate`: load a model in this process and stream one completion to the terminal."""
from __future__ import annotations

import sys

from llmd.options import add_flags, given
from llmd.runtime.config import EngineConfig
from llmd.runtime.errors import LLMDError
from llmd.runtime.llm import LLM
from llmd.runtime.request import SamplingParams


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt with a local model, streaming to the terminal",
                       description="Load MODEL in this process and stream a completion of PROMPT (or of standard "
                       "input when PROMPT is '-').")
    p.add_argument("model", help="model directory (Hugging Face layout), llmd engine directory, GGUF file, or a "
                   "model name (`llmd list`, `llmd pull`)")
    p.add_argument("prompt", help="the prompt text, or '-' to read it from standard input")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (default), higher for more random")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print timings and cache figures after the text")
    add_flags(p.add_argument_group("engine"), EngineConfig, skip=("model",))
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, stop=tuple(args.stop))
        llm = LLM(args.model, **given(args, EngineConfig, skip=("model",)))
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
