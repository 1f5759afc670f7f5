"""Closed-form window from checkpoint + committed history (DESIGN.md sections 2 and 3).

For a window of ``m`` tokens starting from state ``S`` with ``G_i = g_1 + ... + g_i``:

    (I + A) U = R,   A_ij = beta_i exp(G_i - G_j) (k^_i . k^_j)  for j < i, 0 elsewhere
                     R_i  = beta_i (v_i - exp(G_i) S k^_i)
    o_i = exp(G_i) S q^_i + sum_{j<=i} exp(G_i - G_j) (k^_j . q^_i) u_j

``S`` is never materialised: it is the frozen checkpoint ``S0`` plus ``h`` committed
records ``(u_c, k^_c, g_c)`` of the ring, applied to a vector ``x`` as

    S x = exp(Gtot) S0 x + sum_c exp(Gtot - G_c) u_c (k^_c . x)

This is the ``circular`` strategy's verify. Per request (cursor fields indexed by slot):
a row whose ``is_flush`` is set first folds its ``write_pos`` committed raw records into
the checkpoint with the exact recurrence (closed loop) and then uses an empty history.
The window's records (raw ``k``, ``v``, ``g``, ``beta`` plus the closed-form ``u``) are
written at logical positions ``write_pos + i``, i.e. physical
``(cache_base + write_pos + i) & (L - 1)``. Cursors are not changed: rejected records
stay outside ``write_pos`` and are overwritten by the next window.
"""

from __future__ import annotations

import torch

from . import _checks
from .dispatch import pick, register
from .gates import expand_heads, l2_normalize
from .fold import replay_records
from .recurrent import check_layer_inputs, prepare_window
from .records import RawRecords, check_varlen


def apply_history(S0, u, k_hat, g, x):
    """``S x`` for ``S`` = checkpoint ``S0`` advanced by history records, never built.

    Args:
        S0: ``[HV, V, K]`` checkpoint in the compute dtype.
        u: ``[h, HV, V]`` corrected deltas of the committed history.
        k_hat: ``[h, HV, K]`` their normalised, head-expanded keys.
        g: ``[h, HV]`` their log decays.
        x: ``[m, HV, K]`` vectors to apply the state to.

    Returns:
        ``[m, HV, V]``.
    """
    out = torch.einsum("hvk,mhk->mhv", S0, x)
    if u.shape[0] == 0:
        return out
    G = torch.cumsum(g, 0)  # [h, HV]
    g_tot = G[-1]
    out = torch.exp(g_tot)[None, :, None] * out
    scores = torch.einsum("chk,mhk->mch", k_hat, x) * torch.exp(g_tot[None] - G)[None]  # [m, h, HV]
    return out + torch.einsum("mch,chv->mhv", scores, u)


def window_closed_form(S_k, S_q, q_hat, k_hat, v, g, beta):
    """The window's corrected deltas ``U`` and outputs ``o`` from ``S k^_i`` and ``S q^_i``.

    Args:
        S_k, S_q: ``[m, HV, V]`` the start state applied to the window's keys / queries.
        q_hat, k_hat: ``[m, HV, K]``; v: ``[m, HV, V]``; g, beta: ``[m, HV]``.

    Returns:
        ``(U, o)``, each ``[m, HV, V]``.
    """
    m = g.shape[0]
    G = torch.cumsum(g, 0)  # [m, HV]
    causal = torch.ones(m, m, dtype=torch.bool, device=g.device).tril()
    diff = G[:, None, :] - G[None, :, :]  # [i, j, HV]
    # Mask before exp: G_i - G_j > 0 above the diagonal could overflow.
    decay = torch.exp(torch.where(causal[:, :, None], diff, torch.full_like(diff, float("-inf"))))
    kk = torch.einsum("ihk,jhk->ijh", k_hat, k_hat)
    A = (beta[:, None, :] * decay * kk).masked_fill(~causal[:, :, None] | torch.eye(m, dtype=torch.bool, device=g.device)[:, :, None], 0.0)
    R = beta[:, :, None] * (v - torch.exp(G)[:, :, None] * S_k)
    # Forward substitution through the strictly lower-triangular A: (I + A) U = R.
    U = torch.empty_like(R)
    for i in range(m):
        U[i] = R[i] - torch.einsum("jh,jhv->hv", A[i, :i], U[:i]) if i else R[i]
    kq = torch.einsum("jhk,ihk->ijh", k_hat, q_hat)  # (k^_j . q^_i)
    o = torch.exp(G)[:, :, None] * S_q + torch.einsum("ijh,jhv->ihv", decay * kq, U)
    return U, o


