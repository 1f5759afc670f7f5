"""A full speculative step (every layer's verify, then one commit) captured in a CUDA
graph must do exactly what the same step does eagerly, replay after replay.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_graph_step.py
"""

import json
import random

import pytest
import torch

from replayssm import cli
from replayssm.bench import common
from replayssm.ops import tuning
from replayssm.state import GDNShape, StatePool
from replayssm.strategies import STRATEGIES

pytestmark = pytest.mark.gpu

# Production head dims (the kernels' tiles are sized for them) with few heads and layers.
SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=128, head_v_dim=128)
LAYERS = 3
WINDOW = 4
RING_LEN = 16  # circular flushes once a request holds more than 8 committed records
STEPS = 8


@pytest.fixture(autouse=True)
def _seed_random(_seed):
    random.seed(torch.initial_seed())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality; NaN (never-written scratch) equals NaN."""
    if a.dtype.is_floating_point:
        return a.shape == b.shape and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    return torch.equal(a, b)


def capture(step):
    """``(graph, its outputs)``: :func:`~replayssm.bench.common.capture_graph` of one call
    of ``step`` after two eager calls (they really step the pool), keeping the captured
    call's outputs."""
    outs = []
    graph = common.capture_graph(lambda: outs.append(step()), warmup_steps=2)
    return graph, outs[-1]


def check_replay(pool, label: str, static_outs, eager_step) -> None:
    """A replayed step's outputs and the pool's buffers after it equal the eager step's
    (``eager_step``: its outputs and a copy of every buffer), bit for bit."""
    e_outs, e_bufs = eager_step
    for layer, (got, want) in enumerate(zip(static_outs, e_outs, strict=True)):
        assert _same(got, want), f"{label} layer {layer}: outputs differ"
    for name, buf in pool.buffers.items():
        assert _same(buf, e_bufs[name]), f"{label}: buffer {name} differs from the eager step"


def _make_pool(strategy: str, act_dtype: torch.dtype):
    pool = StatePool(SHAPE, LAYERS, 6, strategy=strategy, window=WINDOW, ring_len=RING_LEN,
                     act_dtype=act_dtype, device="cuda", backend="auto")
    for layer in range(LAYERS):
        pool.set_layer_params(
            layer, A_log=torch.empty(SHAPE.num_value_heads).uniform_(-3, -0.3), dt_bias=torch.randn(SHAPE.num_value_heads) * 0.5,
            conv_weight=torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel) * 0.5, conv_bias=torch.randn(SHAPE.conv_dim) * 0.1,
        )
    slots = [pool.alloc() for _ in range(4)]
    pool.buffers["checkpoints"].normal_(0.0, 0.1)
    pool.buffers["conv_state"].normal_()
    return pool, slots


@pytest.mark.parametrize("conv", [False, True], ids=["state", "conv+state"])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES) + ["circular-closed-form"])
def test_graph_replay_equals_eager(strategy, act_dtype, conv):
    """``circular`` at this batch takes its small-batch path (one-launch verify, a flush
    at every commit); ``circular-closed-form`` turns it off in the shape table."""
    if strategy == "circular-closed-form":
        with tuning.override("circular", replay_max_batch=0):
            return test_graph_replay_equals_eager("circular", act_dtype, conv)
    pool, slots = _make_pool(strategy, act_dtype)
    # A padding row, ragged windows; row 0 takes full windows and accepts them all so
    # that circular flushes within STEPS steps.
    rows = [slots[0], slots[1], -1, slots[2], slots[3]]
    lengths = [WINDOW] + [random.randint(1, WINDOW) for _ in rows[1:]]
    batch = pool.batch(rows, lengths)
    n_tok = sum(lengths)
    accepted = torch.tensor([WINDOW] + [random.randint(1, n) for n in lengths[1:]], dtype=torch.int32, device="cuda")
    dt, dev = act_dtype, "cuda"
    if conv:
        xs = [torch.randn(n_tok, SHAPE.conv_dim, device=dev).to(dt) for _ in range(LAYERS)]
    else:
        qs = [torch.randn(n_tok, SHAPE.num_heads, SHAPE.head_k_dim, device=dev).to(dt) for _ in range(LAYERS)]
        ks = [torch.randn(n_tok, SHAPE.num_heads, SHAPE.head_k_dim, device=dev).to(dt) for _ in range(LAYERS)]
        vs = [torch.randn(n_tok, SHAPE.num_value_heads, SHAPE.head_v_dim, device=dev).to(dt) for _ in range(LAYERS)]
    as_ = [torch.randn(n_tok, SHAPE.num_value_heads, device=dev).to(dt) for _ in range(LAYERS)]
    bs = [(torch.randn(n_tok, SHAPE.num_value_heads, device=dev) * 2).to(dt) for _ in range(LAYERS)]
    hk = SHAPE.num_heads * SHAPE.head_k_dim

    def step():
        s, outs = pool.strategy, []
        for layer in range(LAYERS):
            if conv:
                y = s.conv_verify(layer, xs[layer], batch)
                q = y[:, :hk].reshape(n_tok, SHAPE.num_heads, SHAPE.head_k_dim).contiguous()
                k = y[:, hk:2 * hk].reshape(n_tok, SHAPE.num_heads, SHAPE.head_k_dim).contiguous()
                v = y[:, 2 * hk:].reshape(n_tok, SHAPE.num_value_heads, SHAPE.head_v_dim).contiguous()
            else:
                q, k, v = qs[layer], ks[layer], vs[layer]
            outs.append(s.verify(layer, q, k, v, as_[layer], bs[layer], batch))
        s.commit(batch, accepted)
        return outs

    graph, static_outs = capture(step)

    start = {name: buf.clone() for name, buf in pool.buffers.items()}

    def restore():
        for name, buf in pool.buffers.items():
            buf.copy_(start[name])

    eager = []
    for _ in range(STEPS):
        outs = step()
        eager.append(([o.clone() for o in outs], {n: b.clone() for n, b in pool.buffers.items()}))
    torch.cuda.synchronize()

    restore()
    for i in range(STEPS):
        graph.replay()
        torch.cuda.synchronize()
        check_replay(pool, f"step {i}", static_outs, eager[i])

    # Teeth: the steps did something, and the padding row wrote nothing / output zeros.
    final = pool.buffers
    assert not _same(final["checkpoints"], start["checkpoints"]) or strategy == "circular"
    if strategy == "circular":
        assert not _same(final["cache_base"], start["cache_base"]), "no flush happened in the replayed steps"
        assert not _same(final["checkpoints"], start["checkpoints"]), "the flush folded nothing"
    pad = slice(sum(lengths[:2]), sum(lengths[:3]))
    for layer in range(LAYERS):
        assert bool((static_outs[layer][pad] == 0).all())
        live = torch.cat([static_outs[layer][: sum(lengths[:2])], static_outs[layer][sum(lengths[:3]):]])
        assert bool(torch.isfinite(live).all()) and bool((live != 0).any())


