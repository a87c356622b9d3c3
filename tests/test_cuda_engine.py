"""The engine through the CUDA backend's step path against the CPU engine: greedy tokens identical.

On the CPU (slow: every attention call runs on Triton's interpreter) the engine's runner is swapped
for a CudaBackend over CPU tensors with the graph stand-in; with a GPU see test_cuda_gpu.py."""
import os
from pathlib import Path

import pytest

from llmd.runtime.llm import LLM
from llmd.runtime.models.loader import load_model
from llmd.runtime.request import SamplingParams

REPO = Path(__file__).resolve().parents[1]
TARGET, DRAFT = REPO / "models" / "code-target", REPO / "models" / "code-draft"
PROMPTS = ["def fibonacci(n):\n"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted kernels only"),
              pytest.mark.skipif(not TARGET.is_dir(), reason="the bundled models are not here")]


def with_cuda_runner(llm: LLM, k: int) -> LLM:
    """``llm`` with its runners replaced, before any step, by CudaBackends over CPU tensors."""
    from llmd.runtime.execution.cuda.backend import CudaBackend
    e = llm.engine
    c = e.config
    e.runner = CudaBackend(load_model(TARGET, c.dtype), e.block_manager.num_blocks, c.block_size, c.dtype,
                               device="cpu", max_num_seqs=c.max_num_seqs, num_spec_tokens=k,
                               max_model_len=e.max_model_len, graphs="standin")
    if getattr(e, "draft_runner", None) is not None:
        e.draft_runner = CudaBackend(load_model(DRAFT, c.dtype), e.block_manager.num_blocks, c.block_size,
                                         c.dtype, device="cpu", max_num_seqs=c.max_num_seqs,
                                         max_model_len=e.max_model_len, graphs="standin")
        e.proposer.runner = e.draft_runner
    return llm


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("draft", [None, "ngram", str(DRAFT)], ids=["plain", "ngram", "draft"])
def test_greedy_tokens_match_the_cpu_engine(draft):
    opts = dict(kv_memory="16MiB", max_num_seqs=4, draft=draft, num_speculative_tokens=3 if draft else None,
                adaptive_speculation=False)
    want = [c.token_ids for c in LLM(str(TARGET), **opts).generate(PROMPTS, GREEDY)]
    llm = with_cuda_runner(LLM(str(TARGET), **opts), 3 if draft else 0)
    got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert llm.engine.runner.graphs.replays > 0
