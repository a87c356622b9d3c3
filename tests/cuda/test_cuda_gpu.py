"""The CUDA backend on a GPU (``pytest -m gpu``; skipped without CUDA; bench/gpu_check.sh runs them):
the kernels at real shapes against the float32 reference, graph replay against eager steps after
metadata changes, sampling against the CPU sampler, and greedy parity between the GPU and CPU engines
on the bundled pair and a random-weight Qwen2-0.5B shape, with draft and n-gram speculation.

The parity tests come first, and each records its bfloat16 and float32 token agreement with the CPU
engine (JSON in ``$LLMD_GPU_RESULTS`` when it is set) before it asserts float32 identical."""
import json
import os
from pathlib import Path

import pytest
import torch

from cuda_cases import make_case, reference
from llmd.runtime.llm import LLM
from llmd.runtime.request import SamplingParams

REPO = Path(__file__).resolve().parents[2]
TARGET, DRAFT = REPO / "models" / "code-target", REPO / "models" / "code-draft"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
QWEN = (14, 2, 64)          # Qwen2-0.5B: query heads, kv heads, head size


def record(name: str, value) -> None:
    out = os.environ.get("LLMD_GPU_RESULTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(value, indent=1))


def attend(q, kc, vc, meta, splits):
    return torch.ops.llmd.paged_attention(q, kc, vc, meta.query_start, meta.seq_lens, meta.block_table,
                                          meta.shape.max_query_len, splits, q.shape[-1] ** -0.5)


def greedy(model: Path, device: str, dtype: str, draft=None, n=64, prompts=None):
    opts = dict(device=device, dtype=dtype, kv_memory="256MiB", max_num_seqs=8, draft=draft,
                num_speculative_tokens=4 if draft else None, adaptive_speculation=False)
    prompts = prompts or ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\nimport"]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in LLM(str(model), **opts).generate(prompts, params)]


def agreement_then_parity(name: str, model: Path, draft, prompts=None) -> None:
    """bfloat16 and float32 token agreement with the CPU engine recorded first, then float32 asserted
    identical: a difference still leaves both figures."""
    cpu = greedy(model, "cpu", "float32", draft, prompts=prompts)
    f32 = greedy(model, "cuda", "float32", draft, prompts=prompts)
    record(f"agreement_{name}_f32", agreement(f32, cpu))
    record(f"agreement_{name}_bf16", agreement(greedy(model, "cuda", "bfloat16", draft, prompts=prompts), cpu))
    assert f32 == cpu, agreement(f32, cpu)


@pytest.mark.parametrize("draft", [None, "ngram", str(DRAFT)])
def test_greedy_parity_bundled_pair(draft):
    agreement_then_parity(f"bundled_{Path(draft).name if draft else 'plain'}", TARGET, draft)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from llmd.runtime.models.random_model import write_random_model
    return write_random_model(tmp_path_factory.mktemp("qwen") / "qwen2-0.5b", "qwen2-0.5b")


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_greedy_parity_qwen_shape(qwen_dir, draft):
    agreement_then_parity(f"qwen_{draft or 'plain'}", qwen_dir, draft,
                          prompts=[list(range(100, 164)), list(range(7, 300, 3))])


CASES = {
    "decode64": [(1, 1 + (i * 37) % 1000) for i in range(64)],
    "decode2": [(1, 999), (1, 17)],
    "prompt1000": [(1000, 1000)],
    "chunk_and_verify": [(512, 900), (5, 300), (5, 41), (1, 77)],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_kernels_at_real_shapes(case, dtype):
    from llmd.runtime.execution.cuda.ops import decode_splits
    heads, kvh, d = QWEN
    q, kc, vc, meta, spans = make_case(CASES[case], heads, kvh, d, dtype, device="cuda", seed=1)
    want = reference(q, kc, vc, spans, meta.shape.num_rows)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    splits = [1]
    if meta.shape.max_query_len <= 5:
        splits.append(decode_splits(meta.shape.num_seqs, kvh, meta.shape.width))
    for s in splits:
        got = attend(q, kc, vc, meta, s)
        torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


def test_store_kv_at_real_shapes():
    heads, kvh, d = QWEN
    slots = torch.randperm(4096, device="cuda")[:700]
    slots[::7] = -1
    k = torch.randn(700, kvh, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(700, kvh, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(4096, kvh, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    torch.ops.llmd.store_kv(k, v, kc, vc, slots)
    real = slots >= 0
    assert torch.equal(kc[slots[real]], k[real]) and torch.equal(vc[slots[real]], v[real])
    written = torch.zeros(4096, dtype=torch.bool, device="cuda")
    written[slots[real]] = True
    assert kc[~written].abs().max() == 0           # nothing else touched (slot -1 writes nowhere)


def test_graph_replay_matches_eager_after_metadata_changes():
    from llmd.runtime.execution.cuda.backend import CudaRunner
    from llmd.runtime.model_runner import Feed
    from llmd.runtime.models.loader import load_model
    runners = [CudaRunner(load_model(TARGET, "float32"), 256, 16, "float32", max_num_seqs=8, num_spec_tokens=3,
                               max_model_len=512, graphs=g) for g in ("capture", "off")]
    tables = [[5, 9, 1, 30, 31], [0, 2, 32, 33, 34], [7, 3, 8, 35, 36], [4, 37, 38, 39, 40]]
    lens = [40, 20, 33, 9]
    steps = [[Feed(list(range(3, 3 + n)), 0, t, 1) for n, t in zip(lens, tables)]]
    for i in range(6):                           # the batch changes every step: 4, 3, 2, 4 requests, then verification
        live = [0, 1, 2, 3][: (4, 3, 2, 4, 2, 3)[i]]
        k = 1 if i < 4 else 3
        steps.append([Feed([11 + i] * k, lens[j] + i * 3, tables[j], k) for j in live])
    graphed, eager = runners
    for feeds in steps:
        got, want = graphed.run(graphed.prepare_feeds(feeds)), eager.run(eager.prepare_feeds(feeds))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert graphed.graphs.replays == 6
    torch.testing.assert_close(graphed.k_pool, eager.k_pool, atol=1e-5, rtol=1e-5)


def test_device_sampler_matches_the_cpu_sampler():
    from llmd.runtime.execution.cuda.sampling import SamplingBatch, sample_tokens
    from llmd.runtime.sampler import SamplingRow, make_generator, sample
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=2),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=3)]
    for trial in range(20):
        logits = torch.randn(len(params), 151936, generator=torch.Generator().manual_seed(trial)) * 4
        rows = lambda: [SamplingRow(p, None if p.greedy else make_generator(trial), [1, 5, 5, 9], 2) for p in params]  # noqa: E731
        want = sample(logits, rows()).token_ids.tolist()
        got = sample_tokens(logits.cuda(), SamplingBatch.build(rows(), "cuda")).tolist()
        assert got == want


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    """Tokens equal position by position, and the first position where each stream differs."""
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    total = sum(len(w) for w in want)
    first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
    return {"agree": same / total, "first_difference": first}
