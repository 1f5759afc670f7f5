"""Triton kernels against their references (DESIGN.md sections 1, 3 and 5).

Without a GPU these run under the Triton interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``) in fp32 at small shapes; on a CUDA machine the same tests run
the compiled kernels on the GPU.

Tolerance. Kernels and reference compute in fp32 in the same operation order, but not
bit for bit: the reductions over ``K`` (``S k^``, ``S q^``, the norms) are summed in a
different order, and Triton's ``exp`` / ``log`` (and our ``log1p`` via ``log``) differ
from torch's by a few ulp. At these shapes that is ~1e-7 per step on O(1) values, so
``rtol = atol = 1e-5`` leaves room for a few steps while a real bug (a wrong gate, head,
slot or position) is off by O(0.1). Copies (raw records ``k``/``v``, snapshot commit,
cursors, conv state and window buffer) must be exactly equal.
"""

from __future__ import annotations

import pytest
import torch
from layer_inputs import args
from layer_inputs import rand_layer as _rand_layer

triton = pytest.importorskip("triton")

from replayssm.ops import (  # noqa: E402
    RawRecords,
    advance_cursors,
    causal_conv_commit,
    causal_conv_verify,
    gdn_fold,
    gdn_recurrence,
    reset_cursors,
    snapshot_commit,
    triton_common,
)
from replayssm.ops import conv as conv_ops  # noqa: E402
from replayssm.ops import cursors as cursor_ops  # noqa: E402
from replayssm.ops import dispatch  # noqa: E402
from replayssm.ops import fold as fold_ops  # noqa: E402
from replayssm.ops import recurrent as rec_ops  # noqa: E402
from replayssm.ops import snapshot as snap_ops  # noqa: E402
from replayssm.ops import tuning  # noqa: E402
from replayssm.state import GDNShape, StatePool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_common.INTERPRETER:
    pytest.skip("CPU run without TRITON_INTERPRET=1 at import time", allow_module_level=True)

TOL = dict(rtol=1e-5, atol=1e-5)
NAN = float("nan")


# ---------------------------------------------------------------------------- inputs
def rand_layer(n, h, hv, kd, vd):
    return _rand_layer(n, h, hv, kd, vd, device=DEVICE)



def rand_batch(rows, t_max, num_slots, *, pad_row=True):
    """Random windows of 1..t_max tokens on distinct random slots; with ``pad_row`` one
    row (not the first) is padding (slot -1, still carrying tokens)."""
    lengths = torch.randint(1, t_max + 1, (rows,)).tolist()
    slots = torch.randperm(num_slots)[:rows].tolist()
    if pad_row and rows > 1:
        slots[torch.randint(1, rows, ()).item()] = -1
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return (
        torch.tensor(slots, dtype=torch.int32, device=DEVICE),
        torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        lengths,
    )


def nan_records(num_slots, ring, h, kd, hv, vd):
    full = lambda *s: torch.full(s, NAN, device=DEVICE)  # noqa: E731
    return RawRecords(full(num_slots, ring, h, kd), full(num_slots, ring, hv, vd), full(num_slots, ring, hv), full(num_slots, ring, hv))


def clone_records(r):
    return RawRecords(*(x.clone() for x in r))


def assert_close_nan(actual, expected, **tol):
    """Same NaN pattern (written vs never written) and close values elsewhere."""
    assert torch.equal(actual.isnan(), expected.isnan())
    torch.testing.assert_close(actual.nan_to_num(0.0), expected.nan_to_num(0.0), **tol)


def untouched(slots, num_slots):
    live = set(slots.tolist())
    return [s for s in range(num_slots) if s not in live]


def padding_tokens(slots, cu):
    out = []
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            out += list(range(cu[i].item(), cu[i + 1].item()))
    return out


# (H, HV // H, K, V, T): GQA ratios 1, 2, 4; K and V that are not powers of two (masked
# lanes); V spanning two V blocks of the interpreter's BV = 16.
CONFIGS = [(1, 1, 16, 16, 1), (2, 2, 24, 24, 4), (1, 4, 32, 32, 6), (2, 1, 16, 8, 3)]


# ---------------------------------------------------------------------------- recurrence
@pytest.mark.parametrize("h,group,kd,vd,t", CONFIGS)
def test_recurrence_snapshots_and_update_match_reference(h, group, kd, vd, t):
    hv, ns, rows = h * group, 5, 4
    slots, cu, lengths = rand_batch(rows, t, ns)
    x = rand_layer(sum(lengths), h, hv, kd, vd)
    state0 = torch.randn(ns, hv, vd, kd, device=DEVICE)
    snaps0 = torch.full((ns, t, hv, vd, kd), NAN, device=DEVICE)

    st_r, sn_r = state0.clone(), snaps0.clone()
    o_r = gdn_recurrence(*args(x), st_r, slots, cu, snapshots=sn_r, update_state=True, backend="reference")
    st_t, sn_t = state0.clone(), snaps0.clone()
    o_t = gdn_recurrence(*args(x), st_t, slots, cu, snapshots=sn_t, update_state=True, backend="triton")

    torch.testing.assert_close(o_t, o_r, **TOL)
    torch.testing.assert_close(st_t, st_r, **TOL)
    assert_close_nan(sn_t, sn_r, **TOL)
    pad = padding_tokens(slots, cu)
    assert pad and torch.equal(o_t[pad], torch.zeros_like(o_t[pad]))
    for s in untouched(slots, ns):
        assert torch.equal(st_t[s], state0[s])
        assert sn_t[s].isnan().all()


