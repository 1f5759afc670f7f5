"""Test set-up: the Triton interpreter on machines without a GPU, and the `gpu` marker.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is set
here, at collection time, when no CUDA device is present.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    """A different, reproducible seed per test: fresh random inputs, never zeros."""
    import zlib

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def clear_error_words():
    """Start and end with no error flagged by the kernels' device-side index guards."""
    from replayssm.ops import guards

    if torch.cuda.is_available():
        guards.error_word("cuda")  # created outside any graph capture
    guards.clear_errors()
    yield
    guards.clear_errors()
