"""Snapshot commit: copy the accepted position's state into the checkpoint.

The ``snapshot`` strategy's verify writes the state after every window position to a
scratch buffer; its commit, for all layers at once, is

    checkpoints[l, s] = snapshots[l, s, n - 1]      n = accepted tokens of slot s
"""

from __future__ import annotations

import torch

from . import _checks, guards
from .dispatch import pick, register


def check_snapshot_args(checkpoints, snapshots, slots, accepted):
    _checks.tensor("checkpoints", checkpoints, ndim=5, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    nl, ns, hv, vd, kd = checkpoints.shape
    _checks.tensor("snapshots", snapshots, ndim=6, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    _checks.shape("snapshots", snapshots, [nl, ns, None, hv, vd, kd])
    if snapshots.dtype != checkpoints.dtype:
        raise TypeError(f"snapshots ({snapshots.dtype}) and checkpoints ({checkpoints.dtype}) must share a dtype")
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("accepted", accepted, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.shape("accepted", accepted, [slots.shape[0]])
    _checks.same_device(checkpoints, snapshots=snapshots, slots=slots, accepted=accepted)


@register("snapshot_commit", "reference")
def snapshot_commit_reference(
    checkpoints: torch.Tensor, snapshots: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor
) -> None:
    """``checkpoints[:, s] = snapshots[:, s, n - 1]`` for every live row, in place.

    Args:
        checkpoints: ``[layers, num_slots, HV, V, K]``.
        snapshots: ``[layers, num_slots, T, HV, V, K]`` written by verify.
        slots: ``[B]``, ``-1`` rows ignored.
        accepted: ``[B]``, ``1 <= n <= T`` for live rows (validated by the caller).
    """
    check_snapshot_args(checkpoints, snapshots, slots, accepted)
    live = slots >= 0
    s = slots[live].long()
    n = accepted[live].long()
    checkpoints[:, s] = snapshots[:, s, n - 1]


def snapshot_commit(
    checkpoints: torch.Tensor, snapshots: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor,
    *, backend: str = "auto",
) -> None:
    """``snapshot``'s commit: copy each slot's snapshot after its ``accepted`` tokens into
    its checkpoint. Arguments: :func:`snapshot_commit_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("snapshot_commit", backend, checkpoints)(checkpoints, snapshots, slots, accepted)


# ---------------------------------------------------------------------------- Triton
# A plain copy, all layers in one launch: one program per (block of a state, row, layer).
# Reads and writes each committed state element once.

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None

COPY_BLOCK = 2048

if triton is not None:
    from .triton_common import chain_launch, chain_wait

    @triton.jit
    def _snapshot_commit_kernel(
        ckpt_ptr, snap_ptr, slots_ptr, acc_ptr, sc_layer, sc_slot, ss_layer, ss_slot,
        NUMEL: tl.constexpr, TS: tl.constexpr, BLOCK: tl.constexpr, CHAINED: tl.constexpr = False,
    ):
        chain_wait(CHAINED)  # its every input may be the kernel before's
        i_x = tl.program_id(0)
        i_b = tl.program_id(1)
        i_l = tl.program_id(2).to(tl.int64)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        if slot < 0:
            return
        # 1 <= n <= T is the caller's contract; clamp so a bad value cannot address
        # outside this slot's snapshots.
        n = tl.minimum(tl.maximum(tl.load(acc_ptr + i_b).to(tl.int64), 1), TS)
        offs = i_x * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        # Any layer and slot strides; a state (and a slot's T states) packed.
        x = tl.load(snap_ptr + i_l * ss_layer + slot * ss_slot + (n - 1) * NUMEL + offs, mask=mask)
        tl.store(ckpt_ptr + i_l * sc_layer + slot * sc_slot + offs, x, mask=mask)


@register("snapshot_commit", "triton")
def snapshot_commit_triton(
    checkpoints: torch.Tensor, snapshots: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor
) -> None:
    """Triton version of :func:`snapshot_commit_reference` (same arguments), one launch.

    Differences: float32/bfloat16. Layouts: any layer and slot strides, each state
    (checkpoints) and each slot's ``T`` states (snapshots) packed; index tensors
    contiguous. ``slots`` is checked by :mod:`~replayssm.ops.guards` (once per step on
    the host; on the device inside a CUDA graph); ``accepted`` is not read on the host
    and is clamped to ``[1, T]``.
    """
    check_snapshot_args(checkpoints, snapshots, slots, accepted)
    _checks.tensor("checkpoints", checkpoints, dtypes=(torch.float32, torch.bfloat16))
    _checks.packed("checkpoints", checkpoints, 3)
    _checks.packed("snapshots", snapshots, 4)
    _checks.contiguous(slots=slots, accepted=accepted)
    nl, ns = checkpoints.shape[:2]
    slots = guards.check_slots(slots, num_slots=ns)
    numel = checkpoints[0, 0].numel()
    batch = slots.shape[0]
    if batch == 0 or nl == 0 or numel == 0:
        return
    block = min(COPY_BLOCK, triton.next_power_of_2(numel))
    grid = (triton.cdiv(numel, block), batch, nl)
    chained, launch = chain_launch()
    _snapshot_commit_kernel[grid](
        checkpoints, snapshots, slots, accepted, checkpoints.stride(0), checkpoints.stride(1),
        snapshots.stride(0), snapshots.stride(1), NUMEL=numel, TS=snapshots.shape[2], BLOCK=block, CHAINED=chained,
        num_warps=4, **launch,
    )
