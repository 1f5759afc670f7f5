"""Snapshot commit: copy the accepted position's state into the checkpoint.

The ``snapshot`` strategy's verify writes the state after every window position to a
scratch buffer; its commit, for all layers at once, is

    checkpoints[l, s] = snapshots[l, s, n - 1]      n = accepted tokens of slot s
"""

from __future__ import annotations

import torch

from . import _checks
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


def snapshot_commit(*args, backend: str = "auto", **kwargs) -> None:
    """Dispatching front of :func:`snapshot_commit_reference` (same arguments)."""
    return pick("snapshot_commit", backend, args[0] if args else kwargs["checkpoints"])(*args, **kwargs)
