"""Test setup. Without a GPU, Triton kernels run under the Triton interpreter on CPU tensors."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def seed() -> int:
    """A fresh seed per test run (printed on failure through the test id's parameters); the environment
    variable STRICTNORM_TEST_SEED fixes it, to replay a failure."""
    fixed = os.environ.get("STRICTNORM_TEST_SEED")
    return int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
