"""A counter-based random number: 32 uniform bits from ``(seed, a, b, c)``.

    mix(x)  = lowbias32: x ^= x >> 16;  x *= 0x7FEB352D;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16
              (arithmetic mod 2**32, C. Wellons' constants)
    h       = mix(mix(mix(mix(seed) ^ a) ^ b) ^ c)        every input taken mod 2**32

A pure function of its inputs, with no generator state: the same bits on every device,
in eager steps and in CUDA graph replays, and whatever the batch layout. The benchmark
drafters draw with it (``ForcedDrafter``: a request's accepted drafts and its next
drafts from ``(seed, request, step, draft)``).

The reference is elementwise PyTorch (about 20 integer kernels a mix, 80 a call); the
Triton kernel is one launch, which in a captured decode step is the difference between
a benchmark drafter that costs ~0.1 ms a step and one that costs a few microseconds.

The forced drafter's two draws per step, each one launch on the GPU (``slots [B]`` its
rows, ``request`` and ``step [S]`` per-slot counters read through them, so the gathers,
the thresholds and the prefix count are not kernels of their own: 10 and 4 launches
when written as tensor ops):

    hash_accept_counts  n[i] = the leading draws j < k with u(h(seed, request[s], step[s], j)) < P
                        u(h) = (h >> 8) 2^-24, 24 uniform bits as a float32 in [0, 1), exactly
    hash_tokens         t[i, j] = h(seed, request[s], step[s], first + j) mod vocab

where ``s = slots[i]``; a row whose slot is ``-1`` (padding) gets zeros.
"""

from __future__ import annotations

import torch

from . import _checks, guards
from .dispatch import pick, register

MASK32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B


def _mul32(x, c: int):
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)``, with no intermediate at or
    above ``2**63`` (signed overflow): the constant is split into 16-bit halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x):
    """lowbias32 on int64 tensors, or Python ints, holding values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX2)
    return x ^ (x >> 16)


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")


def _check(seed, a, b, c) -> None:
    _check_seed(seed)
    for name, x in (("a", a), ("b", b)):
        _checks.tensor(name, x, ndim=1, dtypes=(torch.int64,))
    _checks.shape("b", b, [a.shape[0]])
    _checks.tensor("c", c, ndim=1, dtypes=(torch.int64,))
    _checks.same_device(a, b=b, c=c)


@register("counter_hash", "reference")
def counter_hash_reference(seed: int, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``h(seed, a[i], b[i], c[j])`` for every ``(i, j)`` (see the module notes).

    Args:
        seed: any int (taken mod ``2**32``).
        a, b: ``[B]`` int64 per-row counters (say, a request and its step).
        c: ``[M]`` int64 per-column counters (say, a draft's index).

    Returns:
        ``[B, M]`` int64 in ``[0, 2**32)``.
    """
    _check(seed, a, b, c)
    h = mix32(seed & MASK32)  # a Python int: the same operators serve ints and tensors
    h = mix32((a[:, None] & MASK32) ^ h)
    h = mix32((b[:, None] & MASK32) ^ h)
    return mix32((c[None, :] & MASK32) ^ h)


def _check_slot_draws(seed, request, step, slots, count: int, name: str) -> None:
    _check_seed(seed)
    _checks.tensor("request", request, ndim=1, dtypes=(torch.int64,))
    _checks.tensor("step", step, ndim=1, dtypes=(torch.int64,))
    _checks.shape("step", step, [request.shape[0]])
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.same_device(request, step=step, slots=slots)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 1024:
        raise ValueError(f"{name} must be an int in [0, 1024], got {count!r}")


