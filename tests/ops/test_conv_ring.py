"""The conv ring (``ring_pos``): a slot's history and window in one buffer, committed by
moving its position. Each test runs the ring beside the conv state and window buffer
it replaces, on the same inputs: the outputs must be the same bits (the same products
in the same order) and the ring's history entries the state's values, step after step,
across wraps of the ring and positions below ``W - 1`` (negative history entries).

Without a GPU these run under the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from replayssm.ops import (  # noqa: E402
    DraftTrees,
    accepted_paths,
    causal_conv_commit,
    causal_conv_verify,
    causal_conv_verify_tree,
    compact_path,
    conv_ring_commit,
    triton_common,
)
from replayssm.ops.conv import ring_history_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_common.INTERPRETER:
    pytest.skip("CPU run without TRITON_INTERPRET=1 at import time", allow_module_level=True)

BACKENDS = ("reference", "triton")


def history(ring: torch.Tensor, pos: torch.Tensor, w: int) -> torch.Tensor:
    """The ring's ``[num_slots, C, W - 1]`` history (oldest first) at ``pos``: what a conv
    state would hold."""
    r = ring.shape[2]
    return torch.stack([ring[s][:, ring_history_rows(int(pos[s]), w, r)] for s in range(ring.shape[0])])


def ring_from_state(state: torch.Tensor, pos: torch.Tensor, r: int) -> torch.Tensor:
    """A ``[num_slots, C, R]`` ring, NaN everywhere but the history entries, which hold
    ``state`` (the pool's layout: entries of a channel block are rows of channels)."""
    ns, c, w1 = state.shape
    ring = torch.full((ns, r, c), float("nan"), device=state.device).transpose(1, 2)
    for s in range(ns):
        ring[s][:, ring_history_rows(int(pos[s]), w1 + 1, r)] = state[s]
    return ring


def batch(lengths, slots):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return as_t(slots), as_t(cu)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c,w,t,r,with_bias", [(40, 4, 5, 8, True), (300, 3, 2, 4, False), (24, 2, 5, 8, True)])
def test_ring_steps_are_the_state_and_buffer_steps(backend, c, w, t, r, with_bias):
    """Eight steps on six slots, each a random mix of verify windows of ``1..T`` tokens
    committed with random counts, one-token decoding steps and prompts longer than the
    ring (``update_state``), padding rows among live ones, positions starting random and
    below ``W - 1``. The ring (``T = R - W + 1`` in the first two cases: a window
    fills it) against the conv state with its window buffer: outputs bit for
    bit, and after every step the ring's history entries equal the state."""
    ns = 6
    gen = torch.Generator().manual_seed(c * 10 + w)
    weight = torch.randn(c, w, device=DEVICE)
    bias = torch.randn(c, device=DEVICE) if with_bias else None
    state = torch.randn(ns, c, w - 1, device=DEVICE)
    pos = torch.randint(-3, 40, (ns,), generator=gen, dtype=torch.int32).to(DEVICE)
    pos[0] = 1  # a history entry before position 0
    ring = ring_from_state(state, pos, r)
    wbuf = torch.full((ns, t, c), float("nan"), device=DEVICE)
    wraps = 0
    for step in range(8):
        rows = int(torch.randint(2, 5, (), generator=gen))
        slots = torch.randperm(ns, generator=gen)[:rows].tolist()
        slots[int(torch.randint(0, rows, (), generator=gen))] = -1
        kind = ("verify", "decode", "verify", "prompt")[step % 4]
        if kind == "prompt":
            lengths = torch.randint(1, 2 * r + 3, (rows,), generator=gen).tolist()
        elif kind == "decode":
            lengths = [1] * rows
        else:
            lengths = torch.randint(1, t + 1, (rows,), generator=gen).tolist()
        s_t, cu = batch(lengths, slots)
        x = torch.randn(sum(lengths), c, device=DEVICE)
        before = pos.clone()
        if kind == "verify":
            y_s = causal_conv_verify(x, state, weight, bias, s_t, cu, window_buf=wbuf, backend=backend)
            y_r = causal_conv_verify(x, ring, weight, bias, s_t, cu, ring_pos=pos, backend=backend)
            acc = torch.tensor([int(torch.randint(1, n + 1, (), generator=gen)) for n in lengths], dtype=torch.int32,
                               device=DEVICE)
            causal_conv_commit(state[None], wbuf[None], s_t, acc, backend=backend)
            conv_ring_commit(pos, s_t, acc, backend=backend)
            live = [s for s in slots if s >= 0]
            for i, s in enumerate(slots):
                if s >= 0:
                    assert int(pos[s]) == int(before[s]) + int(acc[i])
                    wraps += int(before[s]) // r != int(pos[s]) // r
            others = [s for s in range(ns) if s not in live]
            assert torch.equal(pos[others], before[others])
        else:
            y_s = causal_conv_verify(x, state, weight, bias, s_t, cu, update_state=True, max_len=max(lengths),
                                     backend=backend)
            y_r = causal_conv_verify(x, ring, weight, bias, s_t, cu, update_state=True, max_len=max(lengths),
                                     ring_pos=pos, backend=backend)
            assert torch.equal(pos, before), "update_state moved a position"
        assert torch.equal(y_r, y_s), (step, kind)
        assert torch.equal(history(ring, pos, w), state), (step, kind)
    assert wraps > 0  # some commit crossed the ring's end


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_verify_keeps_the_window_where_the_history_continues(backend):
    """A verify stores window position ``t`` at entry ``(p + t) mod R`` and nothing else
    (the history entries and the entries past the window keep their values); the
    Triton ring's entries are the reference's, bit for bit."""
    c, w, r, ns = 40, 4, 8, 4
    weight, bias = torch.randn(c, w, device=DEVICE), torch.randn(c, device=DEVICE)
    ring0 = torch.randn(ns, r, c, device=DEVICE).transpose(1, 2)
    pos = torch.tensor([6, -2, 13, 0], dtype=torch.int32, device=DEVICE)
    slots, cu = batch([5, 2, 3], [0, 3, 1])
    x = torch.randn(10, c, device=DEVICE)
    ring = ring0.clone()
    causal_conv_verify(x, ring, weight, bias, slots, cu, ring_pos=pos, backend=backend)
    for i, s in enumerate(slots.tolist()):
        p = int(pos[s])
        lo, hi = int(cu[i]), int(cu[i + 1])
        written = [(p + j) % r for j in range(hi - lo)]
        assert torch.equal(ring[s][:, written], x[lo:hi].T)
        rest = [e for e in range(r) if e not in written]
        assert torch.equal(ring[s][:, rest], ring0[s][:, rest])
    assert torch.equal(ring[2], ring0[2])  # not in the batch
    if backend == "triton":
        ring_ref = ring0.clone()
        causal_conv_verify(x, ring_ref, weight, bias, slots, cu, ring_pos=pos, backend="reference")
        assert torch.equal(ring, ring_ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_arguments_are_refused_before_anything_is_written(backend):
    c, w, ns = 24, 4, 3
    weight = torch.randn(c, w, device=DEVICE)
    x = torch.randn(6, c, device=DEVICE)
    slots, cu = batch([6], [1])
    pos = torch.zeros(ns, dtype=torch.int32, device=DEVICE)
    for r, match in ((6, "power of two"), (2, "at least W = 4")):
        with pytest.raises(ValueError, match=match):
            causal_conv_verify(x, torch.randn(ns, c, r, device=DEVICE), weight, None, slots, cu, ring_pos=pos,
                               backend=backend)
    ring = torch.randn(ns, c, 8, device=DEVICE)
    ring0 = ring.clone()
    with pytest.raises(ValueError, match="window"):  # 6 tokens, room for 5
        causal_conv_verify(x, ring, weight, None, slots, cu, ring_pos=pos, max_len=6, backend=backend)
    with pytest.raises(ValueError, match="window_buf must be None"):
        causal_conv_verify(x, ring, weight, None, slots, cu, ring_pos=pos, window_buf=torch.randn(ns, 8, c),
                           backend=backend)
    with pytest.raises(ValueError, match="ring_pos"):
        causal_conv_verify(x, ring, weight, None, slots, cu, ring_pos=pos[:2], backend=backend)
    with pytest.raises(TypeError, match="ring_pos"):
        causal_conv_verify(x, ring, weight, None, slots, cu, ring_pos=pos.float(), backend=backend)
    trees = DraftTrees.from_parents([[-1, 0, 0, 1, 1, 2]], max_nodes=6)  # 6 nodes, room for 5
    with pytest.raises(ValueError, match="the trees have 6 nodes"):
        causal_conv_verify_tree(torch.randn(6, c, device=DEVICE), ring, weight, None, slots, trees, ring_pos=pos,
                                backend=backend)
    assert torch.equal(ring, ring0)
    with pytest.raises(ValueError, match="slots"):
        conv_ring_commit(pos, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32),
                         backend=backend)
    assert not pos.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_steps_on_a_ring_are_the_state_and_buffer_steps(backend):
    """Draft trees on a ring: the tree conv reads the history before each slot's
    position (nodes shallower than ``W - 1``) and keeps the nodes' inputs from it; the
    tree commit gathers the accepted path where the history continues
    (``compact_path`` with ``offset = ring_pos``) and moves the position. Two steps
    against the conv state with its window buffer: outputs bit for bit, the history
    after each commit the state."""
    c, w, r, ns = 40, 4, 16, 5
    shapes = [DraftTrees.from_branching((2, 2)).parents[0].tolist(), [-1, 0, 0, 1, 1, 2, 4, 3], [-1, 0, 1]]
    trees = DraftTrees.from_parents(shapes, max_nodes=8)
    weight, bias = torch.randn(c, w, device=DEVICE), torch.randn(c, device=DEVICE)
    state = torch.randn(ns, c, w - 1, device=DEVICE)
    pos = torch.tensor([11, 2, 30, 7, 1], dtype=torch.int32, device=DEVICE)  # 30 + 8 nodes wraps the ring
    ring = ring_from_state(state, pos, r)
    wbuf = torch.full((ns, 8, c), float("nan"), device=DEVICE)
    dev = trees.on(DEVICE)
    for slot_list, accepted in (([2, 0, 4], [6, 7, 2]), ([1, 2, 3], [3, 0, 1])):
        slots = torch.tensor(slot_list, dtype=torch.int32, device=DEVICE)
        x = torch.randn(trees.batch * 8, c, device=DEVICE)
        y_s = causal_conv_verify_tree(x, state, weight, bias, slots, trees, window_buf=wbuf, backend=backend)
        y_r = causal_conv_verify_tree(x, ring, weight, bias, slots, trees, ring_pos=pos, backend=backend)
        assert torch.equal(y_r, y_s)
        path, count = accepted_paths(dev, torch.tensor(accepted, dtype=torch.int32, device=DEVICE))
        compact_path([wbuf[None]], slots, path, count, backend=backend)
        causal_conv_commit(state[None], wbuf[None], slots, count, backend=backend)
        compact_path([ring.transpose(1, 2)[None]], slots, path, count, pos, backend=backend)
        conv_ring_commit(pos, slots, count, backend=backend)
        assert torch.equal(history(ring, pos, w), state)
    assert int(pos[2]) >= r  # slot 2 went past the ring's end
