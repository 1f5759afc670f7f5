"""Plain decoding through ``circular``'s ring (``Strategy.decode``, DESIGN.md section 9),
reference backend, fp32.

A decode step is a window of one token from the frozen checkpoint plus the ring's
committed records, its record appended, then ``commit(batch)``; the state is written
only at a flush. Checked with the lifecycle's two references (``Lifecycle.decode_step``):

* the committed state after every step equals the design recurrence (DESIGN.md section
  1, token by token in fp32) bit for bit: flushes replay raw records through the exact
  step, so any lost, repeated or misplaced record shows;
* outputs against the float64 oracle within ``TOL = 1e-5`` relative (the norm of the
  error over the norm of the outputs, per layer-step): the closed form associates the
  same sums differently from the recurrence, ~1e-7 relative in fp32 on these contractive
  steps (measured below 5e-7), while one wrong record or gate is off by O(0.1).

Plain steps use the pool's window ``T`` in the cursor rule (flush when ``write_pos + 2T
> L``), so a request may take a speculative step of up to ``T`` tokens next: from a fresh
request, pure plain decoding flushes every ``L - 2T + 1`` steps, and so it is asserted.
"""

import pytest
import torch

from replayssm.ops import tuning
from replayssm.state import GDNShape, StatePool
from replayssm.strategies import StepProtocolError
from replayssm.testing.lifecycle import Lifecycle

SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=8)
TOL = 1e-5


def make(*, layers=2, requests=3, window=4, ring_len=16, seed=0, strategy="circular"):
    pool = StatePool(SHAPE, layers, requests + 2, strategy=strategy, window=window, ring_len=ring_len)
    return pool, Lifecycle(pool, num_requests=requests, padding_rows=1, generator=torch.Generator().manual_seed(seed))


def check(reports):
    for r in reports:
        assert r.state_bitexact, f"step {r.step}: committed state differs from the fp32 recurrence"
        assert r.conv_bitexact, f"step {r.step}: conv state/outputs differ from sequential decoding"
        assert r.state_err < TOL, f"step {r.step}: state error {r.state_err:.2e} vs the float64 oracle"
        assert r.out_err < TOL, f"step {r.step}: output error {r.out_err:.2e} vs the float64 oracle"


def snapshot(pool):
    return {name: buf.clone() for name, buf in pool.buffers.items()}


def assert_unchanged(pool, before):
    for name, buf in pool.buffers.items():
        assert torch.equal(buf.nan_to_num(7.0), before[name].nan_to_num(7.0)), f"{name} changed"


