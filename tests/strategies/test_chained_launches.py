"""Which state kernels take part in a chain of programmatic launches, and how.

``triton_common.chained_launches`` lets a kernel start while the one before it runs; each
such kernel waits (``CHAINED``) before reading what that kernel may write. The rules
(DESIGN.md section 6): a read-only verify (fold's) and circular's coefficient and outputs
kernels chain, and so do the conv and commit kernels; a kernel that writes states (plain
decode's and snapshot's recurrence) launches in stream order; and a block's first kernel
launches in stream order. These tests record every launch of a strategy step on a
device where programmatic launches are allowed (patched in: the launches are recorded,
not run) and check those rules. That chained launches give stream order's numbers is a
GPU test (tests/gpu/test_chained_state_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from replayssm.ops import triton_common, tuning  # noqa: E402
from replayssm.state import GDNShape, StatePool  # noqa: E402

if not triton_common.INTERPRETER:
    pytest.skip("records the interpreter's launches (TRITON_INTERPRET=1 at import time)", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

SHAPE = GDNShape(num_heads=1, num_value_heads=2, head_k_dim=16, head_v_dim=8)
WINDOW = 3


@pytest.fixture
def launches(monkeypatch):
    """The launches of kernels as ``(name, CHAINED, programmatic)``, none of them run,
    on a device that allows programmatic launches."""
    seen = []

    def record(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, bool(kwargs.get("CHAINED", False)), bool(kwargs.get("launch_pdl", False))))

    monkeypatch.setattr(InterpretedFunction, "run", record)
    monkeypatch.setattr(triton_common, "dependent_launch", lambda device: True)
    return seen


def _pool(strategy: str):
    gen = torch.Generator().manual_seed(3)
    pool = StatePool(SHAPE, 2, 4, strategy=strategy, window=WINDOW, ring_len=16, backend="triton")
    for layer in range(2):
        pool.set_layer_params(layer, A_log=torch.empty(2).uniform_(-2, -0.5, generator=gen),
                              dt_bias=torch.randn(2, generator=gen),
                              conv_weight=torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel, generator=gen))
    if strategy == "circular":
        pool.strategy.small_batch_path = False  # the closed form, as at large batch
    return pool, [pool.alloc(), pool.alloc()]


def _step(pool, slots, launches, *, tokens: int):
    """One step, each layer's conv and state kernel in a chained block, then the commit
    in one; returns each block's launches."""
    gen = torch.Generator().manual_seed(4)
    s, n = pool.strategy, tokens * len(slots)
    batch = pool.batch(slots, tokens)
    blocks = []
    for layer in range(2):
        x = torch.randn(n, SHAPE.conv_dim, generator=gen)
        a, b = torch.randn(n, 2, generator=gen), torch.randn(n, 2, generator=gen)
        with triton_common.chained_launches(torch.device("cpu")):
            first = len(launches)
            y = s.conv_verify(layer, x, batch)
            q, k, v = torch.split(y, [16, 16, 16], dim=-1)
            q, k, v = q.reshape(n, 1, 16), k.reshape(n, 1, 16), v.reshape(n, 2, 8)
            (s.verify if tokens > 1 else s.decode)(layer, q, k, v, a, b, batch)
            blocks.append(launches[first:])
    with triton_common.chained_launches(torch.device("cpu")):
        first = len(launches)
        s.commit(batch, torch.full((len(slots),), tokens, dtype=torch.int32)) if tokens > 1 else s.commit(batch)
        blocks.append(launches[first:])
    return blocks


@pytest.mark.parametrize("strategy", ["snapshot", "fold", "circular"])
def test_a_step_chains_its_readers_and_leaves_writers_in_stream_order(launches, strategy):
    pool, slots = _pool(strategy)
    *layers, commit = _step(pool, slots, launches, tokens=WINDOW)
    for block in layers:
        # the conv first, in stream order, letting the next kernel start early
        assert block[0] == ("_conv_verify_kernel", True, False), block
        if strategy == "fold":  # a read-only verify: chained, its state loaded before the wait
            assert block[1:] == [("_recurrence_kernel", True, True)], block
        elif strategy == "snapshot":  # a writer (T states a window): stream order
            assert block[1:] == [("_recurrence_kernel", False, False)], block
        else:  # the coefficients after the conv, then the outputs after them
            assert block[1] == ("_coefficients_kernel", True, True), block
            assert [k for k, _, _ in block[2:]] == ["_window_outputs_kernel"] and block[2][1], block
    # the commit: its first kernel in stream order (after the acceptance), the rest chained
    assert commit and commit[0][1:] == (True, False) and all(c[1:] == (True, True) for c in commit[1:]), commit


def test_plain_decoding_through_the_recurrence_writes_states_in_stream_order(launches):
    """fold's plain step (a prompt's path, one token a request) updates the state in place."""
    pool, slots = _pool("fold")
    batch = pool.batch(slots, 1, prefill=True)
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 1, 16, generator=gen), torch.randn(2, 1, 16, generator=gen)
    v, a, b = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, generator=gen), torch.randn(2, 2, generator=gen)
    with triton_common.chained_launches(torch.device("cpu")):
        pool.strategy.prefill(0, q, k, v, a, b, batch)
        pool.strategy.prefill(1, q, k, v, a, b, batch)
    assert launches == [("_recurrence_kernel", False, False)] * 2


@pytest.mark.parametrize("split", [0, 1, 2])
def test_plain_decoding_through_the_ring_chains_its_one_launch(launches, split):
    """circular's plain step: the ring decoding kernel in one launch chains after the conv
    (its checkpoint tiles read before the wait); with the flush rows apart (a kernel on
    a side stream, or before the token kernel) both stay in stream order: chained there,
    the token kernel measured 8-13% slower at batch 16 (BENCHMARKS.md)."""
    pool, slots = _pool("circular")
    with tuning.override("ring_decode", split_flush=split):
        *layers, commit = _step(pool, slots, launches, tokens=1)
    for block in layers:
        assert block[0] == ("_conv_verify_kernel", True, False), block
        if split:
            assert sorted(block[1:]) == [("_ring_decode_kernel", False, False), ("_ring_flush_kernel", False, False)]
        else:
            assert block[1:] == [("_ring_decode_kernel", True, True)], block


def test_outside_a_block_nothing_chains(launches):
    pool, slots = _pool("fold")
    gen = torch.Generator().manual_seed(6)
    batch = pool.batch(slots, WINDOW)
    n = WINDOW * 2
    q, k = torch.randn(n, 1, 16, generator=gen), torch.randn(n, 1, 16, generator=gen)
    v, a, b = torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, generator=gen), torch.randn(n, 2, generator=gen)
    pool.strategy.verify(0, q, k, v, a, b, batch)
    assert launches == [("_recurrence_kernel", False, False)]
