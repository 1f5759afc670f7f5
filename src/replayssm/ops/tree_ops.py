"""Exact per-node tree verify and the accepted path's commit (DESIGN.md section 2, "Trees").

Two ops for draft trees (:class:`~replayssm.ops.trees.DraftTrees`, node ``i`` of request
``b`` at packed row ``b * N + i``):

* :func:`gdn_tree_recurrence`: every node's output from the exact recurrence run along
  its root path from the request's state. Node ``i``'s state is its parent's state
  advanced by node ``i``'s token (``state_update``), so its output is the path
  recurrence's, bit for bit. ``fold`` keeps no node state (it also records the nodes'
  raw inputs, node ``i`` at record ``i``, for its commit); ``snapshot`` writes node
  ``i``'s state to its scratch at position ``i`` (the peer engines' method). Two Triton
  methods give the same bits: a depth-indexed stack of path states, one program per
  request (``"stack"``), or every leaf's root path stepped by a program of its own
  (``"paths"``, for small batches: a chain as long as the tree is deep, not as its node
  count). The shape table's ``exact_tree.path_max_paths`` picks.
* :func:`compact_path`: the commit's gather. For each live row, the records of the
  accepted root path (nodes ``path[0..count)``, at window positions ``offset + path[d]``)
  move to the consecutive positions ``offset + d``; after it, a commit of ``count``
  tokens is the chain commit (the fold's replay, circular's cursor move, the conv
  shift) on the path, bit for bit the path recurrence.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _checks, guards, tuning
from .dispatch import pick, register
from .records import RawRecords, slots_error
from .recurrent import check_layer_inputs, prepare_window, readout, state_update
from .trees import DraftTrees


#: How the Triton op walks the trees (its ``method``): ``"stack"`` (one program per
#: request visits the nodes in depth-first preorder, its root path's states in
#: registers) or ``"paths"`` (one program per leaf steps the leaf's root path). Same
#: outputs, snapshots and records, bit for bit.
METHODS = ("stack", "paths")


def check_method(method) -> None:
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be None or one of {METHODS}, got {method!r}")


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


def check_tree_outputs(snapshots, records, ns, h, kd, hv, vd, nn, *, state_dtypes) -> None:
    """Metadata checks of a tree recurrence's optional outputs: ``snapshots [num_slots,
    T >= N, HV, V, K]`` and ``records`` (rings of ``R >= N`` entries)."""
    if snapshots is not None:
        _checks.tensor("snapshots", snapshots, ndim=5, dtypes=state_dtypes)
        _checks.shape("snapshots", snapshots, [ns, None, hv, vd, kd])
        if snapshots.shape[1] < nn:
            raise ValueError(f"snapshots hold {snapshots.shape[1]} states per slot, the trees have {nn} nodes")
    if records is not None:
        if not isinstance(records, RawRecords):
            raise TypeError(f"records must be RawRecords, got {type(records).__name__}")
        records.check("records", ns, h, kd, hv, vd)
        if records.ring_len < nn:
            raise ValueError(f"records hold {records.ring_len} entries per slot, the trees have {nn} nodes")


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
    method: str | None = None,
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
        method: how the Triton op walks the trees (:data:`METHODS`; None: the shape
            table's choice). Validated here; the reference steps each node from its
            parent either way.

    Returns:
        ``o``: ``[B * N, HV, V]`` in the dtype of ``v``; padded nodes and padding
        requests give zeros.
    """
    n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, A_log, dt_bias)
    check_method(method)
    _checks.tensor("state", state, ndim=4, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    ns = state.shape[0]
    _checks.shape("state", state, [ns, hv, vd, kd])
    nb, nn = check_tree_rows(n, trees, slots)
    check_tree_outputs(snapshots, records, ns, h, kd, hv, vd, nn,
                       state_dtypes=(torch.float32, torch.bfloat16, torch.float64))
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
                        method: str | None = None, backend: str = "auto") -> torch.Tensor:
    """Every tree node's output by the exact recurrence along its root path (``fold``'s
    and ``snapshot``'s tree verify). Arguments, shapes and results:
    :func:`gdn_tree_recurrence_reference`.

    ``method``: how the Triton op walks the trees (:data:`METHODS`; None: the shape
    table's ``exact_tree.path_max_paths``). ``backend``: ``"reference"``, ``"triton"`` or
    ``"auto"`` (Triton for CUDA tensors, the reference elsewhere).
    """
    return pick("tree_recurrence", backend, q)(q, k, v, a, b, A_log, dt_bias, state, slots, trees,
                                               snapshots=snapshots, records=records, method=method)


