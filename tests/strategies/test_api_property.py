"""Random interleavings of every pool and strategy call against an independent float64
model (property-based, hypothesis).

Calls: alloc, alloc(slot=), free, fork, reset, prefill, verify (a step opens at its
first layer), commit, abort, load_states, save/restore, committed_state at any time,
and misuse that must raise (free/fork/reset of an open step's slot, a second batch
in an open step, commit before every layer is verified, double free, taken slots).

The model keeps, per live slot, the float64 recurrent state of every layer (DESIGN.md
section 1, written out here with no library op) and the conv state (the last W - 1
committed inputs, exact copies). After every call: each live slot's committed state
is within 1e-5 of the model relative to max(1, |state|) (fp32 rounding over at most a
few dozen contractive steps), the conv states equal the model's bit for bit, and a call
that raised left every buffer as it was.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replayssm.state import GDNShape, PoolExhausted, StatePool, StepProtocolError

SHAPE = GDNShape(num_heads=1, num_value_heads=2, head_k_dim=8, head_v_dim=4, conv_kernel=3)
LAYERS, SLOTS, WINDOW, RING = 2, 3, 2, 4
TOL = 1e-5


def model_step(S, q, k, v, a, b, A_log, dt_bias):
    """One float64 GDN step of ``S [HV, V, K]`` (DESIGN.md section 1)."""
    hv = S.shape[0]
    q, k, v, a, b = (t.double() for t in (q, k, v, a, b))
    x = a + dt_bias.double()
    g = -torch.exp(A_log.double()) * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    beta = 1 / (1 + torch.exp(-b))
    rep = hv // k.shape[0]
    kh = (k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(rep, 0)
    S = torch.exp(g)[:, None, None] * S
    u = beta[:, None] * (v - torch.einsum("hvk,hk->hv", S, kh))
    return S + u[:, :, None] * kh[:, None, :]


class Model:
    def __init__(self, pool: StatePool):
        self.pool = pool
        s = SHAPE
        self.state: dict[int, torch.Tensor] = {}  # [layers, HV, V, K] float64
        self.conv: dict[int, torch.Tensor] = {}  # [layers, C, W - 1] act dtype
        self.zero_state = torch.zeros(LAYERS, s.num_value_heads, s.head_v_dim, s.head_k_dim, dtype=torch.float64)
        self.zero_conv = torch.zeros(LAYERS, s.conv_dim, s.conv_kernel - 1)

    def add(self, slot):
        self.state[slot], self.conv[slot] = self.zero_state.clone(), self.zero_conv.clone()

    def advance(self, slot, layer, x, tokens):
        """Feed ``tokens`` (indices into the layer inputs ``x``) to ``slot``."""
        p = self.pool.layer_params(layer)
        S = self.state[slot][layer]
        for t in tokens:
            S = model_step(S, x["q"][t], x["k"][t], x["v"][t], x["a"][t], x["b"][t], p["A_log"], p["dt_bias"])
        self.state[slot][layer] = S
        hist = torch.cat([self.conv[slot][layer], x["x"][tokens].T], 1)
        self.conv[slot][layer] = hist[:, hist.shape[1] - (SHAPE.conv_kernel - 1):]

    def fresh(self, slot) -> bool:
        """Whether prefill / load_states may run on ``slot``: no committed history beyond
        the checkpoint (circular: an empty ring, which the cursor says)."""
        return "write_pos" not in self.pool.buffers or int(self.pool.buffers["write_pos"][slot]) == 0


def layer_inputs(gen, n):
    s = SHAPE
    return {
        "x": torch.randn(n, s.conv_dim, generator=gen),
        "q": torch.randn(n, s.num_heads, s.head_k_dim, generator=gen),
        "k": torch.randn(n, s.num_heads, s.head_k_dim, generator=gen),
        "v": torch.randn(n, s.num_value_heads, s.head_v_dim, generator=gen),
        "a": torch.randn(n, s.num_value_heads, generator=gen),
        "b": torch.randn(n, s.num_value_heads, generator=gen) * 2,
    }


def snapshot(pool):
    return ({n: b.clone() for n, b in pool.buffers.items()}, list(pool._free), set(pool._live))


def unchanged(pool, snap):
    bufs, free, live = snap
    return pool._free == free and pool._live == live and all(
        torch.equal(b.nan_to_num(7.0), bufs[n].nan_to_num(7.0)) for n, b in pool.buffers.items()
    )


def check(pool, model):
    assert sorted(model.state) == pool.live_slots
    for s in pool.live_slots:
        for layer in range(LAYERS):
            got = pool.strategy.committed_state(layer, [s])[0].double()
            want = model.state[s][layer]
            err = (got - want).abs().max().item()
            assert err <= TOL * max(1.0, want.abs().max().item()), f"slot {s} layer {layer}: error {err:.2e}"
        assert torch.equal(pool.buffers["conv_state"][:, s], model.conv[s]), f"conv state of slot {s}"


# verify and commit weigh more: most of a real run is steps
OPS = ["alloc", "alloc_slot", "free", "fork", "reset", "prefill", "verify", "verify", "verify", "commit", "commit",
       "abort", "load", "save", "restore", "misuse_batch", "misuse_commit"]


@pytest.mark.parametrize("strategy", ["snapshot", "fold", "circular"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_api_interleavings_match_the_float64_model(strategy, data):
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    pool = StatePool(SHAPE, LAYERS, SLOTS, strategy=strategy, window=WINDOW, ring_len=RING, backend="reference")
    s = SHAPE
    for layer in range(LAYERS):
        pool.set_layer_params(
            layer, A_log=torch.empty(s.num_value_heads).uniform_(-3.0, -0.3, generator=gen),
            dt_bias=torch.randn(s.num_value_heads, generator=gen) * 0.5,
            conv_weight=torch.randn(s.conv_dim, s.conv_kernel, generator=gen) * 0.5,
            conv_bias=torch.randn(s.conv_dim, generator=gen) * 0.1,
        )
    model = Model(pool)
    step = None  # (batch, rows, inputs per verified layer)
    saved = None  # (SavedStates, model copies)
    st_ = pool.strategy

    def expect_raise(exc, fn):
        snap = snapshot(pool)
        with pytest.raises(exc):
            fn()
        assert unchanged(pool, snap), "a failed call changed the pool"

    def open_slots():
        return set(pool.step_slots)

    for _ in range(data.draw(st.integers(1, SLOTS), label="first requests")):
        model.add(pool.alloc())
    for _ in range(data.draw(st.integers(10, 40), label="calls")):
        op = data.draw(st.sampled_from(OPS), label="op")
        live = pool.live_slots
        any_slot = st.integers(-1, SLOTS)
        if op == "alloc":
            if pool.num_free:
                model.add(pool.alloc())
            else:
                expect_raise(PoolExhausted, pool.alloc)
        elif op == "alloc_slot":
            i = data.draw(any_slot, label="slot")
            if 0 <= i < SLOTS and i not in live:
                assert pool.alloc(slot=i) == i
                model.add(i)
            else:
                expect_raise(ValueError, lambda: pool.alloc(slot=i))
        elif op in ("free", "fork", "reset"):
            i = data.draw(any_slot, label="slot")
            call = {"free": pool.free, "fork": pool.fork, "reset": pool.reset}[op]
            if i not in live:
                expect_raise(ValueError, lambda: call(i))
            elif i in open_slots():
                expect_raise(StepProtocolError, lambda: call(i))
            elif op == "fork" and not pool.num_free:
                expect_raise(PoolExhausted, lambda: call(i))
            else:
                out = call(i)
                if op == "free":
                    for d in (model.state, model.conv):
                        del d[i]
                elif op == "reset":
                    model.add(i)
                else:
                    model.state[out], model.conv[out] = model.state[i].clone(), model.conv[i].clone()
        elif op == "prefill":
            if not live:
                continue
            rows = data.draw(st.lists(st.sampled_from(live + [-1]), min_size=1, max_size=3), label="rows")
            rows = [r for k, r in enumerate(rows) if r == -1 or r not in rows[:k]]
            lengths = [data.draw(st.integers(1, 3), label="len") for _ in rows]
            batch = pool.batch(rows, lengths, prefill=True)
            if set(rows) & open_slots():
                expect_raise(StepProtocolError, lambda: st_.conv_prefill(0, torch.randn(batch.num_tokens, s.conv_dim), batch))
                continue
            if not all(model.fresh(r) for r in rows if r >= 0):
                x = layer_inputs(gen, batch.num_tokens)
                expect_raise(StepProtocolError, lambda: st_.prefill(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch))
                continue
            for layer in range(LAYERS):
                x = layer_inputs(gen, batch.num_tokens)
                st_.conv_prefill(layer, x["x"], batch)
                st_.prefill(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
                cu = 0
                for r, m in zip(rows, lengths):
                    if r >= 0:
                        model.advance(r, layer, x, list(range(cu, cu + m)))
                    cu += m
        elif op == "verify":
            if step is None:
                if not live:
                    continue
                rows = data.draw(st.lists(st.sampled_from(live + [-1]), min_size=1, max_size=3), label="rows")
                rows = [r for k, r in enumerate(rows) if r == -1 or r not in rows[:k]]
                lengths = [data.draw(st.integers(1, WINDOW), label="len") for _ in rows]
                step = (pool.batch(rows, lengths), rows, [])
            batch, rows, inputs = step
            layer = len(inputs)
            if layer == LAYERS:
                x = layer_inputs(gen, batch.num_tokens)
                expect_raise(StepProtocolError, lambda: st_.verify(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch))
                continue
            x = layer_inputs(gen, batch.num_tokens)
            st_.conv_verify(layer, x["x"], batch)
            st_.verify(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
            inputs.append(x)
        elif op in ("commit", "abort"):
            if step is None:
                continue
            batch, rows, inputs = step
            if op == "abort":
                st_.abort(batch)
            else:
                while len(inputs) < LAYERS:
                    x = layer_inputs(gen, batch.num_tokens)
                    st_.conv_verify(len(inputs), x["x"], batch)
                    st_.verify(len(inputs), x["q"], x["k"], x["v"], x["a"], x["b"], batch)
                    inputs.append(x)
                accepted = [data.draw(st.integers(1, m), label="accepted") for m in batch.lengths]
                st_.commit(batch, accepted)
                cu = 0
                for r, m, n in zip(rows, batch.lengths, accepted):
                    if r >= 0:
                        for layer in range(LAYERS):
                            model.advance(r, layer, inputs[layer], list(range(cu, cu + n)))
                    cu += m
            step = None
        elif op == "load":
            fresh = [r for r in live if model.fresh(r) and r not in open_slots()]
            if not fresh:
                continue
            r = data.draw(st.sampled_from(fresh), label="slot")
            layer = data.draw(st.integers(0, LAYERS - 1), label="layer")
            states = torch.randn(2, s.num_value_heads, s.head_v_dim, s.head_k_dim, generator=gen) * 0.3
            st_.load_states(layer, torch.tensor([-1, r]), states)
            model.state[r][layer] = states[1].double()
        elif op == "save":
            if step is not None:
                expect_raise(StepProtocolError, lambda: st_.save_states(live))
            elif live:
                saved = (st_.save_states(live), {r: (model.state[r].clone(), model.conv[r].clone()) for r in live})
        elif op == "restore":
            if saved is None:
                continue
            obj, copies = saved
            if step is not None:
                expect_raise(StepProtocolError, lambda: st_.restore_states(obj))
            elif all(r in live and pool.generation(r) == g for r, g in zip(obj.slots, obj.generations)):
                st_.restore_states(obj)
                for r, (S, c) in copies.items():
                    model.state[r], model.conv[r] = S.clone(), c.clone()
            else:
                expect_raise(ValueError, lambda: st_.restore_states(obj))
        elif op == "misuse_batch":
            if step is None or not live:
                continue
            other = pool.batch([live[0]], [1])
            x = layer_inputs(gen, 1)
            expect_raise(StepProtocolError, lambda: st_.verify(0, x["q"], x["k"], x["v"], x["a"], x["b"], other))
        elif op == "misuse_commit":
            if step is None or len(step[2]) == LAYERS:
                continue
            batch = step[0]
            expect_raise(StepProtocolError, lambda: st_.commit(batch, [1] * batch.size))
        check(pool, model)
    if step is not None:
        st_.abort(step[0])
        check(pool, model)
