"""Execution backends: each is held to ``reference`` (greedy tokens identical in float32, logits within
LOGIT_TOL), the choice is made once at load, and a new backend plugs in as one more entry."""
import dataclasses
import random
import types

import pytest
import torch

from engine_run import run
from llmd import LLM, SamplingParams
from llmd.runtime import execution, kernels
from llmd.runtime.config import EngineConfig
from llmd.runtime.errors import EngineDirError, InvalidRequest
from llmd.runtime.execution.base import Execution
from llmd.runtime.execution.cpu import KERNEL_OPS, CpuBackend
from llmd.runtime.execution.reference import ReferenceBackend
from llmd.runtime.model_runner import Feed, ModelRunner
from llmd.runtime.models.layers import TORCH_OPS, Linear
from llmd.runtime.models.loader import load_model

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# float32 logits of a step, absolute: the kernels and torch sum in different orders, and the reference
# attends with an explicit softmax; the test models' logits are of order 1
LOGIT_TOL = 1e-5


def prompts(n=6, seed=2):
    rng = random.Random(seed)
    return [[rng.randrange(20, 400) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir):
    return run(tiny_model_dir, prompts(), GREEDY, execution="reference")[0]


@pytest.mark.parametrize("opts", [{}, {"execution": "cpu"}, {"draft": "ngram"}, {"kv_dtype": "bfloat16"},
                                  {"kv_dtype": "int8"}, {"max_batch_tokens": 16}, {"attention": "reference"}],
                         ids=["auto", "cpu", "ngram", "bf16-kv", "int8-kv", "chunked", "cpu-ref-attention"])
def test_cpu_greedy_tokens_equal_the_reference(tiny_model_dir, reference_tokens, opts):
    assert run(tiny_model_dir, prompts(), GREEDY, **opts)[0] == reference_tokens


def test_reference_with_a_draft_and_a_bf16_pool_equals_itself_plain(tiny_model_dir, reference_tokens):
    assert run(tiny_model_dir, prompts(), GREEDY, execution="reference", draft="ngram")[0] == reference_tokens
    draft = run(tiny_model_dir, prompts(), GREEDY, execution="reference", draft=str(tiny_model_dir))[0]
    assert draft == reference_tokens


def step_logits(model_dir, backend, feeds_per_step, **runner_kw):
    model = load_model(model_dir, "float32")
    backend.prepare(model)
    runner = ModelRunner(model, num_blocks=64, block_size=16, dtype="float32", execution=backend.name, **runner_kw)
    assert type(runner.execution) is backend
    return [runner.run(runner.prepare_feeds(feeds)) for feeds in feeds_per_step], runner


@pytest.mark.parametrize("kw", [{}, {"architecture": "Qwen3ForCausalLM", "head_dim": 16}, {"tie": False}],
                         ids=["llama", "qwen3", "untied"])
def test_cpu_logits_are_within_tolerance_of_the_reference(model_factory, kw):
    path = model_factory("exec-" + "-".join(map(str, kw.values())), **kw)
    rng = random.Random(4)
    blocks = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    lengths = [30, 5, 17]
    steps = [[Feed([rng.randrange(400) for _ in range(n)], 0, b, 1) for n, b in zip(lengths, blocks)],   # prompts
             [Feed([rng.randrange(400)], n, b, 1) for n, b in zip(lengths, blocks)],                     # decodes
             [Feed([rng.randrange(400) for _ in range(4)], n + 1, b, 4) for n, b in zip(lengths, blocks)]]  # verify
    want, ref = step_logits(path, ReferenceBackend, steps)
    got, cpu = step_logits(path, CpuBackend, steps)
    for w, g in zip(want, got):
        assert w.shape == g.shape
        assert (w - g).abs().max().item() < LOGIT_TOL
        assert torch.equal(w.argmax(-1), g.argmax(-1))
    # the reference really is plain torch: checkpoint weights, torch's ops, the per-request attention
    assert ref.execution.ops is TORCH_OPS and ref.attn.reference and not ref.attn.kernel
    assert not ref.model._interleaved
    assert all(m.stored is None and m.plan.split_max_rows == 0 for m in ref.model.modules() if type(m) is Linear)
    if kernels.available():
        assert cpu.execution.ops is KERNEL_OPS and cpu.attn.kernel


def test_without_kernels_the_cpu_backend_settles_on_torch_once(tiny_model_dir, reference_tokens, monkeypatch):
    """Kernels unavailable at load: torch's ops, SDPA attention, no fused step; the same tokens."""
    monkeypatch.setattr(kernels, "available", lambda: False)
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB")
    backend = llm.engine.runner.execution
    assert type(backend) is CpuBackend and backend.ops is TORCH_OPS and not backend.fuses
    assert not llm.engine.runner.attn.kernel
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference_tokens


def test_the_choice_is_made_from_the_setting_and_the_weights():
    assert execution.choose("auto") == "cpu"
    assert execution.choose("reference") == "reference"

    class Step:
        name = "onnxruntime"
    assert execution.choose("auto", Step()) == "compiled"
    with pytest.raises(EngineDirError, match="compiled onnxruntime step; execution 'reference'"):
        execution.choose("reference", Step())
    with pytest.raises(InvalidRequest, match="execution must be one of auto, cpu, reference"):
        EngineConfig(model="m", execution="gpu")
    assert EngineConfig(model="m").execution == "auto"


class CountingBackend(Execution):
    """A backend from outside llmd's package: the reference's forms, counting its hooks' calls."""
    name = "counting"

    def __init__(self, model, attn):
        super().__init__(model, attn)
        self.steps = self.attends = 0
        inner = self.attend

        def attend(layer, q, k, v):
            self.attends += 1
            return inner(layer, q, k, v)
        self.attend = attend

    prepare = staticmethod(ReferenceBackend.prepare)
    attention = ReferenceBackend.attention

    def forward(self, batch):
        self.steps += 1
        return super().forward(batch)


def test_a_new_backend_plugs_in_as_one_more_entry(tiny_model_dir, reference_tokens, monkeypatch):
    monkeypatch.setitem(execution._BACKENDS, "counting", "test_execution:CountingBackend")
    monkeypatch.setattr("llmd.runtime.config.EXECUTIONS", ("auto", "cpu", "reference", "counting"))
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == "execution")
    monkeypatch.setattr(field, "metadata", types.MappingProxyType(
        {**field.metadata, "choices": ("auto", "cpu", "reference", "counting")}))
    monkeypatch.setattr(execution, "EXECUTIONS", ("auto", "cpu", "reference", "counting"))
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB", execution="counting")
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference_tokens
    backend = llm.engine.runner.execution
    assert backend.steps > 0 and backend.attends == backend.steps * llm.engine.model_config.num_layers
