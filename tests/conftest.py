import os

import pytest
import torch

from modelfactory import make_model_dir

torch.set_num_threads(int(os.environ.get("LLMD_TEST_THREADS", "2")))


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
