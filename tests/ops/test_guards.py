"""Memory safety of the Triton launchers (ops/guards.py): bad index values never reach a
kernel.

On the host every launcher raises ``ValueError`` for what the reference rejects, before
anything is written. Inside CUDA graph capture nothing may be read on the host; that
path (``guards.device_checks()`` runs it on the CPU) turns bad rows into padding rows,
so the buffers outside the batch's valid rows stay bit-identical, and the next host
check raises ``DeviceCheckError`` naming the error. Without a GPU the kernels run under
the Triton interpreter; the rejections need no launch at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from layer_inputs import args, rand_layer

pytest.importorskip("triton")

from replayssm.ops import (  # noqa: E402
    RawRecords,
    advance_cursors,
    causal_conv_commit,
    causal_conv_verify,
    gdn_chunked_window,
    gdn_fold,
    gdn_recurrence,
    guards,
    reset_cursors,
    snapshot_commit,
    triton_common,
)
from replayssm.state import Batch, GDNShape, StatePool  # noqa: E402
from replayssm.testing.op_count import count_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_common.INTERPRETER:
    pytest.skip("CPU run without TRITON_INTERPRET=1 at import time", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("clear_error_words")

H, HV, K, V, NS = 1, 2, 16, 8, 3
I32 = dict(dtype=torch.int32, device=DEVICE)


def idx(*values):
    return torch.tensor(values, **I32)


def layer(n):
    return rand_layer(n, H, HV, K, V, device=DEVICE)


def state():
    return torch.randn(NS, HV, V, K, device=DEVICE)


def rings(nl=1, r=4):
    return (torch.randn(nl, NS, r, H, K, device=DEVICE), torch.randn(nl, NS, r, HV, V, device=DEVICE),
            torch.randn(nl, NS, r, HV, device=DEVICE), torch.rand(nl, NS, r, HV, device=DEVICE))


# Each case: a launcher call on freshly built tensors with one bad index value, the
# message the reference gives for it, and the tensors it must leave alone.
def recurrence_case(slots, cu, n=3):
    st = state()
    return lambda: gdn_recurrence(*args(layer(n)), st, slots, cu, max_len=4, update_state=True, backend="triton"), [st]


def conv_case(slots, cu, n=3):
    c = 2 * H * K + HV * V
    cs, wb = torch.randn(NS, c, 3, device=DEVICE), torch.randn(NS, 4, c, device=DEVICE)
    return (lambda: causal_conv_verify(torch.randn(n, c, device=DEVICE), cs, torch.randn(c, 4, device=DEVICE), None,
                                       slots, cu, window_buf=wb, backend="triton"), [cs, wb])


def chunked_case(slots, cu, n=3, wp=0):
    st, ring = state(), RawRecords(*(x[0] for x in rings(r=8)))
    ring_u = torch.randn(NS, 8, HV, V, device=DEVICE)
    write_pos, base, flush = torch.full((NS,), wp, **I32), torch.zeros(NS, **I32), torch.zeros(NS, **I32)
    return (lambda: gdn_chunked_window(*args(layer(n)), st, ring, ring_u, slots, cu, write_pos, base, flush,
                                       max_len=4, backend="triton"), [st, ring_u, *ring])


def fold_case(slots):
    ck, rk = state()[None], rings()
    return lambda: gdn_fold(ck, *rk, slots, torch.zeros_like(slots), torch.ones_like(slots), backend="triton"), [ck]


def snapshot_case(slots):
    ck, sn = state()[None], torch.randn(1, NS, 2, HV, V, K, device=DEVICE)
    return lambda: snapshot_commit(ck, sn, slots, torch.ones_like(slots), backend="triton"), [ck]


def conv_commit_case(slots):
    c = 2 * H * K + HV * V
    cs, wb = torch.randn(1, NS, c, 3, device=DEVICE), torch.randn(1, NS, 2, c, device=DEVICE)
    return lambda: causal_conv_commit(cs, wb, slots, torch.ones_like(slots), backend="triton"), [cs]


def cursor_case(slots, reset=False):
    cur = [torch.zeros(NS, **I32) for _ in range(3)]
    if reset:
        return lambda: reset_cursors(*cur, slots, backend="triton"), cur
    return lambda: advance_cursors(*cur, slots, torch.ones_like(slots), 2, 8, backend="triton"), cur


BAD = {
    "recurrence: slot out of range": (lambda: recurrence_case(idx(0, NS), idx(0, 1, 3)), r"slots\[1\] = 3 is outside"),
    "recurrence: negative slot": (lambda: recurrence_case(idx(-2, 1), idx(0, 1, 3)), r"slots\[0\] = -2 is outside"),
    "recurrence: cu_seqlens past the tokens": (lambda: recurrence_case(idx(0), idx(0, 3000)), "token count 3"),
    "recurrence: window over the bound": (lambda: recurrence_case(idx(0), idx(0, 5), n=5), "5 tokens, expected 1..4"),
    "recurrence: slot twice": (lambda: recurrence_case(idx(1, 1), idx(0, 1, 3)), "unique"),
    "conv: slot out of range": (lambda: conv_case(idx(7), idx(0, 3)), r"slots\[0\] = 7"),
    "conv: cu_seqlens past the tokens": (lambda: conv_case(idx(0), idx(0, 3000)), "token count 3"),
    "conv: decreasing cu_seqlens": (lambda: conv_case(idx(0, 1), idx(0, 2, 1)), "token count|non-decreasing"),
    "chunked: slot out of range": (lambda: chunked_case(idx(0, 9), idx(0, 1, 3)), r"slots\[1\] = 9"),
    "chunked: cu_seqlens past the tokens": (lambda: chunked_case(idx(0), idx(0, 3000)), "token count 3"),
    "chunked: window past the ring": (lambda: chunked_case(idx(0), idx(0, 3), wp=6), "does not fit"),
    "chunked: negative cursor": (lambda: chunked_case(idx(0), idx(0, 3), wp=-4), "must be >= 0"),
    "fold: slot out of range": (lambda: fold_case(idx(0, NS)), r"slots\[1\] = 3"),
    "snapshot commit: slot out of range": (lambda: snapshot_case(idx(-5)), r"slots\[0\] = -5"),
    "conv commit: slot out of range": (lambda: conv_commit_case(idx(1, 40)), r"slots\[1\] = 40"),
    "advance cursors: slot out of range": (lambda: cursor_case(idx(NS)), r"slots\[0\] = 3"),
    "reset cursors: slot out of range": (lambda: cursor_case(idx(-3), reset=True), r"slots\[0\] = -3"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_index_values_raise_before_any_write(case):
    build, match = BAD[case]
    call, touched = build()
    before = [x.clone() for x in touched]
    with pytest.raises(ValueError, match=match):
        call()
    for x, x0 in zip(touched, before):
        assert torch.equal(x, x0)


def test_inside_capture_bad_rows_run_as_padding_and_the_next_check_reports():
    """The capture path: a slot past the pool, a repeated slot and a window over the
    bound become padding rows (zero outputs, no state written); the good row is exactly
    what the host path computes; then check_errors names all three errors, once."""
    x = layer(6)
    st = state()
    first = {name: t[:1] if name in ("q", "k", "v", "a", "b") else t for name, t in x.items()}
    good = gdn_recurrence(*args(first), st.clone(), idx(1), idx(0, 1), max_len=4, backend="triton")
    slots, cu = idx(1, 7, 1), idx(0, 1, 2, 6)  # row 2: the slot again, and 4 tokens with max_len 3
    work = st.clone()
    with guards.device_checks():
        o = gdn_recurrence(*args(x), work, slots, cu, max_len=3, update_state=True, backend="triton")
    assert torch.equal(o[:1], good[:1]), "the valid row differs from the host path"
    assert torch.equal(o[1:], torch.zeros_like(o[1:])), "padding rows must output zeros"
    assert torch.equal(work[0], st[0]) and torch.equal(work[2], st[2]), "an untouched slot changed"
    assert not torch.equal(work[1], st[1]), "the valid row must update its state"
    with pytest.raises(guards.DeviceCheckError, match="outside .-1, num_slots.*two rows.*kernel's bound"):
        guards.check_errors(DEVICE)
    guards.check_errors(DEVICE)  # reported once, then clear


def test_device_checks_keep_cu_seqlens_inside_the_tokens():
    """cu_seqlens = [0, 3000] for 3 tokens: the offsets are clamped, every row is padding,
    and nothing past the 3 tokens is addressed (the state is untouched)."""
    call, touched = recurrence_case(idx(0), idx(0, 3000))
    before = touched[0].clone()
    with guards.device_checks():
        call()
    assert torch.equal(touched[0], before)
    with pytest.raises(guards.DeviceCheckError, match="cu_seqlens"):
        guards.check_errors(DEVICE)


def test_device_guard_of_cursors_liveness_and_accepted():
    """The pieces of the capture path without a kernel: cursors that do not fit, a slot
    that is not live, and accepted counts outside the windows."""
    slots, cu = idx(0, 1, 2), idx(0, 2, 4, 5)
    wp, base = idx(0, 7, 0), idx(0, 0, -1)
    live_mask = torch.tensor([True, True, False], device=DEVICE)
    safe, safe_cu = guards.sanitize_window(slots, cu, num_slots=NS, num_tokens=5, max_len=4, cursors=(wp, base, 8),
                                           live_mask=live_mask)
    assert safe.tolist() == [0, -1, -1] and torch.equal(safe_cu, cu)
    with pytest.raises(guards.DeviceCheckError, match="cursors.*not allocated"):
        guards.check_errors(DEVICE)
    n = guards.clamp_accepted(idx(0, -1, 2), idx(0, 9, 5), idx(2, 2, 3))
    assert n.tolist() == [1, 9, 3]  # live rows clamped into [1, length]; padding rows as given
    with pytest.raises(guards.DeviceCheckError, match="accepted"):
        guards.check_errors(DEVICE)


@pytest.mark.parametrize("batch", [1, 5, 1500])
def test_accepted_clamped_in_one_launch_as_by_tensor_ops(batch):
    """The Triton ``clamp_accepted`` (one launch) against the tensor ops: the same int32
    counts and the same error bit, for in-range counts (no bit), and with counts below 1
    and past the window on live and padding rows (the bit; padding rows as given), the
    counts a strided column of int64 (the step's output buffer), over one program and
    over two (1500 rows)."""
    rng = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, 9, (batch,), generator=rng, dtype=torch.int32).to(DEVICE)
    slots = torch.randint(0, NS, (batch,), generator=rng).to(DEVICE)
    slots[::3] = -1
    good = (torch.rand(batch, generator=rng).to(DEVICE) * lengths).long() + 1
    bad = good.clone()
    bad[-1], bad[0] = -2, 99  # live or padding, one of each at most
    for counts, flagged in ((good, False), (bad, True)):
        column = torch.stack([counts, counts], 1)[:, 1]
        assert column.stride(0) == 2
        results = []
        for backend in ("torch", "triton"):
            guards.clear_errors(DEVICE)
            n = guards.clamp_accepted(slots, column, lengths, backend=backend)
            bits = int(guards.error_word(DEVICE).item())
            results.append((n, bits))
        (want, want_bits), (got, got_bits) = results
        assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want)
        assert got_bits == want_bits == (guards.ACCEPTED if flagged and (slots[[0, -1]] >= 0).any() else 0)
    with count_ops() as ops:  # a kernel for the whole guard (13 tensor ops, each a kernel on a GPU)
        guards.clamp_accepted(slots, column, lengths, backend="triton")
    # On CUDA, eagerly, the error word's host mirror is refreshed after it (a copy to
    # pinned memory, not a kernel; a captured step has none).
    mirror = {"aten.copy_": 1} if DEVICE.type == "cuda" else {}
    assert dict(ops.counts) == {"triton._clamp_accepted_kernel": 1, **mirror}, ops.counts
    guards.clear_errors(DEVICE)


def test_values_are_read_once_per_step(monkeypatch):
    """A caller's index tensors are read once and remembered by version; a batch's are
    never read (its host copy is recorded); an in-place change is read again."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    slots, cu = idx(0, 2), idx(0, 1, 3)
    for _ in range(3):  # three layers of one step
        guards.check_indices(slots, cu, num_slots=NS, num_tokens=3, max_len=4)
    assert len(reads) == 2
    slots[1] = 5
    with pytest.raises(ValueError, match="outside"):
        guards.check_indices(slots, cu, num_slots=NS, num_tokens=3, max_len=4)
    assert len(reads) == 3
    reads.clear()
    b = Batch.build([0, -1, 2], [2, 1, 1], DEVICE)
    guards.check_indices(b.slots, b.cu_seqlens, num_slots=NS, num_tokens=4, max_len=4)
    b.set_slots([1, 0, -1])
    guards.check_indices(b.slots, b.cu_seqlens, num_slots=NS, num_tokens=4, max_len=4)
    assert reads == []
    with pytest.raises(ValueError, match="outside"):
        guards.check_indices(b.slots, b.cu_seqlens, num_slots=1, num_tokens=4, max_len=4)
    # a static prompt batch's windows: rewritten in place, recorded, never read back
    b.set_windows([2, 1, -1], [1, 1, 2])
    assert b.cu_seqlens.tolist() == [0, 1, 2, 4] and b.lengths == (1, 1, 2) and b.max_len == 2
    reads.clear()
    guards.check_indices(b.slots, b.cu_seqlens, num_slots=NS, num_tokens=4, max_len=4)
    assert reads == []
    for bad in ([1, 1, 1], [3, 1, 0], [1, 1]):  # the token count, the bound, one per row
        with pytest.raises(ValueError, match="lengths"):
            b.set_windows([2, 1, -1], bad)
    assert b.cu_seqlens.tolist() == [0, 1, 2, 4]
    # announced on the host only, then loaded from the owner's device buffer (a graph's):
    # nothing reaches the device before the load, and the guards read nothing back after it
    src = torch.tensor([0, 2, -1, 0, 2, 3, 4], device=DEVICE)
    b.set_windows([0, 2, -1], [2, 1, 1], upload=False)
    assert b.slots.tolist() == [2, 1, -1] and b.host_slots == (0, 2, -1) and b.lengths == (2, 1, 1)
    b.load_windows(src[:3], src[3:])
    assert b.slots.tolist() == [0, 2, -1] and b.cu_seqlens.tolist() == [0, 2, 3, 4]
    reads.clear()
    guards.check_indices(b.slots, b.cu_seqlens, num_slots=NS, num_tokens=4, max_len=4)
    assert reads == []
    with pytest.raises(ValueError, match="slots"):
        b.set_windows([0, 2], [2, 1, 1], upload=False)


def test_pool_refuses_a_window_the_triton_kernels_cannot_take():
    shape = GDNShape(1, 1, 8, 8)
    with pytest.raises(ValueError, match="at most 16 for circular on the triton backend"):
        StatePool(shape, 1, 2, strategy="circular", window=17, ring_len=64, backend="triton", device=DEVICE)
    StatePool(shape, 1, 2, strategy="circular", window=17, ring_len=64, backend="reference", device=DEVICE)
    StatePool(shape, 1, 2, strategy="fold", window=32, backend="triton", device=DEVICE)


def test_slots_of_any_integer_type():
    shape = GDNShape(1, 1, 8, 8)
    pool = StatePool(shape, 1, 4, strategy="fold", window=2, device=DEVICE)
    a = pool.alloc(np.int64(2))
    b = pool.alloc(torch.tensor(0, dtype=torch.int16))
    assert (a, b) == (2, 0) and type(a) is int
    for make in (lambda: [np.int32(2), -1, np.int64(0)], lambda: np.array([2, -1, 0]),
                 lambda: torch.tensor([2, -1, 0], dtype=torch.int64), lambda: torch.tensor([2, -1, 0], **I32)):
        batch = pool.batch(make(), np.int64(2))
        assert batch.host_slots == (2, -1, 0) and batch.lengths == (2, 2, 2)
    with pytest.raises(TypeError, match="slots\\[0\\] must be an integer"):
        pool.batch([2.0], 1)
    with pytest.raises(TypeError, match="slots must hold integers"):
        pool.batch(np.array([2.0]), 1)
    with pytest.raises(TypeError, match="slot must be an integer, got a bool"):
        pool.free(np.bool_(True))
    pool.free(np.int64(2))
    assert pool.live_slots == [0]


def test_an_error_word_first_made_under_inference_mode_clears_outside_it(monkeypatch):
    """An engine built inside ``torch.inference_mode()`` makes the device's error word
    there; clearing it afterwards, outside inference mode, must still work."""
    monkeypatch.setattr(guards, "_WORDS", {})
    with torch.inference_mode():
        word = guards.error_word("cpu")
        word.fill_(3)
    assert not word.is_inference()
    guards.clear_errors()
    assert int(word.item()) == 0


def test_host_index_helpers_convert_once_and_refuse_before_writing():
    """``copy_to_device`` takes any integer iterable (a numpy array, a generator), writes
    and records the values and returns them as ints; a wrong count, a value that is no
    integer or one outside the tensor's dtype raises with the tensor unchanged. A
    numpy array given is copied, not aliased."""
    dst = torch.tensor([4, 5, 6], dtype=torch.int32, device=DEVICE)
    host = guards.copy_to_device(dst, np.array([2, -1, 0], dtype=np.int32))
    assert host == (2, -1, 0) and all(type(v) is int for v in host)
    assert dst.tolist() == [2, -1, 0] and guards._lookup(dst, trusted=True).values == host
    assert guards.copy_to_device(dst, (v + 1 for v in range(3))) == (1, 2, 3)
    for bad, err in (([1, 2], ValueError), ([1, None, 2], TypeError), ([1, 2**40, 2], ValueError)):
        with pytest.raises(err):
            guards.copy_to_device(dst, bad)
        assert dst.tolist() == [1, 2, 3]
    src = np.array([7, 8], dtype=np.int64)
    x = guards.to_device(src, DEVICE)
    src[0] = 0
    assert x.tolist() == [7, 8] and x.dtype == torch.int64
    with torch.inference_mode():  # an inference tensor keeps no version counter: recorded all the same
        y = guards.host_index([0, 3], DEVICE)
        assert guards._lookup(y, trusted=True).values == (0, 3)