def _slot_counters(request, step, slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(live [B], request[s], step[s])``, rows whose slot is not one (``-1``, or out of
    range inside a capture) reading slot 0."""
    live = (slots >= 0) & (slots < request.shape[0])
    s = torch.where(live, slots.long(), 0)
    return live, request[s], step[s]


@register("hash_accept_counts", "reference")
def hash_accept_counts_reference(seed: int, request: torch.Tensor, step: torch.Tensor, slots: torch.Tensor,
                                 num_draft: int, p: torch.Tensor) -> torch.Tensor:
    """Accepted drafts of each row (module notes): the leading draws ``j < num_draft``
    below ``P``.

    Args:
        seed: any int (taken mod ``2**32``).
        request, step: ``[S]`` int64 per-slot counters.
        slots: ``[B]`` int32/int64 slot per row in ``[-1, S)``; ``-1`` rows get 0.
        num_draft: ``k``, the draws per row, ``0 <= k <= 1024``.
        p: ``P``, a 0-d float32 tensor on the counters' device (read there, so a
            captured step follows a change of it).

    Returns:
        ``[B]`` int64 in ``[0, k]``.
    """
    _check_slot_draws(seed, request, step, slots, num_draft, "num_draft")
    _check_p(p, request)
    _check_slot_values(slots, request.shape[0])
    live, a, b = _slot_counters(request, step, slots)
    c = torch.arange(num_draft, dtype=torch.int64, device=request.device)
    u = (counter_hash_reference(seed, a, b, c) >> 8).to(torch.float32) * 2.0**-24
    n = (u < p).long().cumprod(1).sum(1)
    return torch.where(live, n, 0)


@register("hash_tokens", "reference")
def hash_tokens_reference(seed: int, request: torch.Tensor, step: torch.Tensor, slots: torch.Tensor, first: int,
                          num: int, vocab: int) -> torch.Tensor:
    """Tokens of each row (module notes): ``h(seed, request[s], step[s], first + j) mod
    vocab`` for ``j < num``.

    Args:
        seed, request, step, slots: as :func:`hash_accept_counts_reference`.
        first: the first draw's counter, ``0 <= first < 2**31``.
        num: tokens per row, ``0 <= num <= 1024``.
        vocab: a positive int below ``2**31``.

    Returns:
        ``[B, num]`` int64 in ``[0, vocab)``.
    """
    _check_slot_draws(seed, request, step, slots, num, "num")
    _check_tokens_args(first, vocab)
    _check_slot_values(slots, request.shape[0])
    live, a, b = _slot_counters(request, step, slots)
    c = first + torch.arange(num, dtype=torch.int64, device=request.device)
    return torch.where(live[:, None], counter_hash_reference(seed, a, b, c) % vocab, 0)


def _check_p(p, like) -> None:
    _checks.tensor("p", p, ndim=0, dtypes=(torch.float32,))
    _checks.same_device(like, p=p)


def _check_tokens_args(first, vocab) -> None:
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < 2**31:
        raise ValueError(f"first must be an int in [0, 2**31), got {first!r}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab < 2**31:
        raise ValueError(f"vocab must be an int in [1, 2**31), got {vocab!r}")


def _check_slot_values(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The slot values checked on the host (:func:`~replayssm.ops.guards.check_slots`,
    read once per tensor version), before any kernel addresses the counters with them.
    Inside a CUDA graph capture nothing is read: the kernel gives a row whose slot is
    outside ``[0, num_slots)`` zeros and reads nothing for it (a device-side guard
    would add launches to every captured step, which this op exists to save)."""
    if guards.on_device(slots):
        return slots
    return guards.check_slots(slots, num_slots=num_slots)


