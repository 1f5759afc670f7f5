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
