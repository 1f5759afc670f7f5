"""State pool: slot lifecycle, misuse errors that change nothing, exact byte accounting."""

import pytest
import torch

from replayssm.state import GDNShape, PoolExhausted, StatePool

SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=8)


def snapshot(pool):
    return {name: buf.clone() for name, buf in pool.buffers.items()}, list(pool._free), set(pool._live)


def assert_same(pool, snap):
    bufs, free, live = snap
    for name, buf in pool.buffers.items():
        assert torch.equal(buf.nan_to_num(7.0), bufs[name].nan_to_num(7.0)), name
    assert pool._free == free and pool._live == live


@pytest.mark.parametrize("strategy", ["snapshot", "fold", "circular"])
def test_byte_accounting_is_exact(strategy):
    L, T, nl, ns = 16, 4, 3, 5
    pool = StatePool(SHAPE, nl, ns, strategy=strategy, window=T, ring_len=L, act_dtype=torch.bfloat16)
    s = SHAPE
    state = s.num_value_heads * s.head_v_dim * s.head_k_dim
    expect = {
        "checkpoints": nl * ns * state * 4,
        "conv_state": nl * ns * s.conv_dim * 3 * 2,
        "conv_window": nl * ns * T * s.conv_dim * 2,
    }

    def records(R):
        return {
            "ring_k": nl * ns * R * s.num_heads * s.head_k_dim * 4,  # normalised, fp32
            "ring_v": nl * ns * R * s.num_value_heads * s.head_v_dim * 2,
            "ring_g": nl * ns * R * s.num_value_heads * 4,
            "ring_beta": nl * ns * R * s.num_value_heads * 4,
        }

    if strategy == "snapshot":
        expect["snapshots"] = nl * ns * T * state * 4
    elif strategy == "fold":
        expect.update(records(T))
    else:
        expect.update(records(L))
        expect["ring_u"] = nl * ns * L * s.num_value_heads * s.head_v_dim * 4
        expect.update(write_pos=ns * 4, cache_base=ns * 4, is_flush=ns * 4, first_cycle=ns * 4)
    got = pool.nbytes()
    assert got.pop("total") == sum(expect.values())
    assert got == expect
    per = pool.nbytes_per_slot()
    assert per["total"] * ns == sum(expect.values())
    assert pool.scratch_nbytes_per_slot() == (sum(expect.values()) - expect["checkpoints"] - expect["conv_state"]) // ns


def test_snapshot_scratch_matches_design_at_qwen_shapes():
    """DESIGN.md section 4: snapshot needs T * HV * V * K * 4 bytes per request and layer
    (8 MiB at Qwen3.5 shapes, T=4); the ring of L=16 records a few hundred KB."""
    qwen = GDNShape(16, 32, 128, 128)
    snap = StatePool(qwen, 1, 1, strategy="snapshot", window=4, act_dtype=torch.bfloat16, device="meta")
    assert snap.nbytes()["snapshots"] == 8 * 2**20
    circ = StatePool(qwen, 1, 1, strategy="circular", window=4, ring_len=16, act_dtype=torch.bfloat16, device="meta")
    ring = sum(v for k, v in circ.nbytes().items() if k.startswith("ring"))
    assert 100 * 2**10 < ring < 1024 * 2**10


def test_alloc_free_fork_reset():
    pool = StatePool(SHAPE, 2, 3, strategy="circular", window=2, ring_len=4)
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == set(pool.live_slots) and pool.num_free == 1
    pool.buffers["checkpoints"][:, a] = torch.randn_like(pool.buffers["checkpoints"][:, a])
    pool.buffers["write_pos"][a] = 3
    pool.buffers["ring_v"][:, a] = torch.randn_like(pool.buffers["ring_v"][:, a])
    c = pool.fork(a)
    for name, buf in pool.buffers.items():
        x, y = (buf[:, a], buf[:, c]) if buf.dim() > 1 else (buf[a], buf[c])
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)), name
    with pytest.raises(PoolExhausted):
        pool.alloc()
    with pytest.raises(PoolExhausted):
        pool.fork(a)
    pool.reset(a)
    assert (pool.buffers["checkpoints"][:, a] == 0).all() and pool.buffers["write_pos"][a] == 0
    assert torch.isnan(pool.buffers["ring_v"][:, a]).all(), "reset re-poisons the ring"
    assert (pool.buffers["checkpoints"][:, c] != 0).any(), "reset leaked into the fork"
    pool.free(a)
    d = pool.alloc()
    assert d == a and (pool.buffers["checkpoints"][:, d] == 0).all() and pool.buffers["write_pos"][d] == 0