def hash_accept_counts(seed: int, request: torch.Tensor, step: torch.Tensor, slots: torch.Tensor, num_draft: int,
                       p: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """:func:`hash_accept_counts_reference`'s counts (same arguments and result), one
    launch on CUDA (``backend``: ``"auto"``, ``"reference"`` or ``"triton"``; no silent
    fallback)."""
    return pick("hash_accept_counts", backend, request)(seed, request, step, slots, num_draft, p)


def hash_tokens(seed: int, request: torch.Tensor, step: torch.Tensor, slots: torch.Tensor, first: int, num: int,
                vocab: int, *, backend: str = "auto") -> torch.Tensor:
    """:func:`hash_tokens_reference`'s tokens (same arguments and result), one launch on
    CUDA (``backend`` as :func:`hash_accept_counts`)."""
    return pick("hash_tokens", backend, request)(seed, request, step, slots, first, num, vocab)


def counter_hash(seed: int, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """:func:`counter_hash_reference`'s bits (same arguments and result), from the Triton
    kernel on CUDA tensors (one launch) and the reference elsewhere (``backend``:
    ``"auto"``, ``"reference"`` or ``"triton"``; no silent fallback)."""
    return pick("counter_hash", backend, a)(seed, a, b, c)


try:
    import triton
    import triton.language as tl
except ImportError:  # the reference above works without Triton
    triton = None

if triton is not None:

    @triton.jit
    def _mix32_int64(x, mask, mix1, mix2):
        # int64 lanes holding [0, 2**32): a product's low 32 bits are exact even where the
        # 64-bit product wraps, so masking after each multiply is arithmetic mod 2**32.
        # The constants come in as int64 arguments, not literals: a literal past 2**31 is
        # typed uint32 by Triton, and its promotion rules are not ours to lean on.
        x = x ^ (x >> 16)
        x = (x * mix1) & mask
        x = x ^ (x >> 15)
        x = (x * mix2) & mask
        return x ^ (x >> 16)

    @triton.jit
    def _hash_rows_cols(a, b, c, seed_mixed, mask, mix1, mix2):
        """``[R, M]`` hashes of rows' ``(a, b) [R]`` and columns' ``c [M]``, each masked
        to 32 bits: the module's chain after the seed's own mix."""
        h = _mix32_int64(a ^ seed_mixed, mask, mix1, mix2)
        h = _mix32_int64(b ^ h, mask, mix1, mix2)
        return _mix32_int64(c[None, :] ^ h[:, None], mask, mix1, mix2)

    @triton.jit
    def _counter_hash_kernel(a_ptr, b_ptr, c_ptr, out_ptr, seed_mixed, mask, mix1, mix2, B, M,
                             BB: tl.constexpr, BM: tl.constexpr):
        rows = tl.program_id(0) * BB + tl.arange(0, BB)
        cols = tl.arange(0, BM)
        row_ok = rows < B
        col_ok = cols < M
        a = tl.load(a_ptr + rows, mask=row_ok, other=0) & mask
        b = tl.load(b_ptr + rows, mask=row_ok, other=0) & mask
        c = tl.load(c_ptr + cols, mask=col_ok, other=0) & mask
        h = _hash_rows_cols(a, b, c, seed_mixed, mask, mix1, mix2)
        tl.store(out_ptr + rows[:, None] * M + cols[None, :], h, mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _slot_draws_kernel(request_ptr, step_ptr, slots_ptr, p_ptr, out_ptr, seed_mixed, mask, mix1, mix2, B, S, M,
                           first, vocab, BB: tl.constexpr, BM: tl.constexpr, COUNT: tl.constexpr):
        """Rows ``BB`` at a time: the row's counters through its slot, then its ``M``
        draws; ``COUNT``: the length of their leading run below ``P`` (one int a row),
        else each draw mod ``vocab``. A slot outside ``[0, S)`` gives zeros."""
        rows = tl.program_id(0) * BB + tl.arange(0, BB)
        row_ok = rows < B
        slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        live = row_ok & (slot >= 0) & (slot < S)
        a = tl.load(request_ptr + slot, mask=live, other=0) & mask
        b = tl.load(step_ptr + slot, mask=live, other=0) & mask
        cols = tl.arange(0, BM)
        col_ok = cols < M
        c = (cols.to(tl.int64) + first) & mask
        h = _hash_rows_cols(a, b, c, seed_mixed, mask, mix1, mix2)
        if COUNT:
            # (h >> 8) has 24 bits: exact in float32, as is the power-of-two scale
            u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08
            stop = (u >= tl.load(p_ptr)) & col_ok[None, :]
            # the first draw at or above P (M where none is): the leading run's length
            n = tl.min(tl.where(stop, cols[None, :], M), axis=1).to(tl.int64)
            tl.store(out_ptr + rows, tl.where(live, n, 0), mask=row_ok)
        else:
            t = tl.where(live[:, None], h % vocab, 0)
            tl.store(out_ptr + rows[:, None] * M + cols[None, :], t, mask=row_ok[:, None] & col_ok[None, :])


def _launch_slot_draws(seed, request, step, slots, p, out, num, first, vocab, count: bool):
    _checks.contiguous(request=request, step=step, slots=slots)
    rows = slots.shape[0]
    if rows == 0 or num == 0:
        return out.zero_()
    bm = triton.next_power_of_2(num)
    bb = max(1, min(128, 2048 // bm))
    _slot_draws_kernel[(triton.cdiv(rows, bb),)](request, step, slots, p, out, mix32(seed & MASK32), MASK32, _MIX1,
                                                 _MIX2, rows, request.shape[0], num, first, vocab, BB=bb, BM=bm,
                                                 COUNT=count)
    return out


@register("hash_accept_counts", "triton")
def hash_accept_counts_triton(seed, request, step, slots, num_draft, p):
    """Triton version of :func:`hash_accept_counts_reference` (same arguments and
    result), one launch; the counters and slots contiguous."""
    _check_slot_draws(seed, request, step, slots, num_draft, "num_draft")
    _check_p(p, request)
    slots = _check_slot_values(slots, request.shape[0])
    out = torch.empty(slots.shape[0], dtype=torch.int64, device=request.device)
    return _launch_slot_draws(seed, request, step, slots, p, out, num_draft, 0, 1, True)


@register("hash_tokens", "triton")
def hash_tokens_triton(seed, request, step, slots, first, num, vocab):
    """Triton version of :func:`hash_tokens_reference` (same arguments and result), one
    launch; the counters and slots contiguous."""
    _check_slot_draws(seed, request, step, slots, num, "num")
    _check_tokens_args(first, vocab)
    slots = _check_slot_values(slots, request.shape[0])
    out = torch.empty(slots.shape[0], num, dtype=torch.int64, device=request.device)
    return _launch_slot_draws(seed, request, step, slots, request, out, num, first, vocab, False)


@register("counter_hash", "triton")
def counter_hash_triton(seed: int, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`counter_hash_reference` (same arguments and bits), one
    launch; ``a``, ``b``, ``c`` contiguous, ``c`` at most 1024 long."""
    _check(seed, a, b, c)
    _checks.contiguous(a=a, b=b, c=c)
    rows, cols = a.shape[0], c.shape[0]
    if cols > 1024:
        raise ValueError(f"c must have at most 1024 entries for the Triton kernel, got {cols}")
    out = torch.empty(rows, cols, dtype=torch.int64, device=a.device)
    if rows == 0 or cols == 0:
        return out
    bm = triton.next_power_of_2(cols)
    bb = max(1, min(128, 2048 // bm))
    # The seed's own mix runs once, here, on a Python int (as the reference does).
    _counter_hash_kernel[(triton.cdiv(rows, bb),)](a, b, c, out, mix32(seed & MASK32), MASK32, _MIX1, _MIX2, rows, cols,
                                                   BB=bb, BM=bm)
    return out