def committed(pool, slots):
    return torch.stack([pool.strategy.committed_state(layer, slots) for layer in range(pool.num_layers)])


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("window,ring_len", [(1, 2), (1, 4), (1, 8), (1, 16), (1, 32), (3, 8), (3, 16), (3, 32)])
def test_plain_ring_steps_are_the_recurrence_across_flushes_at_every_ring_length(window, ring_len):
    """Three full cursor cycles of plain steps at every legal ring length (powers of two
    from 2T up to 32) for T = 1 and 3: exact committed state after every step, outputs
    within TOL of float64, and a request flushes exactly every ``L - 2T + 1`` steps."""
    cycle = ring_len - 2 * window + 1
    pool, lc = make(layers=1, requests=2, window=window, ring_len=ring_len)
    steps = 3 * cycle + 1
    reports = [lc.decode_step() for _ in range(steps)]
    check(reports)
    # From fresh cursors, a flush row at the step after write_pos reaches L - 2T + 1.
    assert sum(r.flushed for r in reports) == 2 * ((steps - 1) // cycle)
    if cycle > 1:  # a flush every step would never read a history
        assert not all(r.out_bitexact for r in reports), "closed-form outputs bit-equal everywhere: is it the recurrence?"


@pytest.mark.parametrize("small_batch", [False, True], ids=["closed_form", "replay"])
def test_plain_and_speculative_steps_mix_on_one_request(small_batch):
    """120 steps, each a plain ring step or a speculative one (random windows, random
    acceptance), chosen at random for the whole batch: the same exact committed state
    and the same output bound as pure speculative decoding. ``replay``: the small-batch
    path's schedule for both kinds, a flush at every commit (the reference op evaluates
    the closed form either way; the Triton tests run the replay kernel)."""
    g = torch.Generator().manual_seed(7)
    pool, lc = make(ring_len=16)
    with tuning.override("circular", replay_max_batch=64 if small_batch else 0):
        kinds = ["decode" if torch.rand((), generator=g) < 0.5 else "spec" for _ in range(120)]
        reports = [lc.decode_step() if k == "decode" else lc.step() for k in kinds]
    check(reports)
    assert kinds.count("decode") > 30 and kinds.count("spec") > 30
    # switches both ways, with flushes landing on either kind of step
    assert any(a != b for a, b in zip(kinds, kinds[1:]))
    flushed = {k for k, r in zip(kinds, reports) if r.flushed}
    assert flushed == {"decode", "spec"}
    first = max(r.state_err for r in reports[:30])
    last = max(r.state_err for r in reports[-30:])
    assert last < 4 * first + 1e-7, f"state error grows: {first:.2e} -> {last:.2e}"


def test_teeth_a_corrupted_record_or_cursor_of_a_plain_step_is_caught():
    """The checks above fail when a plain step's record or a cursor is corrupted."""

    def corrupt_record(pool, rows, accepted):
        s = next(s for s in rows if s >= 0)
        pos = (int(pool.buffers["cache_base"][s]) + int(pool.buffers["write_pos"][s])) % pool.ring_len
        pool.buffers["ring_v"][0, s, pos] += 0.5

    def drop_record(pool, rows, accepted):  # the step's record falls outside the history
        pool.buffers["write_pos"][next(s for s in rows if s >= 0)] -= 1

    for tamper in (corrupt_record, drop_record):
        _, lc = make(ring_len=16)
        for _ in range(3):
            assert lc.decode_step().state_bitexact
        reports = [lc.decode_step(tamper=tamper)] + [lc.decode_step() for _ in range(12)]
        assert any(not r.state_bitexact and r.state_err > TOL for r in reports), tamper.__name__


def test_decode_writes_no_state_between_flushes():
    """Between flushes a plain step leaves every checkpoint as it was (it reads the
    state and appends a record); the flush writes it."""
    pool, lc = make(ring_len=16)
    lc.decode_step()
    ckpt = pool.buffers["checkpoints"]
    for _ in range(20):
        flushing = bool(pool.buffers["is_flush"][lc.slots].any())
        before = ckpt.clone()
        lc.decode_step()
        assert torch.equal(ckpt, before) != flushing


def test_abort_of_a_decode_step_keeps_the_committed_state():
    """A decode step aborted after some layers (a flush row among them) leaves the
    committed state and what follows exactly as if the step never ran."""
    pool, lc = make(ring_len=8, window=2)
    for _ in range(6):  # a flush within L - 2T + 1 = 5 steps of any phase
        lc.decode_step()
        if bool(pool.buffers["is_flush"][lc.slots].any()):
            break
    assert bool(pool.buffers["is_flush"][lc.slots].any()), "the aborted step must include a flush row"
    before = committed(pool, lc.slots)
    batch = pool.batch(lc.slots, 1)
    x = lc.make_inputs(len(lc.slots))
    pool.strategy.conv_verify(0, x["x"], batch)
    pool.strategy.decode(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
    pool.strategy.abort(batch)
    assert torch.equal(committed(pool, lc.slots), before)
    check([lc.decode_step() for _ in range(6)])


def test_fold_history_makes_requests_fresh_without_changing_their_state():
    """After plain and speculative steps, ``fold_history`` folds each request's ring
    into its checkpoints: the committed state is unchanged bit for bit, the checkpoint
    now equals it, the ring is empty (prefill accepts the request), and the lifecycle
    goes on exactly. Refused for a slot of an open step; a no-op without a ring."""
    pool, lc = make(ring_len=16)
    for i in range(7):
        lc.decode_step() if i % 2 else lc.step()
    before = committed(pool, lc.slots)
    assert (pool.buffers["write_pos"][lc.slots] > 0).all()
    assert not torch.equal(pool.buffers["checkpoints"][:, lc.slots], before), "the ring must hold history"
    pool.strategy.fold_history(lc.slots[:2])
    assert torch.equal(committed(pool, lc.slots), before)
    assert torch.equal(pool.buffers["checkpoints"][:, lc.slots[:2]], before[:, :2])
    assert (pool.buffers["write_pos"][lc.slots[:2]] == 0).all() and pool.buffers["write_pos"][lc.slots[2]] > 0
    pool.strategy._check_fresh(lc.slots[:2])
    check([lc.decode_step() if i % 2 else lc.step() for i in range(6)])
    batch = pool.batch(lc.slots, 1)
    x = lc.make_inputs(3)
    pool.strategy.decode(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
    with pytest.raises(StepProtocolError, match="open step"):
        pool.strategy.fold_history(lc.slots[:1])
    with pytest.raises(ValueError, match="not allocated"):
        make(strategy="fold")[0].strategy.fold_history([4])


# ---------------------------------------------------------------------------- the call's contract
class TestDecodeContract:
    @pytest.fixture
    def setup(self):
        pool, lc = make(ring_len=16)
        for _ in range(3):
            lc.step()
        return pool, lc

    def test_bad_calls_raise_naming_the_argument_and_change_nothing(self, setup):
        pool, lc = setup
        before = snapshot(pool)
        x = lc.make_inputs(4)
        one = pool.batch(lc.slots, 1)
        two = pool.batch(lc.slots, [2, 1, 1])
        s = pool.strategy
        with pytest.raises(ValueError, match="batch: decode takes one token per request"):
            s.decode(0, x["q"], x["k"], x["v"], x["a"], x["b"], two)
        with pytest.raises(ValueError, match="tokens"):
            s.decode(0, x["q"], x["k"], x["v"], x["a"], x["b"], one)
        y = lc.make_inputs(3)
        with pytest.raises(ValueError, match="k must"):
            s.decode(0, y["q"], y["k"][:, :1], y["v"], y["a"], y["b"], one)
        with pytest.raises(TypeError, match="q has dtype"):
            s.decode(0, y["q"].double(), y["k"], y["v"], y["a"], y["b"], one)
        with pytest.raises(ValueError, match="layer"):
            s.decode(9, y["q"], y["k"], y["v"], y["a"], y["b"], one)
        with pytest.raises(TypeError, match="batch"):
            s.decode(0, y["q"], y["k"], y["v"], y["a"], y["b"], [0, 1, 2])
        assert not s.step_open
        assert_unchanged(pool, before)

    def test_step_protocol(self, setup):
        pool, lc = setup
        s = pool.strategy
        x = lc.make_inputs(3)
        batch = pool.batch(lc.slots, 1)
        s.decode(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
        with pytest.raises(StepProtocolError, match="already verified"):
            s.decode(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
        with pytest.raises(StepProtocolError, match="missing layers"):
            s.commit(batch)
        with pytest.raises(StepProtocolError, match="same batch"):
            s.decode(1, x["q"], x["k"], x["v"], x["a"], x["b"], pool.batch(lc.slots, 1))
        with pytest.raises(StepProtocolError, match="open step"):
            s.prefill(1, x["q"], x["k"], x["v"], x["a"], x["b"], pool.batch(lc.slots, 1, prefill=True))
        s.decode(1, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
        s.commit(batch)
        assert not s.step_open

    @pytest.mark.parametrize("strategy", ["snapshot", "fold"])
    def test_strategies_without_a_ring_refuse(self, strategy):
        pool, lc = make(strategy=strategy)
        assert not pool.strategy.ring_decode
        x = lc.make_inputs(3)
        with pytest.raises(TypeError, match="ring_decode"):
            pool.strategy.decode(0, x["q"], x["k"], x["v"], x["a"], x["b"], pool.batch(lc.slots, 1))
        assert not pool.strategy.step_open
