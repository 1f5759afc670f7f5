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

import math

import torch

from . import _checks, guards, tuning
from .dispatch import pick, register
from .gates import expand_heads, gdn_gates
from .fold import replay_records
from .recurrent import check_layer_inputs, prepare_window
from .records import RawRecords, check_varlen, slots_error, unit_keys
from .trees import DeviceTrees, DraftTrees


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


def committed_products(S0, ring, ring_u, slot, hist, k_hat, q_hat):
    """``(S k^_i, S q^_i)``, each ``[m, HV, V]``, for ``S`` = checkpoint ``S0``
    (``[HV, V, K]``, compute dtype) advanced by the records at ring positions ``hist``
    of ``slot`` (:func:`apply_history`)."""
    dtype = S0.dtype
    u_h = ring_u[slot, hist].to(dtype)
    k_h = expand_heads(unit_keys(ring.k[slot, hist], dtype), S0.shape[0])
    g_h = ring.g[slot, hist].to(dtype)
    return apply_history(S0, u_h, k_h, g_h, k_hat), apply_history(S0, u_h, k_h, g_h, q_hat)


def window_closed_form(S_k, S_q, q_hat, k_hat, v, g, beta):
    """The window's corrected deltas ``U`` and outputs ``o`` from ``S k^_i`` and ``S q^_i``.

    Args:
        S_k, S_q: ``[m, HV, V]`` the start state applied to the window's keys / queries.
        q_hat, k_hat: ``[m, HV, K]``; v: ``[m, HV, V]``; g, beta: ``[m, HV]``.

    Returns:
        ``(U, o)``, each ``[m, HV, V]``.
    """
    m = g.shape[0]
    causal = torch.ones(m, m, dtype=torch.bool, device=g.device).tril()
    return masked_closed_form(S_k, S_q, q_hat, k_hat, v, torch.cumsum(g, 0), beta, causal)


def masked_closed_form(S_k, S_q, q_hat, k_hat, v, G, beta, mask):
    """``(I + A) U = R`` and the outputs with ``A`` and the output sum masked to ``mask``.

    A chain's ``mask`` is causal and ``G`` the prefix sums of ``g``; a tree's ``mask`` is
    its ancestor-or-self mask and ``G_i`` the sum of ``g`` over node ``i``'s root path
    (DESIGN.md section 2, "Trees"). ``mask`` must be lower triangular (topological order),
    so forward substitution solves the system.

    Args:
        S_k, S_q: ``[m, HV, V]`` the start state applied to the keys / queries.
        q_hat, k_hat: ``[m, HV, K]``; v: ``[m, HV, V]``; G, beta: ``[m, HV]``.
        mask: ``[m, m]`` bool, ``mask[i, j]``: ``j`` is ``i`` or comes before it on its path.

    Returns:
        ``(U, o)``, each ``[m, HV, V]``.
    """
    m = G.shape[0]
    diff = G[:, None, :] - G[None, :, :]  # [i, j, HV]
    # Mask before exp: G_i - G_j > 0 outside the mask could overflow.
    decay = torch.exp(torch.where(mask[:, :, None], diff, torch.full_like(diff, float("-inf"))))
    kk = torch.einsum("ihk,jhk->ijh", k_hat, k_hat)
    A = (beta[:, None, :] * decay * kk).masked_fill(~mask[:, :, None] | torch.eye(m, dtype=torch.bool, device=G.device)[:, :, None], 0.0)
    R = beta[:, :, None] * (v - torch.exp(G)[:, :, None] * S_k)
    # Forward substitution through the strictly lower-triangular A: (I + A) U = R.
    U = torch.empty_like(R)
    for i in range(m):
        U[i] = R[i] - torch.einsum("jh,jhv->hv", A[i, :i], U[:i]) if i else R[i]
    kq = torch.einsum("jhk,ihk->ijh", k_hat, q_hat)  # (k^_j . q^_i)
    o = torch.exp(G)[:, :, None] * S_q + torch.einsum("ijh,jhv->ihv", decay * kq, U)
    return U, o


#: Ways to compute a window (the Triton op's ``method``): ``"closed_form"`` (flush,
#: coefficients, outputs: DESIGN.md section 2) and ``"replay"`` (one launch:
#: the committed history and then the window stepped through the exact recurrence, for
#: small batches). Both fold a flush row's history into the same checkpoint, bit for bit.
METHODS = ("closed_form", "replay")


def check_method(method):
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be None or one of {METHODS}, got {method!r}")


def check_cursors(num_slots: int, **cursors: torch.Tensor):
    for name, x in cursors.items():
        _checks.tensor(name, x, ndim=1, dtypes=(torch.int32, torch.int64))
        _checks.shape(name, x, [num_slots])


def check_ring_state_args(
    q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, *, state_dtypes, u_dtypes, **cursors,
) -> tuple[int, int, int]:
    """Validate a layer's inputs, the checkpoints, the ring and the named cursors
    (metadata only). Returns ``(N, num_slots, L)``."""
    n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, A_log, dt_bias)
    _checks.tensor("checkpoint", checkpoint, ndim=4, dtypes=state_dtypes)
    ns = checkpoint.shape[0]
    _checks.shape("checkpoint", checkpoint, [ns, hv, vd, kd])
    if not isinstance(ring, RawRecords):
        raise TypeError(f"ring must be a RawRecords, got {type(ring).__name__}")
    ring.check("ring", ns, h, kd, hv, vd)
    L = ring.ring_len
    _checks.power_of_two("ring length", L)
    _checks.tensor("ring_u", ring_u, ndim=4, dtypes=u_dtypes)
    _checks.shape("ring_u", ring_u, [ns, L, hv, vd])
    check_cursors(ns, **cursors)
    return n, ns, L


