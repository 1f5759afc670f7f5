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
"""

from __future__ import annotations

import torch

from . import _checks
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


def _check(seed, a, b, c) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
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
    def _counter_hash_kernel(a_ptr, b_ptr, c_ptr, out_ptr, seed_mixed, mask, mix1, mix2, B, M,
                             BB: tl.constexpr, BM: tl.constexpr):
        rows = tl.program_id(0) * BB + tl.arange(0, BB)
        cols = tl.arange(0, BM)
        row_ok = rows < B
        col_ok = cols < M
        a = tl.load(a_ptr + rows, mask=row_ok, other=0) & mask
        b = tl.load(b_ptr + rows, mask=row_ok, other=0) & mask
        c = tl.load(c_ptr + cols, mask=col_ok, other=0) & mask
        h = _mix32_int64(a ^ seed_mixed, mask, mix1, mix2)
        h = _mix32_int64(b ^ h, mask, mix1, mix2)
        h = _mix32_int64(c[None, :] ^ h[:, None], mask, mix1, mix2)
        tl.store(out_ptr + rows[:, None] * M + cols[None, :], h, mask=row_ok[:, None] & col_ok[None, :])


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
