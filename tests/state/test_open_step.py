"""Slots of an open step are guarded; a step can be aborted; alloc can take a given slot;
the committed state reads right at any time.

An open step runs from its first ``verify`` / ``conv_verify`` to its ``commit`` or
``abort``. Oracle checks use the float64 recurrence kept by :class:`Lifecycle` with its
bound (1e-5 relative, fp32 rounding of a contractive recurrence; tests/strategies).
"""

import pytest
import torch

from replayssm.testing.lifecycle import Lifecycle
from replayssm.ops import tuning
from replayssm.state import GDNShape, StatePool, StepProtocolError

STRATEGIES = ["snapshot", "fold", "circular"]
SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=8)
TOL = 1e-5


def make(strategy, *, requests=2, slots=4, layers=2, window=4, ring_len=8, seed=0, backend="reference", shape=SHAPE):
    pool = StatePool(shape, layers, slots, strategy=strategy, window=window, ring_len=ring_len, backend=backend)
    lc = Lifecycle(pool, num_requests=requests, padding_rows=1, generator=torch.Generator().manual_seed(seed))
    return pool, lc


def clone_all(pool):
    return {name: buf.clone() for name, buf in pool.buffers.items()}, list(pool._free), set(pool._live)


def assert_unchanged(pool, snap):
    bufs, free, live = snap
    for name, buf in pool.buffers.items():
        assert torch.equal(buf.nan_to_num(7.0), bufs[name].nan_to_num(7.0)), f"{name} changed"
    assert pool._free == free and pool._live == live


def verify_layers(pool, lc, batch, layers):
    """conv_verify + verify of ``layers`` on fresh random inputs."""
    for layer in layers:
        x = lc.make_inputs(batch.num_tokens)
        pool.strategy.conv_verify(layer, x["x"], batch)
        pool.strategy.verify(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch)