@pytest.mark.parametrize("h,group,kd,vd,t", CONFIGS[1:3])
def test_recurrence_records_match_reference_and_leave_outputs_bit_identical(h, group, kd, vd, t):
    hv, ns, rows = h * group, 5, 3
    slots, cu, lengths = rand_batch(rows, t, ns)
    x = rand_layer(sum(lengths), h, hv, kd, vd)
    state = torch.randn(ns, hv, vd, kd, device=DEVICE)
    state0 = state.clone()
    rec0 = nan_records(ns, t + 1, h, kd, hv, vd)

    rec_r = clone_records(rec0)
    gdn_recurrence(*args(x), state, slots, cu, records=rec_r, backend="reference")
    rec_t = clone_records(rec0)
    o_side = gdn_recurrence(*args(x), state, slots, cu, records=rec_t, backend="triton")
    o_plain = gdn_recurrence(*args(x), state, slots, cu, max_len=t, backend="triton")

    assert torch.equal(o_side, o_plain), "the record side channel changed the outputs"
    assert torch.equal(state, state0), "verify without update_state wrote the state"
    # k per key head is normalised by each side (an fp32 ring: ops.records.keys_normalized;
    # within a few ulp of unit-vector entries), v is a copy; g and beta are recomputed gates.
    assert torch.equal(rec_t.k.isnan(), rec_r.k.isnan())
    torch.testing.assert_close(rec_t.k.nan_to_num(0), rec_r.k.nan_to_num(0), rtol=1e-6, atol=1e-7)
    assert torch.equal(rec_t.v.isnan(), rec_r.v.isnan()) and torch.equal(rec_t.v.nan_to_num(0), rec_r.v.nan_to_num(0))
    assert_close_nan(rec_t.g, rec_r.g, rtol=1e-6, atol=1e-7)
    assert_close_nan(rec_t.beta, rec_r.beta, rtol=1e-6, atol=1e-7)
    for s in untouched(slots, ns):
        assert all(getattr(rec_t, f)[s].isnan().all() for f in rec_t._fields)


@pytest.mark.parametrize("h,group,kd,vd,t", CONFIGS[1:3])
def test_recurrence_without_load_ahead_changes_no_bit(h, group, kd, vd, t):
    """Each token's inputs loaded at its step's start (``load_ahead = 0`` in the exact
    families' rows) instead of during the step before: the same arithmetic, so the
    outputs, the written state, the snapshots and the records are the pipelined
    kernel's bit for bit, in the read-only verify (records) and in the writing
    kernel (snapshots and state), on windows of 1..T tokens beside a padding row; and
    the reference's to fp32 rounding."""
    hv, ns, rows = h * group, 5, 4
    slots, cu, lengths = rand_batch(rows, t, ns)
    x = rand_layer(sum(lengths), h, hv, kd, vd)
    state0 = torch.randn(ns, hv, vd, kd, device=DEVICE)
    runs = {}
    for ahead in (1, 0):
        with tuning.override("exact_write", load_ahead=ahead), tuning.override("exact_read_only", load_ahead=ahead):
            rec = nan_records(ns, t + 1, h, kd, hv, vd)
            o_verify = gdn_recurrence(*args(x), state0.clone(), slots, cu, records=rec, backend="triton")
            st, sn = state0.clone(), torch.full((ns, t, hv, vd, kd), NAN, device=DEVICE)
            o_write = gdn_recurrence(*args(x), st, slots, cu, snapshots=sn, update_state=True, backend="triton")
        runs[ahead] = (o_verify, rec, o_write, st, sn)
    (ov1, rec1, ow1, st1, sn1), (ov0, rec0, ow0, st0, sn0) = runs[1], runs[0]
    assert torch.equal(ov0, ov1) and torch.equal(ow0, ow1), "outputs differ"
    assert torch.equal(st0, st1), "states differ"
    assert torch.equal(sn0.nan_to_num(7.0), sn1.nan_to_num(7.0)), "snapshots differ"
    for f in rec0._fields:
        assert torch.equal(getattr(rec0, f).nan_to_num(7.0), getattr(rec1, f).nan_to_num(7.0)), f"records.{f} differ"
    st_r = state0.clone()
    o_r = gdn_recurrence(*args(x), st_r, slots, cu, update_state=True, backend="reference")
    torch.testing.assert_close(ow0, o_r, **TOL)
    torch.testing.assert_close(st0, st_r, **TOL)
    assert not torch.equal(st0, state0)