def walks_paths(batch: int, paths: int, *, kd: int, vd: int, state_dtype: torch.dtype,
                device: torch.device) -> bool:
    """Whether a tree recurrence of ``batch`` requests with ``paths`` leaf paths each takes
    the ``"paths"`` method: ``batch * paths <= exact_tree.path_max_paths``."""
    cfg = tuning.lookup("exact_tree", K=kd, V=vd, state_dtype=state_dtype, batch=batch, device=device.type)
    return batch * paths <= cfg["path_max_paths"]


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

# gdn_tree_recurrence: one program per (V block, request, value head), like the
# recurrence kernel. Why a stack and not per-path programs: a program per node would
# read the state once per node (N reads instead of 1) and replay its whole path (depth
# + 1 steps per node instead of 1). Here the program loads its [BV, K] state tile once
# and visits the nodes in depth-first preorder (DraftTrees.dfs_order), where every
# node's parent is on the current root path. It keeps that path's states in registers
# as a stack indexed by depth ([DP, BV, K/4] per column part, DP >= the deepest level):
# node at depth d steps from level d - 1 (the root from the checkpoint tile) and its
# state becomes level d. Taking a level is a masked sum over the stack's first axis, an
# exact copy (one term, zeros elsewhere), so every node's state is the path
# recurrence's, bit for bit the recurrence kernel's on the path (same helpers, tile and
# warps). No state is written (fold); with snapshots each node's state is also stored
# (snapshot, the peer method). Registers grow with the depth, not with N: a depth-3
# tree holds 4 levels.

