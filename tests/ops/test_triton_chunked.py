"""The chunked closed-form window kernel (``circular``'s verify) against its reference.

These run under the Triton interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``
without a GPU) in fp32 at small shapes: K < 16, fp32 tolerances and the CPU's dispatch
rules. They are skipped on a CUDA machine, where the compiled kernels (tf32 products,
K >= 16, the GPU's dispatch to the replay path at small batch) are checked by
tests/gpu/test_chunked_gpu.py at Qwen3.5 shapes.

Tolerances.
  * Against the fp32 reference op: ``rtol = atol = 1e-5``. Both evaluate the closed form
    of DESIGN.md section 2 in fp32, but in different association orders (the kernel
    applies the committed history to ``k^`` / ``q^`` per token, the reference through
    einsums) and with Triton's ``exp`` / ``log`` a few ulp from torch's; on O(1) values
    over windows <= 8 and histories <= 12 records that is ~1e-7..1e-6, while a wrong
    head, gate, position or history is off by O(0.1).
  * Against the float64 oracle (the reference op run in float64): ``2e-5 * (1 + |o|)``.
    The fp32 closed form has two sources of error beyond one fp32 rounding per
    operation: the K-length dot products (K <= 32 here, ~sqrt(K) ulp) and the forward
    substitution through ``(I + A)``, whose entries are bounded by 1 (``beta < 1``,
    ``|k^_i . k^_j| <= 1``, decays <= 1) so that at most ``T <= 8`` terms of size <= 1
    accumulate per output. The measured error is ~1e-6; the fp32 reference op itself
    sits at the same distance from the oracle.
  * Copies (``v`` records, raw keys in a 16-bit ring) and untouched buffers: bit for
    bit. Keys in an fp32 ring are normalised by each side (the kernel multiplies by
    ``1 / sqrt(...)``, the reference divides by ``sqrt(...)``, over sums in other
    orders): ``rtol = 1e-6`` (a few ulp of unit-vector entries).
"""

from __future__ import annotations

import pytest
import torch
from layer_inputs import rand_layer as _rand_layer

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from replayssm.ops import RawRecords, gdn_chunked_window, gdn_fold, triton_common  # noqa: E402
from replayssm.ops import chunked as chunked_ops  # noqa: E402
from replayssm.ops import tuning  # noqa: E402
from replayssm.ops.gates import expand_heads  # noqa: E402
from replayssm.ops.records import keys_normalized, stored_keys, unit_keys  # noqa: E402
from replayssm.state import GDNShape, StatePool  # noqa: E402

DEVICE = torch.device("cpu")
if not triton_common.INTERPRETER:
    pytest.skip("interpreter tests (the compiled kernels: tests/gpu/test_chunked_gpu.py)", allow_module_level=True)

TOL = dict(rtol=1e-5, atol=1e-5)
ORACLE_TOL = 2e-5


# ---------------------------------------------------------------------------- inputs
def rand_layer(n, h, hv, kd, vd):
    return _rand_layer(n, h, hv, kd, vd, device=DEVICE)


def poisoned(*shape):
    """Never-written scratch: NaN and +inf alternating along the ring axis (dim 1)."""
    x = torch.full(shape, float("nan"), device=DEVICE)
    x[:, 1::2] = float("inf")
    return x