def test_recurrence_strided_inputs_and_long_prefill_bound():
    """q/k/v as views into one packed projection (the layer's real layout), and a
    bound above 16 that the launcher rounds up to a power of two: the kernel then loops
    to each row's own length (a short row, a padding row beside a long one)."""
    h, hv, kd, vd, ns = 1, 2, 16, 16, 3
    slots = torch.tensor([2, 0, -1], dtype=torch.int32, device=DEVICE)
    lengths = [19, 7, 5]
    cu = torch.tensor([0, 19, 26, 31], dtype=torch.int32, device=DEVICE)
    n = sum(lengths)
    proj = torch.randn(n, 2 * h * kd + hv * vd, device=DEVICE)
    q = proj[:, : h * kd].view(n, h, kd)
    k = proj[:, h * kd : 2 * h * kd].view(n, h, kd)
    v = proj[:, 2 * h * kd :].view(n, hv, vd)
    x = rand_layer(n, h, hv, kd, vd)
    x.update(q=q, k=k, v=v)
    state0 = torch.randn(ns, hv, vd, kd, device=DEVICE)
    st_r, st_t = state0.clone(), state0.clone()
    o_r = gdn_recurrence(*args(x), st_r, slots, cu, update_state=True, max_len=19, backend="reference")
    o_t = gdn_recurrence(*args(x), st_t, slots, cu, update_state=True, max_len=19, backend="triton")
    torch.testing.assert_close(o_t, o_r, **TOL)
    torch.testing.assert_close(st_t, st_r, **TOL)
    assert torch.equal(st_t[1], state0[1])
    assert torch.equal(o_t[26:], torch.zeros_like(o_t[26:]))  # the padding row


# ---------------------------------------------------------------------------- fold
@pytest.mark.parametrize("h,group,kd,vd", [(1, 2, 16, 24), (2, 1, 24, 16)])
def test_fold_matches_reference(h, group, kd, vd):
    hv, nl, ns, r = h * group, 2, 6, 5
    ckpt0 = torch.randn(nl, ns, hv, vd, kd, device=DEVICE)
    ring_k = torch.randn(nl, ns, r, h, kd, device=DEVICE)
    ring_v = torch.randn(nl, ns, r, hv, vd, device=DEVICE)
    ring_g = -torch.rand(nl, ns, r, hv, device=DEVICE) * 2
    ring_beta = torch.rand(nl, ns, r, hv, device=DEVICE)
    # Rows: wrap-around, full ring, padding, zero records, one record.
    slots = torch.tensor([4, 0, -1, 2, 5], dtype=torch.int32, device=DEVICE)
    start = torch.tensor([3, 0, 1, 2, 4], dtype=torch.int32, device=DEVICE)
    count = torch.tensor([4, 5, 3, 0, 1], dtype=torch.int32, device=DEVICE)
    ring = (ring_k, ring_v, ring_g, ring_beta)
    c_r, c_t = ckpt0.clone(), ckpt0.clone()
    gdn_fold(c_r, *ring, slots, start, count, backend="reference")
    gdn_fold(c_t, *ring, slots, start, count, backend="triton")
    torch.testing.assert_close(c_t, c_r, **TOL)
    for s in (1, 2, 3):  # untouched, zero-count and padding-only slots
        assert torch.equal(c_t[:, s], ckpt0[:, s])
    assert not torch.equal(c_t[:, 4], ckpt0[:, 4])


