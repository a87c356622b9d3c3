"""The runner contract (llmd.runtime.execution.contract): every runner has every member the engine,
the speculative proposers, the disk tier and the stats read, and the code reads no other."""
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmd.runtime.execution.contract import EXECUTION_MEMBERS, RUNNER_ATTRIBUTES, missing_members
from llmd.runtime.model_runner import ModelRunner
from llmd.runtime.models.loader import load_model
from llmd.runtime.runner import Runner

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
CALLERS = ["engine.py", "spec/draft.py", "kv_tier.py"]
BS = 16


class FakeStep:
    """A compiled step's stand-in: the contract is about members, not what the step computes."""
    name = "fake"

    def forward(self, input_ids, positions, past_k, past_v):
        raise NotImplementedError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from modelfactory import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("contract"), layers=1, heads=4, kv_heads=2, max_pos=64)


def runners(path):
    model = load_model(path, "float32")
    yield "cpu", ModelRunner(model, 4, BS, "float32", execution="cpu")
    yield "reference", ModelRunner(model, 4, BS, "float32", execution="reference")
    yield "compiled", ModelRunner(model, 4, BS, "float32", backend=FakeStep())
    pytest.importorskip("triton")
    from llmd.runtime.execution.cuda.backend import CudaRunner
    yield "cuda", CudaRunner(load_model(path, "float32"), 4, BS, "float32", device="cpu", graphs="off")


def test_every_runner_has_every_member(model_dir):
    seen = set()
    for name, runner in runners(model_dir):
        assert isinstance(runner, Runner), name
        assert missing_members(runner) == [], name
        seen.add(name)
    assert seen == {"cpu", "reference", "compiled", "cuda"}


def test_a_missing_member_is_reported(model_dir):
    _, cpu = next(runners(model_dir))
    execution = SimpleNamespace(greedy=cpu.execution.greedy, kernels=None)     # no greedy_rounds

    class Planted:      # a runner without copy_slots
        def __getattr__(self, name):
            if name == "copy_slots":
                raise AttributeError(name)
            return execution if name == "execution" else getattr(cpu, name)
    assert missing_members(Planted()) == ["copy_slots", "execution.greedy_rounds"]


def test_callers_read_only_the_contract():
    """Every ``runner.<name>`` the engine, the draft proposer and the disk tier read is declared."""
    concrete = {n for n, v in vars(Runner).items() if callable(v) and not n.startswith("_")}
    declared = set(Runner.__abstractmethods__) | set(RUNNER_ATTRIBUTES) | concrete
    used, exec_used = set(), set()
    for rel in CALLERS:
        text = (RUNTIME / rel).read_text()
        used |= set(re.findall(r"\b(?:runner|draft_runner)\.(\w+)", text))
        exec_used |= set(re.findall(r"runner\.execution\.(\w+)", text))
    assert used and used <= declared, used - declared
    assert exec_used and exec_used <= set(EXECUTION_MEMBERS), exec_used - set(EXECUTION_MEMBERS)


@pytest.mark.heavy
def test_cuda_copy_slots_and_block_views(model_dir):
    pytest.importorskip("triton")
    from llmd.runtime.execution.cuda.backend import CudaRunner
    cuda = CudaRunner(load_model(model_dir, "float32"), 4, BS, "float32", device="cpu", graphs="off")
    cuda.k_pool.normal_()
    cuda.v_pool.normal_()
    cuda.copy_slots(1, 3, 5)
    k, v = cuda.block_views(3)
    torch.testing.assert_close(k[:, :5], cuda.block_views(1)[0][:, :5], rtol=0, atol=0)
    torch.testing.assert_close(v[:, :5], cuda.block_views(1)[1][:, :5], rtol=0, atol=0)
    assert k.shape[1] == BS and not cuda.can_shift
    with pytest.raises(RuntimeError):
        cuda.copy_shifted([0], [1], 2)


def test_the_engine_asks_a_runner_nothing_by_probing():
    """The engine's step is schedule / execute / update: it never asks a runner (or anything else)
    what it has with getattr or hasattr, and has no device branch."""
    text = (RUNTIME / "engine.py").read_text()
    assert not re.search(r"\b(getattr|hasattr)\(", text)
    assert "samples_on_device" not in text and "CudaRunner" not in text
    step = text[text.index("def _step("):text.index("def _record(")]
    assert "self.scheduler.schedule()" in step and "self.runner.execute(plan)" in step
    assert "self.scheduler.update(plan, result)" in step
