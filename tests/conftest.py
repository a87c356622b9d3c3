import os

import pytest
import torch

from modelfactory import make_model_dir

torch.set_num_threads(int(os.environ.get("LLMD_TEST_THREADS", "2")))
# Without a GPU the CUDA backend's Triton kernels run on Triton's interpreter, over CPU tensors. The
# variable is read when a kernel is defined, so it is set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer that has the FIM tokens."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    def make(name: str = "m", **kw):
        return make_model_dir(tmp_path_factory.mktemp(name), **kw)
    return make


@pytest.fixture
def no_grad():
    """llmd's kernels run only where no gradient is recorded, as in the engine (inference_mode)."""
    with torch.no_grad():
        yield