def test_fold_never_reads_poisoned_entries_outside_the_count():
    """Unused ring entries hold NaN: a fold of the first n records must not touch them."""
    h, hv, kd, vd, nl, ns, r = 1, 2, 16, 16, 1, 3, 4
    ckpt = torch.randn(nl, ns, hv, vd, kd, device=DEVICE)
    ring_k = torch.full((nl, ns, r, h, kd), NAN, device=DEVICE)
    ring_v = torch.full((nl, ns, r, hv, vd), NAN, device=DEVICE)
    ring_g = torch.full((nl, ns, r, hv), NAN, device=DEVICE)
    ring_beta = torch.full((nl, ns, r, hv), NAN, device=DEVICE)
    ring_k[:, 1, :2] = torch.randn(nl, 2, h, kd, device=DEVICE)
    ring_v[:, 1, :2] = torch.randn(nl, 2, hv, vd, device=DEVICE)
    ring_g[:, 1, :2] = -torch.rand(nl, 2, hv, device=DEVICE)
    ring_beta[:, 1, :2] = torch.rand(nl, 2, hv, device=DEVICE)
    slots = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    gdn_fold(ckpt, ring_k, ring_v, ring_g, ring_beta, slots, torch.zeros_like(slots), torch.full_like(slots, 2), backend="triton")
    assert torch.isfinite(ckpt).all()


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("h,group,kd,vd,t", [(2, 2, 16, 24, 4), (1, 1, 32, 16, 3)])
def test_exact_paths_agree_bit_for_bit(h, group, kd, vd, t):
    """recurrence(update_state) on the accepted tokens == fold replay of the records ==
    snapshot commit, all through the Triton kernels (DESIGN.md section 3)."""
    hv, ns, rows = h * group, 5, 3
    slots, cu, lengths = rand_batch(rows, t, ns)
    x = rand_layer(sum(lengths), h, hv, kd, vd)
    accepted = [int(torch.randint(1, n + 1, ())) for n in lengths]
    acc = torch.tensor(accepted, dtype=torch.int32, device=DEVICE)
    state0 = torch.randn(ns, hv, vd, kd, device=DEVICE)

    # 1. plain recurrence over the accepted prefix of every window
    keep = torch.cat([torch.arange(cu[i].item(), cu[i].item() + accepted[i]) for i in range(rows)]).to(DEVICE)
    cu_acc = torch.tensor([0] + torch.tensor(accepted).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    direct = state0.clone()
    gdn_recurrence(*(y[keep] for y in args(x)[:5]), x["A_log"], x["dt_bias"], direct, slots, cu_acc,
                   update_state=True, max_len=t, backend="triton")
    # 2. verify with the record side channel, then fold the accepted records
    folded = state0.clone()
    rec = nan_records(ns, t, h, kd, hv, vd)
    gdn_recurrence(*args(x), folded, slots, cu, records=rec, backend="triton")
    gdn_fold(folded[None], rec.k[None], rec.v[None], rec.g[None], rec.beta[None], slots, torch.zeros_like(acc), acc,
             backend="triton")
    # 3. verify with snapshots, then copy the accepted one
    snap = state0.clone()
    snaps = torch.full((ns, t, hv, vd, kd), NAN, device=DEVICE)
    gdn_recurrence(*args(x), snap, slots, cu, snapshots=snaps, backend="triton")
    snapshot_commit(snap[None], snaps[None], slots, acc, backend="triton")

    assert not torch.equal(direct, state0)
    assert torch.equal(folded, direct)
    assert torch.equal(snap, direct)


# ---------------------------------------------------------------------------- commits, cursors
def test_snapshot_commit_is_the_reference_copy():
    nl, ns, t, hv, vd, kd = 2, 6, 4, 2, 8, 16
    ckpt0 = torch.randn(nl, ns, hv, vd, kd, device=DEVICE)
    snaps = torch.randn(nl, ns, t, hv, vd, kd, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 3], dtype=torch.int32, device=DEVICE)
    acc = torch.tensor([4, 2, 1, 3], dtype=torch.int32, device=DEVICE)
    c_r, c_t = ckpt0.clone(), ckpt0.clone()
    snapshot_commit(c_r, snaps, slots, acc, backend="reference")
    snapshot_commit(c_t, snaps, slots, acc, backend="triton")
    assert torch.equal(c_t, c_r)
    for s in (1, 2, 4):
        assert torch.equal(c_t[:, s], ckpt0[:, s])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cursors_match_reference_over_many_commits(dtype):
    ns, window, ring_len = 7, 3, 8
    cur_r = [torch.zeros(ns, dtype=dtype, device=DEVICE) for _ in range(3)]
    cur_t = [c.clone() for c in cur_r]
    for step in range(12):
        slots, _, _ = rand_batch(4, 1, ns)
        acc = torch.randint(1, window + 1, (4,), dtype=torch.int32, device=DEVICE)
        advance_cursors(*cur_r, slots, acc, window, ring_len, backend="reference")
        advance_cursors(*cur_t, slots, acc, window, ring_len, backend="triton")
        assert all(torch.equal(a, b) for a, b in zip(cur_t, cur_r)), f"step {step}"
        if step % 4 == 3:
            reset = torch.tensor([int(torch.randint(ns, ())), -1], dtype=torch.int32, device=DEVICE)
            reset_cursors(*cur_r, reset, backend="reference")
            reset_cursors(*cur_t, reset, backend="triton")
            assert all(torch.equal(a, b) for a, b in zip(cur_t, cur_r))
    assert cur_t[2].any(), "no flush happened: the test would not cover the flush branch"
    assert cur_t[1].any(), "no cache_base moved"


def test_cursors_flush_every_matches_reference():
    """``flush_every`` (circular's small-batch mode): every committed row is flagged, and
    the next commit moves its base past its history; other slots are untouched."""
    ns, window, ring_len = 6, 3, 16
    cur_r = [torch.zeros(ns, dtype=torch.int32, device=DEVICE) for _ in range(3)]
    cur_t = [c.clone() for c in cur_r]
    for step in range(8):
        slots, _, _ = rand_batch(4, 1, ns)
        acc = torch.randint(1, window + 1, (4,), dtype=torch.int32, device=DEVICE)
        before = [c.clone() for c in cur_t]
        advance_cursors(*cur_r, slots, acc, window, ring_len, flush_every=True, backend="reference")
        advance_cursors(*cur_t, slots, acc, window, ring_len, flush_every=True, backend="triton")
        assert all(torch.equal(a, b) for a, b in zip(cur_t, cur_r)), f"step {step}"
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            assert cur_t[2][s] == 1 and cur_t[0][s] == acc[i]  # flagged; history = this step's tokens
            if before[2][s]:
                assert cur_t[1][s] == (before[1][s] + before[0][s]) % ring_len
        untouched = [s for s in range(ns) if s not in slots.tolist()]
        for c, b in zip(cur_t, before):
            assert torch.equal(c[untouched], b[untouched])
    with pytest.raises(TypeError, match="flush_every"):
        advance_cursors(*cur_t, slots, acc, window, ring_len, flush_every=1, backend="triton")


# ---------------------------------------------------------------------------- conv
def conv_inputs(n_tok, c, w, ns, t, with_bias):
    """Fresh conv inputs ``x [n_tok, c]``, taps ``[c, w]``, bias (or ``None``), a random
    conv state ``[ns, c, w - 1]`` and a NaN window buffer ``[ns, t, c]``."""
    x = torch.randn(n_tok, c, device=DEVICE)
    weight = torch.randn(c, w, device=DEVICE)
    bias = torch.randn(c, device=DEVICE) if with_bias else None
    return x, weight, bias, torch.randn(ns, c, w - 1, device=DEVICE), torch.full((ns, t, c), NAN, device=DEVICE)