class Case:
    """A packed batch of windows on a pool-like set of buffers with random cursors.

    Every live slot gets a history of ``write_pos`` committed records at ring positions
    ``(cache_base + c) % L`` (random records and ``u``: keys stored as a ring of
    ``key_dtype`` stores them, normalised in fp32, raw in 16 bits); every other ring entry
    is poisoned. Live rows alternate flush / non-flush so that both paths run; one row
    (not the first) is padding with tokens of its own.
    """

    def __init__(self, h, group, kd, vd, t, ring_len, *, rows=4, num_slots=6, pad_row=True, max_hist=None,
                 key_dtype=torch.float32):
        hv = h * group
        self.h, self.hv, self.kd, self.vd, self.t, self.L = h, hv, kd, vd, t, ring_len
        lengths = torch.randint(1, t + 1, (rows,)).tolist()
        lengths[0] = t  # the longest window always runs
        slots = torch.randperm(num_slots)[:rows].tolist()
        if pad_row and rows > 1:
            slots[int(torch.randint(1, rows, ()))] = -1
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        self.lengths = lengths
        self.slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        self.cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        self.x = rand_layer(cu[-1], h, hv, kd, vd)

        L = ring_len
        hmax = L - t if max_hist is None else max_hist
        self.checkpoint = torch.randn(num_slots, hv, vd, kd, device=DEVICE) * 0.5
        self.ring = RawRecords(poisoned(num_slots, L, h, kd).to(key_dtype), poisoned(num_slots, L, hv, vd),
                               poisoned(num_slots, L, hv), poisoned(num_slots, L, hv))
        self.ring_u = poisoned(num_slots, L, hv, vd)
        wp = torch.randint(0, hmax + 1, (num_slots,))
        live = [s for s in slots if s >= 0]
        if live:
            wp[live[0]] = hmax  # the longest history always runs
        self.write_pos = wp.to(torch.int32).to(DEVICE)
        self.cache_base = torch.randint(0, L, (num_slots,), dtype=torch.int32).to(DEVICE)
        flush = torch.zeros(num_slots, dtype=torch.int32)
        flush[live[1::2]] = 1  # live rows alternate non-flush / flush
        self.is_flush = flush.to(DEVICE)
        for s in range(num_slots):
            for c in range(int(wp[s])):
                p = (int(self.cache_base[s]) + c) % L
                self.ring.k[s, p] = stored_keys(torch.randn(h, kd, device=DEVICE), key_dtype)
                self.ring.v[s, p] = torch.randn(hv, vd, device=DEVICE)
                self.ring.g[s, p] = -torch.empty(hv, device=DEVICE).uniform_(0.02, 1.0)
                self.ring.beta[s, p] = torch.rand(hv, device=DEVICE)
                self.ring_u[s, p] = torch.randn(hv, vd, device=DEVICE) * 0.5

    def with_consistent_u(self):
        """This case with every history record's ``u`` the recurrence's own corrected
        delta (float64 from the checkpoint through the raw records, as a pool's verifies
        leave it), so that reading the history by ``u`` (closed form) or by raw records
        (replay) describe the same committed state."""
        ring_u = self.ring_u.clone()
        for s in range(self.checkpoint.shape[0]):
            S = self.checkpoint[s].double()
            for c in range(int(self.write_pos[s])):
                p = (int(self.cache_base[s]) + c) % self.L
                k_hat = expand_heads(unit_keys(self.ring.k[s, p], torch.float64), self.hv)  # [HV, K]
                S = torch.exp(self.ring.g[s, p].double())[:, None, None] * S
                u = self.ring.beta[s, p].double()[:, None] * (self.ring.v[s, p].double() - torch.einsum("hvk,hk->hv", S, k_hat))
                S = S + u[:, :, None] * k_hat[:, None, :]
                ring_u[s, p] = u.float()
        return self.but(ring_u=ring_u)

    def buffers(self, dtype=None):
        """Fresh copies of the mutable buffers (optionally converted, for the oracle)."""
        cv = (lambda x: x.clone()) if dtype is None else (lambda x: x.to(dtype))
        return cv(self.checkpoint), RawRecords(*(cv(x) for x in self.ring)), cv(self.ring_u)

    def inputs(self, dtype=None):
        x = self.x
        cv = (lambda y: y) if dtype is None else (lambda y: y.to(dtype))
        return [cv(x[n]) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]

    def cursors(self):
        return self.slots, self.cu, self.write_pos, self.cache_base, self.is_flush

    def run(self, backend, dtype=None, method=None):
        ckpt, ring, ring_u = self.buffers(dtype)
        o = gdn_chunked_window(*self.inputs(dtype), ckpt, ring, ring_u, *self.cursors(), max_len=self.t,
                               method=method, backend=backend)
        return o, ckpt, ring, ring_u

    def but(self, **changes):
        """A shallow copy with some attributes replaced."""
        other = Case.__new__(Case)
        other.__dict__.update(self.__dict__, **changes)
        return other

    def live_rows(self):
        return [(i, s) for i, s in enumerate(self.slots.tolist()) if s >= 0]