def committed(pool, slots):
    return [pool.strategy.committed_state(layer, slots) for layer in range(pool.num_layers)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_slots_of_an_open_step_cannot_change_hands(strategy):
    """Guards issue 12's silent corruption: verify [s0, s1], free(s1), alloc() -> s1,
    commit used to succeed and leave the new request's state NaN. Now free, fork, reset
    and re-allocation of a step's slot raise and change nothing, until commit."""
    pool, lc = make(strategy)
    for _ in range(3):
        lc.step()
    s0, s1 = lc.slots
    batch = pool.batch([s0, s1], [4, 4])
    verify_layers(pool, lc, batch, [0])
    snap = clone_all(pool)
    for call in (lambda: pool.free(s1), lambda: pool.fork(s1), lambda: pool.reset(s0), lambda: pool.free(s0)):
        with pytest.raises(StepProtocolError, match="open step"):
            call()
        assert_unchanged(pool, snap)
    with pytest.raises(ValueError, match="not free"):
        pool.alloc(slot=s1)
    assert_unchanged(pool, snap)
    other = pool.alloc()  # a slot outside the step is fine
    assert other not in (s0, s1)
    pool.free(other)
    verify_layers(pool, lc, batch, [1])
    pool.strategy.commit(batch, [4, 4])
    pool.free(s1)  # the step is over
    new = pool.alloc(slot=s1)
    for state in committed(pool, [new]):
        assert torch.equal(state, torch.zeros_like(state)), "a re-allocated slot must start from zero"
    for state in committed(pool, [s0]):
        assert torch.isfinite(state).all()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_batch_whose_slot_changed_hands_cannot_open_a_step(strategy):
    """A batch built before free + alloc of one of its slots would verify the old request
    into the new one: its first verify raises and writes nothing."""
    pool, lc = make(strategy)
    lc.step()
    s0, s1 = lc.slots
    batch = pool.batch([s0, s1], [2, 2])
    pool.free(s1)
    assert pool.alloc(slot=s1) == s1
    snap = clone_all(pool)
    x = lc.make_inputs(4)
    with pytest.raises(StepProtocolError, match="re-allocated"):
        pool.strategy.conv_verify(0, x["x"], batch)
    with pytest.raises(StepProtocolError, match="re-allocated"):
        pool.strategy.verify(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
    assert_unchanged(pool, snap)
    assert not pool.strategy.step_open and not pool.step_slots


def test_alloc_a_given_slot():
    """Engines that assign their own cache indices take a given free slot; it starts
    reset. Out of range or taken: ValueError; not an integer: TypeError; pool unchanged."""
    pool = StatePool(SHAPE, 2, 4, strategy="circular", window=2, ring_len=4)
    assert pool.alloc(slot=2) == 2
    assert pool.live_slots == [2] and pool.num_free == 3
    pool.buffers["checkpoints"][:, 2].normal_()
    pool.buffers["write_pos"][2] = 3
    snap = clone_all(pool)
    for bad, exc, match in ((2, ValueError, "not free"), (4, ValueError, "slot must be"),
                            (-1, ValueError, "slot must be"), (True, TypeError, "slot must be an integer"),
                            (1.0, TypeError, "slot must be an integer")):
        with pytest.raises(exc, match=match):
            pool.alloc(slot=bad)
        assert_unchanged(pool, snap)
    pool.free(2)
    assert pool.alloc(slot=2) == 2
    assert (pool.buffers["checkpoints"][:, 2] == 0).all() and pool.buffers["write_pos"][2] == 0
    assert [pool.alloc() for _ in range(3)] == [0, 1, 3]


@pytest.mark.parametrize("strategy", STRATEGIES + ["circular-small-batch"])
def test_abort_and_committed_state_at_any_time(strategy):
    """Guards: committed_state between circular's verify and commit applied a flushing
    row's history twice (0.49 relative error); there was no way to abandon a step.

    Over many steps (ring_len = 2T: a flush every other step), a step is either committed
    through the lifecycle or verified for a random number of layers and aborted. The
    committed state of every layer must be unchanged by verify (after each layer) and by
    abort (bit for bit: the logical state is the same replay of the same records), and
    the lifecycle's float64 oracle, which never sees the aborted steps, must still agree
    with the pool afterwards. ``circular-small-batch``: circular with its small-batch
    mode on (a flush at every commit)."""
    if strategy == "circular-small-batch":
        with tuning.override("circular", replay_max_batch=8):
            return test_abort_and_committed_state_at_any_time("circular")
    pool, lc = make(strategy, requests=3, slots=5, layers=3, window=4, ring_len=8, seed=5)
    gen = torch.Generator().manual_seed(11)
    aborts = flush_aborts = 0
    for step in range(40):
        if step % 2 == 0:
            r = lc.step()
            assert r.state_err < TOL and r.conv_bitexact, f"step {step}: {r}"
            continue
        rows = list(lc.slots) + [-1]
        lengths = [int(torch.randint(1, 5, (), generator=gen)) for _ in rows]
        batch = pool.batch(rows, lengths)
        before = committed(pool, lc.slots)
        conv_before = pool.buffers["conv_state"].clone()
        if "is_flush" in pool.buffers:
            flush_aborts += int(pool.buffers["is_flush"][lc.slots].sum() > 0)
        reached = int(torch.randint(0, pool.num_layers + 1, (), generator=gen))
        for layer in range(reached):
            verify_layers(pool, lc, batch, [layer])
            for a, b in zip(committed(pool, lc.slots), before):
                assert torch.equal(a, b), f"step {step}: committed state moved after verifying layer {layer}"
        pool.strategy.abort(batch)
        aborts += 1
        assert not pool.strategy.step_open and not pool.step_slots
        for a, b in zip(committed(pool, lc.slots), before):
            assert torch.equal(a, b), f"step {step}: abort changed the committed state"
        assert torch.equal(pool.buffers["conv_state"], conv_before)
    assert aborts == 20
    if strategy == "circular":
        assert flush_aborts >= 5, "the test must abort steps of flushing rows"


@pytest.mark.parametrize("small_batch", [False, True], ids=["closed_form", "replay"])
def test_abort_with_the_triton_fold_keeps_the_oracle(small_batch):
    """The same for circular on the Triton backend (interpreter): abort's fold of the
    layers the step did not reach is the Triton fold; the float64 oracle keeps agreeing.
    ``replay``: with the small-batch path (one-launch verify, a flush at every commit).
    Four steps: aborts after 1, 2, 1 and 0 verified layers (the generator's draws), two
    of them folding the layer the step did not reach. One key head shared by two value
    heads (the interpreter runs each head's programs; more heads repeat them)."""
    if small_batch:
        with tuning.override("circular", replay_max_batch=8):
            return test_abort_with_the_triton_fold_keeps_the_oracle(False)
    shape = GDNShape(num_heads=1, num_value_heads=2, head_k_dim=16, head_v_dim=8)
    pool, lc = make("circular", requests=2, slots=3, layers=2, window=2, ring_len=4, seed=2, backend="triton",
                    shape=shape)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):  # ring_len = 2T: a flush every other step
        r = lc.step()
        assert r.state_err < TOL, f"step {step}: {r.state_err:.2e}"
        batch = pool.batch(lc.slots, [2, 1])
        before = committed(pool, lc.slots)
        verify_layers(pool, lc, batch, range(int(torch.randint(0, 3, (), generator=gen))))
        pool.strategy.abort(batch)
        for a, b in zip(committed(pool, lc.slots), before):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_abort_protocol(strategy):
    """abort without an open step does nothing (safe in an error handler); with one it
    needs the step's batch; after it a new step can start and commit."""
    pool, lc = make(strategy)
    lc.step()
    batch = pool.batch(lc.slots, [2, 2])
    snap = clone_all(pool)
    pool.strategy.abort(batch)
    assert_unchanged(pool, snap)
    verify_layers(pool, lc, batch, [0])
    with pytest.raises(StepProtocolError, match="same batch"):
        pool.strategy.abort(pool.batch(lc.slots, [2, 2]))
    with pytest.raises(TypeError, match="batch"):
        pool.strategy.abort([0, 1])
    pool.strategy.abort(batch)
    r = lc.step()
    assert r.state_err < TOL and r.conv_bitexact
