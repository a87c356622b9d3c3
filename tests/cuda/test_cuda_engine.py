"""The engine through the CUDA backend's step path against the CPU engine: greedy tokens identical.

On the CPU (slow: every attention call runs on Triton's interpreter) ``LLM(device="cuda")`` builds its
CudaBackends over CPU tensors with the graph stand-in (llmd.bench.gpu_rehearse); with a GPU see
test_cuda_gpu.py."""
import os
from pathlib import Path

import pytest

from llmd.runtime.llm import LLM
from llmd.runtime.request import SamplingParams

REPO = Path(__file__).resolve().parents[2]
TARGET, DRAFT = REPO / "models" / "code-target", REPO / "models" / "code-draft"
PROMPTS = ["def fibonacci(n):\n"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

pytestmark = [pytest.mark.heavy, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted kernels only"),
              pytest.mark.skipif(not TARGET.is_dir(), reason="the bundled models are not here")]


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("draft", [None, "ngram", str(DRAFT)], ids=["plain", "ngram", "draft"])
def test_greedy_tokens_match_the_cpu_engine(draft):
    from llmd.bench.gpu_rehearse import rehearsing
    from llmd.runtime.execution.cuda.backend import CudaRunner
    opts = dict(kv_memory="16MiB", max_num_seqs=4, draft=draft, num_speculative_tokens=3 if draft else None,
                adaptive_speculation=False)
    want = [c.token_ids for c in LLM(str(TARGET), **opts).generate(PROMPTS, GREEDY)]
    with rehearsing():
        llm = LLM(str(TARGET), device="cuda", **opts)
    assert isinstance(llm.engine.runner, CudaRunner)
    got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert llm.engine.runner.graphs.replays > 0