def test_misuse_raises_and_changes_nothing():
    pool = StatePool(SHAPE, 2, 2, strategy="fold", window=3)
    a = pool.alloc()
    pool.buffers["checkpoints"].normal_()
    snap = snapshot(pool)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(1)
    with pytest.raises(ValueError, match="slot must be"):
        pool.free(7)
    with pytest.raises(ValueError, match="slot must be"):
        pool.fork(-1)
    with pytest.raises(ValueError, match="not allocated"):
        pool.reset(1)
    with pytest.raises(ValueError, match="not allocated"):
        pool.batch([a, 1], 2)
    with pytest.raises(ValueError, match="twice"):
        pool.batch([a, a], 2)
    with pytest.raises(ValueError, match="lengths"):
        pool.batch([a], [0])
    with pytest.raises(ValueError, match="lengths"):
        pool.batch([a], [1, 2])
    with pytest.raises(ValueError, match="A_log"):
        pool.set_layer_params(0, A_log=torch.randn(3), dt_bias=torch.randn(4), conv_weight=torch.randn(SHAPE.conv_dim, 4))
    with pytest.raises(ValueError, match="conv_weight"):
        pool.set_layer_params(0, A_log=torch.randn(4), dt_bias=torch.randn(4), conv_weight=torch.randn(SHAPE.conv_dim, 3))
    with pytest.raises(RuntimeError, match="set_layer_params"):
        pool.layer_params(1)
    assert_same(pool, snap)
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(strategy="circular", window=4, ring_len=12), "power of two"),
        (dict(strategy="circular", window=4, ring_len=4), "at least 2 \\* window"),
        (dict(strategy="nope"), "strategy"),
        (dict(window=0), "window"),
        (dict(state_dtype=torch.float16), "state_dtype"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_config_checks(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        StatePool(SHAPE, 1, 1, **kwargs)


def test_shape_checks():
    with pytest.raises(ValueError, match="multiple of key heads"):
        GDNShape(3, 4, 8, 8)
    with pytest.raises(ValueError, match="head_k_dim"):
        GDNShape(1, 1, 0, 8)
    assert GDNShape(16, 32, 128, 128).conv_dim == 2 * 16 * 128 + 32 * 128


def test_layer_params_are_views_built_once():
    """No per-step rebuild: the same read-only views on every call, and they follow a
    later set_layer_params (written in place)."""
    shape = GDNShape(2, 4, 8, 8)
    pool = StatePool(shape, 2, 2, strategy="fold", window=2)
    for layer in range(2):
        pool.set_layer_params(layer, A_log=torch.randn(4), dt_bias=torch.randn(4),
                              conv_weight=torch.randn(shape.conv_dim, shape.conv_kernel))
    first = pool.layer_params(1)
    assert pool.layer_params(1) is first
    new = torch.randn(4)
    pool.set_layer_params(1, A_log=new, dt_bias=torch.randn(4), conv_weight=torch.randn(shape.conv_dim, shape.conv_kernel))
    assert torch.equal(first["A_log"], new)
    with pytest.raises(TypeError):
        first["A_log"] = new  # read-only mapping


def test_alloc_many_matches_one_at_a_time():
    """Slots taken in one call: the same slots in the same order, reset buffers (the
    freed slots' leftovers gone), generations and liveness (host and device mask) as one
    call per slot; asking for more than are free, or for a bad count, takes none."""
    many = StatePool(SHAPE, 2, 6, strategy="circular", window=2, ring_len=4)
    one = StatePool(SHAPE, 2, 6, strategy="circular", window=2, ring_len=4)
    for pool in (many, one):
        first = [pool.alloc() for _ in range(4)]
    for name, buf in many.buffers.items():  # leftovers in every slot, the same in both pools
        buf.normal_() if buf.is_floating_point() else buf.random_(0, 3)
        one.buffers[name].copy_(buf)
    for pool in (many, one):
        pool.free_many([first[3], first[1]])
    snap = snapshot(many)
    for bad, err in ((5, PoolExhausted), (-1, ValueError), (1.0, ValueError), (True, ValueError)):
        with pytest.raises(err):
            many.alloc_many(bad)
        assert_same(many, snap)
    got = many.alloc_many(3)
    assert got == [one.alloc() for _ in range(3)] == [4, 5, 3]
    for name, buf in many.buffers.items():
        assert torch.equal(buf.nan_to_num(7.0), one.buffers[name].nan_to_num(7.0)), name
    assert many._free == one._free == [1] and many._live == one._live
    assert [many.generation(s) for s in range(6)] == [one.generation(s) for s in range(6)]
    assert many._live_mask.tolist() == one._live_mask.tolist() == [s in many._live for s in range(6)]
    assert many.alloc_many(0) == [] and many._free == [1]


def test_free_many_matches_one_at_a_time():
    """Several slots freed in one call: the same free list, generations, liveness (host
    and device mask) as one call per slot; a bad free list (a slot not live, one named
    twice, a bad type, one out of range) frees none of it."""
    many = StatePool(SHAPE, 2, 5, strategy="circular", window=2, ring_len=4)
    one = StatePool(SHAPE, 2, 5, strategy="circular", window=2, ring_len=4)
    got = [many.alloc() for _ in range(4)]
    assert got == [one.alloc() for _ in range(4)]
    many.buffers["checkpoints"].normal_()
    snap = snapshot(many)
    for bad, err in (([got[1], 4], ValueError), ([got[2], got[2]], ValueError), ([got[0], 1.5], TypeError),
                     ([got[0], 9], ValueError)):
        with pytest.raises(err):
            many.free_many(bad)
        assert_same(many, snap)
    many.free_many([got[2], got[0]])
    one.free(got[2])
    one.free(got[0])
    assert many._free == one._free == [4, got[2], got[0]] and many._live == one._live
    assert [many.generation(s) for s in range(5)] == [one.generation(s) for s in range(5)]
    assert many._live_mask.tolist() == one._live_mask.tolist() == [s in many._live for s in range(5)]
    many.free_many([])
    assert many._free == one._free
