"""Quantized greedy output does not depend on the batch: each prompt alone and all of them in one batch
give the same tokens (int8 and int4 engines; the fused step serves the decode rows of both)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from llmd import LLM, SamplingParams
from llmd.export.cli import ExportOptions, export_engine
from llmd.runtime import kernels
from llmd.runtime.model_runner import Feed

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not kernels.available(), reason=f"llmd kernels unavailable: {kernels.why()}")]

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "code-target"
FAST = dict(eval_windows=1, eval_tokens=16, accept_loss=True, scale_search=False)


def exported(source: Path, out: Path, quant: str) -> Path:
    """quant: int8, int4 (groups of 64) or int4-g32 (groups of 32, as SmolLM2's export and GGUF blocks)."""
    if not (out / "manifest.json").is_file():
        method, _, group = quant.partition("-g")
        group = {"group_size": int(group or 64)} if method == "int4" else {}
        export_engine(ExportOptions(str(source), str(out), quant=method, **group, **FAST))
    return out


def alone_and_together(engine: Path, prompts: list[list[int]], tokens: int) -> tuple[list, list, int]:
    """Greedy tokens of each prompt run on its own and of all of them as one batch (no prefix cache, no
    draft: every prompt computed from scratch both ways), and the fused steps taken."""
    llm = LLM(str(engine), kv_memory="32MiB", prefix_cache=False, draft="none")
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    fused = llm.engine.runner.model.fused_decode
    return alone, together, fused.steps if fused is not None else 0


@pytest.mark.parametrize("quant", ["int8", "int4", "int4-g32"])
def test_quantized_greedy_output_is_the_same_alone_and_in_a_batch_of_eight(quant, tiny_model_dir, tmp_path_factory):
    engine = exported(tiny_model_dir, tmp_path_factory.mktemp(f"batch-{quant}") / "engine", quant)
    rng = random.Random(8)
    prompts = [[rng.randrange(20, 400) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    alone, together, fused_steps = alone_and_together(engine, prompts, 32)
    assert together == alone
    assert fused_steps > 0


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_bundled_target_quantized_eight_prompts_of_128_tokens_alone_and_batched(quant, tmp_path_factory):
    """The issue's goal on the bundled target: 8 prompts x 128 tokens, identical alone and batched."""
    engine = exported(BUNDLED, tmp_path_factory.mktemp(f"bundled-{quant}") / "engine", quant)
    llm_tokenizer = LLM(str(engine), kv_memory="8MiB").tokenizer
    texts = ["def parse_args(argv):\n    ", "class LRUCache:\n    def __init__(self, capacity):\n",
             "import os\nimport sys\n\n\ndef main():\n", "for i in range(10):\n    if i % 3 == 0:\n",
             "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "with open(path) as f:\n",
             "async def fetch(session, url):\n", "# sort a list of dicts by key\nitems = "]
    prompts = [llm_tokenizer.encode(t) for t in texts]
    alone, together, fused_steps = alone_and_together(engine, prompts, 128)
    assert [len(t) for t in alone] == [128] * 8
    assert together == alone
    assert fused_steps > 0


@pytest.mark.parametrize("quant", ["int8", "int4-g32"])
def test_a_prompt_gets_the_same_logits_alone_and_beside_others(quant, tiny_model_dir, tmp_path_factory):
    """A prompt of up to 16 rows alone (the fused step) and beside others in one step of more rows (the
    Python forward: kernels for the products and for the row operations at every row count): the
    same logits bit for bit, so greedy choices cannot part at a near tie."""
    engine = exported(tiny_model_dir, tmp_path_factory.mktemp(f"logits-{quant}") / "engine", quant)
    runner = LLM(str(engine), kv_memory="8MiB", prefix_cache=False, draft="none").engine.runner
    rng = random.Random(3)
    first, other = [rng.randrange(20, 400) for _ in range(9)], [rng.randrange(20, 400) for _ in range(30)]
    with torch.no_grad():
        alone = runner.run(runner.prepare_feeds([Feed(first, 0, [0, 1], 1)]))
        beside = runner.run(runner.prepare_feeds([Feed(first, 0, [2, 3], 1), Feed(other, 0, [4, 5, 6, 7], 1)]))
    assert torch.equal(alone[0], beside[0])