@pytest.mark.parametrize("c,w,t,with_bias", [(40, 4, 4, True), (24, 2, 3, False), (300, 4, 2, True)])
def test_conv_verify_matches_reference(c, w, t, with_bias):
    ns, rows = 5, 4
    slots, cu, lengths = rand_batch(rows, t, ns)
    x, weight, bias, state0, buf0 = conv_inputs(sum(lengths), c, w, ns, t, with_bias)
    s_r, b_r = state0.clone(), buf0.clone()
    y_r = causal_conv_verify(x, s_r, weight, bias, slots, cu, window_buf=b_r, backend="reference")
    s_t, b_t = state0.clone(), buf0.clone()
    y_t = causal_conv_verify(x, s_t, weight, bias, slots, cu, window_buf=b_t, backend="triton")
    torch.testing.assert_close(y_t, y_r, **TOL)
    assert torch.equal(s_t, state0), "verify advanced the conv state"
    assert torch.equal(b_t.isnan(), b_r.isnan()) and torch.equal(b_t.nan_to_num(0), b_r.nan_to_num(0))
    pad = padding_tokens(slots, cu)
    assert torch.equal(y_t[pad], torch.zeros_like(y_t[pad]))

    # Decode / prefill form: the state advances over the whole window.
    s_r, s_t = state0.clone(), state0.clone()
    y_r = causal_conv_verify(x, s_r, weight, bias, slots, cu, update_state=True, max_len=t, backend="reference")
    y_t = causal_conv_verify(x, s_t, weight, bias, slots, cu, update_state=True, max_len=t, backend="triton")
    torch.testing.assert_close(y_t, y_r, **TOL)
    assert torch.equal(s_t, s_r)
    for s in untouched(slots, ns):
        assert torch.equal(s_t[s], state0[s])