def same(a, b):
    """Bitwise equality with NaN == NaN (poisoned scratch)."""
    return a.shape == b.shape and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def assert_close_nan(actual, expected, **tol):
    """Same never-written pattern (NaN / inf in the same places) and close values elsewhere."""
    assert torch.equal(actual.isfinite(), expected.isfinite())
    assert same(actual[~actual.isfinite()], expected[~expected.isfinite()])
    fin = expected.isfinite()
    torch.testing.assert_close(actual[fin], expected[fin], **tol)


def check_against_reference(case: Case, method=None):
    """The Triton op on ``case`` against the reference op (see the module notes); returns
    the Triton op's ``(o, checkpoint, ring, ring_u)`` for further checks."""
    o_r, ck_r, ring_r, u_r = case.run("reference")
    cursors = [c.clone() for c in case.cursors()]
    o_t, ck_t, ring_t, u_t = case.run("triton", method=method)
    for before, after in zip(cursors, case.cursors()):
        assert torch.equal(before, after), "cursors are read only"

    torch.testing.assert_close(o_t, o_r, **TOL)
    for i, s in enumerate(case.slots.tolist()):
        if s < 0:  # padding rows: exact zeros
            pad = o_t[case.cu[i]:case.cu[i + 1]]
            assert torch.equal(pad, torch.zeros_like(pad))
    # Values (and raw keys) are copies; normalised keys, gates and u computed values;
    # unused entries keep their poison.
    assert same(ring_t.v, ring_r.v)
    if keys_normalized(ring_t.k.dtype):
        assert_close_nan(ring_t.k, ring_r.k, rtol=1e-6, atol=1e-7)
    else:
        assert same(ring_t.k, ring_r.k)
    assert_close_nan(ring_t.g, ring_r.g, **TOL)
    assert_close_nan(ring_t.beta, ring_r.beta, **TOL)
    assert_close_nan(u_t, u_r, **TOL)
    # Checkpoints: flush rows are folded, every other slot is untouched bit for bit.
    flushed = {s for _, s in case.live_rows() if case.is_flush[s]}
    for s in range(case.checkpoint.shape[0]):
        if s in flushed:
            torch.testing.assert_close(ck_t[s], ck_r[s], **TOL)
            assert not torch.equal(ck_t[s], case.checkpoint[s]) or case.write_pos[s] == 0
        else:
            assert torch.equal(ck_t[s], case.checkpoint[s]), f"checkpoint of slot {s} changed"
    return o_t, ck_t, ring_t, u_t


# ---------------------------------------------------------------------------- op vs reference
# (H, HV // H, K, V, T, L): GQA ratios 1, 2, 4; windows 1..8; K and V that are not powers
# of two (masked lanes); V spanning two V blocks of the interpreter's BV = 16.
CONFIGS = [
    (1, 1, 16, 16, 1, 2),
    (2, 2, 24, 20, 3, 8),
    (1, 4, 16, 32, 4, 8),
    (2, 1, 32, 8, 5, 16),
    (1, 2, 16, 8, 8, 16),
]


@pytest.mark.parametrize("h,group,kd,vd,t,L", CONFIGS)
def test_chunked_window_matches_reference(h, group, kd, vd, t, L):
    """Outputs, ring writes and flushed checkpoints against the reference op, with
    histories of 0..L-T committed records, flush and non-flush rows, a padding row and
    NaN/inf in every unused ring entry."""
    check_against_reference(Case(h, group, kd, vd, t, L))


@pytest.mark.parametrize("method", ["closed_form", "replay"])
def test_raw_keys_of_a_16_bit_ring(method):
    """A ring whose keys are bf16 (an engine's own buffers, SGLang's layout) holds raw
    keys: the window's keys stored as given (bit for bit the reference's copies), the
    history's normalised where they are read, by both methods."""
    case = Case(2, 2, 24, 20, 3, 8, key_dtype=torch.bfloat16)
    # Keys bf16 can hold (stored as fp32 activations): the copy is exact under the
    # interpreter too, whose bf16 casts truncate.
    case.x["k"] = case.x["k"].to(torch.bfloat16).float()
    if method == "replay":
        case = case.with_consistent_u()
    _, _, ring_t, _ = check_against_reference(case, method=method)
    assert ring_t.k.dtype == torch.bfloat16


