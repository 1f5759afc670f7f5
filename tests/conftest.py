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


def _interpreter_patches_the_language_once_a_launch() -> None:
    """The Triton interpreter swaps ``triton.language``'s builtins for its own at each
    launch, and again at every call of a ``@triton.jit`` helper inside the kernel, for
    every program of the grid: the same swaps (the helper's modules are the kernel's, or
    a part of them), each walking the modules' members. On the engine's kernels that is
    a third of a test's time. Here a helper's call skips the swap where the launch around
    it has already made it for each language module the helper sees; a helper that sees
    another one swaps as before. What the kernels compute is unchanged (the same
    functions run); only the repeated swaps go."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "_once_a_launch", False) or not hasattr(interpreter, "_LangPatchScope"):
        return
    import inspect

    import triton.language as tl

    active: list[set] = []  # the language modules swapped by the launch in progress
    seen: dict = {}  # a function's language modules (its module's imports)

    def langs(fn) -> set:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[fn]

    def patch_lang(fn):
        if active and langs(fn) <= active[-1]:  # a helper's call inside a launch that swapped its modules
            return interpreter._LangPatchScope()
        scope = patch(fn)
        if active:  # a helper seeing a module that the launch did not swap: swapped, kept until the launch ends
            active[-1] |= langs(fn)
            return scope
        active.append(set(langs(fn)))  # a launch (GridExecutor): until it restores its swaps
        restore = scope.restore

        def restore_and_end():
            active.clear()
            restore()

        scope.restore = restore_and_end
        return scope

    patch_lang._once_a_launch = True
    interpreter._patch_lang = patch_lang


_interpreter_patches_the_language_once_a_launch()


@pytest.fixture
def entry_independent_dots(monkeypatch):
    """Interpreter dots whose entry ``(i, j)`` depends on row ``i`` of the left operand
    and column ``j`` of the right alone, as on a GPU (each entry of an MMA tile
    accumulates its own products, in the same order wherever it sits), for tests of bits
    between two launches of other shapes (a token alone against the same token in a
    window) or between two columns (equal weight rows, equal logits). The interpreter's
    dot is numpy's ``matmul``, whose BLAS picks its kernels by shape and position: on some
    CPUs (OpenBLAS on an AMD EPYC, for one) a row of an ``[M, K] x [K, N]`` product
    differs in its last bit from the same row in a product of another ``M``. Here
    float32 dots go through ``einsum``, whose loop sums each entry over ``K`` in order,
    the same wherever the entry sits (three times slower than BLAS, so only where a
    test asks); other dtypes, and runs on a GPU, are left as they are."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    blas_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.data.dtype == b.data.dtype == d.data.dtype == np.float32):
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


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