def check_window_args(
    q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos, cache_base, is_flush,
    max_len, *, state_dtypes, u_dtypes,
) -> tuple[int, int, int]:
    """Validate the metadata (shapes, dtypes, devices) of a chunked-window call.

    Reads no tensor values, so it never synchronises with the device. Returns
    ``(N, num_slots, L)``.
    """
    n, ns, L = check_ring_state_args(
        q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, state_dtypes=state_dtypes, u_dtypes=u_dtypes,
        write_pos=write_pos, cache_base=cache_base, is_flush=is_flush,
    )
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.shape("cu_seqlens", cu_seqlens, [slots.shape[0] + 1])
    _checks.same_device(
        q, checkpoint=checkpoint, ring=ring.k, ring_u=ring_u, slots=slots, cu_seqlens=cu_seqlens,
        write_pos=write_pos, cache_base=cache_base, is_flush=is_flush,
    )
    if max_len is not None:
        if not isinstance(max_len, int) or isinstance(max_len, bool) or not 1 <= max_len <= L:
            raise ValueError(f"max_len must be an int in [1, ring length {L}], got {max_len!r}")
    return n, ns, L


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
    *,
    max_len: int | None = None,
    method: str | None = None,
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
        max_len: ``T``, the longest window allowed (the pool's ``window``); ``None``
            bounds windows by the ring length only.
        method: ``None`` (the shape table decides), ``"closed_form"`` or ``"replay"``:
            how the Triton op computes the window (see :data:`METHODS`). Validated
            here; this reference always evaluates the closed form, which both methods
            match to rounding (the committed states they leave are identical).

    Returns:
        ``o``: ``[N, HV, V]`` in the dtype of ``v``; padding rows are zero.
    """
    check_method(method)
    n, ns, L = check_window_args(
        q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos, cache_base, is_flush,
        max_len, state_dtypes=(torch.float32, torch.bfloat16, torch.float64), u_dtypes=(torch.float32, torch.float64),
    )
    hv, vd = v.shape[1], v.shape[2]
    cu, sl = check_varlen(cu_seqlens, slots, n, ns, L if max_len is None else max_len)
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
        q_hat, k_hat, vv, g, beta = prepare_window(
            q[bos:eos], k[bos:eos], v[bos:eos], a[bos:eos], b[bos:eos], A_log, dt_bias, dtype
        )
        S_k, S_q = committed_products(checkpoint[s].to(dtype), ring, ring_u, s, hist, k_hat, q_hat)
        U, out = window_closed_form(S_k, S_q, q_hat, k_hat, vv, g, beta)
        o[bos:eos] = out.to(o.dtype)
        for j in range(eos - bos):
            pos = (base + wp + j) & (L - 1)
            ring.write(s, pos, k[bos + j], v[bos + j], g[j], beta[j])
            ring_u[s, pos] = U[j].to(ring_u.dtype)
    return o


def gdn_chunked_window(
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
    *,
    max_len: int | None = None,
    method: str | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``circular``'s verify of a batch of windows: outputs ``o [N, HV, V]`` in closed
    form from each slot's checkpoint, committed ring history and window (flush rows fold
    their records first). Arguments, shapes and results: :func:`gdn_chunked_window_reference`;
    the Triton version's limits: :func:`gdn_chunked_window_triton`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("chunked", backend, q)(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens,
                                       write_pos, cache_base, is_flush, max_len=max_len, method=method)


def tree_gates(g: torch.Tensor, parents: list[int]) -> torch.Tensor:
    """``G_i``: the sum of ``g`` over node ``i``'s root path, ``[m, HV]``.

    Accumulated parent first, in path order, so that a chain gets exactly
    ``torch.cumsum(g, 0)`` (the same additions in the same order).
    """
    G = torch.empty_like(g)
    for i, p in enumerate(parents):
        G[i] = g[i] if p < 0 else G[p] + g[i]
    return G


def gdn_tree_window_reference(
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
    write_pos: torch.Tensor,
    cache_base: torch.Tensor,
    trees: DraftTrees,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and corrected deltas of a batch of draft trees in closed form.

    Per request, with ``S`` the committed state (checkpoint ``S0`` plus the ``write_pos``
    committed records of the ring, applied as in :func:`apply_history`, never built),
    ``P(i)`` the root path of node ``i`` (``i`` included) and ``G_i = sum_{j in P(i)} g_j``:

        (I + A) U = R,  A_ij = beta_i exp(G_i - G_j) (k^_i . k^_j)  for j in P(i), j != i
                        R_i  = beta_i (v_i - exp(G_i) S k^_i)
        o_i = exp(G_i) S q^_i + sum_{j in P(i)} exp(G_i - G_j) (k^_j . q^_i) u_j

    Node ``i``'s state would be ``S_i = exp(G_i) S + sum_{j in P(i)} exp(G_i - G_j) u_j
    k^_j^T``: the recurrence run along ``P(i)``, so ``u_i`` and ``o_i`` are that path's
    corrected delta and output. No ``S_i`` is materialised. A chain-shaped tree is the
    window of :func:`gdn_chunked_window_reference`.

    Args:
        q, k: ``[B * N, H, K]``; v: ``[B * N, HV, V]``; a, b: ``[B * N, HV]``: node ``i`` of
            request ``r`` at row ``r * N + i``, ``N = trees.max_nodes`` (padded nodes'
            rows are read by nothing).
        A_log, dt_bias: ``[HV]``.
        checkpoint: ``[num_slots, HV, V, K]`` frozen states (float32/bfloat16/float64).
        ring: raw-record ring ``[num_slots, L, ...]``, ``L`` a power of two.
        ring_u: ``[num_slots, L, HV, V]`` corrected deltas of the records.
        slots: ``[B]`` slot per request, ``-1`` for padding.
        write_pos, cache_base: ``[num_slots]`` cursors: the committed history of slot
            ``s`` is its records ``(cache_base[s] + c) & (L - 1)``, ``c < write_pos[s]``.
        trees: the requests' :class:`DraftTrees` (``B`` trees of ``N`` nodes).

    Returns:
        ``(o, U)``: ``o`` ``[B * N, HV, V]`` in the dtype of ``v``; ``U`` ``[B * N, HV, V]``
        in the compute dtype (float64 if an input is, else float32). Rows of padded nodes
        and padding requests are zero. Nothing is written: not the checkpoint, not the
        ring, whatever ``is_flush`` would say (a pending flush does not change the
        committed state).
    """
    n, ns, L = check_ring_state_args(
        q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, state_dtypes=(torch.float32, torch.bfloat16, torch.float64),
        u_dtypes=(torch.float32, torch.float64), write_pos=write_pos, cache_base=cache_base,
    )
    if not isinstance(trees, DraftTrees):
        raise TypeError(f"trees must be a DraftTrees, got {type(trees).__name__}")
    nb, nn = trees.batch, trees.max_nodes
    if n != nb * nn:
        raise ValueError(f"q must have trees.batch * trees.max_nodes = {nb} * {nn} = {nb * nn} rows, got {n}")
    hv, vd = v.shape[1], v.shape[2]
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.shape("slots", slots, [nb])
    _checks.same_device(q, checkpoint=checkpoint, ring=ring.k, ring_u=ring_u, slots=slots, write_pos=write_pos,
                        cache_base=cache_base)
    sl, wp_all, base_all = slots.tolist(), write_pos.tolist(), cache_base.tolist()
    error = slots_error(sl, ns, unique=True)
    if error:
        raise ValueError(error)
    for s in sl:
        if s >= 0 and not 0 <= wp_all[s] <= L:
            raise ValueError(f"write_pos[{s}] = {wp_all[s]} is outside [0, ring length {L}]")

    dtype = _checks.compute_dtype(q, k, v, checkpoint)
    o = torch.zeros(n, hv, vd, dtype=v.dtype, device=v.device)
    U_all = torch.zeros(n, hv, vd, dtype=dtype, device=v.device)
    ancestors = trees.ancestors().to(q.device)
    for r, s in enumerate(sl):
        if s < 0:
            continue
        m = int(trees.num_nodes[r])
        bos = r * nn
        hist = [(base_all[s] + c) & (L - 1) for c in range(wp_all[s])]
        q_hat, k_hat, vv, g, beta = prepare_window(
            q[bos:bos + m], k[bos:bos + m], v[bos:bos + m], a[bos:bos + m], b[bos:bos + m], A_log, dt_bias, dtype
        )
        S_k, S_q = committed_products(checkpoint[s].to(dtype), ring, ring_u, s, hist, k_hat, q_hat)
        G = tree_gates(g, trees.parents[r, :m].tolist())
        U, out = masked_closed_form(S_k, S_q, q_hat, k_hat, vv, G, beta, ancestors[r, :m, :m])
        o[bos:bos + m] = out.to(o.dtype)
        U_all[bos:bos + m] = U
    return o, U_all


def check_tree_cursors(trees: DraftTrees, slots, write_pos, L: int) -> list[int]:
    """Host checks of a tree verify's slots and cursors: slots valid and unique, every
    live request's window of ``N`` nodes fits after its history (``write_pos + N <= L``).
    Returns the slots as a list."""
    sl, wp_all = slots.tolist(), write_pos.tolist()
    error = slots_error(sl, write_pos.shape[0], unique=True)
    if error:
        raise ValueError(error)
    for r, s in enumerate(sl):
        if s >= 0 and not 0 <= wp_all[s] <= L - trees.max_nodes:
            raise ValueError(
                f"tree {r} (slot {s}) does not fit: write_pos {wp_all[s]} + {trees.max_nodes} nodes > ring length {L}"
            )
    return sl


@register("chunked_tree", "reference")
def gdn_tree_verify_reference(
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
    write_pos: torch.Tensor,
    cache_base: torch.Tensor,
    is_flush: torch.Tensor,
    trees: DraftTrees,
    *,
    max_len: int | None = None,
    method: str | None = None,
) -> torch.Tensor:
    """``circular``'s verify of a batch of draft trees: the window op
    (:func:`gdn_chunked_window_reference`) with the trees' ancestor mask.

    Per request: a flush row first folds its committed records into the checkpoint
    (the exact replay) and starts from an empty history; the nodes' outputs and
    corrected deltas are :func:`gdn_tree_window_reference`'s; node ``i``'s record (raw
    ``k``, ``v``, ``g``, ``beta`` and its ``u``) is written at logical ring position
    ``write_pos + i`` (physical ``(cache_base + write_pos + i) & (L - 1)``), as a
    window's token ``i`` is. Cursors are not changed; the commit gathers the accepted
    path (:func:`~replayssm.ops.tree_ops.compact_path`) and moves them.

    Args:
        q, k, v, a, b, A_log, dt_bias: as for :func:`gdn_tree_window_reference`
            (``B * N`` rows, node ``i`` of request ``r`` at row ``r * N + i``).
        checkpoint, ring, ring_u, write_pos, cache_base, is_flush: as for
            :func:`gdn_chunked_window_reference`.
        slots: ``[B]`` slot per request, ``-1`` for padding.
        trees: the requests' :class:`DraftTrees`.
        max_len: ``T``, the pool's window (``N <= T``); ``None`` bounds ``N`` by the ring.
        method: the Triton version's choice of kernels (:func:`gdn_tree_verify_triton`);
            the reference has one method and only checks the name.

    Returns:
        ``o``: ``[B * N, HV, V]`` in the dtype of ``v``; padded nodes and padding
        requests give zeros.
    """
    check_method(method)
    n, ns, L = check_ring_state_args(
        q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, state_dtypes=(torch.float32, torch.bfloat16, torch.float64),
        u_dtypes=(torch.float32, torch.float64), write_pos=write_pos, cache_base=cache_base, is_flush=is_flush,
    )
    if not isinstance(trees, DraftTrees):
        raise TypeError(f"trees must be a DraftTrees, got {type(trees).__name__}")
    nn = trees.max_nodes
    bound = L if max_len is None else max_len
    if not isinstance(bound, int) or isinstance(bound, bool) or not 1 <= bound <= L:
        raise ValueError(f"max_len must be an int in [1, ring length {L}], got {max_len!r}")
    if nn > bound:
        raise ValueError(f"trees have {nn} nodes, more than max_len = {bound}")
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.shape("slots", slots, [trees.batch])
    _checks.same_device(q, slots=slots, write_pos=write_pos, cache_base=cache_base, is_flush=is_flush)
    sl = check_tree_cursors(trees, slots, write_pos, L)
    if n != trees.batch * nn:
        raise ValueError(f"q must have trees.batch * trees.max_nodes = {trees.batch} * {nn} = {trees.batch * nn} rows, got {n}")

    dtype = _checks.compute_dtype(q, k, v, checkpoint)
    wp, base = write_pos.clone(), cache_base.clone()
    for s in sl:
        if s >= 0 and int(is_flush[s]) and int(wp[s]):
            hist = [(int(base[s]) + c) & (L - 1) for c in range(int(wp[s]))]
            S = replay_records(checkpoint[s].to(dtype), ring.k[s, hist], ring.v[s, hist], ring.g[s, hist], ring.beta[s, hist])
            checkpoint[s] = S.to(checkpoint.dtype)
        if s >= 0 and int(is_flush[s]):  # empty history, the window where it was
            base[s], wp[s] = (int(base[s]) + int(wp[s])) & (L - 1), 0
    o, U = gdn_tree_window_reference(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, wp, base, trees)
    g_all, beta_all = gdn_gates(a, b, A_log, dt_bias)
    for r, s in enumerate(sl):
        if s < 0:
            continue
        for i in range(int(trees.num_nodes[r])):
            row, pos = r * nn + i, (int(base[s]) + int(wp[s]) + i) & (L - 1)
            ring.write(s, pos, k[row], v[row], g_all[row].to(dtype), beta_all[row].to(dtype))
            ring_u[s, pos] = U[row].to(ring_u.dtype)
    return o


def gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, write_pos, cache_base, is_flush,
                    trees, *, max_len: int | None = None, method: str | None = None,
                    backend: str = "auto") -> torch.Tensor:
    """``circular``'s verify of draft trees: outputs ``o [B * N, HV, V]`` in closed form
    with the ancestor mask, the nodes' records written after the history. Arguments,
    shapes and results: :func:`gdn_tree_verify_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"``.
    """
    return pick("chunked_tree", backend, q)(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, write_pos,
                                            cache_base, is_flush, trees, max_len=max_len, method=method)


# --------------------------------------------------------------------------- Triton
# Two launches per layer (three with the shape table's closed_form.fuse_flush = 0):
#  1. The coefficients, one program per (window, key head's value heads): everything of
#     the closed form that depends on keys, gates and the history but not on V
#     (DESIGN.md section 2: normalisation, decays, (I + A)^-1, the output map), folded
#     into three small matrices such that  [U | o] = (S0 x_r) C1 + u_h Z + v D;  plus the
#     window's keys and gates to the ring. This chain is latency-bound: it runs once
#     per head, outside the state's pass, on a stacked window of 2 max(4, T) rows.
#  2. The outputs, per (V block, window, value head). A flush row first folds its
#     committed raw records into its checkpoint rows (the exact step shared with the
#     recurrence and the fold kernel: the folded checkpoint is theirs, bit for bit) and
#     stores them; every row then multiplies its (folded) checkpoint rows by the window's
#     raw keys and queries, S0 x_r, the only product that reads a state (a flush row's
#     from registers, the others' in one streamed pass over K); three small products
#     with the coefficients give the rows' outputs and corrected deltas, stored with the
#     raw values. Unfused, the fold kernel runs the flush rows first, as a launch of its
#     own, and the outputs kernel reads their checkpoints again.
# Branches on request data are masks or device control flow: the host never reads the
# device and the launches can be captured in a CUDA graph.

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference above works without Triton
    triton = None

#: Longest window the kernel takes (the outputs kernel's stacked window is 2 * max(8, T) rows).
MAX_WINDOW_TRITON = 16