@pytest.mark.parametrize("h,group,kd,vd,t,L", [c for c in CONFIGS if c[1] > 1])
def test_coefficient_programs_per_key_head(h, group, kd, vd, t, L):
    """The coefficient kernel with the value heads of a key head in one program (their K
    pass shared; the shape table's ``closed_form.heads_per_program``, capped at the
    group) against the reference, and the same numbers as one program per value head
    (same operations per head; bit for bit under the interpreter)."""
    case = Case(h, group, kd, vd, t, L)
    with tuning.override("closed_form", heads_per_program=1):
        o_1, ck_1, ring_1, u_1 = case.run("triton", method="closed_form")
    with tuning.override("closed_form", heads_per_program=8):
        o_g, ck_g, ring_g, u_g = check_against_reference(case, method="closed_form")
    for a, b in ((o_g, o_1), (ck_g, ck_1), (u_g, u_1), *zip(ring_g, ring_1)):
        assert same(a, b)


@pytest.mark.parametrize("h,group,kd,vd,t,L", CONFIGS)
def test_replay_method_matches_reference(h, group, kd, vd, t, L):
    """The small-batch method (history and window through the exact recurrence, one
    launch) against the closed-form reference, on cases whose ring ``u`` agree with
    their raw records: same outputs, records and folded checkpoints to fp32 rounding,
    untouched non-flush checkpoints, cursors read only."""
    check_against_reference(Case(h, group, kd, vd, t, L).with_consistent_u(), method="replay")


def test_method_dispatch_follows_the_table(monkeypatch):
    """``method=None`` takes the replay path exactly when the table's ``circular`` row
    allows the batch (0 on the CPU by default: the interpreter's tests cover the closed
    form unless they ask)."""
    case = Case(1, 2, 16, 16, 2, 8, rows=3)
    calls = []
    monkeypatch.setattr(chunked_ops, "launch_replay_window", lambda *a, **k: calls.append("replay"))
    monkeypatch.setattr(chunked_ops, "launch_closed_form", lambda *a, **k: calls.append("closed_form"))
    case.run("triton")
    with tuning.override("circular", replay_max_batch=3):
        case.run("triton")
    with tuning.override("circular", replay_max_batch=2):
        case.run("triton")
        case.run("triton", method="replay")
    with tuning.override("circular", replay_max_batch=3):
        case.run("triton", method="closed_form")
    assert calls == ["closed_form", "replay", "closed_form", "replay", "closed_form"]
    # the CUDA default's edge (the H200 measurement in ops/tuning.py): replay up to 8 rows
    assert chunked_ops.replays_window(8, kd=128, vd=128, state_dtype=torch.float32, device=torch.device("cuda"))
    assert not chunked_ops.replays_window(9, kd=128, vd=128, state_dtype=torch.float32, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="method"):
        case.run("triton", method="fast")
    with pytest.raises(ValueError, match="method"):
        case.run("reference", method="fast")


def test_chunked_window_against_float64_oracle():
    """The fp32 kernel against the reference op run in float64 (see the module notes)."""
    case = Case(2, 2, 32, 16, 8, 16)
    o_t, ck_t, _, _ = case.run("triton")
    o_64, ck_64, _, _ = case.run("reference", torch.float64)
    o_r, _, _, _ = case.run("reference")
    err = ((o_t.double() - o_64).abs() / (1 + o_64.abs())).max().item()
    err_ref = ((o_r.double() - o_64).abs() / (1 + o_64.abs())).max().item()
    assert err < ORACLE_TOL, f"kernel vs float64 oracle: {err:.2e}"
    assert err < 10 * err_ref + 1e-6, f"kernel error {err:.2e} far above the fp32 reference's {err_ref:.2e}"
    for _, s in case.live_rows():
        if case.is_flush[s]:
            torch.testing.assert_close(ck_t[s].double(), ck_64[s], rtol=ORACLE_TOL, atol=ORACLE_TOL)


