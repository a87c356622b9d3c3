"""The CUDA backend's model runner on the CPU (interpreted Triton kernels): graph buckets, padding
and metadata copies through the graph stand-in, and the step's logits against the CPU runner."""
import os

import pytest
import torch

from llmd.runtime.model_runner import Feed, ModelRunner
from llmd.runtime.models.loader import load_model

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted kernels only")]
pytest.importorskip("triton")
from llmd.runtime.execution.cuda.backend import CudaRunner  # noqa: E402
from llmd.runtime.execution.cuda.graphs import batch_sizes, bucket_shapes, choose_bucket  # noqa: E402
from llmd.runtime.execution.cuda.metadata import StepShape  # noqa: E402

BS = 16


def test_batch_sizes():
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert batch_sizes(3) == [1, 2, 3]


def test_bucket_choice():
    shapes = bucket_shapes(20, 8, 4)
    assert choose_bucket(shapes, 3, 3, 1, 5) == StepShape(4, 4, 8, 1)
    assert choose_bucket(shapes, 17, 17, 1, 5) == StepShape(20, 20, 8, 1)
    assert choose_bucket(shapes, 21, 21, 1, 5) is None                   # more requests than any bucket
    assert choose_bucket(shapes, 7, 3, 5, 5) == StepShape(20, 4, 8, 5)    # verification rows
    assert choose_bucket(shapes, 3, 3, 1, 9) is None                      # longer than the table
    assert choose_bucket(bucket_shapes(8, 8, 0), 4, 2, 2, 1) is None      # no verification buckets


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    from modelfactory import make_model_dir
    path = make_model_dir(tmp_path_factory.mktemp("cuda-runner"), layers=1, heads=4, kv_heads=2, max_pos=64)
    blocks = 24

    def model():
        m = load_model(path, "float32")
        m.requires_grad_(False)
        return m
    standin = CudaRunner(model(), blocks, BS, "float32", device="cpu", max_num_seqs=6, num_spec_tokens=3,
                              graphs="standin")
    cpu = ModelRunner(model(), blocks, BS, "float32", reference_attention=True)
    return standin, cpu


def feed(tokens, start, blocks, samples=None):
    return Feed(tokens, start, blocks, len(tokens) if samples is None else samples)


def test_steps_match_the_cpu_runner(runners):
    """Prompts (eager), then decode and verification steps through the stand-in's buckets, against
    the CPU runner's reference attention: logits and pools."""
    standin, cpu = runners
    tables = [[3, 7], [0, 11, 5], [9], [20, 2]]
    prompts = [list(range(5, 25)), list(range(30, 63)), [4, 8, 15], list(range(40, 58))]
    steps = [
        [feed(p, 0, t, 1) for p, t in zip(prompts, tables)],                                   # prompts: eager
        [feed([7], 20, tables[0]), feed([9], 33, tables[1]), feed([1], 3, tables[2])],          # decode, bucket 4
        [feed([2], 21, tables[0]), feed([3], 34, tables[1])],                                   # bucket 2
        [feed([2, 6, 1], 22, tables[0]), feed([3], 35, tables[1]), feed([5, 5], 4, tables[2])],  # verification
        [feed([8], 18, tables[3]), feed([1], 6, tables[2])],                                    # bucket 2 again
    ]
    before = standin.graphs.replays
    for feeds in steps:
        got = standin.run(standin.prepare_feeds(feeds))
        torch.testing.assert_close(got, cpu.run(cpu.prepare_feeds(feeds)), atol=1e-4, rtol=1e-4)
    assert standin.graphs.replays - before == 4
    torch.testing.assert_close(standin.k_pool, cpu.k_pool, atol=1e-5, rtol=1e-5)


def test_replay_copies_overwrite_the_previous_step(runners):
    """A bucket's static buffers after a full step and then a smaller one: the rows the smaller step
    does not use are padding again (slot -1, no request), not the previous step's."""
    standin = runners[0]
    full = [feed([1], 3, [21]), feed([2], 5, [22]), feed([3], 7, [23]), feed([4], 2, [19])]
    standin.run(standin.prepare_feeds(full))
    standin.run(standin.prepare_feeds(full[:3]))
    static = standin.graphs.buckets[StepShape(4, 4, standin.width, 1)].static
    assert static.slot_mapping.tolist() == [21 * BS + 3, 22 * BS + 5, 23 * BS + 7, -1]
    assert static.seq_lens.tolist() == [4, 6, 8, 0]
    assert static.query_start.tolist() == [0, 1, 2, 3, 3]
    assert static.block_table[3].abs().sum() == 0


class Launches:
    """A kernel's launches, recorded and passed through."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((args, kw))
            return self.kernel[grid](*args, **kw)
        return launch


def specializations(kernel, calls) -> dict:
    """Per constexpr combination, the set of full specializations a GPU compile of ``kernel`` would
    key its cache on (sm_90): 16-byte pointer alignment, integers equal to 1 or divisible by 16."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend as TritonCuda
    from triton.runtime.jit import JITFunction, create_function_from_signature
    jit = JITFunction(kernel.fn, do_not_specialize=kernel.kwargs.get("do_not_specialize"))
    bind = create_function_from_signature(jit.signature, jit.params, TritonCuda(GPUTarget("cuda", 90, 32)))
    seen: dict = {}
    for args, kw in calls:
        spec = tuple(map(repr, bind(*args, **kw)[1]))
        seen.setdefault(tuple(sorted(kw.items())), set()).add(spec)
    return seen


def test_a_run_compiles_each_kernel_variant_once(runners, monkeypatch):
    """Eager steps of 1 to 3 requests with odd and even row counts: every launch of a kernel with the
    same compile-time constants specializes alike (metadata parts stay 128-byte aligned, the varying
    integers unspecialized), so a GPU run would not recompile when the batch changes."""
    from llmd.runtime.execution.cuda import kernels
    from llmd.runtime.execution.cuda.metadata import build_metadata
    standin = runners[0]
    names = ("store_kv_kernel", "paged_attention_kernel", "combine_splits_kernel")
    launches = {n: Launches(getattr(kernels, n)) for n in names}
    for n in names:
        monkeypatch.setattr(kernels, n, launches[n])
    tables, lens = [[0], [1, 2], [3, 4, 5]], (12, 20, 37)              # block tables 1 to 3 wide
    steps = [[feed(list(range(3, 3 + n)), 0, t, 1)] for n, t in zip(lens, tables)]                       # prompts
    steps += [[feed([4] * k, n, t) for k, n, t in zip(ks, lens, tables)] for ks in ((1, 2), (2, 2, 1), (1,))]
    steps += [[feed([4, 5], 6, [0]), feed([7] * 3, 0, [9], 1)], [feed([1], 9, [1]), feed([2], 24, tables[1])]]
    for feeds in steps:
        meta = build_metadata(feeds, BS)
        assert all((v.data_ptr() - meta.flat.data_ptr()) % 128 == 0 for v in
                   (meta.input_ids, meta.positions, meta.slot_mapping, meta.query_start, meta.seq_lens, meta.block_table))
        standin.run(standin.prepare_feeds(feeds))
    assert launches["combine_splits_kernel"].calls, "no split-KV step ran"
    for n in names:
        variants = specializations(getattr(kernels, n).kernel, launches[n].calls)
        assert all(len(v) == 1 for v in variants.values()), (n, variants)