def packed_batch(lengths, slots):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return (torch.tensor(slots, dtype=torch.int32, device=DEVICE), torch.tensor(cu, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("c,w,with_bias", [(40, 4, True), (300, 3, False)])
def test_conv_verify_short_windows_keep_buffer_and_advance_state(c, w, with_bias):
    """One token block per window (verify, decoding), whose program loads every tap
    before its first store: live windows of 1 and 2 tokens (fewer than ``W - 1``: the
    new state mixes old entries and inputs), of ``T - 1`` and of ``T``, a padding row
    between live ones, the window buffer kept and the state advanced in one launch,
    against the reference."""
    ns, t = 7, 5
    lengths = [2, t, 3, 1, t - 1]
    slots, cu = packed_batch(lengths, [4, 0, -1, 6, 2])
    x, weight, bias, state0, buf0 = conv_inputs(sum(lengths), c, w, ns, t, with_bias)
    s_r, b_r = state0.clone(), buf0.clone()
    y_r = causal_conv_verify(x, s_r, weight, bias, slots, cu, window_buf=b_r, update_state=True, backend="reference")
    s_t, b_t = state0.clone(), buf0.clone()
    y_t = causal_conv_verify(x, s_t, weight, bias, slots, cu, window_buf=b_t, update_state=True, backend="triton")
    torch.testing.assert_close(y_t, y_r, **TOL)
    assert torch.equal(s_t, s_r)
    for s in untouched(slots, ns):
        assert torch.equal(s_t[s], state0[s])
    # Rows past a window's length stay unwritten (NaN), in the buffer as in the reference's.
    assert torch.equal(b_t.isnan(), b_r.isnan()) and torch.equal(b_t.nan_to_num(0), b_r.nan_to_num(0))
    pad = padding_tokens(slots, cu)
    assert torch.equal(y_t[pad], torch.zeros_like(y_t[pad]))


@pytest.mark.parametrize("c,w,with_bias,x_dtype", [(40, 4, True, torch.float32), (300, 2, False, torch.float32),
                                                   (24, 5, True, torch.bfloat16)])
def test_conv_decode_steps_advance_state_as_the_reference(c, w, with_bias, x_dtype):
    """Decoding (one token a window, ``update_state``): the new state comes from the rows
    that the program loaded for its taps. Three steps in a row, each with fresh inputs,
    padding rows beside live ones and the live slots changing; bf16 inputs into an fp32
    state (the state keeps the inputs' values exactly); against the reference, the
    state bit for bit."""
    ns, rows = 6, 4
    weight = torch.randn(c, w, device=DEVICE).to(x_dtype)
    bias = torch.randn(c, device=DEVICE).to(x_dtype) if with_bias else None
    s_r = torch.randn(ns, c, w - 1, device=DEVICE)
    s_t = s_r.clone()
    for step, slot_list in enumerate(([3, -1, 0, 5], [-1, 3, 1, -1], [0, 5, -1, 2])):
        slots, cu = packed_batch([1] * rows, slot_list)
        x = torch.randn(rows, c, device=DEVICE).to(x_dtype)
        before = s_t.clone()
        y_r = causal_conv_verify(x, s_r, weight, bias, slots, cu, update_state=True, max_len=1, backend="reference")
        y_t = causal_conv_verify(x, s_t, weight, bias, slots, cu, update_state=True, max_len=1, backend="triton")
        # bf16 outputs: a few fp32 ulp apart may round one bf16 ulp apart
        torch.testing.assert_close(y_t, y_r, **(TOL if x_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)))
        assert torch.equal(s_t, s_r), f"step {step}"
        for i, s in enumerate(slot_list):
            if s >= 0:  # the newest entry is this step's input, the older ones moved down
                assert torch.equal(s_t[s, :, -1], x[i].float()) and torch.equal(s_t[s, :, :-1], before[s, :, 1:])
        for s in untouched(slots, ns):
            assert torch.equal(s_t[s], before[s])
        pad = padding_tokens(slots, cu)
        assert torch.equal(y_t[pad], torch.zeros_like(y_t[pad]))


# (C, W, CONV_TOKEN_BLOCK, CONV_TOKEN_GROUP, bias), made small so that the interpreter
# runs many token blocks: two load groups per block; C over two channel blocks, W = 2;
# W = 6 at a block of 2, where the block grows to W - 1 = 5 (or later blocks would read
# a history that the first block has already shifted).
TOKEN_BLOCK_CASES = [(40, 4, 4, 2, True), (300, 2, 3, 3, False), (16, 6, 2, 1, True)]


@pytest.mark.parametrize("c,w,block,group,with_bias", TOKEN_BLOCK_CASES)
def test_conv_token_blocks_match_reference(monkeypatch, c, w, block, group, with_bias):
    """Prompts longer than a token block: windows of 1, BT - 1, BT, BT + 1 and 3 BT + 5
    tokens and a padding row of 2 BT + 3 in one batch, prefill form (the state
    advances) and verify form (window buffer), against the reference; and bit for bit
    the launch where one block covers every window."""
    monkeypatch.setattr(conv_ops, "CONV_TOKEN_GROUP", group)
    monkeypatch.setattr(conv_ops, "CONV_TOKEN_BLOCK", block)
    bt = conv_ops.conv_token_block(3 * block + 5, w)
    assert bt == max(block, w - 1) and bt % group == 0
    ns = 8
    lengths = [bt - 1, 1, 3 * bt + 5, bt, 2 * bt + 3, bt + 1]
    slot_list = torch.randperm(ns)[: len(lengths)].tolist()
    slot_list[4] = -1  # a padding row longer than a block
    slots, cu = packed_batch(lengths, slot_list)
    t = max(lengths)
    x = torch.randn(sum(lengths), c, device=DEVICE)
    weight = torch.randn(c, w, device=DEVICE)
    bias = torch.randn(c, device=DEVICE) if with_bias else None
    state0 = torch.randn(ns, c, w - 1, device=DEVICE)
    pad = padding_tokens(slots, cu)

    def run(backend, token_block=block, **kw):
        monkeypatch.setattr(conv_ops, "CONV_TOKEN_BLOCK", token_block)
        state = state0.clone()
        return causal_conv_verify(x, state, weight, bias, slots, cu, backend=backend, **kw), state

    y_r, s_r = run("reference", update_state=True, max_len=t)
    y_t, s_t = run("triton", update_state=True, max_len=t)
    torch.testing.assert_close(y_t, y_r, **TOL)
    assert torch.equal(s_t, s_r)
    for s in untouched(slots, ns):
        assert torch.equal(s_t[s], state0[s])
    assert torch.equal(y_t[pad], torch.zeros_like(y_t[pad]))
    # A block of 1024 tokens covers every window: one block, the same bits.
    y_1, s_1 = run("triton", token_block=1024, update_state=True, max_len=t)
    assert torch.equal(y_t, y_1) and torch.equal(s_t, s_1)

    buf0 = torch.full((ns, t, c), NAN, device=DEVICE)
    b_r, b_t, b_1 = buf0.clone(), buf0.clone(), buf0.clone()
    y_r, _ = run("reference", window_buf=b_r)
    y_t, s_t = run("triton", window_buf=b_t)
    torch.testing.assert_close(y_t, y_r, **TOL)
    assert torch.equal(s_t, state0), "verify advanced the conv state"
    assert torch.equal(b_t.isnan(), b_r.isnan()) and torch.equal(b_t.nan_to_num(0), b_r.nan_to_num(0))
    y_1, _ = run("triton", token_block=1024, window_buf=b_1)
    assert torch.equal(y_t, y_1) and torch.equal(b_t.nan_to_num(0), b_1.nan_to_num(0))


@pytest.mark.parametrize("c,parts", [(40, (16, 16, 8)), (300, (7, 101, 192)), (24, (1, 1, 22))])
def test_conv_planar_parts_are_the_split_output(monkeypatch, c, parts):
    """``parts``: the outputs in three contiguous parts, bit for bit the one-buffer
    output's column blocks (Triton against Triton, the reference against the
    reference), over token blocks and channel blocks that straddle the parts' bounds,
    a padding row included; the conv state advances the same way."""
    monkeypatch.setattr(conv_ops, "CONV_TOKEN_BLOCK", 4)
    monkeypatch.setattr(conv_ops, "CONV_BLOCK", 32)
    w, ns = 4, 6
    lengths = [9, 1, 14, 5]
    slot_list = torch.randperm(ns)[: len(lengths)].tolist()
    slot_list[2] = -1
    slots, cu = packed_batch(lengths, slot_list)
    x, weight, bias, state0, _ = conv_inputs(sum(lengths), c, w, ns, 1, True)
    for backend in ("reference", "triton"):
        outs = []
        for p in (None, parts):
            state = state0.clone()
            y = causal_conv_verify(x, state, weight, bias, slots, cu, update_state=True, max_len=14, parts=p,
                                   backend=backend)
            outs.append((y, state))
        (y, s_whole), (planes, s_planar) = outs
        assert len(planes) == 3 and all(pl.is_contiguous() for pl in planes)
        for got, want in zip(planes, y.split(parts, dim=1)):
            assert torch.equal(got, want), backend
        assert torch.equal(s_planar, s_whole) and not torch.equal(s_planar, state0)
    with pytest.raises(ValueError, match="sum to the channel count"):
        causal_conv_verify(x, state0.clone(), weight, bias, slots, cu, max_len=14, parts=(1, 1, 1))
    with pytest.raises(TypeError, match="three positive ints"):
        causal_conv_verify(x, state0.clone(), weight, bias, slots, cu, max_len=14, parts=(c, 0, 0))


def test_conv_token_block_does_not_follow_the_prompt_length():
    """Windows up to the block take one block of their own length (verify and decoding
    keep their one-block launch); every longer window takes the same block size, so
    prompts of new lengths compile nothing new."""
    cap = conv_ops.CONV_TOKEN_BLOCK
    assert [conv_ops.conv_token_block(t, 4) for t in (1, 2, 3, 5, cap)] == [1, 2, 3, 5, cap]
    assert {conv_ops.conv_token_block(t, 4) for t in range(cap + 1, 5000, 7)} == {cap}


@pytest.mark.parametrize("blocks", [1, 2])
def test_conv_commit_is_the_reference_shift(blocks):
    """Channels in one commit program, and across two (the last one partly masked)."""
    block = conv_ops.CONV_BLOCK
    nl, ns, w, t = 2, 6, 4, 5
    lo, hi = (3, 40) if blocks == 1 else (block + 1, 2 * block - 1)
    c = int(torch.randint(lo, hi + 1, ()))
    state0 = torch.randn(nl, ns, c, w - 1, device=DEVICE)
    buf = torch.randn(nl, ns, t, c, device=DEVICE)
    # n below, equal to and above W - 1; a padding row.
    slots = torch.tensor([0, 3, -1, 5, 2], dtype=torch.int32, device=DEVICE)
    acc = torch.tensor([1, 3, 2, 5, 2], dtype=torch.int32, device=DEVICE)
    s_r, s_t = state0.clone(), state0.clone()
    causal_conv_commit(s_r, buf, slots, acc, backend="reference")
    causal_conv_commit(s_t, buf, slots, acc, backend="triton")
    assert torch.equal(s_t, s_r)
    for s in (1, 4):
        assert torch.equal(s_t[:, s], state0[:, s])


# ---------------------------------------------------------------------------- validation
def test_launchers_reject_bad_arguments_before_touching_state():
    h, hv, kd, vd, ns = 1, 2, 16, 16, 3
    x = rand_layer(4, h, hv, kd, vd)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
    state = torch.randn(ns, hv, vd, kd, device=DEVICE)
    state0 = state.clone()
    with pytest.raises(ValueError, match="max_len"):
        gdn_recurrence(*args(x), state, slots, cu, update_state=True, backend="triton")
    with pytest.raises(TypeError, match="state"):
        gdn_recurrence(*args(x), state.double(), slots, cu, max_len=2, backend="triton")
    with pytest.raises(ValueError, match="state must be packed"):
        gdn_recurrence(*args(x), state.transpose(2, 3), slots, cu, max_len=2, backend="triton")
    with pytest.raises(ValueError, match="cu_seqlens"):
        gdn_recurrence(*args(x), state, slots, cu[:2], max_len=2, backend="triton")
    with pytest.raises(ValueError, match="max_len"):
        gdn_recurrence(*args(x), state, slots, cu, max_len=0, backend="triton")
    rec = nan_records(ns, 2, h, kd, hv, vd)
    with pytest.raises(TypeError, match="records.g"):
        gdn_recurrence(*args(x), state, slots, cu, records=rec._replace(g=rec.g.double()), backend="triton")
    with pytest.raises(ValueError, match="window_buf|max_len"):
        causal_conv_verify(torch.randn(4, 8, device=DEVICE), torch.zeros(ns, 8, 3, device=DEVICE),
                           torch.randn(8, 4, device=DEVICE), None, slots, cu, backend="triton")
    with pytest.raises(TypeError, match="ring_g"):
        gdn_fold(state[None], torch.zeros(1, ns, 2, h, kd, device=DEVICE), torch.zeros(1, ns, 2, hv, vd, device=DEVICE),
                 torch.zeros(1, ns, 2, hv, device=DEVICE, dtype=torch.float64), torch.zeros(1, ns, 2, hv, device=DEVICE),
                 slots, slots, slots, backend="triton")
    assert torch.equal(state, state0)


def test_dispatch_picks_and_refuses_backends(monkeypatch):
    """Triton kernels take CPU tensors only under the interpreter (as here on a machine
    without CUDA; set so on a CUDA machine too), and are refused without it."""
    cpu = torch.zeros(1)
    monkeypatch.setattr(triton_common, "INTERPRETER", True)
    assert dispatch.pick("recurrence", "auto", cpu) is rec_ops.gdn_recurrence_reference
    assert dispatch.pick("fold", "reference", cpu) is fold_ops.gdn_fold_reference
    assert dispatch.pick("snapshot_commit", "triton", cpu) is snap_ops.snapshot_commit_triton
    for op, fn in [("advance_cursors", cursor_ops.advance_cursors_triton), ("conv_commit", conv_ops.causal_conv_commit_triton)]:
        assert dispatch.pick(op, "triton", cpu) is fn
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.pick("fold", "cuda", cpu)
    monkeypatch.setattr(triton_common, "INTERPRETER", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        dispatch.pick("fold", "triton", cpu)


# ---------------------------------------------------------------------------- lifecycle
@pytest.mark.parametrize("strategy", ["snapshot", "fold"])
def test_lifecycle_triton_pool_tracks_reference_pool(strategy):
    """32 verify -> random accept -> commit steps (after a prefill) on a Triton pool
    and a reference pool fed the same tokens: outputs and committed states agree to
    fp32 rounding at every step, and the difference does not grow (the last quarter's
    8 steps against the first's)."""
    shape = GDNShape(num_heads=1, num_value_heads=1, head_k_dim=16, head_v_dim=8)
    window, steps = 3, 32
    pools = {
        be: StatePool(shape, 1, 3, strategy=strategy, window=window, backend=be, device=DEVICE)
        for be in ("reference", "triton")
    }
    params = dict(
        A_log=torch.empty(1).uniform_(-2, -0.5), dt_bias=torch.randn(1) * 0.5,
        conv_weight=torch.randn(shape.conv_dim, shape.conv_kernel),
    )
    for pool in pools.values():
        pool.set_layer_params(0, **params)
        slots = [pool.alloc(), pool.alloc(), pool.alloc()]
    live = slots[:2]  # slots[2] stays allocated and untouched

    def feed(n):
        return rand_layer(n, 1, 1, shape.head_k_dim, shape.head_v_dim)

    prompt = feed(9)
    for pool in pools.values():
        b = pool.batch(live, [5, 4], prefill=True)
        pool.strategy.prefill(0, *args(prompt)[:5], b)
    errors = []
    for step in range(steps):
        lengths = torch.randint(1, window + 1, (2,)).tolist()
        x = feed(sum(lengths))
        outs, batches = {}, {}
        for be, pool in pools.items():
            batches[be] = pool.batch(live, lengths)
            outs[be] = pool.strategy.verify(0, *args(x)[:5], batches[be])
        torch.testing.assert_close(outs["triton"], outs["reference"], **TOL, msg=f"outputs, step {step}")
        accepted = [int(torch.randint(1, n + 1, ())) for n in lengths]
        for be, pool in pools.items():
            pool.strategy.commit(batches[be], accepted)
        s_r = pools["reference"].strategy.committed_state(0, live)
        s_t = pools["triton"].strategy.committed_state(0, live)
        torch.testing.assert_close(s_t, s_r, **TOL, msg=f"committed state, step {step}")
        errors.append((s_t - s_r).abs().max().item())
    quarter = steps // 4
    assert max(errors[-quarter:]) <= 10 * max(errors[:quarter]) + 1e-6, "Triton vs reference error grows"
    ckpt = pools["triton"].buffers["checkpoints"]
    assert torch.equal(ckpt[:, slots[2]], torch.zeros_like(ckpt[:, slots[2]])), "untouched slot changed"


def test_first_flushes_are_staggered_by_slot():
    """``first_cycle``: requests admitted together on slots 0..P-1 decode one token a
    step; each slot's first flush flag rises at ``write_pos = 1 + slot % P`` (so at P
    different steps), then every P tokens as without the flags; the Triton kernel
    moves the cursors and flags as the reference does, and without ``first_cycle``
    every slot is flagged at the same step."""
    window, ring_len = 2, 16
    period = ring_len - 2 * window + 1
    ns = period + 3
    slots = torch.arange(ns, dtype=torch.int32, device=DEVICE)
    ones = torch.ones(ns, dtype=torch.int32, device=DEVICE)
    runs = {}
    for backend, stagger in (("reference", True), ("triton", True), ("triton", False)):
        cur = [torch.zeros(ns, dtype=torch.int32, device=DEVICE) for _ in range(3)]
        first = torch.ones(ns, dtype=torch.int32, device=DEVICE) if stagger else None
        flags = []
        for _ in range(3 * period):
            advance_cursors(*cur, slots, ones, window, ring_len, first_cycle=first, backend=backend)
            flags.append(cur[2].clone())
        runs[(backend, stagger)] = (torch.stack(flags), cur, first)
    (f_ref, c_ref, first_ref), (f_tri, c_tri, first_tri) = runs[("reference", True)], runs[("triton", True)]
    assert torch.equal(f_tri, f_ref) and all(torch.equal(a, b) for a, b in zip(c_tri, c_ref))
    assert torch.equal(first_tri, first_ref) and not first_tri.any(), "every slot has flushed once"
    raised = [torch.nonzero(f_ref[:, s]).flatten().tolist() for s in range(ns)]
    for s in range(ns):
        first_step = s % period  # write_pos 1 + s % P after step index s % P
        assert raised[s][0] == first_step, (s, raised[s])
        assert all(b - a == period for a, b in zip(raised[s][1:], raised[s][2:])), (s, raised[s])
    assert len({r[0] for r in raised}) == period, "the first flushes fall on P different steps"
    plain = runs[("triton", False)][0]
    assert (plain[period - 1] != 0).all() and not plain[: period - 1].any()