def check_cursors(num_slots: int, **cursors: torch.Tensor):
    for name, x in cursors.items():
        _checks.tensor(name, x, ndim=1, dtypes=(torch.int32, torch.int64))
        _checks.shape(name, x, [num_slots])


@register("chunked", "reference")
def gdn_chunked_window_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    checkpoint: torch.Tensor,
    ring: RawRecords,
    ring_u: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    write_pos: torch.Tensor,
    cache_base: torch.Tensor,
    is_flush: torch.Tensor,
) -> torch.Tensor:
    """Outputs of a packed batch of windows in closed form, writing their records.

    Args:
        q, k: ``[N, H, K]``; v: ``[N, HV, V]``; a, b: ``[N, HV]``; A_log, dt_bias: ``[HV]``.
        checkpoint: ``[num_slots, HV, V, K]`` frozen states (float32/bfloat16/float64);
            flush rows fold their history into it first.
        ring: raw-record ring ``[num_slots, L, ...]``, ``L`` a power of two.
        ring_u: ``[num_slots, L, HV, V]`` float32 corrected deltas of the records.
        slots: ``[B]`` slot per window, ``-1`` for padding.
        cu_seqlens: ``[B + 1]`` token offsets.
        write_pos, cache_base, is_flush: ``[num_slots]`` int32 cursors (read only).

    Returns:
        ``o``: ``[N, HV, V]`` in the dtype of ``v``; padding rows are zero.
    """
    n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, A_log, dt_bias)
    _checks.tensor("checkpoint", checkpoint, ndim=4, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    ns = checkpoint.shape[0]
    _checks.shape("checkpoint", checkpoint, [ns, hv, vd, kd])
    ring.check("ring", ns, h, kd, hv, vd)
    L = ring.ring_len
    _checks.power_of_two("ring length", L)
    _checks.tensor("ring_u", ring_u, ndim=4, dtypes=(torch.float32, torch.float64))
    _checks.shape("ring_u", ring_u, [ns, L, hv, vd])
    check_cursors(ns, write_pos=write_pos, cache_base=cache_base, is_flush=is_flush)
    _checks.same_device(q, checkpoint=checkpoint, ring=ring.k, ring_u=ring_u, write_pos=write_pos)
    cu, sl = check_varlen(cu_seqlens, slots, n, ns, L)
    wp_all, base_all, flush_all = write_pos.tolist(), cache_base.tolist(), is_flush.tolist()
    for i, s in enumerate(sl):
        if s >= 0 and wp_all[s] + cu[i + 1] - cu[i] > L:
            raise ValueError(
                f"window {i} (slot {s}) does not fit: write_pos {wp_all[s]} + {cu[i + 1] - cu[i]} tokens > ring length {L}"
            )

    dtype = _checks.compute_dtype(q, k, v, checkpoint)
    o = torch.zeros(n, hv, vd, dtype=v.dtype, device=v.device)
    for i, s in enumerate(sl):
        bos, eos = cu[i], cu[i + 1]
        if s < 0 or eos == bos:
            continue
        wp, base = wp_all[s], base_all[s]
        hist = [(base + c) & (L - 1) for c in range(wp)]
        if flush_all[s]:
            if hist:
                S = replay_records(checkpoint[s].to(dtype), ring.k[s, hist], ring.v[s, hist], ring.g[s, hist], ring.beta[s, hist])
                checkpoint[s] = S.to(checkpoint.dtype)
            hist = []
        S0 = checkpoint[s].to(dtype)
        u_h = ring_u[s, hist].to(dtype)
        k_h = expand_heads(l2_normalize(ring.k[s, hist], dtype=dtype), hv)
        g_h = ring.g[s, hist].to(dtype)

        q_hat, k_hat, vv, g, beta = prepare_window(
            q[bos:eos], k[bos:eos], v[bos:eos], a[bos:eos], b[bos:eos], A_log, dt_bias, dtype
        )
        S_k = apply_history(S0, u_h, k_h, g_h, k_hat)
        S_q = apply_history(S0, u_h, k_h, g_h, q_hat)
        U, out = window_closed_form(S_k, S_q, q_hat, k_hat, vv, g, beta)
        o[bos:eos] = out.to(o.dtype)
        for j in range(eos - bos):
            pos = (base + wp + j) & (L - 1)
            ring.write(s, pos, k[bos + j], v[bos + j], g[j], beta[j])
            ring_u[s, pos] = U[j].to(ring_u.dtype)
    return o


def gdn_chunked_window(*args, backend: str = "auto", **kwargs) -> torch.Tensor:
    """Dispatching front of :func:`gdn_chunked_window_reference` (same arguments)."""
    return pick("chunked", backend, args[0] if args else kwargs["q"])(*args, **kwargs)
