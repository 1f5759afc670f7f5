"""Plain decoding through circular's ring (DESIGN.md section 9) captured in CUDA graphs
must do exactly what the same steps do eagerly, replay after replay.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_ring_decode_gpu.py

* Strategy level: a plain ring step (every layer's ``decode`` of one token per request,
  then ``commit(batch)``) captured once and replayed across flushes gives the eager
  step's outputs and buffers bit for bit, on both of circular's paths (small-batch
  replay, closed form) and in bf16 and fp32; so does a schedule that alternates the
  plain graph with a captured speculative step on the same requests.
* Engine level: the graphed static plain step through the ring (``StepGenerator``
  without a drafter on a ``circular`` engine) emits the eager static steps' tokens.
"""

import random

import pytest
import torch
from test_graph_step import LAYERS, RING_LEN, SHAPE, WINDOW, _make_pool, capture, check_replay

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.generator import StepGenerator
from replayssm.engine.random_model import build_tiny_model
from replayssm.ops import tuning

pytestmark = pytest.mark.gpu

STEPS = 2 * (RING_LEN - 2 * WINDOW + 1) + 3  # two plain cursor cycles and some: every request flushes


@pytest.fixture(autouse=True)
def _seed_random(_seed):
    random.seed(torch.initial_seed())


def _inputs(n_tok, dt):
    dev = "cuda"
    return dict(
        q=[torch.randn(n_tok, SHAPE.num_heads, SHAPE.head_k_dim, device=dev).to(dt) for _ in range(LAYERS)],
        k=[torch.randn(n_tok, SHAPE.num_heads, SHAPE.head_k_dim, device=dev).to(dt) for _ in range(LAYERS)],
        v=[torch.randn(n_tok, SHAPE.num_value_heads, SHAPE.head_v_dim, device=dev).to(dt) for _ in range(LAYERS)],
        a=[torch.randn(n_tok, SHAPE.num_value_heads, device=dev).to(dt) for _ in range(LAYERS)],
        b=[(torch.randn(n_tok, SHAPE.num_value_heads, device=dev) * 2).to(dt) for _ in range(LAYERS)],
    )


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("path", ["replay", "closed_form"])
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "plain+spec"])
@pytest.mark.parametrize("split_flush", [0, 2], ids=["one_launch", "flush_beside"])
def test_graph_replay_of_the_plain_ring_step_equals_eager(path, act_dtype, mixed, split_flush):
    """Plain ring steps (and speculative ones between them) replayed from CUDA graphs
    equal the same steps run eagerly, outputs and every pool buffer, bit for bit; with
    ``split_flush = 2`` the graph holds the flush kernel on a side stream's branch."""
    with tuning.override("circular", replay_max_batch=0 if path == "closed_form" else 64), \
            tuning.override("ring_decode", split_flush=split_flush):
        pool, slots = _make_pool("circular", act_dtype)
        s = pool.strategy
        rows = [slots[0], slots[1], -1, slots[2], slots[3]]
        plain_batch = pool.batch(rows, 1)
        spec_lengths = [WINDOW] + [random.randint(1, WINDOW) for _ in rows[1:]]
        spec_batch = pool.batch(rows, spec_lengths)
        accepted = torch.tensor([random.randint(1, n) for n in spec_lengths], dtype=torch.int32, device="cuda")
        xp, xs = _inputs(len(rows), act_dtype), _inputs(sum(spec_lengths), act_dtype)

        def plain_step():
            outs = [s.decode(j, xp["q"][j], xp["k"][j], xp["v"][j], xp["a"][j], xp["b"][j], plain_batch)
                    for j in range(LAYERS)]
            s.commit(plain_batch)
            return outs

        def spec_step():
            outs = [s.verify(j, xs["q"][j], xs["k"][j], xs["v"][j], xs["a"][j], xs["b"][j], spec_batch)
                    for j in range(LAYERS)]
            s.commit(spec_batch, accepted)
            return outs

        for _ in range(3):  # staggered cursor phases, as in serving
            spec_step()
        graphs = {"plain": capture(plain_step), "spec": capture(spec_step)}
        schedule = ["spec" if mixed and i % 4 == 3 else "plain" for i in range(STEPS)]
        start = {n: b.clone() for n, b in pool.buffers.items()}
        eager = []
        for kind in schedule:
            outs = (plain_step if kind == "plain" else spec_step)()
            eager.append(([o.clone() for o in outs], {n: b.clone() for n, b in pool.buffers.items()}))
        torch.cuda.synchronize()
        for name, buf in pool.buffers.items():
            buf.copy_(start[name])
        flushed = 0
        for i, kind in enumerate(schedule):
            flushed += int(pool.buffers["is_flush"][slots].sum())
            graph, static_outs = graphs[kind]
            graph.replay()
            torch.cuda.synchronize()
            check_replay(pool, f"step {i} ({kind})", static_outs, eager[i])
    assert flushed >= len(slots) * 2, "every request must flush during the replays"
    pad = plain_batch.host_slots.index(-1)
    for o in graphs["plain"][1]:
        assert bool((o[pad] == 0).all()) and bool(torch.isfinite(o).all())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_graphed_static_plain_ring_steps_equal_eager(family):
    """Requests join and finish (more prompts than slots, budgets of different
    lengths, so the bucket changes); ring L = 16 with window 4: a flush every 9 tokens."""
    model = build_tiny_model(family, seed=3, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(9)]
    budgets = torch.randint(30, 120, (9,), generator=g).tolist()
    tokens = {}
    for graphs in (False, True):
        eng = HybridEngine(model, strategy="circular", num_slots=4, window=WINDOW, ring_len=RING_LEN, max_len=256)
        gen = StepGenerator(eng, None, graphs=graphs)
        tokens[graphs] = gen.generate(prompts, budgets).tokens
        assert eng.ring_decoding and all(st.ring for st in gen._steps.values())
        assert all(st.graph is not None for st in gen._steps.values()) == graphs
    assert tokens[True] == tokens[False]
    assert [len(t) for t in tokens[True]] == budgets
