"""Structured output on a model: do fifty JSON schemas all give valid JSON that the schema accepts,
and what does constraining half of 16 streams add to a decode step?

    .venv/bin/python bench/structured_check.py --model models/code-target
    .venv/bin/python bench/structured_check.py --model ~/.cache/llmd/<qwen2.5-coder> --steps 64

Validity: each schema of ``structured_schemas`` is asked for in one batch (through the chat template
when the model has one), constrained by the schema; an answer counts when it parses and the
schema's validator accepts it. Goal: all fifty.

Cost: 16 greedy streams decode ``--steps`` tokens with no end token, first all free, then with
half of them constrained to a JSON array of integers too long to close within the run; the mean time of a
step in which all 16 are decoding is compared. Goal: at most 10 % over the free run. Speculation is
off in both runs, so that the steps compare like with like.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from llmd.bench.structured_schemas import schemas, valid
from llmd.runtime.engine import Engine
from llmd.runtime.llm import LLM
from llmd.runtime.request import Grammar, SamplingParams

ENDLESS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 4096}


def prompt_for(llm: LLM, schema: dict) -> str | list[int]:
    ask = f"Answer with one JSON object that follows this schema: {json.dumps(schema)}"
    if llm.engine.tokenizer.has_chat_template:
        return llm.engine.tokenizer.encode_chat([{"role": "user", "content": ask}])
    return f"# {ask}\nanswer = "


def check_validity(llm: LLM, max_tokens: int) -> tuple[int, list[str]]:
    cases = schemas()
    params = [SamplingParams(max_tokens=max_tokens, grammar=Grammar("json_schema", json.dumps(s))) for s in cases]
    prompts = [prompt_for(llm, s) for s in cases]
    outs = _batched(llm, prompts, params)
    failures = []
    for i, (schema, text) in enumerate(zip(cases, outs)):
        try:
            ok = valid(json.loads(text), schema)
        except ValueError:
            ok = False
        if not ok:
            failures.append(f"schema {i}: {text[:120]!r}")
    return len(cases) - len(failures), failures


def _batched(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[str]:
    engine, texts = llm.engine, {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", p, sp)
        texts[f"s{i}"] = ""
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.text_delta
            if out.error:
                texts[out.request_id] = f"error: {out.error}"
    return [texts[f"s{i}"] for i in range(len(prompts))]


def step_times(engine: Engine, constrained: int, streams: int, steps: int) -> list[float]:
    grammar = Grammar("json_schema", json.dumps(ENDLESS))
    for i in range(streams):
        g = grammar if i < constrained else None
        engine.add_request(f"c{constrained}-{i}", f"values_{i} = [", SamplingParams(max_tokens=steps, ignore_eos=True,
                                                                                    grammar=g))
    times = []
    while engine.has_unfinished():
        full = len(engine.scheduler.running) == streams and not engine.scheduler.num_waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        if full:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a model directory or GGUF file")
    ap.add_argument("--max-tokens", type=int, default=160, help="the most tokens one answer may take")
    ap.add_argument("--streams", type=int, default=16, help="streams decoding together in the cost run")
    ap.add_argument("--steps", type=int, default=48, help="tokens each stream decodes in the cost run")
    ap.add_argument("--skip-cost", action="store_true", help="check validity only")
    args = ap.parse_args(argv)
    llm = LLM(args.model, draft="none")
    good, failures = check_validity(llm, args.max_tokens)
    print(f"valid: {good}/{len(schemas())}")
    for f in failures:
        print("  " + f)
    if not args.skip_cost:
        step_times(llm.engine, 0, args.streams, 4)                  # warm up
        free = step_times(llm.engine, 0, args.streams, args.steps)
        half = step_times(llm.engine, args.streams // 2, args.streams, args.steps)
        f, h = statistics.mean(free), statistics.mean(half)
        print(f"step at {args.streams} streams: free {f * 1e3:.2f} ms, half constrained {h * 1e3:.2f} ms "
              f"({(h / f - 1) * 100:+.1f} %; goal <= +10 %), over {len(free)} and {len(half)} steps")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
