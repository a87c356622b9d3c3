"""A rehearsal of the device path on the CPU: ``LLM(device="cuda")`` with the engine building its own
CudaBackends over CPU tensors (llmd.bench.gpu_rehearse: Triton's interpreter for the kernels, the graph
stand-in for the captured steps), over what a first GPU run does: a repeated prompt (partial-block reuse:
``copy_slots``), n-gram speculation verified greedily (graph replays of the verification buckets),
sampled and penalised verification, ``stats()``, a draft model's rounds, graphs turned off, and a
capture that fails. Greedy tokens must equal the cpu runner's. A one-layer model keeps it to seconds
(the bundled pair takes about 9 s a step on the interpreter: tests/cuda/test_cuda_engine.py, marked slow)."""
import logging
import os

import pytest

from llmd.runtime.llm import LLM
from llmd.runtime.request import SamplingParams

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted kernels only")]
pytest.importorskip("triton")
from llmd.runtime.execution.cuda.backend import CudaRunner  # noqa: E402
from llmd.runtime.execution.cuda.graphs import StepGraphs  # noqa: E402

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


@pytest.fixture(scope="module")
def cpu_tokens(model_dir):
    return greedy_pass(LLM(str(model_dir), **OPTS))


def on_cuda(path, graphs: str = "standin", **opts) -> LLM:
    """``LLM(device="cuda")`` on the CPU: the engine's runners are CudaBackends it built itself."""
    from llmd.bench.gpu_rehearse import rehearsing     # (imported here: it sets TRITON_INTERPRET where unset)
    with rehearsing(graphs):
        llm = LLM(str(path), device="cuda", **{**OPTS, **opts})
    assert isinstance(llm.engine.runner, CudaRunner)
    return llm


def greedy_pass(llm: LLM) -> list[list[int]]:
    """The prompt twice, the second time from the prefix cache (its partial block copied)."""
    return [llm.generate([PROMPT], GREEDY)[0].token_ids for _ in range(2)]


def test_the_engine_through_the_cuda_backend(model_dir, cpu_tokens):
    llm = on_cuda(model_dir)
    runner = llm.engine.runner
    copies, copy = [], runner.copy_slots
    runner.copy_slots = lambda src, dst, n: (copies.append((src, dst, n)), copy(src, dst, n))
    assert greedy_pass(llm) == cpu_tokens
    assert copies, "the repeated prompt did not reuse a partly filled block"
    verify = [s for s in runner.graphs.buckets if s.max_query_len > 1]
    assert runner.graphs.replays > 0 and verify
    sampled = llm.generate([WIDE], SAMPLED)[0]       # n-gram guesses, verified by sampling
    assert len(sampled.token_ids) == SAMPLED.max_tokens and sampled.metrics["spec_proposed"] > 0
    stats = llm.stats()
    assert stats["spec_accepted"] > 0 and stats["prefix_tokens_hit"] > 0
    assert stats["kv_pool_dtype"] == "float32" and "cpu_kernels" not in stats
    assert stats["cuda_graphs"] == "standin"


def test_a_draft_round_through_the_cuda_backend(model_dir, tmp_path):
    from modelfactory import make_model_dir
    draft = make_model_dir(tmp_path / "draft", seed=1, layers=1, heads=4, kv_heads=2, max_pos=96, tie=False)
    want = LLM(str(model_dir), **{**OPTS, "draft": str(draft)}).generate([PROMPT], GREEDY)[0].token_ids
    llm = on_cuda(model_dir, draft=str(draft))
    e = llm.engine
    assert isinstance(e.draft_runner, CudaRunner) and e.proposer.runner is e.draft_runner
    got = llm.generate([PROMPT], GREEDY)[0]
    assert got.token_ids == want and got.metrics["spec_proposed"] > 0
    assert e.draft_runner.graphs.replays > 0


def test_graphs_turned_off(model_dir, cpu_tokens):
    llm = on_cuda(model_dir, cuda_graphs=False)
    assert llm.engine.runner.graphs is None
    assert greedy_pass(llm) == cpu_tokens
    assert llm.stats()["cuda_graphs"] == "off"


def test_a_failed_capture_warns_and_runs_eagerly(model_dir, cpu_tokens, monkeypatch, caplog):
    def planted(self):
        raise RuntimeError("planted capture failure")
    monkeypatch.setattr(StepGraphs, "_capture_all", planted)
    with caplog.at_level(logging.WARNING, logger="llmd.cuda"):
        llm = on_cuda(model_dir, graphs="capture")
    assert "CUDA graph capture failed (RuntimeError: planted capture failure)" in caplog.text
    assert llm.engine.runner.graphs is None
    assert greedy_pass(llm) == cpu_tokens
    assert llm.stats()["cuda_graphs"] == "failed: RuntimeError: planted capture failure"
