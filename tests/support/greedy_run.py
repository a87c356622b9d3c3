"""Greedy tokens, the logits they were taken from, and every linear plan of a fresh engine, written to
a file: tests/runtime/test_reproducible.py runs this in separate processes and compares what they wrote.

    python tests/support/greedy_run.py OUT MODEL:DTYPE [MODEL:DTYPE ...]
"""
import json
import sys

import torch
from safetensors.torch import save_file

from llmd import LLM, SamplingParams
from llmd.runtime.models.layers import Linear

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n"


def greedy(model: str, dtype: str) -> tuple[list[int], torch.Tensor, dict]:
    # the whole head's logits are what is compared: no head screen (it returns tokens, not logits)
    llm = LLM(model, dtype=dtype, threads=2, kv_memory="16MiB", head_screen=False)
    runner = llm.engine.runner
    logits, run = [], runner.run

    def recorded(batch):
        y = run(batch)
        logits.append(y.clone())
        return y

    runner.run = recorded
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))[0]
    linears = {name: m for name, m in runner.model.named_modules() if isinstance(m, Linear)}
    if runner.model._tied_head is not None:
        linears["tied_head"] = runner.model._tied_head
    return out.token_ids, torch.cat(logits), {name: vars(m.plan) for name, m in linears.items()}


def main(out: str, runs: list[str]) -> None:
    tensors, meta = {}, {}
    for i, run in enumerate(runs):
        model, dtype = run.rsplit(":", 1)
        tokens, logits, plans = greedy(model, dtype)
        tensors[f"logits{i}"] = logits
        meta[run] = {"tokens": tokens, "plans": plans}
    save_file(tensors, out + ".safetensors")
    with open(out + ".json", "w") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
