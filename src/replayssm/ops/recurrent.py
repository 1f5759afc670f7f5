"""Token-by-token GDN recurrence over a packed batch of windows (DESIGN.md section 1).

Per value head, from a state ``S`` (``V x K``):

    S' = exp(g) * S
    u  = beta * (v - S' k^)
    S  = S' + u k^T
    o  = S q^

This file holds the reference (plain PyTorch, any float dtype incl. float64, CPU or
GPU). ``state_update`` and ``readout`` are the single definition of the step's operation
order: every exact path of the reference (verify, snapshot commit, fold replay, flush)
goes through them on ``[HV, V, K]`` tensors, so their results agree bit for bit.
"""

from __future__ import annotations

import torch

from . import _checks
from .dispatch import pick, register
from .gates import expand_heads, gdn_gates, l2_normalize
from .records import RawRecords, check_varlen


def state_update(S: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """One exact step of the state, in the reference operation order.

    Args:
        S: ``[..., HV, V, K]`` state in the compute dtype.
        k_hat: ``[..., HV, K]`` normalised key, already expanded to value heads.
        v: ``[..., HV, V]`` value in the compute dtype.
        g, beta: ``[..., HV]`` gates.

    Returns:
        The new state, same shape and dtype as ``S``.
    """
    S = torch.exp(g)[..., None, None] * S
    u = beta[..., None] * (v - (S * k_hat[..., None, :]).sum(-1))
    return S + u[..., :, None] * k_hat[..., None, :]


def readout(S: torch.Tensor, q_hat: torch.Tensor) -> torch.Tensor:
    """``o = S q^``: ``[..., HV, V, K] x [..., HV, K] -> [..., HV, V]``."""
    return (S * q_hat[..., None, :]).sum(-1)


def check_layer_inputs(q, k, v, a, b, A_log, dt_bias) -> tuple[int, int, int, int, int]:
    """Validate one layer's packed inputs; return ``(N, H, K, HV, V)``."""
    _checks.tensor("q", q, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    n, h, kd = q.shape
    _checks.tensor("k", k, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("k", k, [n, h, kd])
    _checks.tensor("v", v, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("v", v, [n, None, None])
    hv, vd = v.shape[1], v.shape[2]
    _checks.gqa(h, hv)
    for name, x in (("a", a), ("b", b)):
        _checks.tensor(name, x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape(name, x, [n, hv])
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        _checks.tensor(name, x, ndim=1, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape(name, x, [hv])
    _checks.same_device(q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    return n, h, kd, hv, vd


def prepare_window(q, k, v, a, b, A_log, dt_bias, dtype: torch.dtype):
    """Gates, normalised and head-expanded keys/queries of a token range, in ``dtype``.

    Returns ``(q_hat, k_hat, v, g, beta)`` with shapes ``[m, HV, K]``, ``[m, HV, K]``,
    ``[m, HV, V]``, ``[m, HV]``, ``[m, HV]``. ``g`` and ``beta`` are float32 (float64 in
    the oracle) whatever ``dtype`` is.
    """
    hv, kd = v.shape[1], q.shape[2]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    k_hat = expand_heads(l2_normalize(k, dtype=dtype), hv)
    q_hat = expand_heads(l2_normalize(q, kd**-0.5, dtype=dtype), hv)
    return q_hat, k_hat, v.to(dtype), g.to(dtype), beta.to(dtype)


@register("recurrence", "reference")
def gdn_recurrence_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    snapshots: torch.Tensor | None = None,
    records: RawRecords | None = None,
    update_state: bool = False,
) -> torch.Tensor:
    """Run the exact recurrence over every window of a packed batch.

    Args:
        q, k: ``[N, H, K]`` post-conv queries and keys (pre-normalisation).
        v: ``[N, HV, V]`` post-conv values; ``HV`` a multiple of ``H``.
        a, b: ``[N, HV]`` raw gate projections.
        A_log, dt_bias: ``[HV]`` gate parameters.
        state: ``[num_slots, HV, V, K]`` float32, bfloat16 or float64 states; window ``i``
            starts from ``state[slots[i]]``.
        slots: ``[B]`` slot of each window, ``-1`` for padding (zero output, no writes).
        cu_seqlens: ``[B + 1]`` token offsets of the windows in the packed batch.
        snapshots: optional ``[num_slots, T, HV, V, K]``; the state after token ``j`` of
            window ``i`` is written to ``snapshots[slots[i], j]`` (the ``snapshot``
            strategy's scratch). ``T`` must cover the longest window.
        records: optional raw-record rings; token ``j`` of window ``i`` is stored at
            ``[slots[i], j]``. A side channel: it never changes the outputs.
        update_state: write the final state of each window back to ``state`` (plain
            decoding and prefill).

    Returns:
        ``o``: ``[N, HV, V]`` in the dtype of ``v``.

    The recurrence runs in float32 (float64 if ``state`` or the inputs are float64) and
    rounds to the state dtype only where it writes.
    """
    n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, A_log, dt_bias)
    _checks.tensor("state", state, ndim=4, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    num_slots = state.shape[0]
    _checks.shape("state", state, [num_slots, hv, vd, kd])
    _checks.same_device(q, state=state, slots=slots, cu_seqlens=cu_seqlens)
    max_len = None
    if snapshots is not None:
        _checks.tensor("snapshots", snapshots, ndim=5, dtypes=(torch.float32, torch.bfloat16, torch.float64))
        _checks.shape("snapshots", snapshots, [num_slots, None, hv, vd, kd])
        _checks.same_device(q, snapshots=snapshots)
        max_len = snapshots.shape[1]
    if records is not None:
        records.check("records", num_slots, h, kd, hv, vd)
        _checks.same_device(q, records=records.k)
        max_len = records.ring_len if max_len is None else min(max_len, records.ring_len)
    cu, sl = check_varlen(cu_seqlens, slots, n, num_slots, max_len)

    dtype = _checks.compute_dtype(q, k, v, state)
    o = torch.zeros(n, hv, vd, dtype=v.dtype, device=v.device)
    for i, slot in enumerate(sl):
        bos, eos = cu[i], cu[i + 1]
        if slot < 0 or eos == bos:
            continue
        q_hat, k_hat, vv, g, beta = prepare_window(
            q[bos:eos], k[bos:eos], v[bos:eos], a[bos:eos], b[bos:eos], A_log, dt_bias, dtype
        )
        S = state[slot].to(dtype)
        for j in range(eos - bos):
            S = state_update(S, k_hat[j], vv[j], g[j], beta[j])
            o[bos + j] = readout(S, q_hat[j]).to(o.dtype)
            if snapshots is not None:
                snapshots[slot, j] = S.to(snapshots.dtype)
        if records is not None:
            for j in range(eos - bos):
                records.write(slot, j, k[bos + j], v[bos + j], g[j], beta[j])
        if update_state:
            state[slot] = S.to(state.dtype)
    return o


def gdn_recurrence(*args, backend: str = "auto", **kwargs) -> torch.Tensor:
    """Dispatching front of :func:`gdn_recurrence_reference` (same arguments).

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton on CUDA tensors,
    the reference elsewhere).
    """
    impl = pick("recurrence", backend, args[0] if args else kwargs["q"])
    return impl(*args, **kwargs)
