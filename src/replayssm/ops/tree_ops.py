"""Exact per-node tree verify and the accepted path's commit (DESIGN.md section 2, "Trees").

Two ops for draft trees (:class:`~replayssm.ops.trees.DraftTrees`, node ``i`` of request
``b`` at packed row ``b * N + i``):

* :func:`gdn_tree_recurrence`: every node's output from the exact recurrence run along
  its root path from the request's state. Node ``i``'s state is its parent's state
  advanced by node ``i``'s token (``state_update``), so its output is the path
  recurrence's, bit for bit. ``fold`` keeps no node state (it also records the nodes'
  raw inputs, node ``i`` at record ``i``, for its commit); ``snapshot`` writes node
  ``i``'s state to its scratch at position ``i`` (the peer engines' method).
* :func:`compact_path`: the commit's gather. For each live row, the records of the
  accepted root path (nodes ``path[0..count)``, at window positions ``offset + path[d]``)
  move to the consecutive positions ``offset + d``; after it, a commit of ``count``
  tokens is the chain commit (the fold's replay, circular's cursor move, the conv
  shift) on the path, bit for bit the path recurrence.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _checks, guards
from .dispatch import pick, register
from .records import RawRecords, slots_error
from .recurrent import check_layer_inputs, prepare_window, readout, state_update
from .trees import DraftTrees


def check_tree_rows(n: int, trees, slots: torch.Tensor) -> tuple[int, int]:
    """``trees`` is a :class:`DraftTrees` whose ``B * N`` nodes are the ``n`` packed rows
    and whose ``B`` requests are the ``slots``; return ``(B, N)``."""
    if not isinstance(trees, DraftTrees):
        raise TypeError(f"trees must be a DraftTrees, got {type(trees).__name__}")
    nb, nn = trees.batch, trees.max_nodes
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if slots.shape[0] != nb:
        raise ValueError(f"slots must have trees.batch = {nb} entries, got {slots.shape[0]}")
    if n != nb * nn:
        raise ValueError(f"q must have trees.batch * trees.max_nodes = {nb} * {nn} = {nb * nn} rows, got {n}")
    return nb, nn


@register("tree_recurrence", "reference")
def gdn_tree_recurrence_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    trees: DraftTrees,
    *,
    snapshots: torch.Tensor | None = None,
    records: RawRecords | None = None,
) -> torch.Tensor:
    """Outputs of every node of a batch of draft trees by the exact recurrence along the
    nodes' root paths.

    Args:
        q, k: ``[B * N, H, K]``; v: ``[B * N, HV, V]``; a, b: ``[B * N, HV]``: node ``i``
            of request ``r`` at row ``r * N + i`` (``N = trees.max_nodes``; padded nodes'
            rows are read by nothing).
        A_log, dt_bias: ``[HV]``.
        state: ``[num_slots, HV, V, K]`` committed states (read only).
        slots: ``[B]`` slot per request, ``-1`` for padding.
        trees: the requests' :class:`DraftTrees`.
        snapshots: optional ``[num_slots, T, HV, V, K]``, ``T >= N``: node ``i``'s state
            goes to ``snapshots[slot, i]``.
        records: optional raw-record rings of ``R >= N`` entries: node ``i``'s raw
            record goes to position ``i``. A side channel: it changes no output.

    Returns:
        ``o``: ``[B * N, HV, V]`` in the dtype of ``v``; padded nodes and padding
        requests give zeros.
    """
    n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, A_log, dt_bias)
    _checks.tensor("state", state, ndim=4, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    ns = state.shape[0]
    _checks.shape("state", state, [ns, hv, vd, kd])
    nb, nn = check_tree_rows(n, trees, slots)
    if snapshots is not None:
        _checks.tensor("snapshots", snapshots, ndim=5, dtypes=(torch.float32, torch.bfloat16, torch.float64))
        _checks.shape("snapshots", snapshots, [ns, None, hv, vd, kd])
        if snapshots.shape[1] < nn:
            raise ValueError(f"snapshots hold {snapshots.shape[1]} states per slot, the trees have {nn} nodes")
    if records is not None:
        if not isinstance(records, RawRecords):
            raise TypeError(f"records must be RawRecords, got {type(records).__name__}")
        records.check("records", ns, h, kd, hv, vd)
        if records.ring_len < nn:
            raise ValueError(f"records hold {records.ring_len} entries per slot, the trees have {nn} nodes")
    _checks.same_device(q, state=state, slots=slots, snapshots=snapshots, records=None if records is None else records.k)
    sl = slots.tolist()
    error = slots_error(sl, ns, unique=True)
    if error:
        raise ValueError(error)

    dtype = _checks.compute_dtype(q, k, v, state)
    o = torch.zeros(n, hv, vd, dtype=v.dtype, device=v.device)
    for r, s in enumerate(sl):
        if s < 0:
            continue
        m, bos = int(trees.num_nodes[r]), r * nn
        rows = slice(bos, bos + m)
        q_hat, k_hat, vv, g, beta = prepare_window(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias, dtype)
        start = state[s].to(dtype)
        node_states = []
        for i, p in enumerate(trees.parents[r, :m].tolist()):
            S = state_update(start if p < 0 else node_states[p], k_hat[i], vv[i], g[i], beta[i])
            node_states.append(S)
            o[bos + i] = readout(S, q_hat[i]).to(o.dtype)
            if snapshots is not None:
                snapshots[s, i] = S.to(snapshots.dtype)
            if records is not None:
                records.write(s, i, k[bos + i], v[bos + i], g[i], beta[i])
    return o


def gdn_tree_recurrence(q, k, v, a, b, A_log, dt_bias, state, slots, trees, *, snapshots=None, records=None,
                        backend: str = "auto") -> torch.Tensor:
    """Every tree node's output by the exact recurrence along its root path (``fold``'s
    and ``snapshot``'s tree verify). Arguments, shapes and results:
    :func:`gdn_tree_recurrence_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere).
    """
    return pick("tree_recurrence", backend, q)(q, k, v, a, b, A_log, dt_bias, state, slots, trees,
                                               snapshots=snapshots, records=records)


def check_compact_args(buffers, slots, path, count, offset):
    """Validate :func:`compact_path`'s arguments (metadata only); return ``(num_slots, N)``."""
    if not isinstance(buffers, (list, tuple)) or not buffers:
        raise TypeError("buffers must be a non-empty list of [layers, num_slots, R, ...] tensors")
    for i, x in enumerate(buffers):
        _checks.tensor(f"buffers[{i}]", x)
        if x.dim() < 3:
            raise ValueError(f"buffers[{i}] must be [layers, num_slots, R, ...], got shape {list(x.shape)}")
    ns, r = buffers[0].shape[1], buffers[0].shape[2]
    for i, x in enumerate(buffers):
        _checks.shape(f"buffers[{i}]", x, [None, ns, r] + [None] * (x.dim() - 3))
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("path", path, ndim=2, dtypes=_checks.INDEX_DTYPES)
    nb, nn = path.shape
    _checks.shape("slots", slots, [nb])
    if nn > r:
        raise ValueError(f"path has {nn} nodes, the buffers hold {r} records per slot")
    _checks.tensor("count", count, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.shape("count", count, [nb])
    if offset is not None:
        _checks.tensor("offset", offset, ndim=1, dtypes=_checks.INDEX_DTYPES)
        _checks.shape("offset", offset, [ns])
    _checks.same_device(buffers[0], slots=slots, path=path, count=count, offset=offset,
                        **{f"buffers[{i}]": x for i, x in enumerate(buffers)})
    return ns, nn


@register("compact_path", "reference")
def compact_path_reference(
    buffers: Sequence[torch.Tensor], slots: torch.Tensor, path: torch.Tensor, count: torch.Tensor,
    offset: torch.Tensor | None = None,
) -> None:
    """Move each live row's accepted path to consecutive records, in place, every buffer:

        X[:, s, (o + d) % R] = X[:, s, (o + path[b, d]) % R]    for d < count[b]

    with ``s = slots[b]`` and ``o = offset[s]`` (0 without ``offset``).

    Args:
        buffers: tensors ``[layers, num_slots, R, ...]`` (records of every layer).
        slots: ``[B]``, ``-1`` rows are skipped; live slots unique.
        path: ``[B, N]`` the path's nodes (window positions), increasing, ``path[b, 0] = 0``
            (the root), from :func:`~replayssm.ops.trees.accepted_paths`.
        count: ``[B]`` the path lengths, ``1 <= count <= N``.
        offset: optional ``[num_slots]`` ring position of each slot's window (``circular``:
            ``cache_base + write_pos``).
    """
    ns, nn = check_compact_args(buffers, slots, path, count, offset)
    sl, paths, counts = slots.tolist(), path.tolist(), count.tolist()
    error = slots_error(sl, ns, unique=True)
    if error:
        raise ValueError(error)
    r = buffers[0].shape[2]
    offsets = offset.tolist() if offset is not None else [0] * ns
    for row, s in enumerate(sl):
        if s < 0:
            continue
        c = counts[row]
        if not 1 <= c <= nn:
            raise ValueError(f"count[{row}] = {c} is outside [1, {nn}]")
        o = offsets[s]
        src = [(o + p) % r for p in paths[row][:c]]
        dst = [(o + d) % r for d in range(c)]
        for x in buffers:
            x[:, s, dst] = x[:, s, src].clone()


def compact_path(buffers, slots, path, count, offset=None, *, backend: str = "auto") -> None:
    """The tree commit's gather of the accepted path's records into consecutive records
    (in place). Arguments: :func:`compact_path_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"``.
    """
    return pick("compact_path", backend, buffers[0] if buffers else None)(buffers, slots, path, count, offset)


# ---------------------------------------------------------------------------- Triton
# compact_path: one program per (element block, row, layer) of one buffer: it walks the
# path in order, loading record path[d] and storing it at d. A destination d is never a
# later source (path[d'] >= d' > d), so one program needs no barrier; programs own
# disjoint elements.

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None

COMPACT_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _compact_path_kernel(
        x_ptr, slots_ptr, path_ptr, count_ptr, offset_ptr,
        s_layer, s_slot, s_pos, s_a, s_b, E, DB,
        R: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, HAS_OFFSET: tl.constexpr,
    ):
        i_e = tl.program_id(0)
        i_b = tl.program_id(1)
        i_l = tl.program_id(2).to(tl.int64)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        if slot < 0:
            return
        count = tl.minimum(tl.maximum(tl.load(count_ptr + i_b), 0), N)
        if HAS_OFFSET:
            o = tl.load(offset_ptr + slot).to(tl.int64)
        else:
            o = 0
        e = i_e * BLOCK + tl.arange(0, BLOCK)
        mask = e < E
        at = x_ptr + i_l * s_layer + slot * s_slot + (e // DB) * s_a + (e % DB) * s_b
        for d in range(0, count):
            p = tl.minimum(tl.maximum(tl.load(path_ptr + i_b * N + d), 0), N - 1).to(tl.int64)
            val = tl.load(at + ((o + p) % R) * s_pos, mask=mask)
            tl.store(at + ((o + d) % R) * s_pos, val, mask=mask)


@register("compact_path", "triton")
def compact_path_triton(buffers, slots, path, count, offset=None) -> None:
    """Triton version of :func:`compact_path_reference` (same arguments), one launch per
    buffer. Buffers with any strides on their first four axes (a fifth, if any, must be
    the last and contiguous); index tensors contiguous. ``slots`` is checked by
    :mod:`~replayssm.ops.guards`; ``path`` and ``count`` are not read on the host
    (clamped into the window)."""
    ns, nn = check_compact_args(buffers, slots, path, count, offset)
    _checks.contiguous(slots=slots, path=path, count=count, offset=offset)
    views = []
    for i, x in enumerate(buffers):
        if x.dim() > 5:
            raise ValueError(f"buffers[{i}] must have at most 5 axes, got {x.dim()}")
        views.append(x if x.dim() == 5 else x.unsqueeze(-1) if x.dim() == 4 else x[..., None, None])
    slots = guards.check_slots(slots, num_slots=ns)
    nb = slots.shape[0]
    if nb == 0:
        return
    for x in views:
        nl, _, r, da, db = x.shape
        e = da * db
        if nl == 0 or e == 0:
            continue
        block = min(COMPACT_BLOCK, triton.next_power_of_2(e))
        _compact_path_kernel[(triton.cdiv(e, block), nb, nl)](
            x, slots, path, count, offset if offset is not None else count,
            x.stride(0), x.stride(1), x.stride(2), x.stride(3), x.stride(4), e, db,
            R=r, N=nn, BLOCK=block, HAS_OFFSET=offset is not None, num_warps=4,
        )
