"""Raw per-token records, the packed-batch descriptor checks, and ring indexing.

A raw record is what the closed-loop fold needs to replay one token through the exact
recurrence: the key per key head, the value in the activation dtype (stored as given, so
the copy is lossless), and the float32 gates ``g`` and ``beta``. The key is stored
normalised where the ring's keys are float32 (the pools' rings), raw otherwise
(:func:`keys_normalized`): either way a replay steps with the bits the exact
recurrence stepped with.

Ring buffers are per layer ``[num_slots, R, ...]``: record ``i`` of a request whose ring
starts at physical position ``base`` lives at ``(base + i) % R``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _checks
from .gates import l2_normalize


def keys_normalized(ring_k_dtype: torch.dtype) -> bool:
    """Whether a ring whose keys are ``ring_k_dtype`` holds them normalised.

    A float32 ring (a pool's) holds each key as ``k^ = k / sqrt(sum(k*k) + eps)``,
    computed once by the kernel that writes the record with the exact kernels' own
    normalisation, so a replay reads the key it steps with (the bits it computed before
    from the raw key) and the coefficient kernels read unit keys. A 16-bit ring (an
    engine's own buffers in SGLang's layout, whose fold normalises what it reads) or a
    float64 one (the reference's exact pools) holds the raw key as given; every reader
    normalises it."""
    return ring_k_dtype == torch.float32


def stored_keys(k: torch.Tensor, ring_k_dtype: torch.dtype) -> torch.Tensor:
    """What a ring of ``ring_k_dtype`` keys stores for raw keys ``k [..., K]``
    (:func:`keys_normalized`): ``k^`` computed in the ring's dtype, or ``k``."""
    return l2_normalize(k, dtype=ring_k_dtype) if keys_normalized(ring_k_dtype) else k


def unit_keys(ring_k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The normalised keys ``k^ [..., K]`` in ``dtype`` of ring entries ``ring_k``
    (:func:`keys_normalized`)."""
    return ring_k.to(dtype) if keys_normalized(ring_k.dtype) else l2_normalize(ring_k, dtype=dtype)


class RawRecords(NamedTuple):
    """Ring buffers of raw records for one layer.

    Attributes:
        k: ``[num_slots, R, H, K]`` keys: normalised in float32, raw in a 16-bit dtype
            or float64 (:func:`keys_normalized`).
        v: ``[num_slots, R, HV, V]`` values, activation dtype.
        g: ``[num_slots, R, HV]`` float32 log decays.
        beta: ``[num_slots, R, HV]`` float32 write strengths.
    """

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @property
    def ring_len(self) -> int:
        return self.k.shape[1]

    def check(self, name: str, num_slots: int, num_heads: int, head_k: int, num_value_heads: int, head_v: int):
        """Validate the four buffers against the layer's shape (metadata only)."""
        r = self.k.shape[1] if isinstance(self.k, torch.Tensor) and self.k.dim() == 4 else None
        _checks.tensor(f"{name}.k", self.k, ndim=4, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape(f"{name}.k", self.k, [num_slots, r, num_heads, head_k])
        _checks.tensor(f"{name}.v", self.v, ndim=4, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape(f"{name}.v", self.v, [num_slots, r, num_value_heads, head_v])
        for field in ("g", "beta"):
            x = getattr(self, field)
            _checks.tensor(f"{name}.{field}", x, ndim=3, dtypes=(torch.float32, torch.float64))
            _checks.shape(f"{name}.{field}", x, [num_slots, r, num_value_heads])
        _checks.same_device(self.k, **{f"{name}.{f}": getattr(self, f) for f in ("v", "g", "beta")})

    def write(self, slot: int, pos: int, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
        """Store one token's record at physical ring position ``pos`` of ``slot`` (``k``
        raw: normalised here where the ring holds normalised keys)."""
        self.k[slot, pos] = stored_keys(k, self.k.dtype)
        self.v[slot, pos] = v
        self.g[slot, pos] = g
        self.beta[slot, pos] = beta


def check_varlen(
    cu_seqlens: torch.Tensor, slots: torch.Tensor, num_tokens: int, num_slots: int, max_len: int | None = None
) -> tuple[list[int], list[int]]:
    """Validate a packed batch and return ``(cu_seqlens, slots)`` as Python lists.

    Args:
        cu_seqlens: ``[B + 1]`` int32/int64, ``cu_seqlens[0] == 0``, non-decreasing,
            ``cu_seqlens[-1] == num_tokens``.
        slots: ``[B]`` int32/int64 slot of each request in the pool, ``-1`` for padding.
        num_tokens: ``N``, the packed token count.
        num_slots: the pool size; valid slots are ``0 <= slot < num_slots``.
        max_len: if given, every window must have ``1 <= length <= max_len``.

    This reads the tensors' values, so it synchronises with the device; the reference ops
    loop on the host anyway. Fast paths validate values once when a batch is built.
    """
    _checks.tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if cu_seqlens.numel() != slots.numel() + 1:
        raise ValueError(
            f"cu_seqlens must have len(slots) + 1 = {slots.numel() + 1} entries, got {cu_seqlens.numel()}"
        )
    cu = cu_seqlens.tolist()
    sl = slots.tolist()
    error = varlen_error(cu, sl, num_tokens, num_slots, max_len)
    if error:
        raise ValueError(error)
    return cu, sl


def varlen_error(
    cu: list[int], sl: list[int], num_tokens: int, num_slots: int, max_len: int | None = None
) -> str | None:
    """What is wrong with a packed batch given as host lists (``None``: nothing).

    The one statement of the index contract, shared by the reference ops
    (:func:`check_varlen`) and the Triton launchers' guards
    (:mod:`replayssm.ops.guards`): ``cu`` starts at 0, never decreases and ends at
    ``num_tokens``; with ``max_len`` every window has ``1..max_len`` tokens; slots lie in
    ``[-1, num_slots)`` and live ones are unique.
    """
    if len(cu) != len(sl) + 1:
        return f"cu_seqlens must have len(slots) + 1 = {len(sl) + 1} entries, got {len(cu)}"
    if cu[0] != 0 or cu[-1] != num_tokens:
        return f"cu_seqlens must start at 0 and end at the token count {num_tokens}, got {cu}"
    for i in range(len(sl)):
        n = cu[i + 1] - cu[i]
        if n < 0:
            return f"cu_seqlens must be non-decreasing, got {cu}"
        if max_len is not None and not 1 <= n <= max_len:
            return f"window {i} has {n} tokens, expected 1..{max_len}"
    return slots_error(sl, num_slots, unique=True)


def slots_error(sl: list[int], num_slots: int, *, unique: bool) -> str | None:
    """What is wrong with slot values given as a host list (``None``: nothing): each in
    ``[-1, num_slots)``, and with ``unique`` no live slot twice."""
    for i, s in enumerate(sl):
        if not -1 <= s < num_slots:
            return f"slots[{i}] = {s} is outside [-1, {num_slots})"
    if unique:
        live = [s for s in sl if s >= 0]
        if len(set(live)) != len(live):
            return f"slots must be unique (apart from -1 padding), got {sl}"
    return None