def test_history_and_flush_matter():
    """Teeth: the cases above would notice a kernel that ignored the history, the flush
    or the history's first record: each tweak keeps every read on written, finite
    records and still moves the outputs by far more than the tolerance (1% of the
    outputs' scale, 1000x TOL). (A tweak that reads a poisoned entry gives NaN, which
    proves nothing about the kernel; NaN used to count as a change here.)"""
    case = Case(1, 2, 16, 16, 4, 8, pad_row=False, max_hist=4)
    o, _, _, _ = case.run("reference")
    late = (case.write_pos - 1).clamp(min=0)
    tweaks = {
        "no history": case.but(write_pos=torch.zeros_like(case.write_pos)),
        "no flush": case.but(is_flush=torch.zeros_like(case.is_flush)),
        "history without its first record": case.but(
            write_pos=late, cache_base=torch.where(case.write_pos > 0, (case.cache_base + 1) % case.L, case.cache_base)
        ),
    }
    for name, other in tweaks.items():
        o2, _, _, _ = other.run("reference")
        assert torch.isfinite(o2).all(), name
        assert (o2 - o).abs().max() > 1e-2 * o.abs().max(), name


@pytest.mark.parametrize("method,fuse_flush,early_tile",
                         [("closed_form", 0, 0), ("closed_form", 1, 0), ("closed_form", 1, 1), ("replay", 1, 0)],
                         ids=["fold_launch", "fused", "fused_early_tile", "replay"])
def test_flush_fold_equals_fold_kernel_bit_for_bit(method, fuse_flush, early_tile):
    """A flush row's folded checkpoint is exactly what the fold kernel makes of the same
    records (all replay them through the shared exact step): the closed form running the
    fold kernel first or folding inside its outputs kernel (the shape table's
    ``closed_form.fuse_flush``, with the tile loaded after the cursors or before them,
    ``closed_form.early_tile``), and the small-batch replay method; fp32 and bf16
    states. Two flushing rows, one with a history of 5 records, one of 0 to 5."""
    for state_dtype in (torch.float32, torch.bfloat16):
        case = Case(2, 2, 16, 24, 3, 8, pad_row=False, rows=2, max_hist=5)
        case.is_flush = torch.ones_like(case.is_flush)
        case.checkpoint = case.checkpoint.to(state_dtype)
        with tuning.override("closed_form", fuse_flush=fuse_flush, early_tile=early_tile):
            _, ck_t, _, _ = case.run("triton", method=method)
        ck_f, ring, _ = case.buffers()
        gdn_fold(ck_f[None], ring.k[None], ring.v[None], ring.g[None], ring.beta[None], case.slots,
                 case.cache_base[case.slots.long()], case.write_pos[case.slots.long()], backend="triton")
        assert torch.equal(ck_t, ck_f), state_dtype
        assert not torch.equal(ck_t, case.checkpoint)


def test_flush_in_a_fold_launch_matches_reference():
    """The closed form with its flush in a separate fold launch (the table's
    ``closed_form.fuse_flush = 0``) against the reference; the fused default runs in
    every other test of this module."""
    with tuning.override("closed_form", fuse_flush=0):
        check_against_reference(Case(2, 2, 24, 20, 3, 8), method="closed_form")


@pytest.mark.parametrize("wide", [False, True], ids=["K24_V20_T3", "K16_V16_T4_rows5"])
def test_early_tile_matches_reference(wide):
    """The fused outputs kernel with every row's checkpoint tile loaded before its
    cursors (``closed_form.early_tile = 1``) against the reference: rows that flush,
    rows that do not, a padding row, and rows with a history."""
    case = Case(2, 2, 24, 20, 3, 8) if not wide else Case(2, 2, 16, 16, 4, 8, rows=5)
    with tuning.override("closed_form", fuse_flush=1, early_tile=1):
        check_against_reference(case, method="closed_form")


def _mixed_case(t=3) -> Case:
    """Rows that fold with a history, a flush row with none, a row that does not flush
    between two that fold, and a padding row."""
    case = Case(2, 2, 24, 20, t, 8, rows=6, num_slots=8)
    live = [s for s in case.slots.tolist() if s >= 0]
    flush = torch.zeros_like(case.is_flush)
    flush[live[0]] = flush[live[2]] = flush[live[3]] = 1
    wp = case.write_pos.clone()
    wp[live[0]], wp[live[1]], wp[live[2]], wp[live[3]] = 5, 3, 4, 0
    for s in (live[1], live[2]):  # records for the lengthened histories
        for c in range(int(case.write_pos[s]), int(wp[s])):
            p = (int(case.cache_base[s]) + c) % case.L
            case.ring.k[s, p] = torch.randn(case.h, case.kd, device=DEVICE)
            case.ring.v[s, p] = torch.randn(case.hv, case.vd, device=DEVICE)
            case.ring.g[s, p] = -torch.empty(case.hv, device=DEVICE).uniform_(0.02, 1.0)
            case.ring.beta[s, p] = torch.rand(case.hv, device=DEVICE)
            case.ring_u[s, p] = torch.randn(case.hv, case.vd, device=DEVICE) * 0.5
    return case.but(is_flush=flush, write_pos=wp)


