"""The correctness contract of DESIGN.md section 5 for every strategy (reference backend).

The lifecycle runs 256 chained verify -> random accept -> commit steps with random
window lengths, padding rows and (for ``circular``) many flushes, and after every step
compares against the float64 oracle and the float32 reference recurrence.

Tolerances: every strategy's committed state must equal the float32 reference recurrence
bit for bit (``snapshot`` and ``fold`` run it, ``circular`` folds raw records through it).
Against the float64 oracle the error is float32 rounding of a contractive recurrence
(|exp(g)| <= 1, beta in (0, 1), unit keys): we require < 1e-5 relative at every step,
and that it does not grow (last quarter's max within 4x the first quarter's). ``circular``
outputs come from the closed form, a different association of the same sums: they must
stay within the same 1e-5 of the oracle as the recurrence's own outputs do.
"""

import pytest
import torch

from replayssm.testing.lifecycle import Lifecycle
from replayssm.state import GDNShape, StatePool
from replayssm.strategies import StepProtocolError

STRATEGIES = ["snapshot", "fold", "circular"]
SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=8)
TOL = 1e-5


def make(strategy, *, layers=2, slots=5, window=4, ring_len=8, seed=0):
    pool = StatePool(SHAPE, layers, slots, strategy=strategy, window=window, ring_len=ring_len)
    return pool, Lifecycle(pool, num_requests=3, padding_rows=1, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lifecycle_256_steps(strategy):
    pool, lc = make(strategy)
    reports = [lc.step() for _ in range(256)]
    for r in reports:
        assert r.state_bitexact, f"step {r.step}: committed state differs from the reference recurrence"
        assert r.conv_bitexact, f"step {r.step}: conv state/outputs differ from sequential decoding"
        assert r.state_err < TOL, f"step {r.step}: state error {r.state_err:.2e} vs the float64 oracle"
        assert r.out_err < TOL, f"step {r.step}: output error {r.out_err:.2e} vs the float64 oracle"
        if pool.strategy.exact_outputs:
            assert r.out_bitexact, f"step {r.step}: outputs differ from the reference recurrence"
    first = max(r.state_err for r in reports[:64])
    last = max(r.state_err for r in reports[-64:])
    assert last < 4 * first + 1e-7, f"state error grows: {first:.2e} -> {last:.2e}"
    assert sum(sum(r.accepted) for r in reports) > 256 * 3, "acceptance too low to exercise multi-token commits"
    if strategy == "circular":
        assert sum(r.flushed for r in reports) > 50, "the lifecycle must exercise flushes"
        assert not all(r.out_bitexact for r in reports), "closed-form outputs bit-equal everywhere: is verify the recurrence?"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lifecycle_on_a_conv_ring(strategy):
    """The conv history and window as one ring a slot (``conv_ring=True``, 8 entries for
    windows of 4 and taps of 4): over 48 steps each slot's history is sequential
    decoding's inputs and the conv outputs sequential decoding's, bit for bit, the GDN
    state the reference recurrence's; the positions pass the ring's end many times,
    and no window buffer exists. (The Triton ring kernels: tests/ops/test_conv_ring.py.)"""
    pool = StatePool(SHAPE, 2, 5, strategy=strategy, window=4, ring_len=8, conv_ring=True)
    lc = Lifecycle(pool, num_requests=3, padding_rows=1, generator=torch.Generator().manual_seed(7))
    assert "conv_window" not in pool.buffers and pool.conv_state.shape[-1] == 8
    for _ in range(48):
        r = lc.step()
        assert torch.equal(pool.conv_history()[:, lc.slots], lc.conv_reference), f"step {r.step}: conv history"
        assert r.conv_bitexact, f"step {r.step}: conv outputs differ from sequential decoding"
        assert r.state_bitexact, f"step {r.step}: committed state differs from the reference recurrence"
    assert int(pool.conv_pos[lc.slots].min()) > 4 * 8


def _corrupt_record(pool, rows, accepted):
    """Poison the value of the first record the commit will keep, for the first live row."""
    i = next(i for i, s in enumerate(rows) if s >= 0)
    s = rows[i]
    buf = pool.buffers
    if "snapshots" in buf:
        buf["snapshots"][0, s, accepted[i] - 1] += 0.5
    elif "write_pos" in buf:  # circular: the window's first record sits after the history
        L = pool.ring_len
        pos = (int(buf["cache_base"][s]) + int(buf["write_pos"][s])) % L
        buf["ring_v"][0, s, pos] += 0.5
    else:
        buf["ring_v"][0, s, 0] += 0.5


def _corrupt_cursor(pool, rows, accepted):
    s = next(s for s in rows if s >= 0)
    pool.buffers["write_pos"][s] += 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_teeth_corrupted_record_is_caught(strategy):
    """One corrupted record (snapshot for ``snapshot``) makes the lifecycle fail."""
    _, lc = make(strategy)
    for _ in range(5):
        assert lc.step().state_bitexact
    bad = lc.step(tamper=_corrupt_record)
    following = [lc.step() for _ in range(3)]
    caught = [not r.state_bitexact and r.state_err > TOL for r in [bad] + following]
    assert any(caught), "a corrupted record went unnoticed"


def test_teeth_corrupted_cursor_is_caught():
    _, lc = make("circular")
    for _ in range(3):
        lc.step()
    reports = [lc.step(tamper=_corrupt_cursor)] + [lc.step() for _ in range(3)]
    assert any(not r.state_bitexact and r.state_err > TOL for r in reports)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_untouched_slots_and_padding_rows(strategy):
    """Slots outside the batch stay bit-identical in every buffer; padding rows get zero
    outputs and write nothing."""
    pool, lc = make(strategy, slots=6)
    for _ in range(6):
        lc.step()
    bystander = pool.alloc()
    x = lc.make_inputs(3)
    for layer in range(pool.num_layers):  # give the bystander real history
        b1 = pool.batch([bystander], [3], prefill=True)
        pool.strategy.conv_prefill(layer, x["x"], b1)
        pool.strategy.prefill(layer, x["q"], x["k"], x["v"], x["a"], x["b"], b1)
    snapshot = {name: buf.clone() for name, buf in pool.buffers.items()}
    live = lc.slots
    batch = pool.batch([-1, live[0], -1, live[1]], [2, 3, 1, 4])
    outs = []
    for layer in range(pool.num_layers):
        x = lc.make_inputs(batch.num_tokens)
        pool.strategy.conv_verify(layer, x["x"], batch)
        outs.append(pool.strategy.verify(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch))
    pool.strategy.commit(batch, [1, 2, 1, 3])
    for o in outs:
        assert torch.equal(o[0:2], torch.zeros_like(o[0:2])) and torch.equal(o[5:6], torch.zeros_like(o[5:6]))
        assert (o[2:5].abs() > 0).all()
    for name, buf in pool.buffers.items():
        before = snapshot[name]
        for s in [bystander, live[2]] + [s for s in range(pool.num_slots) if s not in pool.live_slots]:
            now, was = (buf[:, s], before[:, s]) if buf.dim() > 1 else (buf[s], before[s])
            assert torch.equal(now.nan_to_num(7.0), was.nan_to_num(7.0)), f"{name} of untouched slot {s} changed"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_poisoned_unused_ring_entries_never_reach_a_checkpoint(strategy):
    """Fill every ring entry that holds no committed record with NaN/inf before each
    step: outputs, checkpoints and committed states stay finite and exact."""
    pool, lc = make(strategy)

    def poison(pool):
        buf = pool.buffers
        for s in lc.slots:
            if "write_pos" in buf:
                L = pool.ring_len
                used = {(int(buf["cache_base"][s]) + c) % L for c in range(int(buf["write_pos"][s]))}
            else:
                used = set()
            for name in ("ring_k", "ring_v", "ring_g", "ring_beta", "ring_u", "snapshots"):
                if name in buf:
                    for p in range(buf[name].shape[2]):
                        if p not in used:
                            buf[name][:, s, p] = float("nan") if p % 2 else float("inf")
        buf["conv_window"].fill_(float("nan"))

    for _ in range(40):
        poison(pool)
        r = lc.step()
        assert r.state_bitexact and r.state_err < TOL and r.out_err < TOL
        assert torch.isfinite(pool.buffers["checkpoints"]).all()


def test_fold_side_channel_leaves_outputs_bitidentical():
    """``fold``'s record writes are a side channel: its verify outputs equal the
    ``snapshot`` verify's (plain recurrence) outputs bit for bit on the same inputs."""
    pools = {}
    for name in ("fold", "snapshot"):
        pool, lc = make(name, seed=3)
        pools[name] = (pool, lc)
    for _ in range(20):
        x = pools["fold"][1].make_inputs(8)
        outs = {}
        for name, (pool, lc) in pools.items():
            batch = pool.batch(lc.slots[:2], [4, 4])
            outs[name] = [pool.strategy.verify(l, x["q"], x["k"], x["v"], x["a"], x["b"], batch) for l in range(2)]
            pool.strategy.commit(batch, [3, 2])
        for a, b in zip(outs["fold"], outs["snapshot"]):
            assert torch.equal(a, b)


class TestProtocolAndFailedCalls:
    @pytest.fixture(params=STRATEGIES)
    def setup(self, request):
        pool, lc = make(request.param)
        for _ in range(5):
            lc.step()
        return pool, lc

    def snapshot(self, pool):
        return {name: buf.clone() for name, buf in pool.buffers.items()}

    def assert_unchanged(self, pool, before):
        for name, buf in pool.buffers.items():
            assert torch.equal(buf.nan_to_num(7.0), before[name].nan_to_num(7.0)), f"{name} changed"

    def test_bad_inputs_change_nothing(self, setup):
        pool, lc = setup
        before = self.snapshot(pool)
        batch = pool.batch(lc.slots, [2, 2, 2])
        x = lc.make_inputs(6)
        with pytest.raises(ValueError, match="tokens"):
            pool.strategy.verify(0, x["q"][:5], x["k"][:5], x["v"][:5], x["a"][:5], x["b"][:5], batch)
        with pytest.raises(ValueError, match="k must"):
            pool.strategy.verify(0, x["q"], x["k"][:, :1], x["v"], x["a"], x["b"], batch)
        with pytest.raises(ValueError, match="layer"):
            pool.strategy.verify(9, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
        with pytest.raises(TypeError, match="batch"):
            pool.strategy.verify(0, x["q"], x["k"], x["v"], x["a"], x["b"], [0, 1])
        self.assert_unchanged(pool, before)

    def test_bad_accepted_changes_nothing(self, setup):
        pool, lc = setup
        batch = pool.batch(lc.slots, [2, 3, 1])
        x = lc.make_inputs(6)
        for layer in range(pool.num_layers):
            pool.strategy.verify(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
        before = self.snapshot(pool)
        for bad in ([1, 4, 1], [0, 1, 1], [1, 1]):
            with pytest.raises(ValueError, match="accepted"):
                pool.strategy.commit(batch, bad)
            self.assert_unchanged(pool, before)
        pool.strategy.commit(batch, [2, 3, 1])

    def test_step_protocol(self, setup):
        pool, lc = setup
        batch = pool.batch(lc.slots, [2, 2, 2])
        x = lc.make_inputs(6)
        with pytest.raises(StepProtocolError, match="missing layers"):
            pool.strategy.commit(batch, [1, 1, 1])
        pool.strategy.verify(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
        with pytest.raises(StepProtocolError, match="already verified"):
            pool.strategy.verify(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
        other = pool.batch(lc.slots, [2, 2, 2])
        with pytest.raises(StepProtocolError, match="same batch"):
            pool.strategy.verify(1, x["q"], x["k"], x["v"], x["a"], x["b"], other)
        pool.strategy.verify(1, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
        pool.strategy.commit(batch, [1, 2, 1])
        with pytest.raises(ValueError, match="window"):
            pool.batch(lc.slots, [5, 1, 1])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fork_continues_identically(strategy):
    """A forked request carries checkpoint, conv, ring and cursors: fed the same tokens,
    parent and child stay bit-identical; freeing the parent leaves the child intact."""
    pool, lc = make(strategy, slots=6)
    for _ in range(7):
        lc.step()
    parent = lc.slots[0]
    child = pool.fork(parent)
    for step in range(6):
        batch = pool.batch([parent, child], [4, 4])
        x = lc.make_inputs(4)
        xx = {k: torch.cat([v, v]) for k, v in x.items()}
        outs = []
        for layer in range(pool.num_layers):
            pool.strategy.conv_verify(layer, xx["x"], batch)
            outs.append(pool.strategy.verify(layer, xx["q"], xx["k"], xx["v"], xx["a"], xx["b"], batch))
        pool.strategy.commit(batch, [step % 4 + 1] * 2)
        for o in outs:
            assert torch.equal(o[:4], o[4:])
    for layer in range(pool.num_layers):
        a, b = pool.strategy.committed_state(layer, [parent, child])
        assert torch.equal(a, b)
    kept = pool.strategy.committed_state(0, [child])
    pool.free(parent)
    assert torch.equal(pool.strategy.committed_state(0, [child]), kept)
    with pytest.raises(ValueError, match="not allocated"):
        pool.strategy.committed_state(0, [parent])
