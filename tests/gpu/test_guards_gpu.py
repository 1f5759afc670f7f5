"""Memory safety on the GPU: index guards inside real CUDA graphs, and a commit that
does not synchronise.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_guards_gpu.py
(tests/ops/test_guards.py runs the host-side rejections there as well, compiled.)

* A captured recurrence replayed with an out-of-range slot or ``cu_seqlens = [0, 3000]``
  for 3 tokens touches no memory outside its valid rows, and the next
  ``check_errors`` names the error; valid replays equal eager calls bit for bit.
* A pool batch built from a device slot tensor inside capture checks the slots on the
  device (range, liveness); a replay with a freed slot runs that row as padding.
* ``commit`` with accepted counts on the GPU runs under ``torch.cuda.set_sync_debug_mode
  ("error")``; a bad count is clamped and reported by ``pool.check_errors``.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.ops import gdn_recurrence, guards
from replayssm.state import GDNShape, StatePool

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clear_error_words")]

DEV = torch.device("cuda")
H, HV, K, V, NS, T = 2, 4, 64, 64, 4, 3


def layer(n):
    return (torch.randn(n, H, K, device=DEV), torch.randn(n, H, K, device=DEV), torch.randn(n, HV, V, device=DEV),
            torch.randn(n, HV, device=DEV), torch.randn(n, HV, device=DEV),
            torch.rand(HV, device=DEV) * -2, torch.randn(HV, device=DEV) * 0.5)


def capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles; runs the host-side checks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_captured_recurrence_masks_bad_indices_and_reports_them():
    x = layer(3)
    state = torch.randn(NS, HV, V, K, device=DEV)
    slots = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEV)
    work = state.clone()
    graph, out = capture(lambda: gdn_recurrence(*x, work, slots, cu, max_len=T, update_state=True))

    work.copy_(state)
    graph.replay()
    expect = state.clone()
    o_eager = gdn_recurrence(*x, expect, slots, cu, max_len=T, update_state=True)
    torch.cuda.synchronize()
    assert torch.equal(out, o_eager) and torch.equal(work, expect)
    guards.check_errors(DEV)

    for bad_slots, bad_cu, match in (([0, 1000], [0, 1, 3], "slot index outside"),
                                     ([0, 2], [0, 1, 3000], "cu_seqlens"),
                                     ([3, 3], [0, 1, 3], "two rows")):
        slots.copy_(torch.tensor(bad_slots, dtype=torch.int32))
        cu.copy_(torch.tensor(bad_cu, dtype=torch.int32))
        work.copy_(state)
        graph.replay()
        torch.cuda.synchronize()
        live = [s for s in bad_slots if 0 <= s < NS]
        for s in range(NS):
            if s not in live:
                assert torch.equal(work[s], state[s]), f"slot {s} changed with {bad_slots}, {bad_cu}"
        with pytest.raises(guards.DeviceCheckError, match=match):
            guards.check_errors(DEV)


def strategy_pool(strategy="fold"):
    shape = GDNShape(H, HV, K, V)
    pool = StatePool(shape, 2, NS, strategy=strategy, window=T, device=DEV)
    for layer_idx in range(2):
        pool.set_layer_params(layer_idx, A_log=torch.rand(HV) * -2, dt_bias=torch.randn(HV) * 0.5,
                              conv_weight=torch.randn(shape.conv_dim, shape.conv_kernel))
    return pool


def step(pool, batch, inputs, accepted):
    outs = [pool.strategy.verify(layer_idx, *x[:5], batch) for layer_idx, x in enumerate(inputs)]
    pool.strategy.commit(batch, accepted)
    return outs


@pytest.mark.parametrize("strategy", ["snapshot", "fold", "circular"])
def test_commit_does_not_synchronise_and_reports_bad_counts(strategy):
    pool = strategy_pool(strategy)
    slots = [pool.alloc(), pool.alloc()]
    batch = pool.batch([slots[0], -1, slots[1]], [3, 1, 2])
    inputs = [layer(6) for _ in range(2)]
    accepted = torch.tensor([2, 1, 2], dtype=torch.int32, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(pool, batch, inputs, accepted)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    pool.check_errors()
    before = pool.strategy.committed_state(0, slots)
    batch = pool.batch([slots[0], -1, slots[1]], [3, 1, 2])
    step(pool, batch, inputs, torch.tensor([0, 1, 5], dtype=torch.int32, device=DEV))  # both live rows bad
    with pytest.raises(guards.DeviceCheckError, match="accepted"):
        pool.check_errors()
    after = pool.strategy.committed_state(0, slots)
    assert not torch.equal(after, before), "clamped counts (1 and 2) still commit tokens"


def test_a_device_slot_batch_inside_capture_checks_liveness_on_the_device():
    pool = strategy_pool("fold")
    a, b = pool.alloc(), pool.alloc()
    dev_slots = torch.tensor([a, b], dtype=torch.int32, device=DEV)
    inputs = [layer(2 * T) for _ in range(2)]
    accepted = torch.full((2,), 2, dtype=torch.int32, device=DEV)
    ckpt = pool.buffers["checkpoints"]
    start = ckpt.clone()

    def body():
        batch = pool.batch(dev_slots, T)
        return step(pool, batch, inputs, accepted)

    graph, _ = capture(body)
    ckpt.copy_(start)
    graph.replay()
    graphed = ckpt.clone()
    ckpt.copy_(start)
    step(pool, pool.batch([a, b], T), inputs, accepted)
    torch.cuda.synchronize()
    assert torch.equal(graphed, ckpt), "the captured step differs from the eager one"
    pool.check_errors()

    pool.free(b)
    ckpt.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ckpt[:, b], start[:, b]), "a freed slot's state changed"
    assert not torch.equal(ckpt[:, a], start[:, a])
    with pytest.raises(guards.DeviceCheckError, match="not allocated"):
        pool.check_errors()