@triton.jit
def _short_tail_order_kernel(slots_ptr, cu_ptr, wp_ptr, flush_ptr, out_ptr, batch, tail, BB: tl.constexpr):
    j = tl.program_id(0)
    tl.store(out_ptr + j, triton_common.short_tail_row(j, slots_ptr, cu_ptr, wp_ptr, flush_ptr, batch, tail, BB))


@pytest.mark.parametrize("tail", [0, 1, 2, 3, 9])
def test_short_tail_order_moves_the_last_non_folding_rows_to_the_end(tail):
    """``triton_common.short_tail_row`` for every position of a batch of 7 rows (BB 8):
    a permutation of the rows in which the last ``tail`` rows that do not fold (padding
    and a flush row without records count as not folding) come last, the others in
    batch order; past the non-folding count, every folding row first."""
    slots = torch.tensor([4, -1, 0, 2, 5, 1, 3], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 2, 3, 5, 6, 8, 9, 11], dtype=torch.int32, device=DEVICE)
    flush = torch.tensor([1, 0, 1, 1, 1, 0], dtype=torch.int32, device=DEVICE)  # by slot
    wp = torch.tensor([3, 2, 5, 4, 0, 6], dtype=torch.int32, device=DEVICE)  # slot 4 flushes with no records
    out = torch.full((7,), -1, dtype=torch.int32, device=DEVICE)
    _short_tail_order_kernel[(7,)](slots, cu, wp, flush, out, 7, tail, BB=8)
    folds = [s >= 0 and bool(flush[s]) and int(wp[s]) > 0 for s in slots.tolist()]
    others = [r for r in range(7) if not folds[r]]
    assert sum(folds) == 3 and len(others) == 4
    moved = others[len(others) - min(tail, len(others)):]
    assert out.tolist() == [r for r in range(7) if r not in moved] + moved


@pytest.mark.parametrize("tail", [1, 64])
def test_short_tail_changes_no_bit(tail):
    """The outputs kernel's grid with short programs last (``closed_form.short_tail``:
    one row moved, and every folding row first) on a batch of padding, non-flush rows,
    a flush row with no records and two folding rows apart: every row's outputs,
    checkpoint and records are those of the grid in batch order, bit for bit (the same
    code per row; a row missed or taken twice by the order would differ), and within
    tolerance of the reference."""
    case = _mixed_case()
    got = {}
    with tuning.override("closed_form", fuse_flush=1, short_tail=0):
        got[0] = case.run("triton")
    with tuning.override("closed_form", fuse_flush=1, short_tail=tail):  # the reordered grid's run, checked too
        got[tail] = check_against_reference(case, method="closed_form")
    (o0, ck0, ring0, u0), (o1, ck1, ring1, u1) = got[0], got[tail]
    assert same(o0, o1) and same(ck0, ck1) and same(u0, u1)
    assert all(same(x, y) for x, y in zip(ring0, ring1))


@pytest.mark.parametrize("early_tile", [0, 1])
def test_records_first_changes_no_bit(early_tile):
    """The outputs kernel's rows that do not fold loading their history's ``u`` and
    their values before the pass over the checkpoint (``closed_form.records_first``)
    or after it: outputs, checkpoints, records and ``u`` bit for bit (only where the
    loads sit moves), on a batch of padding, non-flush rows, a flush row with no
    records and folding rows; and within tolerance of the reference."""
    case = _mixed_case()
    got = {}
    with tuning.override("closed_form", fuse_flush=1, early_tile=early_tile, records_first=0):  # checked too
        got[0] = check_against_reference(case, method="closed_form")
    with tuning.override("closed_form", fuse_flush=1, early_tile=early_tile, records_first=1):
        got[1] = case.run("triton", method="closed_form")
    (o0, ck0, ring0, u0), (o1, ck1, ring1, u1) = got[0], got[1]
    assert same(o0, o1) and same(ck0, ck1) and same(u0, u1)
    assert all(same(x, y) for x, y in zip(ring0, ring1))


