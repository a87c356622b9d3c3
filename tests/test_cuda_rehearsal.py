"""A rehearsal of the device path on the CPU: the engine driven through CudaBackend over CPU tensors,
Triton's interpreter for the kernels and the graph stand-in for the captured steps, over what a first
GPU run does: a repeated prompt (partial-block reuse: ``copy_slots``), n-gram speculation verified
greedily (graph replays of the verification buckets), sampled and penalised verification, ``stats()``,
and a draft model's rounds on a CudaBackend of its own. Greedy tokens must equal the cpu runner's. A one-layer model keeps it to seconds (the
bundled pair takes about 9 s a step on the interpreter: tests/test_cuda_engine.py, marked slow)."""
import os

import pytest

from llmd.runtime.llm import LLM
from llmd.runtime.models.loader import load_model
from llmd.runtime.request import SamplingParams

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted kernels only")
pytest.importorskip("triton")
from llmd.runtime.execution.cuda.backend import CudaBackend  # noqa: E402

K = 3
OPTS = dict(dtype="float32", kv_memory="1MiB", max_num_seqs=2, max_model_len=96, draft="ngram",
            num_speculative_tokens=K, adaptive_speculation=False)
PROMPT = [5, 6, 7, 8, 9] * 4                   # 20 tokens: one full block and a partial one; repeats for n-grams
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, repetition_penalty=1.3, ignore_eos=True)
WIDE = list(range(3, 88))                     # so many distinct tokens that a sampled one is likely among them


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from modelfactory import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("rehearsal"), layers=1, heads=4, kv_heads=2, max_pos=96,
                          tie=False)     # untied: its greedy text varies, and repeats for n-grams to find


def cuda_runner(llm: LLM, path, k: int) -> CudaBackend:
    e, c = llm.engine, llm.engine.config
    return CudaBackend(load_model(path, "float32"), e.block_manager.num_blocks, c.block_size, "float32",
                       device="cpu", max_num_seqs=c.max_num_seqs, num_spec_tokens=k,
                       max_model_len=e.max_model_len, graphs="standin")


def on_cuda_backend(llm: LLM, path) -> tuple[LLM, list]:
    """``llm`` with its runner, before any step, a CudaBackend over CPU tensors with the graph stand-in,
    and the engine's flags read again from it (as ``Engine.__init__`` reads them from a runner it
    builds); the second value collects the ``copy_slots`` calls."""
    e, runner = llm.engine, cuda_runner(llm, path, K)
    copies, copy = [], runner.copy_slots
    runner.copy_slots = lambda src, dst, n: (copies.append((src, dst, n)), copy(src, dst, n))
    e.runner = runner
    e._screens = runner.screens_head
    e.block_manager.max_stale = 0                  # can_shift is False: shifted reuse stays off
    return llm, copies


def greedy_pass(llm: LLM) -> list[list[int]]:
    """The prompt twice, the second time from the prefix cache (its partial block copied)."""
    return [llm.generate([PROMPT], GREEDY)[0].token_ids for _ in range(2)]


def test_the_engine_through_the_cuda_backend(model_dir):
    want = greedy_pass(LLM(str(model_dir), **OPTS))
    llm, copies = on_cuda_backend(LLM(str(model_dir), **OPTS), model_dir)
    assert greedy_pass(llm) == want
    assert copies, "the repeated prompt did not reuse a partly filled block"
    graphs = llm.engine.runner.graphs
    verify = [s for s, b in graphs.buckets.items() if s.max_query_len > 1]
    assert graphs.replays > 0 and verify
    sampled = llm.generate([WIDE], SAMPLED)[0]       # n-gram guesses, verified by sampling
    assert len(sampled.token_ids) == SAMPLED.max_tokens and sampled.metrics["spec_proposed"] > 0
    stats = llm.stats()
    assert stats["spec_accepted"] > 0 and stats["prefix_tokens_hit"] > 0
    assert stats["kv_pool_dtype"] == "float32" and "cpu_kernels" not in stats


def test_a_draft_round_through_the_cuda_backend(model_dir, tmp_path):
    from modelfactory import make_model_dir
    draft = make_model_dir(tmp_path / "draft", seed=1, layers=1, heads=4, kv_heads=2, max_pos=96, tie=False)
    opts = {**OPTS, "draft": str(draft)}
    want = LLM(str(model_dir), **opts).generate([PROMPT], GREEDY)[0].token_ids
    llm, _ = on_cuda_backend(LLM(str(model_dir), **opts), model_dir)
    e = llm.engine
    e.draft_runner = e.proposer.runner = cuda_runner(llm, draft, 0)
    got = llm.generate([PROMPT], GREEDY)[0]
    assert got.token_ids == want and got.metrics["spec_proposed"] > 0
    assert e.draft_runner.graphs.replays > 0
