import os
import re
import sys
from pathlib import Path

import pytest
import torch

# the shared helpers (tests/support) import by their bare names, from every folder of tests
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from modelfactory import make_model_dir  # noqa: E402

# one thread a worker where pytest-xdist runs two (make test), two threads in a single process
torch.set_num_threads(int(os.environ.get("LLMD_TEST_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")))
# Without a GPU the CUDA backend's Triton kernels run on Triton's interpreter, over CPU tensors. The
# variable is read when a kernel is defined, so it is set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


HEAVY_MODULE = re.compile(r"^pytestmark = .*pytest\.mark\.heavy", re.M)


def pytest_ignore_collect(collection_path, config):
    """Where heavy tests are deselected (``-m "not slow and not heavy"``, make test-fast), a module whose
    every test is heavy (its ``pytestmark`` says so) is not even imported: its imports cost each worker."""
    expr = config.getoption("markexpr") or ""
    if collection_path.suffix != ".py" or " or " in expr or not re.search(r"(^|\band )not heavy\b", expr):
        return None
    return True if HEAVY_MODULE.search(collection_path.read_text()) else None


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