def test_strided_inputs():
    """Activations may be strided views (splits of a projection) with a contiguous last axis."""
    case = Case(2, 1, 16, 16, 3, 8)
    o_r, _, _, _ = case.run("reference")
    n = case.cu[-1].item()
    wide = torch.randn(n, 3, 2, 16, device=DEVICE)
    wide[:, 0], wide[:, 1] = case.x["q"], case.x["k"]
    ab = torch.randn(n, 2, 2, device=DEVICE)
    ab[:, 0], ab[:, 1] = case.x["a"], case.x["b"]
    case.x = dict(case.x, q=wide[:, 0], k=wide[:, 1], a=ab[:, 0], b=ab[:, 1])
    assert not case.x["q"].is_contiguous()
    o_t, _, _, _ = case.run("triton")
    torch.testing.assert_close(o_t, o_r, **TOL)


# ---------------------------------------------------------------------------- validation
def test_launcher_rejects_bad_arguments_before_touching_state():
    case = Case(1, 2, 16, 16, 2, 4, rows=2)
    ckpt, ring, ring_u = case.buffers()
    before = [ckpt.clone(), *(x.clone() for x in ring), ring_u.clone()]
    ins = case.inputs()
    cur = list(case.cursors())
    launch = chunked_ops.gdn_chunked_window_triton

    def call(*, ins=ins, ckpt=ckpt, ring=ring, ring_u=ring_u, cur=cur, **kw):
        kw.setdefault("max_len", 2)
        return launch(*ins, ckpt, ring, ring_u, *cur, **kw)

    with pytest.raises(ValueError, match="max_len"):
        call(max_len=None)
    with pytest.raises(ValueError, match="max_len"):
        call(max_len=5)  # longer than the ring
    with pytest.raises(TypeError, match="checkpoint"):
        call(ckpt=ckpt.double())
    with pytest.raises(TypeError, match="ring_u"):
        call(ring_u=ring_u.double())
    with pytest.raises(TypeError, match="ring.g"):
        call(ring=ring._replace(g=ring.g.double()))
    with pytest.raises(TypeError, match="ring must be"):
        call(ring=tuple(ring))
    with pytest.raises(ValueError, match="checkpoint must be contiguous"):
        call(ckpt=ckpt.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match="ring_u must have shape"):
        call(ring_u=ring_u[:, :2])
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(cur=[cur[0], cur[1][:-1], *cur[2:]])
    with pytest.raises(ValueError, match="is_flush must have shape"):
        call(cur=[*cur[:4], cur[4][:-1]])
    with pytest.raises(TypeError, match="write_pos"):
        call(cur=[*cur[:2], cur[2].float(), *cur[3:]])
    with pytest.raises(ValueError, match="contiguous along its last axis"):
        call(ins=[ins[0].repeat_interleave(2, -1)[..., ::2], *ins[1:]])
    after = [ckpt, *ring, ring_u]
    assert all(same(a, b) for a, b in zip(after, before)), "a rejected call touched a buffer"