def replays_window(batch: int, *, kd: int, vd: int, state_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a call of ``batch`` windows runs the small-batch path (the exact
    recurrence in one launch, see ``_replay_window_kernel``) instead of the closed form:
    ``batch <= replay_max_batch`` of the shape table's ``circular`` row. The
    ``circular`` strategy asks the same question at commit, to flush at every step
    while the batch is this small. Both paths leave the same committed states."""
    cfg = tuning.lookup("circular", K=kd, V=vd, state_dtype=state_dtype, batch=batch, device=device.type)
    return batch <= cfg["replay_max_batch"]


def replays_tree(batch: int, paths: int, *, kd: int, vd: int, state_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a tree verify of ``batch`` requests with ``paths`` leaf paths each takes
    the small-batch path (each leaf's root path through the exact recurrence, see
    ``_tree_replay_kernel``): ``batch * paths <= tree_replay_max_paths`` of the shape
    table's ``circular`` row."""
    cfg = tuning.lookup("circular", K=kd, V=vd, state_dtype=state_dtype, batch=batch, device=device.type)
    return batch * paths <= cfg["tree_replay_max_paths"]


def product_precision(act_dtype: torch.dtype) -> str:
    """``input_precision`` of the closed form's products with the state, ``S x_r``
    (``[BV, K] x [K, 2T]``), and of the window's Gram matrices, for an activation dtype.

    On tensor cores ("tf32") these cost nothing next to the state's read; as fp32 FMA
    ("ieee") they are most of the kernel's instructions. tf32 rounds the fp32 state to
    11 significant bits, a relative error of ~2^-12 in a product over K = 128 terms, 8x
    below the rounding of a bf16 output (2^-9); 16-bit keys and queries are exact in
    tf32, and their Gram matrices accumulate in fp32. So: "tf32" for 16-bit
    activations, "ieee" for fp32 activations (CPU tests, fp32 models), where tf32 would
    show. The small coefficient products always run in "ieee"."""
    return "ieee" if act_dtype == torch.float32 else "tf32"


if triton is not None:
    from .recurrent import (
        ACT_DTYPES_TRITON,
        STATE_DTYPES_TRITON,
        check_index_pair,
        check_inner_contiguous,
        check_max_len,
    )
    from .fold import launch_fold, replay_and_store_tile as _replay_and_store_tile, replay_history as _replay_history
    from .fold import _ring_pos
    from .recurrent import _load_token as _rec_load_token, exact_block_k, exact_row, exact_tile
    from .recurrent import exact_token as _exact_token
    from .triton_common import NORM_EPS, block_rows, chain_active, chain_launch, chain_wait, exact_warps
    from .triton_common import device_fn as _tl_device_fn
    from .triton_common import INTERPRETER as _TL_INTERPRETER
    from .triton_common import gdn_gates as _tl_gdn_gates
    from .triton_common import load_parts as _tl_load_parts
    from .triton_common import mask_and as _tl_mask_and
    from .triton_common import row_sum as _tl_row_sum, store_parts as _tl_store_parts
    from .triton_common import as_stored as _tl_as_stored, to_rtne as _tl_to_rtne, window_program as _tl_window_program
    from .triton_common import normalized as _tl_normalized, record_key as _tl_record_key
    from .triton_common import dependent_launch, register_cap, short_tail_row as _tl_short_tail_row
    from .tree_ops import leaf_path as _leaf_path, owns as _owns, path_node as _path_node
    from .tree_ops import zero_padded_nodes as _zero_padded_nodes

    @_tl_device_fn
    def _window_rows(bos, length, BT: tl.constexpr):
        """The stacked window ``[2 BT]``: row ``r < BT`` is token ``r``'s key, row
        ``BT + i`` token ``i``'s query. Returns ``(offs_x, is_k, is_q, tok, p_tok, x_ok,
        xk_ok, xq_ok)``: row index, row kind, token in the window and in the packed
        batch, and whether the row's token exists (as any row, a key row, a query row)."""
        offs_x = tl.arange(0, 2 * BT)
        is_k = offs_x < BT
        is_q = offs_x >= BT
        tok = offs_x % BT
        x_ok = tok < length
        return offs_x, is_k, is_q, tok, bos + tok, x_ok, is_k & x_ok, is_q & x_ok

    @_tl_device_fn
    def _load_window_x(q_ptr, k_ptr, p_tok, i_h, offs_k, mask_k, xk_ok, xq_ok,
                       stride_q_tok, stride_q_head, stride_k_tok, stride_k_head):
        """Columns ``offs_k`` of the stacked window's raw keys and queries, ``x [2 BT, KC]``
        as stored: each row from its key or its query in one load (the row's pointer at
        either), zero where the token is missing."""
        row = tl.where(xk_ok, k_ptr + p_tok * stride_k_tok + i_h * stride_k_head,
                       q_ptr + p_tok * stride_q_tok + i_h * stride_q_head)
        return tl.load(row[:, None] + offs_k[None, :], mask=(xk_ok | xq_ok)[:, None] & mask_k[None, :], other=0.0)

    @_tl_device_fn
    def _mm(a, b, INNER: tl.constexpr, PRECISION: tl.constexpr):
        """``a @ b`` for fp32 blocks whose inner side is ``INNER``: tl.dot from 16 up (its
        least inner side on every Triton this runs on), a broadcast sum below (the
        stacked window of T <= 4 is 8 wide; its products are a few hundred FMAs). The
        sum runs along the broadcast block's first axis, which one warp's layout keeps in
        each thread's registers (no shuffles; along the middle axis, 4 lanes shared it)."""
        if INNER >= 16:
            return tl.dot(a, b, input_precision=PRECISION)
        else:
            return _tl_row_sum(tl.trans(a)[:, :, None] * b[:, None, :], 0)

    if _TL_INTERPRETER:

        def _gram(a, b, PRECISION):
            """``a b^T`` (interpreter form): its tl.dot multiplies bf16 blocks wrongly
            (Triton 3.9: numpy has no bf16), so 16-bit blocks go through fp32 first; their
            products are exact either way."""
            return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision=PRECISION)

    else:

        @triton.jit
        def _gram(a, b, PRECISION: tl.constexpr):
            """``a b^T`` in fp32 for blocks of rows of keys and queries: 16-bit blocks
            multiply as stored (exact products, fp32 sums, as in tf32, with no fp32 copy
            of either block), fp32 ones at ``PRECISION``."""
            return tl.dot(a, tl.trans(b), input_precision=PRECISION, out_dtype=tl.float32)

    @triton.jit
    def _coefficients_kernel(
        q_ptr, k_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, rk_ptr, rg_ptr, rb_ptr,
        slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, coef_ptr, anc_ptr, nodes_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_a_tok, stride_b_tok,
        scale, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L: tl.constexpr, LOG_T: tl.constexpr, BT: tl.constexpr,
        BH: tl.constexpr, BK: tl.constexpr, VH: tl.constexpr, DOT_PRECISION: tl.constexpr,
        TREE: tl.constexpr = False, TN: tl.constexpr = 1, LAUNCH_DEPENDENTS: tl.constexpr = False,
        CHAINED: tl.constexpr = False,
    ):
        """Grid ``(windows, HV / VH)``: the coefficients ``coef [B, HV, 2 BX + BH, BX]`` (rows:
        C1, Z, D) of ``VH`` value heads of one key head (GQA: they share the normalised
        window and history keys, so the K pass runs once for all of them), and the
        window's gates and (once per key head) keys as the ring keeps them. Coordinates
        in the BX x BX space: a column c < BT is token j = c (its k^), a row is token i
        (k-row: A, q-row: output).

        With ``TREE`` the window is a draft tree of ``TN`` nodes (DESIGN.md section 2,
        "Trees"): tokens past ``nodes_ptr[i_b]`` are padded nodes (like tokens past the
        window's end), and ``anc_ptr [B, TN]`` holds each node's ancestor-or-self set as
        a bitmask, which replaces the causal mask in the gate sums and every masked
        product. Off, the chain's code is unchanged.

        With ``LAUNCH_DEPENDENTS`` the outputs kernel, launched as this one's programmatic
        dependent, may start as soon as every program here has: its checkpoint pass
        overlaps this kernel's chain (:func:`launch_closed_form`). ``CHAINED``: launched
        by :func:`~replayssm.ops.triton_common.chain_launch`; it waits for the kernel
        before it first, and only then lets the outputs kernel start, whose pass over
        the checkpoint reads the window's activations."""
        if CHAINED:
            chain_wait(CHAINED)
        elif LAUNCH_DEPENDENTS:
            tl.extra.cuda.gdc_launch_dependents()
        i_b = tl.program_id(0)
        hv0 = tl.program_id(1) * VH  # the program's first value head; VH divides the group
        i_h = hv0 // (HV // H)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        bos = tl.load(cu_ptr + i_b).to(tl.int64)
        length = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
        if TREE:
            length = tl.minimum(length, tl.load(nodes_ptr + i_b).to(tl.int64))
        if (slot >= 0) & (length > 0):
            # Ring positions in 32 bits, wrapped by a mask where L is a power of two (as
            # the exact replay's, fold.replay_tile); the slot's offset into the rings
            # stays 64-bit (a pool's rings can pass 2^31 elements).
            wp = tl.load(wp_ptr + slot).to(tl.int32)
            base = tl.load(base_ptr + slot).to(tl.int32)
            n_hist = tl.where(tl.load(flush_ptr + slot) != 0, 0, wp)  # a flush row starts from an empty history
            offs_x, is_k, is_q, tok, p_tok, x_ok, xk_ok, xq_ok = _window_rows(bos, length, BT)
            offs_h = tl.arange(0, BH)
            hist = offs_h < n_hist
            pos_h = _ring_pos(base + offs_h, L)
            pos_w = _ring_pos(base + wp + tok, L)  # the window's records: logical write_pos + i
            rk_at = rk_ptr + slot * (L * H * K) + i_h * K
            rg_at = rg_ptr + slot * (L * HV)
            rb_at = rb_ptr + slot * (L * HV)
            offs_k = tl.arange(0, BK)
            mask_k = offs_k < K
            # The stacked window in one load, each row from its key or its query, as stored
            # (zero where the token is missing): a 16-bit ring stores its key rows as loaded.
            x_at = tl.where(is_k, k_ptr + p_tok * stride_k_tok + i_h * stride_k_head,
                            q_ptr + p_tok * stride_q_tok + i_h * stride_q_head)
            x = tl.load(x_at[:, None] + offs_k[None, :], mask=x_ok[:, None] & mask_k[None, :], other=0.0)
            NORMED: tl.constexpr = rk_ptr.dtype.element_ty == tl.float32  # ops.records.keys_normalized
            k_group = hv0 % (HV // H) == 0  # the window's keys are stored by the group's first program
            if NORMED:
                # The ring keeps each key normalised, by the exact kernels' own helper on a
                # key held as they hold it (four [K/4] vectors, whose sums run in the same
                # layout and order), so with the bits the exact recurrence steps with.
                KQ: tl.constexpr = BK // 4
                offs_c = tl.arange(0, KQ)
                for t in tl.static_range(BT):
                    t_ok = _tl_mask_and(offs_c >= 0, k_group & (t < length))
                    k0, k1, k2, k3 = _tl_load_parts(k_ptr, (bos + t) * stride_k_tok + i_h * stride_k_head + offs_c,
                                                    t_ok, offs_c, K, KQ)
                    kh0, kh1, kh2, kh3 = _tl_normalized(k0, k1, k2, k3, eps, 1.0)
                    _tl_store_parts(rk_at, _ring_pos(base + wp + t, L) * (H * K) + offs_c, t_ok, offs_c, K, KQ,
                                    kh0, kh1, kh2, kh3)
            else:
                k_store = _tl_mask_and(xk_ok, k_group)
                tl.store(rk_at + pos_w[:, None] * (H * K) + offs_k[None, :], x.to(rk_ptr.dtype.element_ty),
                         mask=k_store[:, None] & mask_k[None, :])
            # Unused ring entries may hold NaN: masked loads give 0 instead.
            h = tl.load(rk_at + pos_h[:, None] * (H * K) + offs_k[None, :],
                        mask=hist[:, None] & mask_k[None, :], other=0.0)
            if NORMED:
                # Keys and queries are exact in tf32 when 16-bit; the history's unit keys
                # round to tf32 as the state does in S x (product_precision).
                P = _gram(x, x, DOT_PRECISION)  # x_r . x_c
                HX = _gram(h, x.to(tl.float32), DOT_PRECISION)  # k^_c . x_r
            else:
                if x.dtype != h.dtype or x.dtype == tl.float32:
                    x = x.to(tl.float32)
                    h = h.to(tl.float32)
                # Keys and queries are exact in tf32 when 16-bit: these lose nothing.
                P = _gram(x, x, DOT_PRECISION)  # x_r . x_c
                HX = _gram(h, x, DOT_PRECISION)  # k_c . x_r (history keys)
            eye = offs_x[:, None] == offs_x[None, :]
            # The coefficients need no exact norms (the flush replays the records): rsqrt,
            # not sqrt_rn and div_rn with their slow paths.
            r_x = tl.where(is_q, scale, 1.0) * tl.math.rsqrt(_tl_row_sum(tl.where(eye, P, 0.0), 1) + eps)  # 1/|x_r| (q: x scale)
            P = P * r_x[:, None] * r_x[None, :]  # x^_r . x^_c
            if NORMED:
                HX = HX * r_x[None, :]  # k^_c . x^_r: the history's keys are unit vectors
            else:
                if h.dtype == tl.float32:
                    hh = _tl_row_sum(h * h, 1)
                else:
                    # 16-bit keys: |k_c|^2 on the tensor cores too, the diagonal of h h^T
                    # (exact products, fp32 sums), instead of an fp32 copy of h.
                    hh = _tl_row_sum(tl.where(offs_h[:, None] == offs_h[None, :], _gram(h, h, "ieee"), 0.0), 1)
                r_h = tl.where(hist, tl.math.rsqrt(hh + eps), 0.0)
                HX = HX * r_h[:, None] * r_x[None, :]  # k^_c . x^_r
            # Transposed, as the head's matrices are built (row c, column r):
            # on_path_t[c, r]: c's token is on r's root path (r's own included).
            if TREE:
                # Row r's ancestor set (its token's), tested at c's token.
                anc = tl.load(anc_ptr + i_b * TN + tok, mask=x_ok, other=0)
                on_path_t = ((anc[None, :] >> tok[:, None]) & 1) != 0
            else:
                on_path_t = tok[:, None] <= tok[None, :]
            pair_t = xk_ok[:, None] & x_ok[None, :] & on_path_t
            a_at = a_ptr + p_tok * stride_a_tok
            b_at = b_ptr + p_tok * stride_b_tok
            for j in tl.static_range(VH):
                _head_coefficients(a_at, b_at, A_log_ptr, dt_bias_ptr, rg_at, rb_at, coef_ptr, i_b, hv0 + j,
                                   P, HX, r_x, offs_x, is_k, is_q, tok, x_ok, xk_ok, xq_ok, eye, pair_t, on_path_t, offs_h,
                                   hist, pos_h, pos_w, HV, LOG_T, BT, BH, TREE)

    @triton.jit
    def _head_coefficients(a_at, b_at, A_log_ptr, dt_bias_ptr, rg_at, rb_at, coef_ptr, i_b, i_hv,
                           P, HX, r_x, offs_x, is_k, is_q, tok, x_ok, xk_ok, xq_ok, eye, pair_t, on_path_t, offs_h, hist,
                           pos_h, pos_w, HV: tl.constexpr, LOG_T: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                           TREE: tl.constexpr = False):
        """One value head's C1, Z, D (see the module notes) from its key head's normalised
        Gram matrix ``P`` and history products ``HX``; its window gates go to the ring
        (``rg_at``, ``rb_at``: the slot's gates, at ring positions ``pos_h`` / ``pos_w``)."""
        BX: tl.constexpr = 2 * BT
        # Committed history (no records for flush rows), never built:
        #   S x = exp(Gtot) S0 x + sum_c exp(Gtot - G_c) u_c (k^_c . x),
        # exp(Gtot - G_c) = exp(g_{c+1} + ... + g_h): a suffix sum, no cancellation.
        g_h = tl.load(rg_at + pos_h * HV + i_hv, mask=hist, other=0.0)
        w_h = tl.where(hist, tl.exp(_tl_row_sum(tl.where(offs_h[None, :] > offs_h[:, None], g_h[None, :], 0.0), 1)), 0.0)
        e_Gh = tl.exp(_tl_row_sum(g_h, 0))

        # Gates per row (a row's token), G_r = g_1 + ... + g_tok(r).
        a_x = tl.load(a_at + i_hv, mask=x_ok, other=0.0)
        b_x = tl.load(b_at + i_hv, mask=x_ok, other=0.0)
        g, beta = _tl_gdn_gates(a_x, b_x, tl.load(A_log_ptr + i_hv), tl.load(dt_bias_ptr + i_hv))
        g = tl.where(xk_ok, g, 0.0)  # on the key rows only, so that a row sum runs over tokens
        beta = tl.where(xk_ok, beta, 0.0)
        tl.store(rg_at + pos_w * HV + i_hv, g, mask=xk_ok)
        tl.store(rb_at + pos_w * HV + i_hv, beta, mask=xk_ok)
        if TREE:
            # G_r = the sum of g over r's root path (g is zero off the key rows).
            G = _tl_row_sum(tl.where(on_path_t, g[:, None], 0.0), 0)
        else:
            G = _tl_row_sum(tl.where(offs_x[:, None] <= tok[None, :], g[:, None], 0.0), 0)
        e_G = tl.exp(G)

        # The window's matrices, built transposed (row c, column r: the orientation in
        # which they enter the products below, so that nothing is transposed):
        #   A^T_cr = beta_r exp(G_r - G_c) (k^_r . k^_c), c < r;   M^T_cr = exp(G_r - G_c) (q^_r . k^_c), c <= r
        # (P is symmetric up to rounding: P_cr for P_rc.)
        # Mask before exp: G_r - G_c > 0 for c > r could overflow.
        decay_t = tl.where(pair_t, tl.exp(tl.where(pair_t, G[None, :] - G[:, None], 0.0)), 0.0)
        A_t = tl.where(is_k[None, :] & (offs_x[:, None] < offs_x[None, :]), beta[None, :] * decay_t * P, 0.0)
        M_t = tl.where(is_q[None, :], decay_t * P, 0.0)
        # A^T is strictly upper triangular on the key block and zero elsewhere:
        #   E = ((I + A)^-1)^T on the key block = (I_k - A^T)(I + A^T^2)(I + A^T^4)...
        # (I_k: the identity's key rows; E is zero off the key block.)
        E = tl.where(eye & is_k[:, None], 1.0, 0.0) - A_t
        A_pow = A_t
        for _ in tl.static_range(LOG_T - 1):
            A_pow = _mm(A_pow, A_pow, BX, "ieee")
            E = E + _mm(E, A_pow, BX, "ieee")
        # The window's corrected deltas and outputs are linear in S x^_r and v:
        #   U_i = sum_j (I + A)^-1_ij beta_j (v_j - exp(G_j) S k^_j)
        #   o_i = exp(G_i) S q^_i + sum_j M_ij U_j
        # so with F = E (I + M^T), [U | o] = (S x^) C + v D where
        #   D = diag(beta) F,  C = -diag(beta e^G) F + diag(e^G on q rows).
        F = E + _mm(E, M_t, BX, "ieee")
        D = beta[:, None] * F
        C = tl.where(eye & xq_ok[:, None], e_G[:, None], 0.0) - (beta * e_G)[:, None] * F
        # S x^_r = exp(Gtot) r_x S0 x_r + sum_c w_c u_c (k^_c . x^_r): the checkpoint enters
        # through C1 = diag(exp(Gtot) r_x) C, the history's u through Z = diag(w) HX C.
        C1 = (e_Gh * r_x)[:, None] * C
        Z = _mm(w_h[:, None] * HX, C, BX, "ieee")
        coef_at = coef_ptr + (i_b * HV + i_hv) * ((2 * BX + BH) * BX)
        tl.store(coef_at + offs_x[:, None] * BX + offs_x[None, :], C1)
        tl.store(coef_at + (BX + offs_h[:, None]) * BX + offs_x[None, :], Z)
        tl.store(coef_at + (BX + BH + offs_x[:, None]) * BX + offs_x[None, :], D)

    @triton.jit
    def _checkpoint_window_products(q_ptr, k_ptr, ckpt_at, p_tok, i_h, offs_v, mask_v, xk_ok, xq_ok,
                                    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                                    K: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, BX: tl.constexpr,
                                    BV: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
        """``S0 x_r [BV, BX]`` for the stacked raw keys and queries: the checkpoint's one
        read, in ``KC``-wide chunks pipelined ``NUM_STAGES`` deep. A bf16 checkpoint with
        bf16 activations multiplies as stored (each stacked row is one key or query, so
        it is bf16 exactly; the products are exact and sum in fp32, as in tf32, with no
        conversion of the chunk); other dtypes go through fp32 at ``DOT_PRECISION``."""
        offs_c = tl.arange(0, KC)
        SX = tl.zeros([BV, BX], dtype=tl.float32)
        for kc in tl.range(0, BK, KC, num_stages=NUM_STAGES):
            offs_k = kc + offs_c
            mask_k = offs_k < K
            S_c = tl.load(ckpt_at + offs_v[:, None] * K + offs_k[None, :], mask=mask_v[:, None] & mask_k[None, :],
                          other=0.0)
            x_c = _load_window_x(q_ptr, k_ptr, p_tok, i_h, offs_k, mask_k, xk_ok, xq_ok,
                                 stride_q_tok, stride_q_head, stride_k_tok, stride_k_head)
            if S_c.dtype == tl.bfloat16 and x_c.dtype == tl.bfloat16:
                SX = tl.dot(S_c, tl.trans(x_c), SX)
            else:
                SX = tl.dot(S_c.to(tl.float32), tl.trans(x_c.to(tl.float32)), SX, input_precision=DOT_PRECISION)
        return SX

    @triton.jit
    def _parts_window_products(S0, S1, S2, S3, q_ptr, k_ptr, p_tok, i_h, offs_c, xk_ok, xq_ok,
                               stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                               K: tl.constexpr, KQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """``S x_r [BV, BX]`` for a state tile held as four ``KQ``-wide parts (registers)
        and the stacked window's raw keys and queries."""
        x0 = _load_window_x(q_ptr, k_ptr, p_tok, i_h, offs_c, offs_c < K, xk_ok, xq_ok,
                            stride_q_tok, stride_q_head, stride_k_tok, stride_k_head).to(tl.float32)
        x1 = _load_window_x(q_ptr, k_ptr, p_tok, i_h, KQ + offs_c, KQ + offs_c < K, xk_ok, xq_ok,
                            stride_q_tok, stride_q_head, stride_k_tok, stride_k_head).to(tl.float32)
        x2 = _load_window_x(q_ptr, k_ptr, p_tok, i_h, 2 * KQ + offs_c, 2 * KQ + offs_c < K, xk_ok, xq_ok,
                            stride_q_tok, stride_q_head, stride_k_tok, stride_k_head).to(tl.float32)
        x3 = _load_window_x(q_ptr, k_ptr, p_tok, i_h, 3 * KQ + offs_c, 3 * KQ + offs_c < K, xk_ok, xq_ok,
                            stride_q_tok, stride_q_head, stride_k_tok, stride_k_head).to(tl.float32)
        SX = tl.dot(S0, tl.trans(x0), input_precision=DOT_PRECISION)
        SX = tl.dot(S1, tl.trans(x1), SX, input_precision=DOT_PRECISION)
        SX = tl.dot(S2, tl.trans(x2), SX, input_precision=DOT_PRECISION)
        return tl.dot(S3, tl.trans(x3), SX, input_precision=DOT_PRECISION)

    @triton.jit
    def _row_window_products(S0, S1, S2, S3, q_ptr, k_ptr, ckpt_at, p_tok, i_h, offs_c, offs_v, mask_v, xk_ok, xq_ok,
                             stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                             K: tl.constexpr, KQ: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, BX: tl.constexpr,
                             BV: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
                             EARLY_TILE: tl.constexpr):
        """A row that does not fold: ``S0 x_r`` from its tile's parts in registers
        (``EARLY_TILE``) or streamed from the checkpoint."""
        if EARLY_TILE:
            return _parts_window_products(S0, S1, S2, S3, q_ptr, k_ptr, p_tok, i_h, offs_c, xk_ok, xq_ok,
                                          stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, K, KQ,
                                          DOT_PRECISION)
        return _checkpoint_window_products(q_ptr, k_ptr, ckpt_at, p_tok, i_h, offs_v, mask_v, xk_ok, xq_ok,
                                           stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                                           K, BK, KC, BX, BV, DOT_PRECISION, NUM_STAGES)

    @triton.jit
    def _folded_window_products(S0, S1, S2, S3, q_ptr, k_ptr, ckpt_at, tile, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ring_at,
                                base, wp, p_tok, i_h, i_hv, offs_c, offs_v, mask_v, xk_ok, xq_ok,
                                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, eps,
                                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
                                KQ: tl.constexpr, AHEAD: tl.constexpr, ROUND_STATE: tl.constexpr,
                                DOT_PRECISION: tl.constexpr, EARLY_TILE: tl.constexpr):
        """A flush row's ``S x_r``: the fold's replay and store on its tile (so the
        checkpoint is the fold's, bit for bit), then the window's products with the
        folded tile as stored, as every other row's are with its checkpoint."""
        if not EARLY_TILE:
            S0, S1, S2, S3 = _tl_load_parts(ckpt_at, tile, mask_v[:, None], offs_c[None, :], K, KQ)
        S0, S1, S2, S3 = _replay_and_store_tile(
            S0, S1, S2, S3, ckpt_at, tile, rk_ptr + ring_at * (H * K) + i_h * K,
            rv_ptr + ring_at * (HV * V) + i_hv * V, rg_ptr + ring_at * HV + i_hv, rb_ptr + ring_at * HV + i_hv,
            base, tl.minimum(wp, L), offs_c, offs_v, mask_v, H * K, HV * V, HV, HV, eps, K, L, KQ, AHEAD,
            ROUND_STATE)
        return _parts_window_products(S0, S1, S2, S3, q_ptr, k_ptr, p_tok, i_h, offs_c, xk_ok, xq_ok,
                                      stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, K, KQ, DOT_PRECISION)

    @triton.jit
    def _row_records(ru_at, v_ptr, p_tok, i_hv, pos_h, hist, offs_v, mask_v, xk_ok, stride_v_tok, stride_v_head,
                     HV: tl.constexpr, V: tl.constexpr):
        """What the outputs read besides the state and the coefficients: the history's
        ``u [BV, BH]`` (slot's ``ring_u`` at ``ru_at``, its rows at ring positions
        ``pos_h``) and the window's values ``v [BV, BX]`` as stored. Neither is written
        by the coefficient kernel, so they may load before its end."""
        # (Unused ring entries may hold NaN: masked loads give 0 instead.)
        u_h = tl.load(ru_at + pos_h[None, :] * (HV * V) + offs_v[:, None], mask=mask_v[:, None] & hist[None, :],
                      other=0.0)
        v_x = tl.load(v_ptr + p_tok[None, :] * stride_v_tok + i_hv * stride_v_head + offs_v[:, None],
                      mask=mask_v[:, None] & xk_ok[None, :], other=0.0)
        return u_h, v_x

    @triton.jit
    def _window_row(
        i_v, i_b, i_hv,
        q_ptr, k_ptr, v_ptr, ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
        slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, coef_ptr, o_ptr, nodes_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
        BT: tl.constexpr, BTC: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, BV: tl.constexpr,
        DOT_PRECISION: tl.constexpr, COEF_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
        FUSE_FLUSH: tl.constexpr, ROUND_STATE: tl.constexpr, AHEAD: tl.constexpr, TREE: tl.constexpr,
        WAIT_COEF: tl.constexpr, EARLY_TILE: tl.constexpr, RECORDS_FIRST: tl.constexpr,
    ):
        """Outputs and corrected deltas of V block ``i_v`` (``BV`` rows) of window ``i_b``'s
        value head ``i_hv``, from its rows of the (folded) checkpoint and the
        coefficients.

        ``FUSE_FLUSH``: a flush row folds its history here
        (:func:`_folded_window_products`), so its checkpoint is read once for the fold
        and the window together; without it the fold kernel has already run.
        ``EARLY_TILE``: every row loads its whole checkpoint tile, as four parts in
        registers, first: its address needs the slot alone, so its loads are in flight
        while the cursors load, and a row that does not flush multiplies the parts as
        they are (no pipelined pass over K after the cursors). ``TREE``: tokens past
        ``nodes_ptr[i_b]`` are a tree's padded nodes: read by nothing, zero outputs, no
        records (the tree lives in the coefficients). ``WAIT_COEF``: the kernel runs as
        the coefficient kernel's programmatic dependent and waits for its end before
        reading ``coef``. ``RECORDS_FIRST``: a row that does not fold loads its history's
        ``u`` and its values before its pass over the checkpoint (their latency under the
        pass, their registers held through it) instead of after it."""
        BX: tl.constexpr = 2 * BT
        BXC: tl.constexpr = 2 * BTC  # the coefficient kernel's stacked window (BTC <= BT)
        KQ: tl.constexpr = BK // 4
        i_h = i_hv // (HV // H)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        bos = tl.load(cu_ptr + i_b).to(tl.int64)
        length = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < V
        if TREE:
            rows_ok = tl.arange(0, 2 * BT) % BT < length  # the window's rows, padded nodes included
            if slot >= 0:
                length = tl.minimum(length, tl.load(nodes_ptr + i_b).to(tl.int64))
        offs_x, is_k, is_q, tok, p_tok, x_ok, xk_ok, xq_ok = _window_rows(bos, length, BT)
        # o is a fresh contiguous [N, HV, V]; column r >= BT of a [BV, BX] block is token r - BT
        p_o = o_ptr + (p_tok[None, :] * HV + i_hv) * V + offs_v[:, None]
        if (slot < 0) | (length <= 0):
            # Padding row: zero outputs, nothing else.
            tl.store(p_o, tl.zeros([BV, BX], dtype=o_ptr.dtype.element_ty), mask=mask_v[:, None] & xq_ok[None, :])
        else:
            ckpt_at = ckpt_ptr + (slot * HV + i_hv) * (V * K)
            offs_c = tl.arange(0, KQ)
            tile = offs_v[:, None] * K + offs_c[None, :]
            if EARLY_TILE:
                S0, S1, S2, S3 = _tl_load_parts(ckpt_at, tile, mask_v[:, None], offs_c[None, :], K, KQ)
            else:
                S0, S1, S2, S3 = 0.0, 0.0, 0.0, 0.0  # loaded where they are needed
            # Ring positions in 32 bits, wrapped by a mask (fold._ring_pos); the slot's
            # offset into the rings stays 64-bit (a pool's rings can pass 2^31 elements).
            wp = tl.load(wp_ptr + slot).to(tl.int32)
            base = tl.load(base_ptr + slot).to(tl.int32)
            flush = tl.load(flush_ptr + slot) != 0
            folds = flush & (wp > 0)
            n_hist = tl.where(flush, 0, wp)
            ring_at = slot * L
            offs_h = tl.arange(0, BH)
            hist = offs_h < n_hist
            pos_h = _ring_pos(base + offs_h, L)
            pos_w = _ring_pos(base + wp + tok, L)  # the window's records: logical write_pos + i
            ru_at = ru_ptr + ring_at * (HV * V) + i_hv * V
            # The fold's branch exists only where the kernel folds (a Python flag
            # assigned here would become a run-time one): its four-part products
            # need K >= 64 on CUDA.
            # With RECORDS_FIRST a row that does not fold loads its history's u and
            # its values first, so that their latency overlaps its pass over the
            # checkpoint; a folding row loads them after its fold, keeping the fold's
            # registers free. Without it every row loads them after its products.
            rec_args = (ru_at, v_ptr, p_tok, i_hv, pos_h, hist, offs_v, mask_v, xk_ok, stride_v_tok,
                        stride_v_head, HV, V)
            products = (S0, S1, S2, S3, q_ptr, k_ptr, ckpt_at, p_tok, i_h, offs_c, offs_v, mask_v, xk_ok, xq_ok,
                        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head)
            if FUSE_FLUSH:
                if folds:
                    SX = _folded_window_products(S0, S1, S2, S3, q_ptr, k_ptr, ckpt_at, tile, rk_ptr, rv_ptr,
                                                 rg_ptr, rb_ptr, ring_at, base, wp, p_tok, i_h, i_hv, offs_c,
                                                 offs_v, mask_v, xk_ok, xq_ok, stride_q_tok, stride_q_head,
                                                 stride_k_tok, stride_k_head, eps, H, HV, K, V, L, KQ, AHEAD,
                                                 ROUND_STATE, DOT_PRECISION, EARLY_TILE)
                    if RECORDS_FIRST:
                        u_h, v_x = _row_records(*rec_args)
                else:
                    if RECORDS_FIRST:
                        u_h, v_x = _row_records(*rec_args)
                    SX = _row_window_products(*products, K, KQ, BK, KC, BX, BV, DOT_PRECISION, NUM_STAGES, EARLY_TILE)
            else:
                if RECORDS_FIRST:
                    u_h, v_x = _row_records(*rec_args)
                SX = _row_window_products(*products, K, KQ, BK, KC, BX, BV, DOT_PRECISION, NUM_STAGES, EARLY_TILE)
            if not RECORDS_FIRST:
                u_h, v_x = _row_records(*rec_args)
            # [U | o] = (S0 x_r) C1 + u_h Z + v D
            # The coefficients were computed on the coefficient kernel's stacked window
            # of 2 BTC rows: row r of this one is its row cx(r); the rest are zero.
            if WAIT_COEF:
                # Everything above overlapped the coefficient kernel: it reads nothing
                # that kernel writes (its records are the window's, past the history:
                # ops/cursors.py), and writes nothing it reads (the flush rows'
                # checkpoints). From here on it reads the coefficients and writes the
                # window's records.
                tl.extra.cuda.gdc_wait()
            cx = tok + tl.where(is_q, BTC, 0)
            c_ok = tok < BTC
            coef_at = coef_ptr + (i_b * HV + i_hv) * ((2 * BXC + BH) * BXC)
            C1 = tl.load(coef_at + cx[:, None] * BXC + cx[None, :], mask=c_ok[:, None] & c_ok[None, :], other=0.0)
            Z = tl.load(coef_at + (BXC + offs_h[:, None]) * BXC + cx[None, :], mask=c_ok[None, :], other=0.0)
            D = tl.load(coef_at + (BXC + BH + cx[:, None]) * BXC + cx[None, :],
                        mask=c_ok[:, None] & c_ok[None, :], other=0.0)
            out = tl.dot(SX, C1, input_precision=COEF_PRECISION)
            out = tl.dot(u_h, Z, out, input_precision=COEF_PRECISION)
            # U on key columns, o on query columns
            out = tl.dot(v_x.to(tl.float32), D, out, input_precision=COEF_PRECISION)
            if TREE:
                # Padded nodes' rows get zeros.
                tl.store(p_o, _tl_to_rtne(tl.where(xq_ok[None, :], out, 0.0), o_ptr.dtype.element_ty),
                         mask=mask_v[:, None] & (is_q & rows_ok)[None, :])
            else:
                tl.store(p_o, _tl_to_rtne(out, o_ptr.dtype.element_ty), mask=mask_v[:, None] & xq_ok[None, :])
            rec = pos_w[None, :] * (HV * V) + offs_v[:, None]
            vk_ok = mask_v[:, None] & xk_ok[None, :]
            tl.store(rv_ptr + ring_at * (HV * V) + i_hv * V + rec, v_x.to(rv_ptr.dtype.element_ty), mask=vk_ok)
            tl.store(ru_at + rec, out, mask=vk_ok)

    @triton.jit
    def _window_outputs_kernel(
        q_ptr, k_ptr, v_ptr, ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
        slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, coef_ptr, o_ptr, nodes_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, eps, batch, tail,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
        BT: tl.constexpr, BTC: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, BV: tl.constexpr,
        DOT_PRECISION: tl.constexpr, COEF_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
        FUSE_FLUSH: tl.constexpr, ROUND_STATE: tl.constexpr, AHEAD: tl.constexpr, TREE: tl.constexpr = False,
        WAIT_COEF: tl.constexpr = False, EARLY_TILE: tl.constexpr = False,
        SHORT_TAIL: tl.constexpr = False, BB: tl.constexpr = 1, RECORDS_FIRST: tl.constexpr = False,
        CHAINED: tl.constexpr = False,
    ):
        """Grid ``(V blocks, windows, HV)``: every row's window (:func:`_window_row`).

        ``CHAINED``: part of a chain (:func:`~replayssm.ops.triton_common.chained_launches`);
        it lets the next kernel start at once, whose programs wait for this one's end
        before they read anything it writes.

        ``SHORT_TAIL`` (``BB >= batch``): grid ``(V blocks, HV, windows)``, its last axis a
        position in the order that moves the last ``tail`` rows that do not fold to the
        end (:func:`~replayssm.ops.triton_common.short_tail_row`). The GPU starts
        programs in grid order, so no fold's chain, the longest program, starts in the
        last waves; with ``tail >= batch`` the folds all start first."""
        if CHAINED:
            tl.extra.cuda.gdc_launch_dependents()
        if SHORT_TAIL:
            i_b = _tl_short_tail_row(tl.program_id(2), slots_ptr, cu_ptr, wp_ptr, flush_ptr, batch, tail, BB)
            i_hv = tl.program_id(1)
        else:
            i_b = tl.program_id(1)
            i_hv = tl.program_id(2)
        _window_row(tl.program_id(0), i_b, i_hv,
                    q_ptr, k_ptr, v_ptr, ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
                    slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, coef_ptr, o_ptr, nodes_ptr,
                    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, eps,
                    H, HV, K, V, L, BT, BTC, BH, BK, KC, BV, DOT_PRECISION, COEF_PRECISION, NUM_STAGES,
                    FUSE_FLUSH, ROUND_STATE, AHEAD, TREE, WAIT_COEF, EARLY_TILE, RECORDS_FIRST)

    # ---- small batches: one launch, the exact recurrence all the way ("replay")
    # At a few requests every kernel is latency-bound: the time is the length of each
    # program's dependent chain plus one launch overhead per kernel, not bytes. There the
    # closed form's flush and window solve (two dependent chains in one program) cost more
    # than stepping the recurrence: one program per (V block, window,
    # value head) loads its checkpoint tile once, replays the row's committed history
    # through the exact step (the fold kernel's helpers, loads and order: a flush row
    # stores the tile back, bit for bit the fold's checkpoint), then steps the window's
    # tokens on the tile in registers for the outputs and the records (u is the step's
    # own corrected delta). Paired with a flush at every commit (``is_flush`` raised by
    # ``advance_cursors(..., flush_every=True)``), a row's history is the last step's
    # accepted tokens, so a program's chain is at most 2T steps.

    @_tl_device_fn
    def _store_token(o_at, o, rk_ptr, rv_ptr, ru_ptr, rg_ptr, rb_ptr, rec, i_h, i_hv, offs_c, offs_v, mc, mv,
                     k_writer, gate_writer, k0, k1, k2, k3, xv, u, g, beta, eps,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KQ: tl.constexpr):
        """A replayed token's output at ``o_at`` and its record at flat ring entry
        ``rec``: ``k`` as the ring keeps it (where ``k_writer``: once per key head;
        :func:`~replayssm.ops.triton_common.record_key`), ``v``, ``u``, and the gates
        (where ``gate_writer``: once per value head); ``mc`` / ``mv`` the block masks."""
        tl.store(o_at, _tl_to_rtne(o, o_at.dtype.element_ty), mask=mv)
        r0, r1, r2, r3 = _tl_record_key(rk_ptr, k0, k1, k2, k3, eps)
        _tl_store_parts(rk_ptr, (rec * H + i_h) * K + offs_c, _tl_mask_and(mc, k_writer), offs_c, K, KQ,
                        r0, r1, r2, r3)
        tl.store(rv_ptr + (rec * HV + i_hv) * V + offs_v, xv.to(rv_ptr.dtype.element_ty), mask=mv)
        tl.store(ru_ptr + (rec * HV + i_hv) * V + offs_v, u, mask=mv)
        tl.store(rg_ptr + rec * HV + i_hv, g, mask=gate_writer)
        tl.store(rb_ptr + rec * HV + i_hv, beta, mask=gate_writer)

    @triton.jit
    def _replay_window_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
        ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
        slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, o_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_a_tok, stride_b_tok,
        scale, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, T: tl.constexpr, ROUND_STATE: tl.constexpr,
    ):
        i_v, i_b, i_hv, i_h, slot, bos, length = _tl_window_program(slots_ptr, cu_ptr, H, HV)
        KQ: tl.constexpr = BK // 4
        offs_c = tl.arange(0, KQ)  # key index within a part
        all_c = offs_c >= 0
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < V
        o_row = o_ptr + (bos * HV + i_hv) * V + offs_v  # o is a fresh contiguous [N, HV, V]

        if slot < 0:
            # Padding row: zero outputs, nothing else.
            for i in range(0, T):
                tl.store(o_row + i * HV * V, tl.full([BV], 0, o_ptr.dtype.element_ty), mask=_tl_mask_and(mask_v, i < length))
            return

        wp = tl.load(wp_ptr + slot).to(tl.int64)
        base = tl.load(base_ptr + slot).to(tl.int64)
        flush = tl.load(flush_ptr + slot) != 0
        ring_at = slot * L  # flat record index of the slot's ring
        tile = offs_v[:, None] * K + offs_c[None, :]
        ckpt_at = ckpt_ptr + (slot * HV + i_hv) * (V * K)
        # ---- the committed history, exactly as the fold kernel replays it
        count = tl.minimum(wp, L)
        S0, S1, S2, S3 = _replay_history(
            ckpt_at, tile, rk_ptr + ring_at * (H * K) + i_h * K, rv_ptr + ring_at * (HV * V) + i_hv * V,
            rg_ptr + ring_at * HV + i_hv, rb_ptr + ring_at * HV + i_hv, base, count, offs_c, offs_v, mask_v,
            H * K, HV * V, HV, HV, eps, K, L, KQ)
        # A flush row's checkpoint becomes the folded state (the fold's store, bit for bit);
        # every other row's checkpoint is read only.
        _tl_store_parts(ckpt_at, tile, _tl_mask_and(mask_v, flush & (count > 0))[:, None], offs_c[None, :], K, KQ,
                        S0, S1, S2, S3)
        if ROUND_STATE:
            # The committed state is what a fold stores (16-bit): the window starts from it.
            S0, S1, S2, S3 = _tl_as_stored(S0, S1, S2, S3, ckpt_ptr.dtype.element_ty)

        # ---- the window, token by token (next token's loads ahead of this token's step)
        A_log = tl.load(A_log_ptr + i_hv)
        dt_bias = tl.load(dt_bias_ptr + i_hv)
        k_writer = (i_hv % (HV // H) == 0) & (i_v == 0)  # the key once per key head
        valid_n = 0 < length
        mc_n, mv_n, q0n, q1n, q2n, q3n, k0n, k1n, k2n, k3n, xv_n, a_n, b_n = _rec_load_token(
            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos, valid_n, all_c, mask_v, i_h, i_hv, offs_c, offs_v,
            stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok,
            K, KQ,
        )
        for i in range(0, T):
            valid, mc, mv = valid_n, mc_n, mv_n
            q0, q1, q2, q3, k0, k1, k2, k3, xv, a, b = q0n, q1n, q2n, q3n, k0n, k1n, k2n, k3n, xv_n, a_n, b_n
            valid_n = i + 1 < length
            mc_n, mv_n, q0n, q1n, q2n, q3n, k0n, k1n, k2n, k3n, xv_n, a_n, b_n = _rec_load_token(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos + i + 1, valid_n, all_c, mask_v, i_h, i_hv, offs_c, offs_v,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                stride_a_tok, stride_b_tok, K, KQ,
            )
            # Positions past the row's end keep the state (nothing of theirs is stored).
            S0, S1, S2, S3, o, u, g, beta = _exact_token(S0, S1, S2, S3, q0, q1, q2, q3, k0, k1, k2, k3, xv, a, b,
                                                          A_log, dt_bias, valid, eps, scale)
            # The record at logical position write_pos + i (physical after cache_base).
            _store_token(o_row + i * HV * V, o, rk_ptr, rv_ptr, ru_ptr, rg_ptr, rb_ptr, ring_at + (base + wp + i) % L,
                         i_h, i_hv, offs_c, offs_v, mc, mv, k_writer, valid & (i_v == 0), k0, k1, k2, k3, xv, u, g,
                         beta, eps, H, HV, K, V, KQ)

    # The small-batch path for draft trees. One program per (V block, leaf path, value
    # head) steps the exact recurrence along its leaf's root path, so a tree's latency is
    # a chain of its depth (its paths run side by side), not the closed form's window of
    # all its nodes. A node on several paths is stepped by each of them, with the same
    # arithmetic from the same state, so the same bits; the first path through it stores
    # its output and record. No program here writes a state: several read each row's
    # checkpoint, so the flush rows' fold runs first, as a launch of its own.

    @triton.jit
    def _tree_replay_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
        ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
        slots_ptr, wp_ptr, base_ptr, flush_ptr, nodes_ptr, paths_ptr, o_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_a_tok, stride_b_tok,
        scale, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, TN: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
        BD: tl.constexpr, ROUND_STATE: tl.constexpr, LOAD_AHEAD: tl.constexpr,
    ):
        i_v = tl.program_id(0)
        i_b = tl.program_id(1) // P
        i_p = tl.program_id(1) % P
        i_hv = tl.program_id(2)
        i_h = i_hv // (HV // H)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        bos = i_b.to(tl.int64) * TN  # request i_b's node i is packed row i_b * TN + i
        KQ: tl.constexpr = BK // 4
        offs_c = tl.arange(0, KQ)
        all_c = offs_c >= 0
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < V
        o_row = o_ptr + (bos * HV + i_hv) * V + offs_v  # o is a fresh contiguous [B * TN, HV, V]
        _zero_padded_nodes(o_row, nodes_ptr, i_b, i_p, slot, mask_v, HV, V, TN, BV)
        path, own, offs_d = _leaf_path(paths_ptr, i_p, D, BD)
        first = _path_node(path, offs_d, 0)
        if (slot < 0) | (first < 0):
            return

        wp = tl.load(wp_ptr + slot).to(tl.int64)
        base = tl.load(base_ptr + slot).to(tl.int64)
        flush = tl.load(flush_ptr + slot) != 0
        ring_at = slot * L
        tile = offs_v[:, None] * K + offs_c[None, :]
        ckpt_at = ckpt_ptr + (slot * HV + i_hv) * (V * K)
        # A flush row's checkpoint already holds its history (the fold launch before this
        # one); any other row's history is replayed here, read only.
        count = tl.where(flush, 0, tl.minimum(wp, L))
        S0, S1, S2, S3 = _replay_history(
            ckpt_at, tile, rk_ptr + ring_at * (H * K) + i_h * K, rv_ptr + ring_at * (HV * V) + i_hv * V,
            rg_ptr + ring_at * HV + i_hv, rb_ptr + ring_at * HV + i_hv, base, count, offs_c, offs_v, mask_v,
            H * K, HV * V, HV, HV, eps, K, L, KQ)
        if ROUND_STATE:
            # As the chain's replay: the window starts from the state a fold would store.
            S0, S1, S2, S3 = _tl_as_stored(S0, S1, S2, S3, ckpt_ptr.dtype.element_ty)

        # ---- the path, node by node; with LOAD_AHEAD the next node's loads are issued
        # before this node's step (the recurrence kernel's flag, recurrent.py: fewer
        # registers without it, so more programs an SM)
        A_log = tl.load(A_log_ptr + i_hv)
        dt_bias = tl.load(dt_bias_ptr + i_hv)
        k_writer = (i_hv % (HV // H) == 0) & (i_v == 0)  # the key once per key head
        if LOAD_AHEAD:
            node_n = first
            mc_n, mv_n, q0n, q1n, q2n, q3n, k0n, k1n, k2n, k3n, xv_n, a_n, b_n = _rec_load_token(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos + node_n, node_n >= 0, all_c, mask_v, i_h, i_hv, offs_c, offs_v,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                stride_a_tok, stride_b_tok, K, KQ,
            )
        for s in range(0, D):
            if LOAD_AHEAD:
                node, mc, mv = node_n, mc_n, mv_n
                q0, q1, q2, q3, k0, k1, k2, k3, xv, a, b = q0n, q1n, q2n, q3n, k0n, k1n, k2n, k3n, xv_n, a_n, b_n
                node_n = _path_node(path, offs_d, s + 1)
                mc_n, mv_n, q0n, q1n, q2n, q3n, k0n, k1n, k2n, k3n, xv_n, a_n, b_n = _rec_load_token(
                    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos + tl.maximum(node_n, 0), node_n >= 0, all_c, mask_v, i_h,
                    i_hv, offs_c, offs_v, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
                    stride_v_head, stride_a_tok, stride_b_tok, K, KQ,
                )
            else:
                node = _path_node(path, offs_d, s)
                mc, mv, q0, q1, q2, q3, k0, k1, k2, k3, xv, a, b = _rec_load_token(
                    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos + tl.maximum(node, 0), node >= 0, all_c, mask_v, i_h,
                    i_hv, offs_c, offs_v, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
                    stride_v_head, stride_a_tok, stride_b_tok, K, KQ,
                )
            valid = node >= 0
            store = valid & _owns(own, offs_d, s)
            # Past the path's end the state stays (nothing of those steps is stored).
            S0, S1, S2, S3, o, u, g, beta = _exact_token(S0, S1, S2, S3, q0, q1, q2, q3, k0, k1, k2, k3, xv, a, b,
                                                          A_log, dt_bias, valid, eps, scale)
            # Node i's record at logical position write_pos + i, as a window's token i.
            at = tl.maximum(node, 0)
            _store_token(o_row + at * HV * V, o, rk_ptr, rv_ptr, ru_ptr, rg_ptr, rb_ptr, ring_at + (base + wp + at) % L,
                         i_h, i_hv, offs_c, offs_v, mc, _tl_mask_and(mv, store), k_writer & store,
                         store & (i_v == 0), k0, k1, k2, k3, xv, u, g, beta, eps, H, HV, K, V, KQ)


def launch_flush(checkpoint, ring, slots, write_pos, cache_base, is_flush) -> None:
    """Launch the closed form's flush on validated arguments: the fold kernel on the rows
    with ``is_flush`` (their committed records, from ``cache_base``), the others exit."""
    kd, vd = checkpoint.shape[3], checkpoint.shape[2]
    cfg = tuning.lookup("closed_form", K=kd, V=vd, state_dtype=checkpoint.dtype, batch=slots.shape[0])
    launch_fold(checkpoint[None], *(getattr(ring, f)[None] for f in ring._fields), slots, cache_base, write_pos, is_flush,
                block_v=cfg["flush_block_v"], records_ahead=cfg["flush_records_ahead"])


def launch_coefficients(q, k, a, b, A_log, dt_bias, checkpoint, ring, slots, cu_seqlens, write_pos, cache_base,
                        is_flush, max_len: int, tree: DeviceTrees | None = None, *,
                        dependent: bool = False) -> torch.Tensor:
    """Launch the closed form's coefficient kernel on validated arguments; return the
    coefficients ``[B, HV, 2 BX + BH, BX]`` (float32). It writes the window's keys
    (normalised in an fp32 ring: ``ops.records.keys_normalized``) and gates to the ring. With ``tree`` the windows are those draft trees (the
    kernel's ``TREE``); with ``dependent`` it lets the next launch, the outputs kernel
    as a programmatic dependent, start early. Inside
    :func:`~replayssm.ops.triton_common.chained_launches` it is itself a dependent of the
    kernel before it, which it waits for before anything else."""
    h, kd = q.shape[1], q.shape[2]
    _, hv, vd, _ = checkpoint.shape
    batch = slots.shape[0]
    bt, bh = _coefficient_block(max_len), max(16, ring.ring_len)
    cfg = tuning.lookup("closed_form", K=kd, V=vd, state_dtype=checkpoint.dtype, batch=batch)
    coef = torch.empty(batch, hv, 4 * bt + bh, 2 * bt, dtype=torch.float32, device=q.device)
    # Value heads per program: they share a key head, so its K pass runs once for all of
    # them; at most the group, and a divisor of it.
    vh = math.gcd(cfg["heads_per_program"], hv // h)
    chained, launch = chain_launch()
    _coefficients_kernel[(batch, hv // vh)](
        q, k, a, b, A_log, dt_bias, ring.k, ring.g, ring.beta,
        slots, cu_seqlens, write_pos, cache_base, is_flush, coef,
        slots if tree is None else tree.ancestor_bits, slots if tree is None else tree.num_nodes,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), a.stride(0), b.stride(0),
        kd**-0.5, NORM_EPS,
        H=h, HV=hv, K=kd, L=ring.ring_len, LOG_T=max(1, (max_len - 1).bit_length()), BT=bt, BH=bh,
        BK=exact_block_k(kd), VH=vh, DOT_PRECISION=product_precision(q.dtype),
        TREE=tree is not None, TN=1 if tree is None else tree.parents.shape[1], LAUNCH_DEPENDENTS=dependent,
        CHAINED=chained, num_warps=cfg["coef_warps"], **launch, **register_cap(cfg["coef_max_registers"], q.device),
    )
    return coef


def _outputs_launch(q, k, v, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos, cache_base, is_flush, coef, o,
                    max_len: int, tree: DeviceTrees | None, cfg: dict) -> tuple[tuple, dict]:
    """The arguments and constexprs that the outputs kernel and the flush rows' kernel
    share."""
    kd, vd = q.shape[2], v.shape[2]
    bt, bh = _window_blocks(max_len, ring.ring_len)
    bk = exact_block_k(kd)
    args = (q, k, v, checkpoint, ring.k, ring.v, ring.g, ring.beta, ring_u,
            slots, cu_seqlens, write_pos, cache_base, is_flush, coef, o, slots if tree is None else tree.num_nodes,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), NORM_EPS)
    common = dict(H=q.shape[1], HV=v.shape[1], K=kd, V=vd, L=ring.ring_len, BT=bt, BTC=_coefficient_block(max_len),
                  BH=bh, BK=bk, KC=max(16, min(cfg["k_chunk"], bk)), DOT_PRECISION=product_precision(q.dtype),
                  COEF_PRECISION="tf32" if cfg["tf32_coefficients"] and q.dtype != torch.float32 else "ieee",
                  NUM_STAGES=cfg["num_stages"], ROUND_STATE=checkpoint.dtype != torch.float32,
                  AHEAD=cfg["flush_records_ahead"], RECORDS_FIRST=bool(cfg["records_first"]))
    return args, common


def launch_window_outputs(q, k, v, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos, cache_base, is_flush, coef,
                          o, max_len: int, *, fuse_flush: bool | None = None, tree: DeviceTrees | None = None,
                          dependent: bool = False) -> None:
    """Launch the closed form's outputs kernel (outputs and corrected deltas from the
    checkpoint and ``coef``) on validated arguments; ``fuse_flush``: whether it folds the
    flush rows itself (default: :func:`fuses_flush`); ``dependent``: launch it as the
    programmatic dependent of the coefficient kernel just launched (which must have
    been launched with ``dependent`` too, and on a device where
    :func:`~replayssm.ops.triton_common.dependent_launch` holds). Inside
    :func:`~replayssm.ops.triton_common.chained_launches` it lets the next kernel of the
    chain start."""
    hv, vd = v.shape[1], v.shape[2]
    batch = slots.shape[0]
    cfg = tuning.lookup("closed_form", K=q.shape[2], V=vd, state_dtype=checkpoint.dtype, batch=batch)
    args, common = _outputs_launch(q, k, v, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos, cache_base,
                                   is_flush, coef, o, max_len, tree, cfg)
    bv = block_rows(vd, batch * hv, q.device, cfg["block_v"], least=16)
    fuse = fuses_flush(q.shape[2], vd, checkpoint.dtype, batch, q.device) if fuse_flush is None else fuse_flush
    # Short programs last (the folding rows' are the longest: a chain of exact steps),
    # where those are among the programs of this launch.
    tail = cfg["short_tail"] if fuse else 0
    _window_outputs_kernel[(triton.cdiv(vd, bv), hv, batch) if tail else (triton.cdiv(vd, bv), batch, hv)](
        *args, batch, tail, **common, BV=bv, FUSE_FLUSH=fuse, TREE=tree is not None, WAIT_COEF=dependent,
        EARLY_TILE=fuse and bool(cfg["early_tile"]), SHORT_TAIL=tail > 0,
        BB=triton.next_power_of_2(batch) if tail else 1, CHAINED=chain_active(),
        # A fused flush is an exact replay: warps that keep the exact kernels' layout of
        # a row (it decides the bits of every row sum; triton_common.exact_warps).
        num_warps=exact_warps(cfg["num_warps"], bv) if fuse else cfg["num_warps"],
        **({"launch_pdl": True} if dependent else {}),
        **register_cap(cfg["max_registers"], q.device),
    )


def _four_parts_ok(kd: int, device: torch.device) -> bool:
    """Whether the outputs kernel may hold a tile as four parts (a fused fold, an early
    tile): their key blocks are tensor-core operands (``K >= 64``; the interpreter takes
    any)."""
    return device.type != "cuda" or exact_block_k(kd) // 4 >= 16


def fuses_flush(kd: int, vd: int, state_dtype: torch.dtype, batch: int, device: torch.device) -> bool:
    """Whether the closed form folds its flush rows inside the outputs kernel (one read
    of a flush row's checkpoint for the fold and the window, one launch fewer) rather
    than in a fold launch before it: the shape table's ``closed_form.fuse_flush``, on
    heads that allow four-part tiles (:func:`_four_parts_ok`)."""
    cfg = tuning.lookup("closed_form", K=kd, V=vd, state_dtype=state_dtype, batch=batch, device=device.type)
    return bool(cfg["fuse_flush"]) and _four_parts_ok(kd, device)


def _window_blocks(max_len: int, ring_len: int) -> tuple[int, int]:
    """``(BT, BH)`` of the outputs kernel: tl.dot wants sides of 16, so its stacked
    window has ``2 * max(8, T)`` rows and the history ``max(16, L)``."""
    return max(8, triton.next_power_of_2(max_len)), max(16, ring_len)


def _coefficient_block(max_len: int) -> int:
    """``BT`` of the coefficient kernel: its stacked window has ``2 * max(4, T)`` rows.
    Its work grows with ``(2 BT)^3``, so a window of T <= 4 is not padded to 16 rows:
    its products with an inner side of 8 are broadcast sums (:func:`_mm`), and the
    outputs kernel reads the coefficients into its 16-row layout."""
    return max(4, triton.next_power_of_2(max_len))


def launch_closed_form(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos,
                       cache_base, is_flush, o, max_len: int, tree: DeviceTrees | None = None) -> None:
    """Launch the closed form (flush unless the outputs kernel fuses it, coefficients,
    outputs) on validated arguments; ``tree``: the windows are these draft trees.

    Where the device allows it and the shape table's ``closed_form.dependent_launch``
    says so, the outputs kernel is the coefficient kernel's programmatic dependent: its
    programs start while the coefficients are computed, make their pass over the
    checkpoint (and fold their flush rows), and wait only before they read the
    coefficients. The coefficient kernel is one wave of short programs, a dependent
    chain rather than bytes, so this hides it behind the first wave of the outputs.
    Inside :func:`~replayssm.ops.triton_common.chained_launches` the flush and the
    coefficient kernel wait for the kernel before them first, and the outputs kernel lets
    the next kernel of the chain start."""
    batch = slots.shape[0]
    fuse = fuses_flush(q.shape[2], v.shape[2], checkpoint.dtype, batch, q.device)
    cfg = tuning.lookup("closed_form", K=q.shape[2], V=v.shape[2], state_dtype=checkpoint.dtype, batch=batch)
    dependent = bool(cfg["dependent_launch"]) and dependent_launch(q.device)
    if not fuse:
        launch_flush(checkpoint, ring, slots, write_pos, cache_base, is_flush)
    coef = launch_coefficients(q, k, a, b, A_log, dt_bias, checkpoint, ring, slots, cu_seqlens, write_pos, cache_base,
                               is_flush, max_len, tree=tree, dependent=dependent)
    launch_window_outputs(q, k, v, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos, cache_base, is_flush, coef,
                          o, max_len, fuse_flush=fuse, tree=tree, dependent=dependent)


def launch_replay_window(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos,
                         cache_base, is_flush, o, max_len: int) -> None:
    """Launch the small-batch kernel (history replayed, then the window stepped; one
    launch, flush included) on validated arguments."""
    h, kd = q.shape[1], q.shape[2]
    hv, vd = v.shape[1], v.shape[2]
    batch = slots.shape[0]
    # It writes states (flush rows), so it takes the exact writers' tile and warps.
    _, bv, warps = exact_tile(kd, vd, batch, hv, checkpoint.dtype, q.device)
    _replay_window_kernel[(triton.cdiv(vd, bv), batch, hv)](
        q, k, v, a, b, A_log, dt_bias,
        checkpoint, ring.k, ring.v, ring.g, ring.beta, ring_u,
        slots, cu_seqlens, write_pos, cache_base, is_flush, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        kd**-0.5, NORM_EPS,
        H=h, HV=hv, K=kd, V=vd, L=ring.ring_len, BK=exact_block_k(kd), BV=bv, T=max_len,
        ROUND_STATE=checkpoint.dtype != torch.float32, num_warps=warps,
    )


def launch_tree_replay(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, write_pos, cache_base, is_flush,
                       o, tree: DeviceTrees) -> None:
    """Launch the trees' small-batch path on validated arguments: the flush rows' fold,
    then one program per (V block, leaf path, value head) stepping its path."""
    h, kd = q.shape[1], q.shape[2]
    hv, vd = v.shape[1], v.shape[2]
    batch, paths, depth = tree.leaf_paths.shape
    launch_flush(checkpoint, ring, slots, write_pos, cache_base, is_flush)
    # The writers' tile and warps (the chain replay's): the read-only height (128 rows
    # for fp32) spills here. It writes no state, so it loads as the read-only kernels do.
    _, bv, warps = exact_tile(kd, vd, batch * paths, hv, checkpoint.dtype, q.device)
    ahead = exact_row(kd, vd, batch * paths, checkpoint.dtype, read_only=True)["load_ahead"]
    _tree_replay_kernel[(triton.cdiv(vd, bv), batch * paths, hv)](
        q, k, v, a, b, A_log, dt_bias,
        checkpoint, ring.k, ring.v, ring.g, ring.beta, ring_u,
        slots, write_pos, cache_base, is_flush, tree.num_nodes, tree.leaf_paths, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        kd**-0.5, NORM_EPS,
        H=h, HV=hv, K=kd, V=vd, L=ring.ring_len, BK=exact_block_k(kd), BV=bv, TN=tree.parents.shape[1], P=paths,
        D=depth, BD=triton.next_power_of_2(depth), ROUND_STATE=checkpoint.dtype != torch.float32,
        LOAD_AHEAD=bool(ahead), num_warps=warps,
    )


def check_triton_window_call(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos,
                             cache_base, is_flush, max_len: int):
    """The Triton window ops' checks (this op's and :mod:`~replayssm.ops.ring_decode`'s):
    index values as the reference checks them (:mod:`~replayssm.ops.guards`; on the
    device inside a CUDA graph), then metadata, dtypes and layouts. Returns ``(slots,
    cu_seqlens, N)``."""
    slots, cu_seqlens = guards.check_window_call(q, checkpoint, ring, slots, cu_seqlens, write_pos, cache_base, max_len)
    check_max_len(max_len)
    n, _, _ = check_window_args(
        q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos, cache_base, is_flush,
        max_len, state_dtypes=STATE_DTYPES_TRITON, u_dtypes=(torch.float32,),
    )
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        _checks.tensor(name, x, dtypes=ACT_DTYPES_TRITON)
    for name in ("k", "v"):
        _checks.tensor(f"ring.{name}", getattr(ring, name), dtypes=ACT_DTYPES_TRITON)
    for name in ("g", "beta"):
        _checks.tensor(f"ring.{name}", getattr(ring, name), dtypes=(torch.float32,))
    check_inner_contiguous(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    check_index_pair(slots, cu_seqlens)
    _checks.contiguous(
        checkpoint=checkpoint, ring_u=ring_u, write_pos=write_pos, cache_base=cache_base, is_flush=is_flush,
        **{f"ring.{f}": getattr(ring, f) for f in ring._fields},
    )
    return slots, cu_seqlens, n


@register("chunked", "triton")
def gdn_chunked_window_triton(
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
    *,
    max_len: int | None = None,
    method: str | None = None,
) -> torch.Tensor:
    """Triton version of :func:`gdn_chunked_window_reference` (same arguments and results).

    Differences: ``max_len`` is required (it sizes the in-kernel window block; pass
    the pool's window) and at most :data:`MAX_WINDOW_TRITON`. float64 is not supported (the reference is the float64 oracle);
    ``ring_u`` and the ring's ``g`` / ``beta`` must be float32; checkpoint, ring buffers,
    cursors, ``slots`` and ``cu_seqlens`` contiguous, activations contiguous along
    their last axis. Tensor values are not read on the host (no device synchronisation,
    CUDA-graph capturable), so the caller guarantees what the reference checks: windows
    of ``1..max_len`` tokens, unique in-range live slots, and ``write_pos + length <=
    L`` for every row (the cursor rule keeps it).

    Precision: a flush row's folded checkpoint is the recurrence's, bit for bit on one
    device (the fold kernel replays the raw records). Outputs and the window's ``u``
    agree with the reference to fp32 rounding for fp32 activations; for 16-bit
    activations the products with the state run on tensor cores in tf32 (see
    :func:`product_precision`; a bf16 checkpoint's with bf16 activations, where they
    are not folded first, multiply as stored: exact products, fp32 sums), ~2^-12
    relative, below the output's own rounding, and so
    do the outputs kernel's small products with the coefficients (the shape table's
    ``closed_form.tf32_coefficients``).

    Method (``None``: ``"replay"`` when :func:`replays_window` says the batch is small,
    else ``"closed_form"``). ``"replay"`` is one launch: each row's committed history
    (raw records) and then its window go through the exact recurrence step, so its
    outputs are the recurrence's (fp32 FMA, no tf32 at any activation dtype) and its
    ``u`` the recurrence's corrected deltas; a non-flush row with a long history costs a
    step per record, which is why the strategy pairs it with a flush at every commit.
    It reads the history's raw records, the closed form the history's ``u``: the two
    agree when ``ring_u`` holds the records' deltas, as every verify leaves it.
    """
    check_method(method)
    if max_len is None:
        raise ValueError("max_len is required by the triton backend: pass the pool's window")
    slots, cu_seqlens, n = check_triton_window_call(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots,
                                                    cu_seqlens, write_pos, cache_base, is_flush, max_len)
    if max_len > MAX_WINDOW_TRITON:
        raise ValueError(f"max_len must be at most {MAX_WINDOW_TRITON} for the triton backend, got {max_len}")
    o = torch.empty(n, v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    if slots.shape[0] == 0:
        return o
    if method is None:
        small = replays_window(slots.shape[0], kd=q.shape[2], vd=v.shape[2], state_dtype=checkpoint.dtype, device=q.device)
        method = "replay" if small else "closed_form"
    if method == "replay":
        launch_replay_window(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos,
                             cache_base, is_flush, o, max_len)
        return o
    launch_closed_form(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos,
                       cache_base, is_flush, o, max_len)
    return o


_TREE_CU: dict = {}


def tree_cu_seqlens(batch: int, nodes: int, device) -> torch.Tensor:
    """``cu_seqlens`` of ``batch`` windows of ``nodes`` tokens on ``device`` (int32), kept
    per shape: a tree step's packing, with its host values recorded for the guards."""
    key = (batch, nodes, torch.device(device))
    cu = _TREE_CU.get(key)
    if cu is None:
        cu = _TREE_CU[key] = guards.host_index([i * nodes for i in range(batch + 1)], device)
    return cu


@register("chunked_tree", "triton")
def gdn_tree_verify_triton(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, write_pos, cache_base,
                           is_flush, trees, *, max_len: int | None = None, method: str | None = None) -> torch.Tensor:
    """Triton version of :func:`gdn_tree_verify_reference` (same arguments and results).
    Limits as :func:`gdn_chunked_window_triton`'s (``max_len`` required, at most
    :data:`MAX_WINDOW_TRITON`); the flush is the same fold.

    Method (``None``: ``"replay"`` when :func:`replays_tree` says the requests' leaf
    paths are few, else ``"closed_form"``). ``"closed_form"``: the chain's kernels with
    ``TREE`` on (the ancestor mask from the trees' bitmasks, on the device).
    ``"replay"``: the flush rows' fold, then each leaf's root path through the exact
    recurrence step, all paths side by side, so the outputs and ``u`` are the
    recurrence's along each node's root path (fp32 FMA) and the latency is a chain of
    the trees' depth; a non-flush row's history is replayed by each of its paths, which
    is why the strategy flushes at every commit at these sizes. Both leave the same
    committed states."""
    check_method(method)
    if not isinstance(trees, DraftTrees):
        raise TypeError(f"trees must be a DraftTrees, got {type(trees).__name__}")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.shape[0] != trees.batch:
        raise ValueError(f"slots must be a [trees.batch = {trees.batch}] tensor")
    if max_len is None:
        raise ValueError("max_len is required by the triton backend: pass the pool's window")
    if trees.max_nodes > max_len:
        raise ValueError(f"trees have {trees.max_nodes} nodes, more than max_len = {max_len}")
    cu = tree_cu_seqlens(trees.batch, trees.max_nodes, q.device)
    slots, cu = guards.check_window_call(q, checkpoint, ring, slots, cu, write_pos, cache_base, max_len)
    check_max_len(max_len)
    if max_len > MAX_WINDOW_TRITON:
        raise ValueError(f"max_len must be at most {MAX_WINDOW_TRITON} for the triton backend, got {max_len}")
    n, ns, L = check_window_args(
        q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu, write_pos, cache_base, is_flush,
        max_len, state_dtypes=STATE_DTYPES_TRITON, u_dtypes=(torch.float32,),
    )
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        _checks.tensor(name, x, dtypes=ACT_DTYPES_TRITON)
    for name in ("g", "beta"):
        _checks.tensor(f"ring.{name}", getattr(ring, name), dtypes=(torch.float32,))
    check_inner_contiguous(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    _checks.contiguous(
        checkpoint=checkpoint, ring_u=ring_u, write_pos=write_pos, cache_base=cache_base, is_flush=is_flush,
        **{f"ring.{f}": getattr(ring, f) for f in ring._fields},
    )
    o = torch.empty(n, v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    if slots.shape[0] == 0:
        return o
    tree = trees.on(q.device)
    if method is None:
        small = replays_tree(trees.batch, tree.leaf_paths.shape[1], kd=q.shape[2], vd=v.shape[2],
                             state_dtype=checkpoint.dtype, device=q.device)
        method = "replay" if small else "closed_form"
    if method == "replay":
        launch_tree_replay(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, write_pos, cache_base,
                           is_flush, o, tree)
        return o
    launch_closed_form(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu, write_pos, cache_base,
                       is_flush, o, max_len, tree=tree)
    return o