if triton is not None:
    from .recurrent import _load_token as _rec_load_token, exact_block_k, exact_tile, exact_token as _exact_token
    from .triton_common import EXACT_NUM_WARPS, NORM_EPS, block_rows, gdn_gates as _tl_gdn_gates
    from .triton_common import gdn_state_step as _tl_state_step, load_parts as _tl_load_parts
    from .triton_common import record_key as _tl_record_key
    from .triton_common import mask_and as _tl_mask_and, normalized as _tl_normalized, row_dot as _tl_row_dot
    from .triton_common import row_sum as _tl_row_sum, store_parts as _tl_store_parts, to_rtne as _tl_to_rtne
    from .triton_common import device_fn as _tl_device_fn

    @triton.jit
    def _pop_level(stack, lvl, d):
        """Level ``d`` of a ``[DP, BV, KQ]`` stack (exact: one term of the sum is nonzero)."""
        return _tl_row_sum(tl.where(lvl[:, None, None] == d, stack, 0.0), 0)

    @triton.jit
    def _push_level(stack, lvl, d, S):
        return tl.where(lvl[:, None, None] == d, S[None, :, :], stack)

    @triton.jit
    def _tree_recurrence_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
        state_ptr, slots_ptr, nodes_ptr, depth_ptr, order_ptr, o_ptr,
        snap_ptr, rec_k_ptr, rec_v_ptr, rec_g_ptr, rec_beta_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_a_tok, stride_b_tok, stride_state_slot, stride_snap_slot,
        srk_slot, srk_pos, srk_head, srv_slot, srv_pos, srv_head, srg_slot, srg_pos, srg_head,
        srb_slot, srb_pos, srb_head,
        scale, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        TN: tl.constexpr, DP: tl.constexpr, HAS_SNAPSHOTS: tl.constexpr, HAS_RECORDS: tl.constexpr,
    ):
        i_v = tl.program_id(0)
        i_b = tl.program_id(1)
        i_hv = tl.program_id(2)
        i_h = i_hv // (HV // H)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        bos = i_b.to(tl.int64) * TN
        KQ: tl.constexpr = BK // 4
        offs_c = tl.arange(0, KQ)
        all_c = offs_c >= 0
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < V
        o_at = o_ptr + (bos * HV + i_hv) * V + offs_v  # o is a fresh contiguous [B * TN, HV, V]
        if slot < 0:
            for i in range(0, TN):
                tl.store(o_at + i * HV * V, tl.full([BV], 0, o_ptr.dtype.element_ty), mask=mask_v)
            return
        count = tl.load(nodes_ptr + i_b)
        A_log = tl.load(A_log_ptr + i_hv)
        dt_bias = tl.load(dt_bias_ptr + i_hv)
        tile = offs_v[:, None] * K + offs_c[None, :]
        R0, R1, R2, R3 = _tl_load_parts(state_ptr + slot * stride_state_slot + i_hv * (V * K), tile, mask_v[:, None],
                                        offs_c[None, :], K, KQ)
        lvl = tl.arange(0, DP)
        st0 = tl.zeros([DP, BV, KQ], dtype=tl.float32)
        st1 = tl.zeros([DP, BV, KQ], dtype=tl.float32)
        st2 = tl.zeros([DP, BV, KQ], dtype=tl.float32)
        st3 = tl.zeros([DP, BV, KQ], dtype=tl.float32)
        if HAS_RECORDS:
            k_writer = (i_hv % (HV // H) == 0) & (i_v == 0)
            rk_at = rec_k_ptr + slot * srk_slot + i_h * srk_head
            rv_at = rec_v_ptr + slot * srv_slot + i_hv * srv_head
            rg_at = rec_g_ptr + slot * srg_slot + i_hv * srg_head
            rb_at = rec_beta_ptr + slot * srb_slot + i_hv * srb_head
        for j in range(0, TN):
            valid = j < count
            node = tl.load(order_ptr + i_b * TN + j).to(tl.int64)
            d = tl.load(depth_ptr + i_b * TN + node)
            mc, mv, q0, q1, q2, q3, k0, k1, k2, k3, v, a, b = _rec_load_token(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos + node, valid, all_c, mask_v, i_h, i_hv, offs_c, offs_v,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                stride_a_tok, stride_b_tok, K, KQ,
            )
            # The parent's state: the checkpoint for the root, else stack level d - 1.
            is_root = d <= 0
            P0 = tl.where(is_root, R0, _pop_level(st0, lvl, d - 1))
            P1 = tl.where(is_root, R1, _pop_level(st1, lvl, d - 1))
            P2 = tl.where(is_root, R2, _pop_level(st2, lvl, d - 1))
            P3 = tl.where(is_root, R3, _pop_level(st3, lvl, d - 1))
            g, beta = _tl_gdn_gates(a, b, A_log, dt_bias)
            kh0, kh1, kh2, kh3 = _tl_normalized(k0, k1, k2, k3, eps, 1.0)
            qh0, qh1, qh2, qh3 = _tl_normalized(q0, q1, q2, q3, eps, scale)
            S0, S1, S2, S3 = _tl_state_step(P0, P1, P2, P3, kh0, kh1, kh2, kh3, v.to(tl.float32), g, beta)
            # A padded node (past count) pushes nothing: its level index is out of the stack.
            at = tl.where(valid, d, DP)
            st0 = _push_level(st0, lvl, at, S0)
            st1 = _push_level(st1, lvl, at, S1)
            st2 = _push_level(st2, lvl, at, S2)
            st3 = _push_level(st3, lvl, at, S3)
            o = _tl_row_dot(S0, S1, S2, S3, qh0, qh1, qh2, qh3)
            # Padded nodes' rows get zeros.
            tl.store(o_at + node * HV * V, _tl_to_rtne(tl.where(valid, o, 0.0), o_ptr.dtype.element_ty), mask=mask_v)
            if HAS_SNAPSHOTS:
                snap_at = snap_ptr + slot * stride_snap_slot + (node * HV + i_hv) * (V * K)
                _tl_store_parts(snap_at, tile, mv[:, None], offs_c[None, :], K, KQ, S0, S1, S2, S3)
            if HAS_RECORDS:
                r0, r1, r2, r3 = _tl_record_key(rk_at, k0, k1, k2, k3, eps)
                _tl_store_parts(rk_at, node * srk_pos + offs_c, _tl_mask_and(mc, k_writer), offs_c, K, KQ,
                                r0, r1, r2, r3)
                tl.store(rv_at + node * srv_pos + offs_v, v.to(rec_v_ptr.dtype.element_ty), mask=mv)
                tl.store(rg_at + node * srg_pos, g, mask=valid & (i_v == 0))
                tl.store(rb_at + node * srb_pos, beta, mask=valid & (i_v == 0))

    # The "paths" method: one program per (V block, leaf path, value head) loads its
    # state tile and steps the path's nodes from the root, as the recurrence kernel steps
    # a window. A node on several paths is stepped by each with the same arithmetic from
    # the same state, so the same bits (the stack method's too: same helpers, tile and
    # warps); the first path through it stores its output, snapshot and record (leaf
    # paths are in depth-first preorder, DraftTrees.leaf_paths). A program's chain is
    # the tree's depth, not its node count, which is what small batches wait for.

    @_tl_device_fn
    def path_node(path, offs_d, s):
        """Node at depth ``s`` of a leaf path held as a ``[D]`` vector (``-1`` past its end)."""
        return tl.max(tl.where(offs_d == s, path, -1), 0)

    @_tl_device_fn
    def leaf_path(paths_ptr, i_p, D: tl.constexpr, BD: tl.constexpr):
        """Program ``(*, b * P + p, *)``'s leaf path (``[BD]``, ``-1`` past its end), which of
        its nodes it stores, and the depth index. The paths through a node are consecutive
        (leaves in depth-first preorder): the node at depth ``d`` is this path's to store
        unless the previous path has it too."""
        offs_d = tl.arange(0, BD)
        row = paths_ptr + tl.program_id(1).to(tl.int64) * D
        path = tl.load(row + offs_d, mask=offs_d < D, other=-1)
        prev = tl.load(row - D + offs_d, mask=_tl_mask_and(offs_d < D, i_p > 0), other=-1)
        return path, path != prev, offs_d

    @_tl_device_fn
    def owns(own, offs_d, s):
        """Whether a path program stores its node at depth ``s`` (:func:`leaf_path`)."""
        return tl.max(tl.where(offs_d == s, own.to(tl.int32), 0), 0) != 0

    @triton.jit
    def zero_padded_nodes(o_at, nodes_ptr, i_b, i_p, slot, mask_v, HV: tl.constexpr, V: tl.constexpr,
                          TN: tl.constexpr, BV: tl.constexpr):
        """Zero outputs on the padded nodes of request ``i_b`` (all of a padding
        request's), stored by its first path program."""
        if i_p == 0:
            num = tl.where(slot >= 0, tl.load(nodes_ptr + i_b), 0)
            for i in range(0, TN):
                tl.store(o_at + i * HV * V, tl.full([BV], 0, o_at.dtype.element_ty), mask=_tl_mask_and(mask_v, i >= num))

    @triton.jit
    def _tree_path_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
        state_ptr, slots_ptr, nodes_ptr, paths_ptr, o_ptr,
        snap_ptr, rec_k_ptr, rec_v_ptr, rec_g_ptr, rec_beta_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_a_tok, stride_b_tok, stride_state_slot, stride_snap_slot,
        srk_slot, srk_pos, srk_head, srv_slot, srv_pos, srv_head, srg_slot, srg_pos, srg_head,
        srb_slot, srb_pos, srb_head,
        scale, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        TN: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
        HAS_SNAPSHOTS: tl.constexpr, HAS_RECORDS: tl.constexpr,
    ):
        i_v = tl.program_id(0)
        i_b = tl.program_id(1) // P
        i_p = tl.program_id(1) % P
        i_hv = tl.program_id(2)
        i_h = i_hv // (HV // H)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        bos = i_b.to(tl.int64) * TN
        KQ: tl.constexpr = BK // 4
        offs_c = tl.arange(0, KQ)
        all_c = offs_c >= 0
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < V
        o_at = o_ptr + (bos * HV + i_hv) * V + offs_v  # o is a fresh contiguous [B * TN, HV, V]
        zero_padded_nodes(o_at, nodes_ptr, i_b, i_p, slot, mask_v, HV, V, TN, BV)
        path, own, offs_d = leaf_path(paths_ptr, i_p, D, BD)
        if (slot < 0) | (path_node(path, offs_d, 0) < 0):
            return
        A_log = tl.load(A_log_ptr + i_hv)
        dt_bias = tl.load(dt_bias_ptr + i_hv)
        tile = offs_v[:, None] * K + offs_c[None, :]
        S0, S1, S2, S3 = _tl_load_parts(state_ptr + slot * stride_state_slot + i_hv * (V * K), tile, mask_v[:, None],
                                        offs_c[None, :], K, KQ)
        if HAS_RECORDS:
            k_writer = (i_hv % (HV // H) == 0) & (i_v == 0)
            rk_at = rec_k_ptr + slot * srk_slot + i_h * srk_head
            rv_at = rec_v_ptr + slot * srv_slot + i_hv * srv_head
            rg_at = rec_g_ptr + slot * srg_slot + i_hv * srg_head
            rb_at = rec_beta_ptr + slot * srb_slot + i_hv * srb_head
        for s in range(0, D):
            node = path_node(path, offs_d, s)
            valid = node >= 0
            at = tl.maximum(node, 0)
            mc, mv, q0, q1, q2, q3, k0, k1, k2, k3, v, a, b = _rec_load_token(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos + at, valid, all_c, mask_v, i_h, i_hv, offs_c, offs_v,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                stride_a_tok, stride_b_tok, K, KQ,
            )
            store = valid & owns(own, offs_d, s)
            # Past the path's end the state stays (nothing of those steps is stored).
            S0, S1, S2, S3, o, u, g, beta = _exact_token(S0, S1, S2, S3, q0, q1, q2, q3, k0, k1, k2, k3, v, a, b,
                                                         A_log, dt_bias, valid, eps, scale)
            ms = _tl_mask_and(mv, store)
            tl.store(o_at + at * HV * V, _tl_to_rtne(o, o_ptr.dtype.element_ty), mask=ms)
            if HAS_SNAPSHOTS:
                snap_at = snap_ptr + slot * stride_snap_slot + (at * HV + i_hv) * (V * K)
                _tl_store_parts(snap_at, tile, ms[:, None], offs_c[None, :], K, KQ, S0, S1, S2, S3)
            if HAS_RECORDS:
                r0, r1, r2, r3 = _tl_record_key(rk_at, k0, k1, k2, k3, eps)
                _tl_store_parts(rk_at, at * srk_pos + offs_c, _tl_mask_and(mc, k_writer & store), offs_c, K, KQ,
                                r0, r1, r2, r3)
                tl.store(rv_at + at * srv_pos + offs_v, v.to(rec_v_ptr.dtype.element_ty), mask=ms)
                tl.store(rg_at + at * srg_pos, g, mask=store & (i_v == 0))
                tl.store(rb_at + at * srb_pos, beta, mask=store & (i_v == 0))

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


@register("tree_recurrence", "triton")
def gdn_tree_recurrence_triton(q, k, v, a, b, A_log, dt_bias, state, slots, trees, *, snapshots=None, records=None,
                               method=None):
    """Triton version of :func:`gdn_tree_recurrence_reference` (same arguments and
    results): the depth-indexed stack of path states in registers, or each leaf's root
    path stepped by its own program (``method``, see the notes above the kernels).
    Layouts and limits as ``gdn_recurrence_triton``'s (no float64; ``state`` and
    ``snapshots`` packed per slot, records with a contiguous last axis and float32
    gates)."""
    from .recurrent import ACT_DTYPES_TRITON, STATE_DTYPES_TRITON, check_inner_contiguous

    n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, A_log, dt_bias)
    check_method(method)
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        _checks.tensor(name, x, dtypes=ACT_DTYPES_TRITON)
    check_inner_contiguous(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    _checks.tensor("state", state, ndim=4, dtypes=STATE_DTYPES_TRITON)
    ns = state.shape[0]
    _checks.shape("state", state, [ns, hv, vd, kd])
    _checks.packed("state", state, 3)
    nb, nn = check_tree_rows(n, trees, slots)
    _checks.contiguous(slots=slots)
    check_tree_outputs(snapshots, records, ns, h, kd, hv, vd, nn, state_dtypes=STATE_DTYPES_TRITON)
    if snapshots is not None:
        _checks.packed("snapshots", snapshots, 4)
    if records is not None:
        for field in ("g", "beta"):
            _checks.tensor(f"records.{field}", getattr(records, field), dtypes=(torch.float32,))
        check_inner_contiguous(**{f"records.{f}": getattr(records, f) for f in ("k", "v")})
    _checks.same_device(q, state=state, slots=slots, snapshots=snapshots, records=None if records is None else records.k)
    slots = guards.check_slots(slots, num_slots=ns)
    o = torch.empty(n, hv, vd, dtype=v.dtype, device=v.device)
    if nb == 0:
        return o
    dev = trees.on(q.device)
    dummy = o
    rec = records if records is not None else RawRecords(dummy, dummy, dummy, dummy)
    rec_strides = [x.stride(d) if records is not None else 0 for x in rec for d in range(3)]
    common = (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        state.stride(0), snapshots.stride(0) if snapshots is not None else 0, *rec_strides,
        kd**-0.5, NORM_EPS,
    )
    outputs = (snapshots if snapshots is not None else dummy, rec.k, rec.v, rec.g, rec.beta)
    _, paths, depth = dev.leaf_paths.shape
    if method is None:
        paths_ok = walks_paths(nb, paths, kd=kd, vd=vd, state_dtype=state.dtype, device=state.device)
        method = "paths" if paths_ok else "stack"
    if method == "paths":
        _, bv, warps = exact_tile(kd, vd, nb * paths, hv, state.dtype, q.device)  # the writers' tile and warps
        _tree_path_kernel[(triton.cdiv(vd, bv), nb * paths, hv)](
            q, k, v, a, b, A_log, dt_bias, state, slots, dev.num_nodes, dev.leaf_paths, o, *outputs, *common,
            H=h, HV=hv, K=kd, V=vd, BK=exact_block_k(kd), BV=bv, TN=nn, P=paths, D=depth,
            BD=triton.next_power_of_2(depth), HAS_SNAPSHOTS=snapshots is not None, HAS_RECORDS=records is not None,
            num_warps=warps,
        )
        return o
    levels = max(1, int(trees.depth.max()))  # stack levels: depths 0 .. max - 1 are parents
    # The stack holds DP path states of BV rows in registers: its rows, not one tile's,
    # are what the register file bounds (the shape table's exact_tree.stack_rows).
    dp = triton.next_power_of_2(levels)
    stack_rows = tuning.lookup("exact_tree", K=kd, V=vd, state_dtype=state.dtype, batch=nb)["stack_rows"]
    bv = block_rows(vd, nb * hv, q.device, max(16, stack_rows // dp))
    _tree_recurrence_kernel[(triton.cdiv(vd, bv), nb, hv)](
        q, k, v, a, b, A_log, dt_bias, state, slots, dev.num_nodes, dev.depth, dev.dfs_order, o, *outputs, *common,
        H=h, HV=hv, K=kd, V=vd, BK=exact_block_k(kd), BV=bv, TN=nn, DP=dp,
        HAS_SNAPSHOTS=snapshots is not None, HAS_RECORDS=records is not None, num_warps=EXACT_NUM_WARPS,
    )
    return o