def test_empty_batch_touches_nothing():
    case = Case(1, 1, 16, 16, 2, 4, rows=2)
    ckpt, ring, ring_u = case.buffers()
    x = rand_layer(0, 1, 1, 16, 16)
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    cu = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for backend in ("reference", "triton"):
        o = gdn_chunked_window(*(x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")), ckpt, ring, ring_u,
                               none, cu, *case.cursors()[2:], max_len=2, backend=backend)
        assert o.shape == (0, 1, 16)
    assert torch.equal(ckpt, case.checkpoint) and same(ring_u, case.ring_u)


def test_reference_max_len_bounds_windows():
    case = Case(1, 1, 16, 16, 3, 8, rows=2)
    with pytest.raises(ValueError, match="expected 1..2"):
        ckpt, ring, ring_u = case.buffers()
        gdn_chunked_window(*case.inputs(), ckpt, ring, ring_u, *case.cursors(), max_len=2, backend="reference")


# ---------------------------------------------------------------------------- lifecycle
def committed_by_reference_fold(pool, slots):
    """The committed states of a ``circular`` pool (checkpoint + history folded into a
    copy), folded by the reference op: an independent check of the Triton buffers."""
    buf = pool.buffers
    idx = torch.tensor(slots, dtype=torch.long, device=DEVICE)
    state = buf["checkpoints"][0, idx].clone()
    gdn_fold(state[None], buf["ring_k"][0, idx][None], buf["ring_v"][0, idx][None], buf["ring_g"][0, idx][None],
             buf["ring_beta"][0, idx][None], torch.arange(len(slots), dtype=torch.int32, device=DEVICE),
             buf["cache_base"][idx], buf["write_pos"][idx], backend="reference")
    return state


@pytest.mark.parametrize("small_batch", [False, True], ids=["closed_form", "replay"])
def test_lifecycle_triton_pool_tracks_reference_pool(small_batch):
    """24 verify -> random accept -> commit steps on a Triton ``circular`` pool and a
    reference one fed the same tokens (1 layer, 2 requests, ring of 8 for window 3, so
    a request flushes every few steps: about 21 flushes, 19 the fewest in 30 seeds;
    some 36 tokens through the ring a request, four and a half times its length). At
    every step outputs and committed states agree to fp32 rounding and the difference
    does not grow. Every flush writes exactly (bit for bit) the
    committed state that the fold kernel computes from the same checkpoint
    and records (the pool's own ``committed_state`` before that step).

    ``replay``: the same with the small-batch path on (table override): the Triton
    verify replays the exact recurrence in one launch and both pools flush every row
    at every commit."""
    if small_batch:
        with tuning.override("circular", replay_max_batch=64):
            run_lifecycle(expect_flush_every=True)
    else:
        run_lifecycle(expect_flush_every=False)


def run_lifecycle(expect_flush_every):
    shape = GDNShape(num_heads=1, num_value_heads=1, head_k_dim=16, head_v_dim=8)
    window, ring_len, steps = 3, 8, 24
    pools = {
        be: StatePool(shape, 1, 3, strategy="circular", window=window, ring_len=ring_len, backend=be, device=DEVICE)
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
    trit = pools["triton"]
    errors, flushes, expected_flush = [], 0, None
    for step in range(steps):
        lengths = torch.randint(1, window + 1, (2,)).tolist()
        x = rand_layer(sum(lengths), 1, 1, shape.head_k_dim, shape.head_v_dim)
        ins = [x[n] for n in ("q", "k", "v", "a", "b")]
        flush_rows = [i for i, s in enumerate(live) if trit.buffers["is_flush"][s]]
        outs, batches = {}, {}
        for be, pool in pools.items():
            batches[be] = pool.batch(live, lengths)
            outs[be] = pool.strategy.verify(0, *ins, batches[be])
        torch.testing.assert_close(outs["triton"], outs["reference"], **TOL, msg=f"outputs, step {step}")
        for i in flush_rows:
            assert torch.equal(trit.buffers["checkpoints"][0, live[i]], expected_flush[i]), f"flush, step {step}"
        flushes += len(flush_rows)
        accepted = [int(torch.randint(1, n + 1, ())) for n in lengths]
        for be, pool in pools.items():
            pool.strategy.commit(batches[be], accepted)
        assert bool(trit.buffers["is_flush"][live].all()) or not expect_flush_every
        s_r = pools["reference"].strategy.committed_state(0, live)
        s_t = committed_by_reference_fold(trit, live)
        torch.testing.assert_close(s_t, s_r, **TOL, msg=f"committed state, step {step}")
        errors.append((s_t - s_r).abs().max().item())
        if any(trit.buffers["is_flush"][s] for s in live):  # the fold kernel's answer, for the next verify
            expected_flush = trit.strategy.committed_state(0, live)
            torch.testing.assert_close(expected_flush, s_t, **TOL)
    assert flushes > 15, "the lifecycle must exercise flushes"
    quarter = steps // 4
    assert max(errors[-quarter:]) <= 10 * max(errors[:quarter]) + 1e-6, "Triton vs reference error grows"
    ckpt = trit.buffers["checkpoints"]
    assert torch.equal(ckpt[:, slots[2]], torch.zeros_like(ckpt[:, slots[2]])), "untouched slot changed"
