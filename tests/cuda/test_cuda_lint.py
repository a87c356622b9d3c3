"""The fake-tensor step lint: whole CUDA-backend steps (prompt chunks, decode buckets, verification
buckets, sampling on the device) under FakeTensorMode with fake device tensors (cuda where torch has
CUDA, else meta standing for it), and faults it catches."""
import pytest
import torch

from llmd.runtime.model_runner import Feed
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.request import SamplingParams
from llmd.runtime.sampler import SamplingRow, make_generator

pytest.importorskip("triton")
from llmd.runtime.execution.cuda.lint import DEVICE, StepLintError, lint_steps  # noqa: E402

CFG = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 300,
                             "hidden_size": 112, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 7, "num_key_value_heads": 1, "max_position_embeddings": 256,
                             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False})

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                         presence_penalty=0.3, frequency_penalty=0.2, seed=3)


def rows(params):
    return [SamplingRow(p, None if p.greedy else make_generator(1), [1, 2, 2, 5], 2) for p in params]


STEPS = [
    ([Feed(list(range(1, 40)), 0, [4, 9, 1], 1), Feed([5, 6, 7], 0, [2], 1)], rows([GREEDY, SAMPLED])),  # prompts
    ([Feed([3], 39, [4, 9, 1], 1), Feed([8], 3, [2], 1), Feed([9], 7, [6], 1)], rows([GREEDY, SAMPLED, GREEDY])),
    ([Feed([3, 4, 5], 40, [4, 9, 1, 7], 3)], rows([GREEDY] * 3)),                                           # verify k=2
]


def test_a_whole_step_stays_on_the_device_without_host_syncs():
    ids = lint_steps(CFG, STEPS, num_spec_tokens=2)
    assert [t.shape[0] for t in ids] == [2, 3, 3]
    assert all(t.device == DEVICE for t in ids)


def test_eager_steps_pass_too():
    lint_steps(CFG, STEPS[:2], dtype="float32", graphs="off")


def test_catches_a_host_sync():
    def plant(runner):
        forward = runner.model.forward

        def synced(ids, positions, attn):
            if int(positions.max()) > 0:        # a value read on the host
                pass
            return forward(ids, positions, attn)
        runner.model.forward = synced
    with pytest.raises(StepLintError, match="host sync"):
        lint_steps(CFG, STEPS[:1], runner_hook=plant)


def test_catches_a_nonzero():
    def plant(runner):
        attend = runner.attn.attend
        runner.attn.attend = lambda layer, q, k, v: attend(layer, q, k, v)[runner.attn.meta.slot_mapping >= 0]
    with pytest.raises(StepLintError, match="host sync"):
        lint_steps(CFG, STEPS[1:2], runner_hook=plant)


def test_catches_a_tensor_left_on_the_cpu():
    def plant(runner):
        runner.model.norm.weight = torch.nn.Parameter(torch.ones(CFG.hidden_size, dtype=torch.bfloat16),
                                                      requires_grad=False)
    with pytest.raises(StepLintError, match="device mismatch"):
        lint_steps(CFG, STEPS[:1], runner_hook=plant)
