"""Exact fold of raw records into checkpoints, all layers in one call (DESIGN.md section 3).

For each request row ``i`` with slot ``s = slots[i] >= 0`` and every layer ``l``:

    S = checkpoints[l, s]
    for c in 0 .. count[i] - 1:
        r = (start[i] + c) mod R
        S = state_update(S, k^(ring_k[l, s, r]), ring_v[l, s, r], ring_g[l, s, r], ring_beta[l, s, r])
    checkpoints[l, s] = S

This is the closed-loop fold: it replays the raw records through the same
:func:`~replayssm.ops.recurrent.state_update` that the recurrence uses, so a state
folded here equals the state the recurrence reaches on the same tokens, bit for bit.
``fold`` calls it with ``start = 0, count = accepted`` at every commit; ``circular``
calls it with ``start = cache_base, count = write_pos`` for flush rows.
"""

from __future__ import annotations

import torch

from . import _checks
from .dispatch import pick, register
from .gates import expand_heads, l2_normalize
from .recurrent import state_update


def check_fold_args(checkpoints, ring_k, ring_v, ring_g, ring_beta, slots, start, count):
    """Validate the fold's arguments (metadata only); return ``(layers, num_slots, R)``."""
    _checks.tensor("checkpoints", checkpoints, ndim=5, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    nl, ns, hv, vd, kd = checkpoints.shape
    _checks.tensor("ring_k", ring_k, ndim=5, dtypes=_checks.FLOAT_DTYPES)
    r, h = ring_k.shape[2], ring_k.shape[3]
    _checks.shape("ring_k", ring_k, [nl, ns, r, h, kd])
    _checks.gqa(h, hv)
    _checks.tensor("ring_v", ring_v, ndim=5, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("ring_v", ring_v, [nl, ns, r, hv, vd])
    for name, x in (("ring_g", ring_g), ("ring_beta", ring_beta)):
        _checks.tensor(name, x, ndim=4, dtypes=(torch.float32, torch.float64))
        _checks.shape(name, x, [nl, ns, r, hv])
    for name, x in (("slots", slots), ("start", start), ("count", count)):
        _checks.tensor(name, x, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if not (slots.numel() == start.numel() == count.numel()):
        raise ValueError(
            f"slots, start and count must have one entry per row, got {slots.numel()}, {start.numel()}, {count.numel()}"
        )
    _checks.same_device(
        checkpoints, ring_k=ring_k, ring_v=ring_v, ring_g=ring_g, ring_beta=ring_beta, slots=slots, start=start, count=count
    )
    return nl, ns, r


def replay_records(S, k, v, g, beta):
    """Replay raw records ``[c, ...]`` into the state ``S`` (``[HV, V, K]``), in order.

    ``k`` is ``[c, H, K]`` pre-normalisation, ``v`` ``[c, HV, V]``, ``g``/``beta``
    ``[c, HV]``; everything is computed in the dtype of ``S``.
    """
    dtype = S.dtype
    k_hat = expand_heads(l2_normalize(k, dtype=dtype), S.shape[0])
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    for c in range(k.shape[0]):
        S = state_update(S, k_hat[c], v[c], g[c], beta[c])
    return S


@register("fold", "reference")
def gdn_fold_reference(
    checkpoints: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_g: torch.Tensor,
    ring_beta: torch.Tensor,
    slots: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """Fold ``count[i]`` raw records of every layer into the checkpoints, in place.

    Args:
        checkpoints: ``[layers, num_slots, HV, V, K]`` float32/bfloat16/float64.
        ring_k: ``[layers, num_slots, R, H, K]`` raw keys (activation dtype).
        ring_v: ``[layers, num_slots, R, HV, V]`` raw values (activation dtype).
        ring_g, ring_beta: ``[layers, num_slots, R, HV]`` float32 gates.
        slots: ``[B]`` slot per row, ``-1`` rows are skipped.
        start: ``[B]`` physical ring position of the first record to fold.
        count: ``[B]`` number of records to fold, ``0 <= count <= R``.
    """
    nl, ns, r = check_fold_args(checkpoints, ring_k, ring_v, ring_g, ring_beta, slots, start, count)
    sl, st, ct = slots.tolist(), start.tolist(), count.tolist()
    for i, s in enumerate(sl):
        if not -1 <= s < ns:
            raise ValueError(f"slots[{i}] = {s} is outside [-1, {ns})")
        if s >= 0 and not 0 <= ct[i] <= r:
            raise ValueError(f"count[{i}] = {ct[i]} is outside [0, {r}]")
    dtype = _checks.compute_dtype(checkpoints, ring_v)
    for i, s in enumerate(sl):
        if s < 0 or ct[i] == 0:
            continue
        pos = [(st[i] + c) % r for c in range(ct[i])]
        for layer in range(nl):
            S = replay_records(
                checkpoints[layer, s].to(dtype),
                ring_k[layer, s, pos], ring_v[layer, s, pos], ring_g[layer, s, pos], ring_beta[layer, s, pos],
            )
            checkpoints[layer, s] = S.to(checkpoints.dtype)


def gdn_fold(*args, backend: str = "auto", **kwargs) -> None:
    """Dispatching front of :func:`gdn_fold_reference` (same arguments)."""
    return pick("fold", backend, args[0] if args else kwargs["checkpoints"])(*args, **kwargs)
