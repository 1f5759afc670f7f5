"""The plain-PyTorch reference ops, each checked against an independent statement of its
equation (DESIGN.md sections 1-3)."""

import math

import pytest
import torch
from layer_inputs import args
from layer_inputs import rand_layer as _rand_layer

from replayssm.ops import (
    RawRecords,
    causal_conv_commit_reference,
    causal_conv_verify_reference,
    gdn_chunked_window_reference,
    gdn_fold_reference,
    gdn_gates,
    gdn_recurrence_reference,
    l2_normalize,
    snapshot_commit_reference,
)
from replayssm.ops.records import stored_keys


def rand_layer(n, h, hv, kd, vd, dtype=torch.float64):
    return _rand_layer(n, h, hv, kd, vd, dtype)


def cu_of(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def naive_step(S, q, k, v, a, b, A_log, dt_bias):
    """DESIGN.md section 1 for one value head, written as matrix algebra in float64:
    S <- exp(g) S (I - beta k^ k^T) + beta v k^T,  o = S q^."""
    x = a + dt_bias
    sp = x if x > 20 else math.log1p(math.exp(x))
    g = -math.exp(A_log) * sp
    beta = 1 / (1 + math.exp(-b))
    kd = k.numel()
    kh = k / torch.sqrt((k * k).sum() + 1e-6)
    qh = q / torch.sqrt((q * q).sum() + 1e-6) * kd**-0.5
    eye = torch.eye(kd, dtype=S.dtype)
    S = math.exp(g) * S @ (eye - beta * torch.outer(kh, kh)) + beta * torch.outer(v, kh)
    return S, S @ qh


def naive_replay(S, k, v, g, beta):
    """Raw records replayed in float64 through :func:`naive_step`'s matrix form, from
    the stored gates: ``S [HV, V, K]``, ``k [c, H, K]`` raw, ``v [c, HV, V]``,
    ``g, beta [c, HV]``."""
    S = S.double().clone()
    hv, group = S.shape[0], S.shape[0] // k.shape[1]
    eye = torch.eye(S.shape[2], dtype=torch.float64)
    for c in range(k.shape[0]):
        for h in range(hv):
            kk = k[c, h // group].double()
            kh = kk / torch.sqrt((kk * kk).sum() + 1e-6)
            b, e = beta[c, h].double(), torch.exp(g[c, h].double())
            S[h] = e * S[h] @ (eye - b * torch.outer(kh, kh)) + b * torch.outer(v[c, h].double(), kh)
    return S


def naive_states(S, x, group):
    """The float64 state after the tokens of ``x`` from ``S [HV, V, K]`` (naive_step)."""
    S = S.double().clone()
    for t in range(x["q"].shape[0]):
        for h in range(S.shape[0]):
            S[h], _ = naive_step(
                S[h], x["q"][t, h // group].double(), x["k"][t, h // group].double(), x["v"][t, h].double(),
                x["a"][t, h].item(), x["b"][t, h].item(), x["A_log"][h].item(), x["dt_bias"][h].item(),
            )
    return S


class TestGates:
    def test_formulas_and_softplus_threshold(self):
        a = torch.randn(64, 8, dtype=torch.float64) * 15
        b = torch.randn(64, 8, dtype=torch.float64) * 4
        A_log, dt_bias = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64) * 3
        g, beta = gdn_gates(a, b, A_log, dt_bias)
        for i in range(64):
            for h in range(8):
                x = (a[i, h] + dt_bias[h]).item()
                sp = x if x > 20 else math.log1p(math.exp(x))
                assert g[i, h].item() == pytest.approx(-math.exp(A_log[h].item()) * sp, rel=1e-12)
                assert beta[i, h].item() == pytest.approx(1 / (1 + math.exp(-b[i, h].item())), rel=1e-12)
        assert (a + dt_bias > 20).any(), "the test must reach the softplus threshold branch"

    def test_gates_are_float32_for_low_precision_inputs(self):
        g, beta = gdn_gates(torch.randn(3, 4).bfloat16(), torch.randn(3, 4).bfloat16(), torch.randn(4), torch.randn(4))
        assert g.dtype == beta.dtype == torch.float32
        assert (g <= 0).all() and ((beta > 0) & (beta < 1)).all()

    def test_l2_normalize(self):
        x = torch.randn(5, 3, 16, dtype=torch.float64)
        y = l2_normalize(x, 0.25)
        ref = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) * 0.25
        torch.testing.assert_close(y, ref, rtol=1e-14, atol=0)

    def test_bad_gate_shapes(self):
        with pytest.raises(ValueError, match="A_log"):
            gdn_gates(torch.randn(3, 4), torch.randn(3, 4), torch.randn(5), torch.randn(4))
        with pytest.raises(ValueError, match="a and b"):
            gdn_gates(torch.randn(3, 4), torch.randn(3, 5), torch.randn(4), torch.randn(4))
        with pytest.raises(TypeError, match="b must"):
            gdn_gates(torch.randn(3, 4), torch.ones(3, 4, dtype=torch.int32), torch.randn(4), torch.randn(4))


class TestRecurrenceOracle:
    @pytest.mark.parametrize("group", [1, 2, 4])
    def test_matches_naive_matrix_form(self, group):
        h, kd, vd = 2, 8, 6
        hv = h * group
        lengths = [3, 1, 5]
        x = rand_layer(sum(lengths), h, hv, kd, vd)
        state = torch.randn(4, hv, vd, kd, dtype=torch.float64)
        slots = torch.tensor([2, 0, 3], dtype=torch.int32)
        before = state.clone()
        o = gdn_recurrence_reference(*args(x), state, slots, cu_of(lengths), update_state=True)
        cu = cu_of(lengths).tolist()
        for i, s in enumerate(slots.tolist()):
            for hvi in range(hv):
                S = before[s, hvi].clone()
                kh = hvi // group  # value head hv reads key head hv // (HV // H)
                for t in range(cu[i], cu[i + 1]):
                    S, o_t = naive_step(
                        S, x["q"][t, kh], x["k"][t, kh], x["v"][t, hvi], x["a"][t, hvi].item(), x["b"][t, hvi].item(),
                        x["A_log"][hvi].item(), x["dt_bias"][hvi].item(),
                    )
                    torch.testing.assert_close(o[t, hvi], o_t, rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(state[s, hvi], S, rtol=1e-10, atol=1e-12)
        assert torch.equal(state[1], before[1]), "a slot outside the batch changed"

    def test_snapshots_and_records(self):
        h, hv, kd, vd = 1, 2, 8, 4
        lengths = [3, 2]
        x = rand_layer(5, h, hv, kd, vd, torch.float32)
        state = torch.randn(3, hv, vd, kd)
        snaps = torch.full((3, 4, hv, vd, kd), float("nan"))
        rec = RawRecords(
            torch.full((3, 4, h, kd), float("nan")), torch.full((3, 4, hv, vd), float("nan")),
            torch.full((3, 4, hv), float("nan")), torch.full((3, 4, hv), float("nan")),
        )
        slots = torch.tensor([2, 0], dtype=torch.int32)
        o_plain = gdn_recurrence_reference(*args(x), state, slots, cu_of(lengths))
        o = gdn_recurrence_reference(*args(x), state, slots, cu_of(lengths), snapshots=snaps, records=rec)
        assert torch.equal(o, o_plain), "side channels must not change the outputs"
        g, beta = gdn_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
        for i, (s, bos, n) in enumerate([(2, 0, 3), (0, 3, 2)]):
            S = state[s].clone()
            for j in range(n):
                one = {k: v[bos + j : bos + j + 1] if v.dim() > 1 else v for k, v in x.items()}
                st = S[None].clone()
                gdn_recurrence_reference(*args(one), st, torch.tensor([0], dtype=torch.int32), cu_of([1]), update_state=True)
                S = st[0]
                assert torch.equal(snaps[s, j], S)
                # An fp32 ring keeps the key normalised (ops.records.keys_normalized).
                kk = x["k"][bos + j].double()
                k_hat = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
                torch.testing.assert_close(rec.k[s, j].double(), k_hat, rtol=1e-6, atol=1e-7)
                assert torch.equal(rec.v[s, j], x["v"][bos + j])
                assert torch.equal(rec.g[s, j], g[bos + j]) and torch.equal(rec.beta[s, j], beta[bos + j])
        assert torch.isnan(snaps[1]).all() and torch.isnan(rec.v[1]).all(), "an unused slot was written"

    def test_padding_rows(self):
        x = rand_layer(6, 1, 2, 8, 4, torch.float32)
        state = torch.randn(2, 2, 4, 8)
        before = state.clone()
        o = gdn_recurrence_reference(
            *args(x), state, torch.tensor([-1, 1, -1], dtype=torch.int32), cu_of([2, 2, 2]), update_state=True
        )
        assert torch.equal(o[:2], torch.zeros_like(o[:2])) and torch.equal(o[4:], torch.zeros_like(o[4:]))
        assert (o[2:4] != 0).all()
        assert torch.equal(state[0], before[0])

    def test_validation(self):
        x = rand_layer(4, 2, 4, 8, 4, torch.float32)
        state = torch.randn(2, 4, 4, 8)
        cu = cu_of([2, 2])
        slots = torch.tensor([0, 1], dtype=torch.int32)
        with pytest.raises(ValueError, match="state"):
            gdn_recurrence_reference(*args(x), torch.randn(2, 4, 4, 7), slots, cu)
        with pytest.raises(ValueError, match="cu_seqlens"):
            gdn_recurrence_reference(*args(x), state, slots, cu_of([1, 2]))
        with pytest.raises(ValueError, match="slots"):
            gdn_recurrence_reference(*args(x), state, torch.tensor([0, 2], dtype=torch.int32), cu)
        with pytest.raises(ValueError, match="unique"):
            gdn_recurrence_reference(*args(x), state, torch.tensor([1, 1], dtype=torch.int32), cu)
        with pytest.raises(ValueError, match="multiple of key heads"):
            bad = dict(x, q=torch.randn(4, 3, 8), k=torch.randn(4, 3, 8))
            gdn_recurrence_reference(*args(bad), state, slots, cu)
        with pytest.raises(ValueError, match="v must"):
            gdn_recurrence_reference(*args(dict(x, v=torch.randn(5, 4, 4))), state, slots, cu)


def make_ring(ns, L, h, hv, kd, vd, dtype):
    nan = float("nan")
    return RawRecords(
        torch.full((ns, L, h, kd), nan, dtype=dtype), torch.full((ns, L, hv, vd), nan, dtype=dtype),
        torch.full((ns, L, hv), nan, dtype=dtype), torch.full((ns, L, hv), nan, dtype=dtype),
    ), torch.full((ns, L, hv, vd), nan, dtype=dtype)


def fill_history(ring, ring_u, slot, state, positions, h, hv, kd, vd, dtype):
    """Commit random tokens into ``ring`` at ``positions`` by running the recurrence, and
    return the state they lead to (what the closed form must reproduce)."""
    n = len(positions)
    if n == 0:
        return state[slot].clone(), None
    x = rand_layer(n, h, hv, kd, vd, dtype)
    rec = RawRecords(*(torch.empty((1, n) + t.shape[2:], dtype=t.dtype) for t in ring))
    st = state[slot : slot + 1].clone()
    gdn_recurrence_reference(*args(x), st, torch.tensor([0], dtype=torch.int32), cu_of([n]), records=rec, update_state=True)
    # u_c of each committed record: recompute through the closed form from the checkpoint.
    one_ring, one_u = make_ring(1, 32, h, hv, kd, vd, dtype)
    zeros = torch.zeros(1, dtype=torch.int32)
    gdn_chunked_window_reference(
        *args(x), state[slot : slot + 1].clone(), one_ring, one_u, torch.tensor([0], dtype=torch.int32), cu_of([n]),
        zeros, zeros, zeros,
    )
    for c, p in enumerate(positions):
        ring.write(slot, p, rec.k[0, c], rec.v[0, c], rec.g[0, c], rec.beta[0, c])
        ring_u[slot, p] = one_u[0, c]
    return st[0], x


class TestChunkedWindow:
    @pytest.mark.parametrize("window", range(1, 9))
    @pytest.mark.parametrize("group", [1, 2, 4])
    def test_matches_recurrence_with_history(self, window, group):
        """Closed form from checkpoint + committed history + window == recurrence from the
        state the history leads to (float64: agreement to ~1e-12)."""
        h, kd, vd, L = 2, 8, 4, 16
        hv = h * group
        ns = 3
        dtype = torch.float64
        ckpt = torch.randn(ns, hv, vd, kd, dtype=dtype)
        ring, ring_u = make_ring(ns, L, h, hv, kd, vd, dtype)
        hist = int(torch.randint(0, L - window + 1, ()))
        base = int(torch.randint(0, L, ()))
        positions = [(base + c) % L for c in range(hist)]
        S_hist, _ = fill_history(ring, ring_u, 1, ckpt, positions, h, hv, kd, vd, dtype)
        wp = torch.tensor([0, hist, 0], dtype=torch.int32)
        cb = torch.tensor([0, base, 0], dtype=torch.int32)
        x = rand_layer(window, h, hv, kd, vd, dtype)
        slots = torch.tensor([1], dtype=torch.int32)
        ck_before = ckpt.clone()
        o = gdn_chunked_window_reference(
            *args(x), ckpt, ring, ring_u, slots, cu_of([window]), wp, cb, torch.zeros(ns, dtype=torch.int32)
        )
        assert torch.equal(ckpt, ck_before), "a non-flush verify must not write the checkpoint"
        st = S_hist[None].clone()
        recs = RawRecords(*(torch.empty((1, window) + t.shape[2:], dtype=t.dtype) for t in ring))
        o_ref = gdn_recurrence_reference(
            *args(x), st, torch.tensor([0], dtype=torch.int32), cu_of([window]), records=recs, update_state=True
        )
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-11)
        for j in range(window):
            p = (base + hist + j) % L
            assert torch.equal(ring.k[1, p], x["k"][j]) and torch.equal(ring.v[1, p], x["v"][j])
            assert torch.equal(ring.g[1, p], recs.g[0, j]) and torch.equal(ring.beta[1, p], recs.beta[0, j])
        # The committed u of the window, applied to the history state, gives the
        # recurrence's state: S_T = exp(G_T) S + sum_j exp(G_T - G_j) u_j k^_j^T.
        G = torch.cumsum(recs.g[0], 0)
        khat = l2_normalize(x["k"]).repeat_interleave(group, dim=1)
        S = torch.exp(G[-1])[:, None, None] * S_hist
        for j in range(window):
            p = (base + hist + j) % L
            S = S + torch.exp(G[-1] - G[j])[:, None, None] * ring_u[1, p][:, :, None] * khat[j][:, None, :]
        torch.testing.assert_close(S, st[0], rtol=1e-10, atol=1e-11)

    def test_flush_row_folds_history_exactly(self):
        h, hv, kd, vd, L, T = 1, 2, 8, 4, 8, 3
        dtype = torch.float32
        ckpt = torch.randn(2, hv, vd, kd, dtype=dtype)
        ring, ring_u = make_ring(2, L, h, hv, kd, vd, dtype)
        base, hist = 6, 5
        positions = [(base + c) % L for c in range(hist)]  # wraps around the ring end
        before_flush, before_other = ckpt[0].clone(), ckpt[1].clone()
        S_hist, hist_x = fill_history(ring, ring_u, 0, ckpt, positions, h, hv, kd, vd, dtype)
        x = rand_layer(T, h, hv, kd, vd, dtype)
        o = gdn_chunked_window_reference(
            *args(x), ckpt, ring, ring_u, torch.tensor([0], dtype=torch.int32), cu_of([T]),
            torch.tensor([hist, 0], dtype=torch.int32), torch.tensor([base, 0], dtype=torch.int32),
            torch.tensor([1, 0], dtype=torch.int32),
        )
        # The flush replays the raw records: against the float64 statement of the step
        # (5 contractive fp32 steps on O(1) values: within 1e-5 of the state's scale). A
        # fold of the wrong records, order or count is off by O(0.1).
        S64 = naive_states(before_flush, hist_x, hv // h)
        assert (ckpt[0].double() - S64).abs().max() <= 1e-5 * S64.abs().max()
        assert torch.equal(ckpt[1], before_other), "a slot outside the batch changed"
        st = S_hist[None].clone()
        o_ref = gdn_recurrence_reference(*args(x), st, torch.tensor([0], dtype=torch.int32), cu_of([T]))
        torch.testing.assert_close(o, o_ref, rtol=2e-5, atol=2e-6)

    def test_window_overflowing_the_ring_is_rejected(self):
        h, hv, kd, vd, L = 1, 1, 4, 4, 4
        ring, ring_u = make_ring(1, L, h, hv, kd, vd, torch.float32)
        x = rand_layer(2, h, hv, kd, vd, torch.float32)
        ckpt = torch.randn(1, hv, vd, kd)
        with pytest.raises(ValueError, match="does not fit"):
            gdn_chunked_window_reference(
                *args(x), ckpt, ring, ring_u, torch.tensor([0], dtype=torch.int32), cu_of([2]),
                torch.tensor([3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            )
        assert torch.isnan(ring.v).all(), "a rejected call wrote the ring"


class TestFold:
    @pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=["unit_keys", "raw_bf16_keys"])
    def test_fold_replays_records_like_the_float64_step_all_layers(self, key_dtype):
        """Folding records == the float64 statement of the step (naive matrix form) on
        the same records, for every layer in one call, with a wrapping start position;
        padding rows and other slots untouched. Keys: normalised in an fp32 ring, raw in
        a bf16 one (``ops.records.keys_normalized``); the naive step normalises both, a
        unit key to within 1e-6. Bound: <= 4 contractive fp32 steps on O(1) values,
        within 1e-5 of the state's scale. (This used to compare with the reference
        recurrence, which runs the same ``state_update`` as the fold: it could not fail.)"""
        nl, ns, h, hv, kd, vd, R = 3, 4, 2, 4, 8, 4, 5
        ckpt = torch.randn(nl, ns, hv, vd, kd)
        before = ckpt.clone()
        rings = [torch.full((nl, ns, R) + shp, float("nan")) for shp in ((h, kd), (hv, vd), (hv,), (hv,))]
        rings[0] = rings[0].to(key_dtype)
        rows = ((3, 3, 4), (1, 0, 2))  # (slot, start, count)
        for layer in range(nl):
            for s, st, n in rows:
                for c in range(n):
                    rings[0][layer, s, (st + c) % R] = stored_keys(torch.randn(h, kd), key_dtype)
                    rings[1][layer, s, (st + c) % R] = torch.randn(hv, vd)
                    rings[2][layer, s, (st + c) % R] = -torch.rand(hv) * 2  # log decays g <= 0
                    rings[3][layer, s, (st + c) % R] = torch.rand(hv)  # beta in (0, 1)
        slots = torch.tensor([3, -1, 1], dtype=torch.int32)
        start = torch.tensor([3, 0, 0], dtype=torch.int32)
        count = torch.tensor([4, 2, 2], dtype=torch.int32)
        gdn_fold_reference(ckpt, *rings, slots, start, count)
        for layer in range(nl):
            for s, st, n in rows:
                pos = [(st + c) % R for c in range(n)]
                S64 = naive_replay(before[layer, s], *(r[layer, s, pos] for r in rings))
                assert (ckpt[layer, s].double() - S64).abs().max() <= 1e-5 * S64.abs().max(), (layer, s)
            for s in (0, 2):
                assert torch.equal(ckpt[layer, s], before[layer, s])

    def test_count_out_of_range(self):
        ckpt = torch.randn(1, 1, 1, 2, 2)
        rings = [torch.zeros((1, 1, 2) + shp) for shp in ((1, 2), (1, 2), (1,), (1,))]
        with pytest.raises(ValueError, match="count"):
            gdn_fold_reference(ckpt, *rings, torch.tensor([0]), torch.tensor([0]), torch.tensor([3]))


class TestSnapshotCommit:
    def test_copies_accepted_position(self):
        ck = torch.randn(2, 3, 2, 2, 2)
        snaps = torch.randn(2, 3, 4, 2, 2, 2)
        before = ck.clone()
        snapshot_commit_reference(ck, snaps, torch.tensor([2, -1, 0]), torch.tensor([3, 1, 1]))
        assert torch.equal(ck[:, 2], snaps[:, 2, 2]) and torch.equal(ck[:, 0], snaps[:, 0, 0])
        assert torch.equal(ck[:, 1], before[:, 1])


class TestConv:
    def test_verify_matches_conv1d_and_commit_matches_sequential_decode(self):
        C, W, ns = 6, 4, 3
        weight, bias = torch.randn(C, W), torch.randn(C)
        state = torch.randn(ns, C, W - 1)
        lengths = [3, 4]
        slots = torch.tensor([2, 0], dtype=torch.int32)
        x = torch.randn(7, C)
        buf = torch.full((ns, 4, C), float("nan"))
        before = state.clone()
        y = causal_conv_verify_reference(x, state, weight, bias, slots, cu_of(lengths), window_buf=buf)
        assert torch.equal(state, before), "verify must not advance the conv state"
        cu = cu_of(lengths).tolist()
        for i, s in enumerate(slots.tolist()):
            seq = torch.cat([before[s], x[cu[i] : cu[i + 1]].T], 1)[None]  # [1, C, W-1+m]
            ref = torch.nn.functional.silu(torch.nn.functional.conv1d(seq, weight[:, None], bias, groups=C))[0].T
            torch.testing.assert_close(y[cu[i] : cu[i + 1]], ref, rtol=1e-5, atol=1e-6)
        # commit 2 of 3 and 4 of 4 == decoding those tokens one by one
        accepted = torch.tensor([2, 4], dtype=torch.int32)
        seq_state = before.clone()
        for i, s in enumerate(slots.tolist()):
            for t in range(cu[i], cu[i] + accepted[i]):
                causal_conv_verify_reference(x[t : t + 1], seq_state, weight, bias, torch.tensor([s]), cu_of([1]), update_state=True)
        causal_conv_commit_reference(state[None], buf[None], slots, accepted)
        assert torch.equal(state, seq_state)