def test_bench_kernels_runs_captured_steps(tmp_path):
    """The benchmark's own CUDA path: copy bandwidth, L2 rotation, capture, event timing."""
    path = tmp_path / "k.json"
    rc = cli.main(["bench", "kernels", "--batches", "1,4", "--layers", "2", "--repeats", "3", "--quiet", "--json", str(path)])
    data = json.loads(path.read_text())
    assert rc == 0, data["errors"]
    assert data["smoke"] is False and data["config"]["cuda_graph"] is True
    assert data["device"]["copy_GBps"] > 100 and data["device"]["l2_bytes"] > 0
    names = [*STRATEGIES.keys(), "plain_decode", "plain_ring", "snapshot_verify"]
    assert sorted((r["strategy"], r["batch"]) for r in data["rows"]) == sorted((n, b) for n in names for b in (1, 4))
    for r in data["rows"]:
        assert r["timing"]["method"] == "cuda-graph"
        assert r["floor_us"] > 0 and r["floor_ratio"] > 0 and r["achieved_GBps"] > 0 and r["us_per_layer_step"] > 0
        if r["batch"] == 1:  # 2 layers of 2 MiB states sit in L2: the step rotates among copies
            assert r["timing"]["rotated_copies"] > 1
        if r["strategy"] in ("circular", "plain_ring"):
            assert r["timing"]["steps_per_block"] % r["cursor_cycle_steps"] == 0


def test_a_graph_released_during_a_capture_does_not_break_it():
    """A reference cycle holding a captured graph becomes unreachable inside another
    capture, and the body then allocates enough to trigger Python's collector: the
    capture still succeeds (no collection runs during a capture: a graph destroyed there
    is a CUDA graph reset, which a capturing stream refuses), the collector is back on
    afterwards, and the old graph goes at the next collection."""
    import gc
    import weakref

    from replayssm.engine.graph_step import capture_graph

    x = torch.zeros(16, device="cuda")

    class Holder:  # a cycle: only the cyclic collector frees it
        def __init__(self):
            self.me = self
            self.graph = capture_graph(lambda: x.add_(1.0))

    holder = [Holder()]
    gone = weakref.ref(holder[0])
    seen = []

    def body():  # call 1: the eager warm-up; call 2: the capture
        if seen:
            holder.clear()  # the old graph's last outside reference, inside the capture
        junk = [[i] for i in range(20000)]  # well past the collector's allocation threshold
        seen.append((gc.isenabled(), len(junk)))
        x.mul_(2.0)

    graph = capture_graph(body, warmup_steps=1)
    assert seen[-1] == (False, 20000), "the collector ran enabled inside the capture"
    assert gc.isenabled()
    graph.replay()
    torch.cuda.synchronize()
    gc.collect()
    assert gone() is None
