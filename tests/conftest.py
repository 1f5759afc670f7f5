"""Test set-up: the Triton interpreter on machines without a GPU, and the `gpu` marker.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is set
here, at collection time, when no CUDA device is present.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


class _CurrentStderr:
    """A stream that writes to ``sys.stderr`` as it is at each write."""

    def write(self, text):
        return sys.stderr.write(text)

    def flush(self):
        sys.stderr.flush()


def _transformers_logs_to_the_current_stderr() -> None:
    """transformers binds its log handler to ``sys.stderr`` as it is when the library
    first logs. Inside a test that is the test's capture (``capsys``), closed when the
    test ends, and a later test's warning then prints a "Logging error" traceback into
    its own captured stderr (which the CLI tests read). Bind it here, to whatever
    ``sys.stderr`` is at each write."""
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger()  # creates the handler now
    handler = hf_logging._default_handler
    handler.setStream(_CurrentStderr())
    handler.__dict__.pop("flush", None)  # the library pinned the old stream's flush on the instance


_transformers_logs_to_the_current_stderr()


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


@pytest.fixture
def read_flags(monkeypatch):
    """The list, filled as the test runs, of every read of a step's output by a
    ``StepGenerator``: ``True`` where the next step was queued before the read
    (``run_ahead``), ``False`` where it follows the read."""
    from replayssm.engine.generator import StepGenerator

    flags = []
    read = StepGenerator._read

    def logged_read(self, step, n, run_next):
        flags.append(run_next)
        return read(self, step, n, run_next)

    monkeypatch.setattr(StepGenerator, "_read", logged_read)
    return flags
