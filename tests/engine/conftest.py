"""Shared set-up of the engine tests: one intra-op thread and a per-test generator.

The tiny models' ops are microseconds long; with several threads, hand-offs between
them cost more than the work (and far more on a busy 2-core machine), so the engine
tests run single-threaded and restore the setting afterwards.
"""

import pytest
import torch
import transformers  # noqa: F401  (the 'test' extra installs it; a missing one must fail, not skip)


@pytest.fixture(autouse=True, scope="package")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def rng() -> torch.Generator:
    """A generator seeded from the per-test seed (tests/conftest.py): fresh inputs per test."""
    return torch.Generator().manual_seed(torch.initial_seed())


@pytest.fixture
def seed() -> int:
    """A per-test integer seed for model weights."""
    return torch.initial_seed() % 100_000


def _check_refused(fn, args: dict, cases, *untouched: torch.Tensor) -> None:
    """Each ``(change, error, message)`` in ``cases``: ``fn(**args)`` with ``change``
    applied raises ``error`` whose text matches ``message``, and every tensor in
    ``untouched`` keeps its values (a refused call writes nothing)."""
    kept = [t.clone() for t in untouched]
    for change, error, message in cases:
        with pytest.raises(error, match=message):
            fn(**{**args, **change})
        for t, k in zip(untouched, kept):
            assert torch.equal(t, k), f"{change}: refused, but wrote an output"


@pytest.fixture
def refused():
    """``refused(fn, args, cases, *untouched)``: bad arguments are refused, naming the
    argument, and touch nothing (see :func:`_check_refused`)."""
    return _check_refused
