"""Steps whose windows are shorter than the pool's window, on the Triton path.

A pool sized for a draft tree (window ``N``) also takes chain steps of ``depth + 1``
tokens (a tree's spine, ``StaticStep(spine=True)``). Every window kernel loops to a
compile-time bound ``T`` and masks each row past its length, so a kernel launched at
the pool's ``N`` for 4-token windows pays ``N`` masked steps. These tests ask that the
strategies launch their conv and GDN kernels at the batch's bound, and that doing so
changes nothing: the outputs and committed states of a window-8 pool stepped with
windows of at most 3 tokens equal those of a window-3 pool fed the same tokens (bit
for bit for the exact strategies' outputs and for every committed state; circular's
outputs within ``rtol = atol = 1e-5``, the closed form's blocks being sized by ``T``:
~1e-7 on these O(1) values, where a wrong record is off by O(0.1)).

Without a GPU these run under the Triton interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``) in fp32 at small shapes.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import replayssm.strategies.base as base_mod  # noqa: E402
import replayssm.strategies.circular as circular_mod  # noqa: E402
import replayssm.strategies.fold as fold_mod  # noqa: E402
import replayssm.strategies.snapshot as snapshot_mod  # noqa: E402
from replayssm.ops import triton_common  # noqa: E402
from replayssm.state import GDNShape, StatePool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_common.INTERPRETER:
    pytest.skip("CPU run without TRITON_INTERPRET=1 at import time", allow_module_level=True)

SHAPE = GDNShape(num_heads=1, num_value_heads=2, head_k_dim=16, head_v_dim=8)
STRATEGIES = ["snapshot", "fold", "circular"]
# The GDN window op each strategy's verify launches (module, name).
GDN_OPS = {"snapshot": (snapshot_mod, "gdn_recurrence"), "fold": (fold_mod, "gdn_recurrence"),
           "circular": (circular_mod, "gdn_chunked_window")}


def make_pool(strategy, window, params):
    pool = StatePool(SHAPE, 1, 4, strategy=strategy, window=window, ring_len=16, backend="triton", device=DEVICE)
    pool.set_layer_params(0, **params)
    return pool, [pool.alloc(), pool.alloc()]


def rand_step(n, gen):
    s = SHAPE
    qkvab = [(torch.randn(n, *shape, generator=gen) * scale).to(DEVICE) for shape, scale in (
        ((s.num_heads, s.head_k_dim), 1.0), ((s.num_heads, s.head_k_dim), 1.0),
        ((s.num_value_heads, s.head_v_dim), 1.0), ((s.num_value_heads,), 1.0), ((s.num_value_heads,), 2.0))]
    return torch.randn(n, s.conv_dim, generator=gen).to(DEVICE), qkvab


def layer_params(gen):
    return dict(A_log=torch.empty(SHAPE.num_value_heads).uniform_(-2, -0.5, generator=gen),
                dt_bias=torch.randn(SHAPE.num_value_heads, generator=gen) * 0.5,
                conv_weight=torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel, generator=gen))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_short_windows_launch_at_the_batch_bound(strategy, monkeypatch):
    """A window-8 pool's step of windows [3, 2]: the conv and GDN ops get ``max_len = 3``
    (the pool's 8 would loop 8 masked steps)."""
    gen = torch.Generator().manual_seed(5)
    pool, live = make_pool(strategy, 8, layer_params(gen))
    seen = {}

    def spy(name, op):
        def wrapped(*args, **kwargs):
            seen[name] = kwargs.get("max_len")
            return op(*args, **kwargs)
        return wrapped

    mod, name = GDN_OPS[strategy]
    monkeypatch.setattr(mod, name, spy("gdn", getattr(mod, name)))
    monkeypatch.setattr(base_mod, "causal_conv_verify", spy("conv", base_mod.causal_conv_verify))
    conv_x, qkvab = rand_step(5, gen)
    batch = pool.batch(live, [3, 2])
    pool.strategy.conv_verify(0, conv_x, batch)
    pool.strategy.verify(0, *qkvab, batch)
    pool.strategy.commit(batch, [2, 1])
    assert seen == {"conv": 3, "gdn": 3}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_short_windows_compute_what_a_pool_of_their_window_computes(strategy):
    """8 steps of windows of 1..3 tokens with random acceptance on a window-8 pool and a
    window-3 pool: conv and GDN outputs and the committed states agree (see the module
    notes for the tolerances)."""
    gen = torch.Generator().manual_seed(9)
    params = layer_params(gen)
    (wide, live), (narrow, _) = make_pool(strategy, 8, params), make_pool(strategy, 3, params)
    for step in range(8):
        lengths = [int(torch.randint(1, 4, (), generator=gen)) for _ in live]
        accepted = [int(torch.randint(1, n + 1, (), generator=gen)) for n in lengths]
        conv_x, qkvab = rand_step(sum(lengths), gen)
        outs = []
        for pool in (wide, narrow):
            batch = pool.batch(live, lengths)
            y = pool.strategy.conv_verify(0, conv_x, batch)
            o = pool.strategy.verify(0, *qkvab, batch)
            pool.strategy.commit(batch, accepted)
            outs.append((y, o, pool.strategy.committed_state(0, live)))
        (y8, o8, s8), (y3, o3, s3) = outs
        assert torch.equal(y8, y3), f"conv outputs, step {step}"
        if strategy == "circular":
            torch.testing.assert_close(o8, o3, rtol=1e-5, atol=1e-5, msg=f"outputs, step {step}")
        else:
            assert torch.equal(o8, o3), f"outputs, step {step}"
        assert torch.equal(s8, s3), f"committed state, step {step}: {(s8 - s3).abs().max().item():.2e}"
    assert not torch.equal(s8, torch.zeros_like(s8))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_empty_step_still_runs(strategy):
    """A step of no windows (``max_len`` 0) on a window-8 pool: empty outputs, no error."""
    gen = torch.Generator().manual_seed(2)
    pool, _ = make_pool(strategy, 8, layer_params(gen))
    batch = pool.batch([], [])
    conv_x, qkvab = rand_step(0, gen)
    assert pool.strategy.conv_verify(0, conv_x, batch).shape == (0, SHAPE.conv_dim)
    assert pool.strategy.verify(0, *qkvab, batch).shape == (0, SHAPE.num_value_heads, SHAPE.head_v_dim)
    pool.strategy.commit(batch, [])
