"""States written into one layer's checkpoints by device slots, in one launch:

    checkpoints[slots[i]] = states[i]      for every row with slots[i] >= 0

The chunked prompt kernel returns each request's final state; a graphed prompt pass
holds its requests' slots on the device only (``-1`` at capture, so the capture writes
nothing). Through torch's indexing that store is a clamp, a gather, a ``where``, a cast
and an index put; here it is one copy, cast with rounding to nearest even.
"""

from __future__ import annotations

import torch

from . import _checks, guards
from .dispatch import pick, register

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def check_write_args(checkpoints, slots, states):
    """Validate :func:`write_checkpoints`' arguments (metadata only)."""
    _checks.tensor("checkpoints", checkpoints, ndim=4, dtypes=STATE_DTYPES)
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("states", states, ndim=4, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("states", states, [slots.shape[0], *checkpoints.shape[1:]])
    _checks.same_device(checkpoints, slots=slots, states=states)


@register("write_checkpoints", "reference")
def write_checkpoints_reference(checkpoints: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """``checkpoints[slots[i]] = states[i]`` (cast to the checkpoints' dtype) for every
    row with ``slots[i] >= 0``, in place.

    Args:
        checkpoints: ``[num_slots, HV, V, K]``, one layer's.
        slots: ``[B]`` slot per row, ``-1`` rows skipped; live slots unique, in range.
        states: ``[B, HV, V, K]`` any float dtype.
    """
    check_write_args(checkpoints, slots, states)
    live = slots >= 0
    checkpoints[slots[live].long()] = states[live].to(checkpoints.dtype)


def write_checkpoints(checkpoints: torch.Tensor, slots: torch.Tensor, states: torch.Tensor, *,
                      backend: str = "auto") -> None:
    """Write ``states`` into the checkpoints of ``slots``. Arguments:
    :func:`write_checkpoints_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("write_checkpoints", backend, checkpoints)(checkpoints, slots, states)


# ---------------------------------------------------------------------------- Triton
try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None

COPY_BLOCK = 2048

if triton is not None:
    from .triton_common import to_rtne as _tl_to_rtne

    @triton.jit
    def _write_checkpoints_kernel(ck_ptr, slots_ptr, st_ptr, ck_slot, st_row, NUMEL: tl.constexpr,
                                  BLOCK: tl.constexpr):
        i_x = tl.program_id(0)
        i_b = tl.program_id(1).to(tl.int64)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        if slot < 0:
            return
        offs = i_x * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        x = tl.load(st_ptr + i_b * st_row + offs, mask=mask)
        tl.store(ck_ptr + slot * ck_slot + offs, _tl_to_rtne(x.to(tl.float32), ck_ptr.dtype.element_ty), mask=mask)


@register("write_checkpoints", "triton")
def write_checkpoints_triton(checkpoints: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Triton version of :func:`write_checkpoints_reference` (same arguments), one launch
    of ``(cdiv(HV V K, 2048), B)`` programs, nothing read on the host.

    Differences: float32/bfloat16 on both sides; each slot's checkpoint and each row's
    state packed (any slot and row strides); ``slots`` contiguous, checked by
    :mod:`~replayssm.ops.guards` (on the host once per value, on the device inside a
    CUDA graph, where a bad slot becomes a skipped row).
    """
    check_write_args(checkpoints, slots, states)
    for name, x in (("checkpoints", checkpoints), ("states", states)):
        _checks.tensor(name, x, dtypes=(torch.float32, torch.bfloat16))
        _checks.packed(name, x, 3)
    _checks.contiguous(slots=slots)
    slots = guards.check_slots(slots, num_slots=checkpoints.shape[0])
    numel = checkpoints[0].numel() if checkpoints.shape[0] else 0
    if slots.shape[0] == 0 or numel == 0:
        return
    block = min(COPY_BLOCK, triton.next_power_of_2(numel))
    _write_checkpoints_kernel[(triton.cdiv(numel, block), slots.shape[0])](
        checkpoints, slots, states, checkpoints.stride(0), states.stride(0), NUMEL=numel, BLOCK=block, num_warps=4,
    )
