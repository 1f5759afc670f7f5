"""Depthwise causal convolution (kernel W, SiLU) with verify / commit semantics.

GDN layers convolve the concatenated ``q|k|v`` channels before the recurrence. Per
channel ``c`` and token ``t`` of a window, with ``x_{-W+1} .. x_{-1}`` taken from the
request's conv state (the last ``W - 1`` committed inputs):

    y_t = silu(bias_c + sum_{j=0}^{W-1} w[c, j] * x_{t - W + 1 + j})

Verify (:func:`causal_conv_verify`) never advances the state; it keeps the window's
inputs in a per-slot buffer. Commit (:func:`causal_conv_commit`) shifts the first ``n``
buffered inputs into the state, which leaves it exactly as if the ``n`` accepted tokens
had been decoded one by one. Plain decoding and prefill pass ``update_state=True``.

A conv ring (``ring_pos``) keeps a slot's history and its window in one buffer of ``R``
entries: the committed history is entries ``p - W + 1 .. p - 1`` (mod ``R``) before the
slot's position ``p``, and a verify stores its window's inputs at ``p, p + 1, ...``
where the commit finds them, so the commit only moves the position
(:func:`conv_ring_commit`): no entry is copied. Plain decoding and prefill rewrite the
history entries in place and leave the position where it is.
"""

from __future__ import annotations

import torch

from . import _checks, guards
from .dispatch import pick, register
from .records import check_varlen, slots_error
from .recurrent import check_index_pair, check_inner_contiguous, check_max_len, window_bound


def check_parts(parts, c: int) -> tuple[int, int, int] | None:
    """Validate a planar conv output's ``parts`` (three channel counts summing to ``C``)."""
    if parts is None:
        return None
    if (not isinstance(parts, (tuple, list)) or len(parts) != 3
            or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in parts)):
        raise TypeError(f"parts must be three positive ints (the q, k, v channel counts), got {parts!r}")
    if sum(parts) != c:
        raise ValueError(f"parts {tuple(parts)} must sum to the channel count {c}")
    return tuple(parts)


def check_conv_args(x, conv_state, weight, bias, ring_pos=None):
    """Validate a conv call (metadata only); return ``(N, C, W)``. ``C`` and ``W`` come
    from the registered ``weight``, so an input with the wrong channel count is the one
    named in the error. With ``ring_pos``, ``conv_state`` is a ring (:func:`check_ring`)."""
    _checks.tensor("weight", weight, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    c, w = weight.shape
    if w < 2:
        raise ValueError(f"conv kernel width must be at least 2, got {w}")
    _checks.tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("x", x, [None, c])
    n = x.shape[0]
    if bias is not None:
        _checks.tensor("bias", bias, ndim=1, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("bias", bias, [c])
    _checks.tensor("conv_state", conv_state, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    if ring_pos is None:
        _checks.shape("conv_state", conv_state, [None, c, w - 1])
    else:
        _checks.shape("conv_state", conv_state, [None, c, None])
        check_ring(conv_state.shape[2], w, ring_pos, conv_state.shape[0])
    _checks.same_device(x, conv_state=conv_state, weight=weight, bias=bias, ring_pos=ring_pos)
    return n, c, w


def check_ring(r: int, w: int, ring_pos, num_slots: int) -> None:
    """Validate a conv ring of ``r`` entries for taps of width ``w``: ``r`` a power of
    two of at least ``w`` entries, and ``ring_pos`` an integer ``[num_slots]`` of
    positions."""
    if r < w or r & (r - 1):
        raise ValueError(f"conv_state as a ring must hold a power of two of at least W = {w} entries, got {r}")
    _checks.tensor("ring_pos", ring_pos, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.shape("ring_pos", ring_pos, [num_slots])


def ring_history_rows(pos: int, w: int, r: int) -> list[int]:
    """The ring entries of a slot's ``W - 1`` history inputs, oldest first, at position ``pos``."""
    return [(pos - (w - 1) + j) % r for j in range(w - 1)]


@register("conv_verify", "reference")
def causal_conv_verify_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    window_buf: torch.Tensor | None = None,
    update_state: bool = False,
    max_len: int | None = None,
    parts: tuple[int, int, int] | None = None,
    ring_pos: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over a packed batch of windows.

    Args:
        x: ``[N, C]`` pre-conv channels (``C = 2 H K + HV V`` for GDN).
        conv_state: ``[num_slots, C, W - 1]`` last committed inputs, oldest first.
        weight: ``[C, W]`` depthwise taps; bias: ``[C]`` or ``None``.
        slots: ``[B]`` slot per window, ``-1`` for padding (zero output, no writes).
        cu_seqlens: ``[B + 1]`` token offsets.
        window_buf: optional ``[num_slots, T, C]``; window ``i``'s inputs are kept in
            ``window_buf[slots[i], :len]`` for :func:`causal_conv_commit`.
        update_state: advance ``conv_state`` over the whole window (decode / prefill).
        max_len: optional bound on every window's length. The Triton backend needs a
            bound from ``window_buf`` or ``max_len`` (it never reads ``cu_seqlens`` on
            the host); the reference checks the windows against it.
        parts: optional channel counts ``(C_q, C_k, C_v)`` summing to ``C``: the output
            in three contiguous parts instead of one ``[N, C]`` (a chunked kernel that
            wants contiguous ``q``, ``k``, ``v`` would otherwise copy each).
        ring_pos: optional ``[num_slots]`` integer positions: ``conv_state`` is then a
            conv ring ``[num_slots, C, R]`` (``R`` a power of two, ``R >= W``) whose
            entries ``(p - W + 1 .. p - 1) mod R`` are slot ``s``'s history, ``p =
            ring_pos[s]``. A verify stores window input ``t`` at entry ``(p + t) mod R``
            (the ring is its own window buffer: no ``window_buf``; windows of at most
            ``R - W + 1`` tokens) for :func:`conv_ring_commit`; ``update_state`` writes
            the new history to the same ``W - 1`` entries and leaves ``p`` as it is.

    Returns:
        ``y``: ``[N, C]`` in the dtype of ``x``, or with ``parts`` the tuple ``(y_q [N,
        C_q], y_k [N, C_k], y_v [N, C_v])``, each contiguous (the same values). Computed
        in float32 (float64 for float64 inputs).
    """
    n, c, w = check_conv_args(x, conv_state, weight, bias, ring_pos)
    parts = check_parts(parts, c)
    ns = conv_state.shape[0]
    max_len = check_max_len(max_len)
    if window_buf is not None:
        if ring_pos is not None:
            raise ValueError("window_buf must be None with ring_pos: the ring keeps the window's inputs")
        _checks.tensor("window_buf", window_buf, ndim=3, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("window_buf", window_buf, [ns, None, c])
        _checks.same_device(x, window_buf=window_buf)
        max_len = window_buf.shape[1] if max_len is None else min(max_len, window_buf.shape[1])
    if ring_pos is not None and not update_state:
        room = conv_state.shape[2] - (w - 1)
        max_len = room if max_len is None else min(max_len, room)
    cu, sl = check_varlen(cu_seqlens, slots, n, ns, max_len)
    dtype = _checks.compute_dtype(x, weight)
    wt = weight.to(dtype)
    y = torch.zeros_like(x)
    positions = ring_pos.tolist() if ring_pos is not None else None
    for i, s in enumerate(sl):
        bos, eos = cu[i], cu[i + 1]
        if s < 0 or eos == bos:
            continue
        if positions is None:
            rows = list(range(w - 1))
        else:
            rows = ring_history_rows(positions[s], w, conv_state.shape[2])
        hist = conv_state[s][:, rows]  # [C, W - 1], oldest first
        xs = torch.cat([hist.to(dtype).T, x[bos:eos].to(dtype)], 0)  # [W-1+m, C]
        acc = torch.zeros(eos - bos, c, dtype=dtype, device=x.device)
        if bias is not None:
            acc = acc + bias.to(dtype)
        for j in range(w):
            acc = acc + wt[:, j] * xs[j : j + eos - bos]
        y[bos:eos] = torch.nn.functional.silu(acc).to(y.dtype)
        if window_buf is not None:
            window_buf[s, : eos - bos] = x[bos:eos]
        if update_state:
            conv_state[s][:, rows] = torch.cat([hist.T, x[bos:eos].to(conv_state.dtype)], 0)[-(w - 1) :].T
        elif positions is not None:
            r = conv_state.shape[2]
            conv_state[s][:, [(positions[s] + t) % r for t in range(eos - bos)]] = x[bos:eos].T.to(conv_state.dtype)
    return y if parts is None else tuple(part.contiguous() for part in y.split(parts, dim=1))


def check_conv_commit_args(conv_state, window_buf, slots, accepted):
    """Validate :func:`causal_conv_commit`'s arguments (metadata only); return the
    conv state's shape ``(layers, num_slots, C, W - 1)``."""
    _checks.tensor("conv_state", conv_state, ndim=4, dtypes=_checks.FLOAT_DTYPES)
    nl, ns, c, w1 = conv_state.shape
    _checks.tensor("window_buf", window_buf, ndim=4, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("window_buf", window_buf, [nl, ns, None, c])
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("accepted", accepted, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.shape("accepted", accepted, [slots.shape[0]])
    _checks.same_device(conv_state, window_buf=window_buf, slots=slots, accepted=accepted)
    return nl, ns, c, w1


@register("conv_commit", "reference")
def causal_conv_commit_reference(
    conv_state: torch.Tensor, window_buf: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor
) -> None:
    """Shift the first ``accepted[i]`` buffered inputs into the conv state, in place.

    Args:
        conv_state: ``[layers, num_slots, C, W - 1]`` (all layers at once).
        window_buf: ``[layers, num_slots, T, C]`` inputs kept by verify.
        slots: ``[B]`` slot per row, ``-1`` ignored.
        accepted: ``[B]``, ``1 <= n <= T`` for live rows (validated by the caller).
    """
    nl, ns, c, w1 = check_conv_commit_args(conv_state, window_buf, slots, accepted)
    for s, n in zip(slots.tolist(), accepted.tolist()):
        if s < 0:
            continue
        hist = torch.cat([conv_state[:, s].transpose(1, 2), window_buf[:, s, :n].to(conv_state.dtype)], 1)
        conv_state[:, s] = hist[:, -w1:].transpose(1, 2)


def check_ring_commit_args(ring_pos, slots, accepted) -> int:
    """Validate :func:`conv_ring_commit`'s arguments (metadata only); return ``num_slots``."""
    _checks.tensor("ring_pos", ring_pos, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("accepted", accepted, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.shape("accepted", accepted, [slots.shape[0]])
    _checks.same_device(ring_pos, slots=slots, accepted=accepted)
    return ring_pos.shape[0]


@register("conv_ring_commit", "reference")
def conv_ring_commit_reference(ring_pos: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor) -> None:
    """Commit the first ``accepted[i]`` inputs of each window in a conv ring (see
    :func:`causal_conv_verify_reference`'s ``ring_pos``), in place: the verify stored
    them where the history continues, so the slot's position moves past them, and the
    rest of the window is overwritten by the next one.

    Args:
        ring_pos: ``[num_slots]`` positions (one per slot, shared by every layer's ring).
        slots: ``[B]`` slot per row, ``-1`` ignored; live slots unique.
        accepted: ``[B]``, ``1 <= n <= T`` for live rows (validated by the caller).
    """
    ns = check_ring_commit_args(ring_pos, slots, accepted)
    sl = slots.tolist()
    error = slots_error(sl, ns, unique=True)
    if error:
        raise ValueError(error)
    for s, n in zip(sl, accepted.tolist()):
        if s >= 0:
            ring_pos[s] += n


def conv_ring_commit(ring_pos: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor, *,
                     backend: str = "auto") -> None:
    """Move each slot's conv ring position past its ``accepted`` window inputs: the
    ring's commit, no entry copied. Arguments: :func:`conv_ring_commit_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"``.
    """
    return pick("conv_ring_commit", backend, ring_pos)(ring_pos, slots, accepted)


def causal_conv_verify(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    window_buf: torch.Tensor | None = None,
    update_state: bool = False,
    max_len: int | None = None,
    parts: tuple[int, int, int] | None = None,
    ring_pos: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The depthwise causal conv (with SiLU) over packed windows ``x [N, C] -> [N, C]``,
    each window continuing its slot's ``conv_state``. Arguments, shapes and results:
    :func:`causal_conv_verify_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("conv_verify", backend, x)(x, conv_state, weight, bias, slots, cu_seqlens, window_buf=window_buf,
                                           update_state=update_state, max_len=max_len, parts=parts,
                                           ring_pos=ring_pos)


def causal_conv_commit(
    conv_state: torch.Tensor, window_buf: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor,
    *, backend: str = "auto",
) -> None:
    """Advance each slot's ``conv_state`` over its ``accepted`` window tokens, as if they
    had been decoded one by one. Arguments: :func:`causal_conv_commit_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("conv_commit", backend, conv_state)(conv_state, window_buf, slots, accepted)


def tree_conv_sources(trees, w: int) -> list[list[list[int]]]:
    """Per request and real node, the ``W`` inputs its conv taps read, oldest first: the
    node's root path preceded by the conv state. Entry ``e >= 0`` is node ``e`` of the
    window; ``e < 0`` is conv state entry ``W - 1 + e`` (``-1``: the newest)."""
    out = []
    for r in range(trees.batch):
        parents, rows = trees.parents[r].tolist(), []
        for i in range(int(trees.num_nodes[r])):
            chain = [i]
            while len(chain) < w and parents[chain[-1]] >= 0:
                chain.append(parents[chain[-1]])
            chain = chain[::-1]
            rows.append(list(range(-(w - len(chain)), 0)) + chain)
        out.append(rows)
    return out


@register("conv_verify_tree", "reference")
def causal_conv_verify_tree_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    trees,
    *,
    window_buf: torch.Tensor | None = None,
    ring_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv + SiLU over draft trees: each node's window is its own root
    path, preceded by the request's conv state:

        y_i = silu(bias + sum_j w[:, j] x_{a_{W-1-j}(i)})

    where ``a_0(i) = i``, ``a_{d+1}(i)`` is the parent of ``a_d(i)``, and past the root
    the conv state's entries, newest first. A chain's node windows are a window's
    causal taps, the same products in the same order.

    Args:
        x: ``[B * N, C]`` pre-conv channels, node ``i`` of request ``r`` at row ``r * N + i``.
        conv_state: ``[num_slots, C, W - 1]`` (read only).
        weight: ``[C, W]``; bias: ``[C]`` or ``None``.
        slots: ``[B]`` slot per request, ``-1`` for padding.
        trees: the requests' :class:`~replayssm.ops.trees.DraftTrees`.
        window_buf: optional ``[num_slots, T, C]``, ``T >= N``: the nodes' inputs, node
            ``i`` at position ``i`` (for the commit, which shifts in the accepted path).
        ring_pos: optional ``[num_slots]``: ``conv_state`` is a conv ring ``[num_slots,
            C, R]`` (:func:`causal_conv_verify_reference`), read at the slot's history
            entries; node ``i``'s input is stored at entry ``(p + i) mod R`` (``N <= R -
            W + 1``), where the tree commit gathers the accepted path
            (:func:`~replayssm.ops.tree_ops.compact_path` with ``offset = ring_pos``).

    Returns:
        ``y``: ``[B * N, C]`` in the dtype of ``x``; padded nodes and padding requests
        give zeros.
    """
    from .tree_ops import check_tree_rows

    n, c, w = check_conv_args(x, conv_state, weight, bias, ring_pos)
    ns = conv_state.shape[0]
    nb, nn = check_tree_rows(n, trees, slots)
    check_tree_window(window_buf, ring_pos, conv_state, ns, c, nn, w)
    _checks.same_device(x, slots=slots, window_buf=window_buf)
    sl = slots.tolist()
    error = slots_error(sl, ns, unique=True)
    if error:
        raise ValueError(error)
    dtype = _checks.compute_dtype(x, weight)
    wt = weight.to(dtype)
    y = torch.zeros_like(x)
    for r, (s, nodes) in enumerate(zip(sl, tree_conv_sources(trees, w))):
        if s < 0:
            continue
        bos = r * nn
        rows = list(range(w - 1)) if ring_pos is None else ring_history_rows(int(ring_pos[s]), w, conv_state.shape[2])
        state = conv_state[s][:, rows].to(dtype).T  # [W - 1, C], oldest first
        for i, src in enumerate(nodes):
            acc = torch.zeros(c, dtype=dtype, device=x.device)
            if bias is not None:
                acc = acc + bias.to(dtype)
            for j, e in enumerate(src):
                acc = acc + wt[:, j] * (x[bos + e].to(dtype) if e >= 0 else state[w - 1 + e])
            y[bos + i] = torch.nn.functional.silu(acc).to(y.dtype)
        if window_buf is not None:
            window_buf[s, : len(nodes)] = x[bos : bos + len(nodes)]
        elif ring_pos is not None:
            ring = [(int(ring_pos[s]) + i) % conv_state.shape[2] for i in range(len(nodes))]
            conv_state[s][:, ring] = x[bos : bos + len(nodes)].T.to(conv_state.dtype)
    return y


def check_tree_window(window_buf, ring_pos, conv_state, ns: int, c: int, nn: int, w: int) -> None:
    """Validate where a tree conv keeps its ``nn`` nodes' inputs: a ``window_buf [ns, T,
    C]`` of ``T >= nn`` entries, or a conv ring (``ring_pos``, already checked by
    :func:`check_conv_args`) with room for them beside its ``W - 1`` of history."""
    if window_buf is not None:
        if ring_pos is not None:
            raise ValueError("window_buf must be None with ring_pos: the ring keeps the window's inputs")
        _checks.tensor("window_buf", window_buf, ndim=3, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("window_buf", window_buf, [ns, None, c])
        if window_buf.shape[1] < nn:
            raise ValueError(f"window_buf holds {window_buf.shape[1]} inputs per slot, the trees have {nn} nodes")
    elif ring_pos is not None and nn > conv_state.shape[2] - (w - 1):
        raise ValueError(f"a conv ring of {conv_state.shape[2]} entries holds windows of at most "
                         f"{conv_state.shape[2] - (w - 1)} tokens beside its W - 1 = {w - 1} of history, "
                         f"the trees have {nn} nodes")


def causal_conv_verify_tree(x, conv_state, weight, bias, slots, trees, *, window_buf=None, ring_pos=None,
                            backend: str = "auto"):
    """The causal conv over draft trees (each node's taps along its root path), ``x [B * N,
    C] -> [B * N, C]``. Arguments, shapes and results: :func:`causal_conv_verify_tree_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"``.
    """
    return pick("conv_verify_tree", backend, x)(x, conv_state, weight, bias, slots, trees, window_buf=window_buf,
                                                ring_pos=ring_pos)


# ---------------------------------------------------------------------------- Triton
# Verify: one program per (token block, channel block, window); each token's W taps come
# from the packed inputs or, before the window, from the conv state. Commit: one launch
# for all layers, one program per (channel block, row, layer). A program owns its
# channels of one slot's history, and reads all of it before a barrier and the writes.

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None

CONV_BLOCK = 256
#: Tokens per verify program when a window is longer (prompts): the token axis of the
#: grid then has ``cdiv(max_len, CONV_TOKEN_BLOCK)`` blocks, so a long prompt spreads
#: over many programs, and the compiled kernel does not depend on the prompt's length.
#: Shorter windows (verify, decoding) take one block of their padded length.
CONV_TOKEN_BLOCK = 16
#: Tokens of a block after a window's first whose input rows one program loads
#: together (a multiple-block window's blocks are multiples of it). A first block loads
#: all of its rows together.
CONV_TOKEN_GROUP = 8
CONV_DTYPES_TRITON = (torch.float16, torch.bfloat16, torch.float32)

if triton is not None:
    from .triton_common import chain_launch, chain_wait, mask_and as _tl_mask_and, to_rtne as _tl_to_rtne

    @triton.jit
    def _entry(base, k, R: tl.constexpr):
        """The row of a slot's conv entry ``k`` counted from ``base``: ``k`` itself in a
        conv state or window buffer (``R = 0``), entry ``(base + k) mod R`` of a ring of
        ``R`` (a power of two; ``base`` may be negative)."""
        if R > 0:
            return (base + k) & (R - 1)
        else:
            return k

    @triton.jit
    def _shift_history(state_at, stride_w, src_at, stride_src, n, mask_c, W: tl.constexpr, WP: tl.constexpr):
        """Shift ``n`` inputs (``src_at + t * stride_src``, ``t < n``) into histories of
        ``W - 1`` entries (``state_at + p * stride_w``): the commit's shift from the window
        buffer. New entry ``p`` is input ``n - (W - 1) + p`` when that is ``>= 0``, else old
        entry ``p + n``. Everything is loaded before anything is stored, with a barrier in
        between, so no thread can overwrite an entry that another thread has yet to read."""
        p = tl.arange(0, WP)
        in_hist = p < W - 1
        t = n - (W - 1) + p
        from_src = in_hist & (t >= 0)
        m = mask_c[:, None]
        xv = tl.load(src_at[:, None] + t[None, :] * stride_src, mask=m & from_src[None, :], other=0.0)
        sv = tl.load(state_at[:, None] + ((p + n) * stride_w)[None, :], mask=m & (in_hist & (t < 0))[None, :],
                     other=0.0)
        new = tl.where(from_src[None, :], xv.to(state_at.dtype.element_ty), sv)
        tl.debug_barrier()
        tl.store(state_at[:, None] + (p * stride_w)[None, :], new, mask=m & in_hist[None, :])

    @triton.jit
    def _conv_taps(w_ptr, bias_ptr, offs_c, mask_c, W: tl.constexpr, HAS_BIAS: tl.constexpr):
        """The ``W`` taps of channels ``offs_c`` and the sum each output starts from (the
        bias, or zeros), in float32."""
        ws = ()
        for j in tl.static_range(W):
            ws = ws + (tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0).to(tl.float32),)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
        else:
            bias = tl.full(offs_c.shape, 0.0, tl.float32)
        return ws, bias

    @triton.jit
    def _conv_rows(x_at, state_at, h0, p0, length, stride_x_tok, ss_w, mask_c, W: tl.constexpr, U: tl.constexpr,
                   FIRST_BLOCK: tl.constexpr, R: tl.constexpr):
        """The ``W - 1 + U`` rows that positions ``p0 .. p0 + U - 1`` read (positions ``p0 - W
        + 1 .. p0 + U - 1``) as stored, rows past ``length`` zeros. A window's first block
        (``FIRST_BLOCK``, ``p0 = 0``) reads the rows before the window from the conv state,
        entry ``W - 1 + t`` for position ``t < 0`` (a ring's from ``h0``: :func:`_entry`)."""
        xs = ()
        for k in tl.static_range(U + W - 1):
            if FIRST_BLOCK and k < W - 1:
                xs = xs + (tl.load(state_at + _entry(h0, k, R) * ss_w, mask=mask_c, other=0.0),)
            else:
                xs = xs + (tl.load(x_at + (p0 - (W - 1) + k) * stride_x_tok,
                                   mask=_tl_mask_and(mask_c, p0 - (W - 1) + k < length), other=0.0),)
        return xs

    @triton.jit
    def _conv_outputs(xs, ws, bias, y_row, wbuf_at, w0, p0, length, mask_c, y_tok, sb_pos, W: tl.constexpr,
                      U: tl.constexpr, HAS_WBUF: tl.constexpr, R: tl.constexpr):
        """Store positions ``p0 .. p0 + U - 1`` (those below ``length``) from their rows ``xs``
        (:func:`_conv_rows`; ``y_tok``: the outputs' token stride, per channel in a planar
        output), and with ``HAS_WBUF`` their inputs to the window buffer (a ring's
        entries from ``w0``). Each
        output is ``silu(bias + w_0 x_{i-W+1} + ... + w_{W-1} x_i)``, summed in that order
        (the reference's) whatever the block, so a token's bits do not depend on the block
        that holds it."""
        for i in tl.static_range(U):
            acc = bias
            for j in tl.static_range(W):
                acc = acc + ws[j] * xs[i + j].to(tl.float32)
            y = tl.div_rn(acc, 1.0 + tl.exp(-acc))  # SiLU
            valid = _tl_mask_and(mask_c, p0 + i < length)
            tl.store(y_row + (p0 + i) * y_tok, _tl_to_rtne(y, y_row.dtype.element_ty), mask=valid)
            if HAS_WBUF:
                tl.store(wbuf_at + _entry(w0, p0 + i, R) * sb_pos, xs[i + W - 1].to(wbuf_at.dtype.element_ty),
                         mask=valid)

    @triton.jit
    def _next_history(xs, x_at, state_at, length, stride_x_tok, mask_c, W: tl.constexpr, BT: tl.constexpr,
                      LONG: tl.constexpr):
        """A slot's ``W - 1`` conv state entries after a window of ``length`` tokens, from the
        rows ``xs`` of the window's first block (:func:`_conv_rows`, ``U = BT``), as
        :func:`_shift_history` writes them: new entry ``p`` is window position ``length - (W
        - 1) + p``, row ``length + p`` of ``xs``, an old entry as it is or an input cast to
        the state's dtype. ``length`` is known only at run time, so each entry is picked
        among the rows it may be: rows ``p + 1 .. p + BT`` (``length = 1 .. BT``; one row
        when ``BT = 1``). ``LONG``: the window may end past the block (a prompt, where
        latency matters less than registers), so an entry that is an input is loaded
        again (from cache when it lies in the block), and only old entries are picked."""
        state_ty = state_at.dtype.element_ty
        hist = ()
        for p in tl.static_range(W - 1):
            if LONG:
                t = length - (W - 1) + p
                new = tl.load(x_at + t * stride_x_tok, mask=_tl_mask_and(mask_c, t >= 0), other=0.0).to(state_ty)
                for k in tl.static_range(p + 1, W - 1):
                    new = tl.where(length + p == k, xs[k], new)
            else:
                for k in tl.static_range(p + 1, p + 1 + BT):
                    if k < W - 1:
                        row = xs[k]
                    else:
                        row = xs[k].to(state_ty)
                    if k == p + 1:
                        new = row
                    else:
                        new = tl.where(length + p == k, row, new)
            hist = hist + (new,)
        return hist

    @triton.jit
    def _conv_first_block(x_at, state_at, w_ptr, bias_ptr, y_row, wbuf_at, offs_c, mask_c, h0, w0, length,
                          stride_x_tok, y_tok, ss_w, sb_pos, W: tl.constexpr, BT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_WBUF: tl.constexpr, UPDATE_STATE: tl.constexpr, LONG: tl.constexpr, R: tl.constexpr):
        """Positions ``0 .. BT - 1`` (those below ``length``) of a window, the taps before it
        from the conv state; with ``UPDATE_STATE`` the state advanced over the whole window
        (``LONG``: the window may be longer than the block).

        Every load (taps, bias, the conv state entries, the block's input rows, the new
        state's entries past the block) is issued before the first store: a load cannot
        move above a store that may alias it, so loads between stores would cost a few
        dependent memory round trips each, where these are in flight together. The new
        state is picked from the rows already loaded."""
        ws, bias = _conv_taps(w_ptr, bias_ptr, offs_c, mask_c, W, HAS_BIAS)
        xs = _conv_rows(x_at, state_at, h0, 0, length, stride_x_tok, ss_w, mask_c, W, BT, True, R)
        if UPDATE_STATE:
            hist = _next_history(xs, x_at, state_at, length, stride_x_tok, mask_c, W, BT, LONG)
        _conv_outputs(xs, ws, bias, y_row, wbuf_at, w0, 0, length, mask_c, y_tok, sb_pos, W, BT, HAS_WBUF, R)
        if UPDATE_STATE:
            # This block's programs are the only readers of the slot's history, and the
            # new entries are inputs, which nothing writes: no other program races with
            # the update. Within the program, Triton may give the loads above and the
            # stores below different thread layouts, so every thread must be done
            # reading before any thread overwrites.
            tl.debug_barrier()
            for p in tl.static_range(W - 1):
                tl.store(state_at + _entry(h0, p, R) * ss_w, hist[p], mask=mask_c)

    @triton.jit
    def _conv_tokens(x_at, state_at, w_ptr, bias_ptr, y_row, wbuf_at, offs_c, mask_c, w0, t0, length, stride_x_tok,
                     y_tok, ss_w, sb_pos, W: tl.constexpr, BT: tl.constexpr, U: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_WBUF: tl.constexpr, R: tl.constexpr):
        """Positions ``t0 .. t0 + BT - 1`` (those below ``length``) of a block after a window's
        first (``t0 >= W - 1``: every tap is an input), in groups of ``U`` tokens (``BT`` a
        multiple of ``U``). The taps and bias are loaded once, and each group loads its
        ``W - 1 + U`` rows before any of its stores (see :func:`_conv_first_block`)."""
        ws, bias = _conv_taps(w_ptr, bias_ptr, offs_c, mask_c, W, HAS_BIAS)
        for g in range(0, BT // U):
            p0 = t0 + g * U
            xs = _conv_rows(x_at, state_at, 0, p0, length, stride_x_tok, ss_w, mask_c, W, U, False, R)
            _conv_outputs(xs, ws, bias, y_row, wbuf_at, w0, p0, length, mask_c, y_tok, sb_pos, W, U, HAS_WBUF, R)

    @triton.jit
    def _conv_verify_kernel(
        x_ptr, state_ptr, w_ptr, bias_ptr, slots_ptr, cu_ptr, y_ptr, wbuf_ptr, pos_ptr,
        stride_x_tok, C, ss_slot, ss_c, ss_w, sb_slot, sb_pos, sb_c, N, start_k, start_v,
        W: tl.constexpr, BT: tl.constexpr, U: tl.constexpr, BC: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_WBUF: tl.constexpr, UPDATE_STATE: tl.constexpr, PLANAR: tl.constexpr,
        R: tl.constexpr = 0, CHAINED: tl.constexpr = False,
    ):
        """Window positions ``[i_t BT, (i_t + 1) BT)`` of window ``i_b``, channels
        ``[i_c BC, (i_c + 1) BC)``. ``BT >= W - 1`` whenever a window spans more than one
        block (``U > 0``), so only a window's first block reads its conv state.

        ``y`` is a fresh contiguous ``[N, C]``, or with ``PLANAR`` three contiguous parts
        one after another, ``[N, start_k]``, ``[N, start_v - start_k]`` and ``[N, C -
        start_v]`` (channels ``[0, start_k)``, ``[start_k, start_v)``, ``[start_v, C)``):
        each channel's outputs start at its part's base and step by its part's width.
        ``R > 0``: ``state_ptr`` is a conv ring of ``R`` entries a slot and ``pos_ptr``
        the slots' positions; the history is read (and with ``UPDATE_STATE`` rewritten) at
        the ``W - 1`` entries before the position, and ``wbuf_ptr`` (the ring itself, when
        ``HAS_WBUF``) takes window position ``t`` at entry ``position + t``.
        ``CHAINED``: launched by :func:`~replayssm.ops.triton_common.chain_launch`."""
        chain_wait(CHAINED)  # its every input may be the kernel before's
        i_t = tl.program_id(0)
        i_c = tl.program_id(1)
        i_b = tl.program_id(2)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        bos = tl.load(cu_ptr + i_b).to(tl.int64)
        length = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
        t0 = i_t * BT
        if t0 >= length:
            return  # the grid covers the longest window; this one ends before the block
        offs_c = i_c * BC + tl.arange(0, BC)
        mask_c = offs_c < C
        if PLANAR:
            in_k = offs_c >= start_k
            in_v = offs_c >= start_v
            start = tl.where(in_v, start_v, tl.where(in_k, start_k, 0))
            y_tok = tl.where(in_v, C - start_v, tl.where(in_k, start_v - start_k, start_k)).to(tl.int64)
            y_row = y_ptr + start.to(tl.int64) * N + (offs_c - start) + bos * y_tok
        else:
            y_tok = C
            y_row = y_ptr + bos * C + offs_c
        if slot < 0:
            for i in range(0, BT):
                tl.store(y_row + (t0 + i) * y_tok, tl.full([BC], 0, y_ptr.dtype.element_ty),
                         mask=_tl_mask_and(mask_c, t0 + i < length))
            return

        # [BC] rows of W - 1 inputs, oldest first; any strides (e.g. a [slots, W - 1, C]
        # state passed transposed).
        state_at = state_ptr + slot * ss_slot + offs_c * ss_c
        x_at = x_ptr + bos * stride_x_tok + offs_c
        wbuf_at = wbuf_ptr + slot * sb_slot + offs_c * sb_c
        w0 = 0
        if R > 0:
            w0 = tl.load(pos_ptr + slot).to(tl.int64)
        if i_t == 0:
            _conv_first_block(x_at, state_at, w_ptr, bias_ptr, y_row, wbuf_at, offs_c, mask_c, w0 - (W - 1), w0,
                              length, stride_x_tok, y_tok, ss_w, sb_pos, W, BT, HAS_BIAS, HAS_WBUF, UPDATE_STATE,
                              U > 0, R)
        elif U > 0:  # U = 0: the grid has one token block, the first
            _conv_tokens(x_at, state_at, w_ptr, bias_ptr, y_row, wbuf_at, offs_c, mask_c, w0, t0, length, stride_x_tok,
                         y_tok, ss_w, sb_pos, W, BT, U, HAS_BIAS, HAS_WBUF, R)

    @triton.jit
    def _conv_verify_tree_kernel(
        x_ptr, state_ptr, w_ptr, bias_ptr, slots_ptr, nodes_ptr, parents_ptr, depth_ptr, y_ptr, wbuf_ptr, pos_ptr,
        stride_x_tok, C, ss_slot, ss_c, ss_w, sb_slot, sb_pos, sb_c,
        W: tl.constexpr, TN: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WBUF: tl.constexpr,
        R: tl.constexpr = 0,
    ):
        """The tree conv: node ``i``'s tap ``j`` reads its ancestor at distance ``W - 1 - j``
        (found by walking ``parents``), or, past the root, conv state entry ``depth + j``;
        the sums in the chain kernel's order, so a chain gets the chain's bits.

        The node loop is unrolled, and every node's loads (its walk up ``parents``, its
        taps, its own input) come before the first store, and before the first SiLU: a
        load cannot move above a store that may alias it, nor, in practice, above the
        branch to an IEEE division's slow path, which waits for the loads before it. So
        the nodes' loads are in flight together, not each node's after the one before
        it. A node's own input, its last tap, is also its window buffer row. ``R > 0``: a
        conv ring, as in :func:`_conv_verify_kernel`."""
        i_c = tl.program_id(0)
        i_b = tl.program_id(1)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        bos = i_b.to(tl.int64) * TN
        offs_c = i_c * BC + tl.arange(0, BC)
        mask_c = offs_c < C
        y_row = y_ptr + bos * C + offs_c  # y is a fresh contiguous [B * TN, C]
        if slot < 0:
            for i in range(0, TN):
                tl.store(y_row + i * C, tl.full([BC], 0, y_ptr.dtype.element_ty), mask=mask_c)
            return
        count = tl.load(nodes_ptr + i_b)
        w0 = 0
        if R > 0:
            w0 = tl.load(pos_ptr + slot).to(tl.int64)
        state_at = state_ptr + slot * ss_slot + offs_c * ss_c
        x_at = x_ptr + bos * stride_x_tok + offs_c
        ws, bias = _conv_taps(w_ptr, bias_ptr, offs_c, mask_c, W, HAS_BIAS)
        sums = ()
        xs = ()  # each node's own input
        for i in tl.static_range(TN):
            valid = i < count
            d = tl.load(depth_ptr + i_b * TN + i)
            xi = tl.load(x_at + i * stride_x_tok, mask=_tl_mask_and(mask_c, valid), other=0.0)
            node = i + 0 * d
            up = ()  # up[k]: the ancestor at distance k + 1 (-1 past the root), tap W - 2 - k's node
            for _ in tl.static_range(W - 1):
                node = tl.where(node >= 0, tl.load(parents_ptr + i_b * TN + tl.maximum(node, 0)), -1)
                up = up + (node,)
            acc = bias
            for j in tl.static_range(W - 1):
                node = up[W - 2 - j]
                from_x = node >= 0
                xv = tl.load(x_at + tl.maximum(node, 0) * stride_x_tok, mask=_tl_mask_and(mask_c, valid & from_x),
                             other=0.0)
                sv = tl.load(state_at + _entry(w0 - (W - 1), d + j, R) * ss_w,
                             mask=_tl_mask_and(mask_c, valid & (node < 0)), other=0.0)
                acc = acc + ws[j] * tl.where(from_x, xv.to(tl.float32), sv.to(tl.float32))
            sums = sums + (acc + ws[W - 1] * xi.to(tl.float32),)
            xs = xs + (xi,)
        for i in tl.static_range(TN):
            valid = i < count
            acc = sums[i]
            y = tl.div_rn(acc, 1.0 + tl.exp(-acc))  # SiLU
            tl.store(y_row + i * C, _tl_to_rtne(tl.where(valid, y, 0.0), y_ptr.dtype.element_ty), mask=mask_c)
            if HAS_WBUF:
                tl.store(wbuf_ptr + slot * sb_slot + _entry(w0, i, R) * sb_pos + offs_c * sb_c,
                         xs[i].to(wbuf_ptr.dtype.element_ty), mask=_tl_mask_and(mask_c, valid))

    @triton.jit
    def _conv_commit_kernel(
        state_ptr, wbuf_ptr, slots_ptr, acc_ptr, C,
        ss_layer, ss_slot, ss_c, ss_w, sb_layer, sb_slot, sb_pos, sb_c,
        W: tl.constexpr, WP: tl.constexpr, TB: tl.constexpr, BC: tl.constexpr, CHAINED: tl.constexpr = False,
    ):
        chain_wait(CHAINED)  # its every input may be the kernel before's
        i_c = tl.program_id(0)
        i_b = tl.program_id(1)
        i_l = tl.program_id(2).to(tl.int64)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        if slot < 0:
            return
        # Like the reference, n beyond the buffer shifts in the whole buffer.
        n = tl.minimum(tl.maximum(tl.load(acc_ptr + i_b).to(tl.int64), 0), TB)
        offs_c = i_c * BC + tl.arange(0, BC)
        mask_c = offs_c < C
        state_at = state_ptr + i_l * ss_layer + slot * ss_slot + offs_c * ss_c
        wbuf_at = wbuf_ptr + i_l * sb_layer + slot * sb_slot + offs_c * sb_c
        _shift_history(state_at, ss_w, wbuf_at, sb_pos, n, mask_c, W, WP)


    @triton.jit
    def _conv_ring_commit_kernel(pos_ptr, slots_ptr, acc_ptr, B, BB: tl.constexpr, CHAINED: tl.constexpr = False):
        """Every live row's slot position moves by its accepted count (live slots are
        unique: no two rows add to one position). A position is only ever taken mod the
        ring's length, so no count can move an access out of the ring."""
        chain_wait(CHAINED)  # the counts may be the kernel before's
        offs = tl.program_id(0) * BB + tl.arange(0, BB)
        in_batch = offs < B
        slot = tl.load(slots_ptr + offs, mask=in_batch, other=-1).to(tl.int64)
        live = in_batch & (slot >= 0)
        n = tl.load(acc_ptr + offs, mask=live, other=0)
        at = pos_ptr + tl.maximum(slot, 0)
        tl.store(at, tl.load(at, mask=live, other=0) + n.to(pos_ptr.dtype.element_ty), mask=live)


def conv_token_block(t: int, w: int) -> int:
    """Tokens ``BT`` per verify program for windows of at most ``t`` tokens and taps of
    width ``w``: the whole window when that is at most :data:`CONV_TOKEN_BLOCK` tokens
    (verify windows and decoding: one block, a compiled kernel per window length), else
    blocks of :data:`CONV_TOKEN_BLOCK` tokens, but at least ``w - 1`` of them, so that
    only a window's first block reads its conv state, and a multiple of
    :data:`CONV_TOKEN_GROUP`."""
    if t <= CONV_TOKEN_BLOCK:
        return t
    return triton.cdiv(max(CONV_TOKEN_BLOCK, w - 1), CONV_TOKEN_GROUP) * CONV_TOKEN_GROUP


@register("conv_verify", "triton")
def causal_conv_verify_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    window_buf: torch.Tensor | None = None,
    update_state: bool = False,
    max_len: int | None = None,
    parts: tuple[int, int, int] | None = None,
    ring_pos: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`causal_conv_verify_reference` (same arguments and results).

    Differences: no float64. Layouts: ``conv_state`` and ``window_buf`` any strides (a
    ``[slots, W - 1, C]`` state passed transposed, an engine's strided window buffer),
    ``weight`` and ``bias`` contiguous, ``x`` contiguous along channels. Windows must
    have ``1..T`` tokens (``T`` from ``window_buf`` or ``max_len``) and live slots be
    unique and in range: :mod:`~replayssm.ops.guards` checks that once per step on the
    host, or on the device inside a CUDA graph (bad rows run as padding).

    One launch, nothing read on the host (capturable in a CUDA graph), on a grid of
    ``(cdiv(T, BT), cdiv(C, BC), B)`` programs, each ``BT`` consecutive tokens of one
    window and ``BC = min(256, C)`` of its channels (``C`` rounded up to a power of two).
    ``BT`` comes from :func:`conv_token_block`: the whole window when ``T <=``
    :data:`CONV_TOKEN_BLOCK` ``= 16`` (verify windows and decoding), blocks of 16 tokens
    for longer ones (prompts), so that a long prompt spreads over many programs and the
    compiled kernel does not depend on its length. A window's first block loads its
    conv state entries and all its input rows before any store, blocks after it
    :data:`CONV_TOKEN_GROUP` ``= 8`` tokens at a time (a load cannot move above a store
    that may alias it, so the loads are issued together, not token by token). With
    ``update_state`` the programs of a window's first token block, the only ones that
    read its conv state, write its new entries after their outputs, picked from the
    rows loaded for the taps (a prompt's last inputs past the block are loaded with
    them). Every output is the same bits whatever the block: the same products, summed
    in the same order. ``parts`` changes only where the outputs are stored. A conv ring
    (``ring_pos``, contiguous) is read and written at its slots' entries
    (:func:`_entry`); its positions are not read on the host.
    """
    n, c, w = check_conv_args(x, conv_state, weight, bias, ring_pos)
    parts = check_parts(parts, c)
    ns = conv_state.shape[0]
    for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight), ("bias", bias), ("window_buf", window_buf)):
        if t is not None:
            _checks.tensor(name, t, dtypes=CONV_DTYPES_TRITON)
    check_inner_contiguous(x=x)
    _checks.contiguous(weight=weight, bias=bias, ring_pos=ring_pos)
    check_index_pair(slots, cu_seqlens)
    _checks.same_device(x, slots=slots, cu_seqlens=cu_seqlens)
    max_len = check_max_len(max_len)
    buf_len = None
    if window_buf is not None:
        if ring_pos is not None:
            raise ValueError("window_buf must be None with ring_pos: the ring keeps the window's inputs")
        _checks.tensor("window_buf", window_buf, ndim=3)
        _checks.shape("window_buf", window_buf, [ns, None, c])
        _checks.same_device(x, window_buf=window_buf)
        buf_len = window_buf.shape[1]
    ring = conv_state.shape[2] if ring_pos is not None else 0
    if ring and not update_state:
        buf_len = ring - (w - 1)  # the window's room in the ring
    y = torch.empty(n * c, dtype=x.dtype, device=x.device)
    planes = y.view(n, c) if parts is None else tuple(
        y[n * lo : n * (lo + width)].view(n, width) for lo, width in zip((0, parts[0], parts[0] + parts[1]), parts))
    batch = slots.shape[0]
    if batch == 0 or c == 0:
        return planes
    t = window_bound(max_len, buf_len)
    given = slots
    bound = min(b for b in (max_len, buf_len) if b)
    slots, cu_seqlens = guards.check_indices(slots, cu_seqlens, num_slots=ns, num_tokens=n, max_len=bound)
    if slots is not given:
        y.zero_()  # rewritten on the device: rows made padding zero only what they cover
    bc = min(CONV_BLOCK, triton.next_power_of_2(c))
    bt = conv_token_block(t, w)
    if ring and not update_state:  # the ring is the window buffer
        window_buf = conv_state.transpose(1, 2)
    wbuf_strides = window_buf.stride() if window_buf is not None else (0, 0, 0)
    blocks = triton.cdiv(bound, bt)
    # Token blocks on the first axis, the one without the 65535 limit: a prompt may be long.
    chained, launch = chain_launch()
    _conv_verify_kernel[(blocks, triton.cdiv(c, bc), batch)](
        x, conv_state, weight, bias if bias is not None else weight, slots, cu_seqlens, y,
        window_buf if window_buf is not None else y, ring_pos if ring_pos is not None else slots,
        x.stride(0), c, *conv_state.stride(), *wbuf_strides, n,
        *((parts[0], parts[0] + parts[1]) if parts is not None else (0, 0)),
        W=w, BT=bt, U=CONV_TOKEN_GROUP if blocks > 1 else 0, BC=bc,
        HAS_BIAS=bias is not None, HAS_WBUF=window_buf is not None, UPDATE_STATE=bool(update_state),
        PLANAR=parts is not None, R=ring, CHAINED=chained, num_warps=4, **launch,
    )
    return planes


@register("conv_commit", "triton")
def causal_conv_commit_triton(
    conv_state: torch.Tensor, window_buf: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor
) -> None:
    """Triton version of :func:`causal_conv_commit_reference` (same arguments), one launch.

    Buffers with any strides, index tensors contiguous. ``slots`` is checked by
    :mod:`~replayssm.ops.guards` (once per step on the host; on the device inside a CUDA
    graph); ``accepted`` is not read on the host (clamped to ``[0, T]``).
    """
    nl, ns, c, w1 = check_conv_commit_args(conv_state, window_buf, slots, accepted)
    _checks.tensor("conv_state", conv_state, dtypes=CONV_DTYPES_TRITON)
    _checks.tensor("window_buf", window_buf, dtypes=CONV_DTYPES_TRITON)
    _checks.contiguous(slots=slots, accepted=accepted)
    slots = guards.check_slots(slots, num_slots=ns)
    batch = slots.shape[0]
    if batch == 0 or nl == 0 or c == 0 or w1 == 0:
        return
    bc = min(CONV_BLOCK, triton.next_power_of_2(c))
    chained, launch = chain_launch()
    _conv_commit_kernel[(triton.cdiv(c, bc), batch, nl)](
        conv_state, window_buf, slots, accepted, c, *conv_state.stride(), *window_buf.stride(),
        W=w1 + 1, WP=triton.next_power_of_2(w1), TB=window_buf.shape[2], BC=bc, CHAINED=chained, num_warps=4,
        **launch,
    )


@register("conv_ring_commit", "triton")
def conv_ring_commit_triton(ring_pos: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor) -> None:
    """Triton version of :func:`conv_ring_commit_reference` (same arguments), one launch
    of one program per 1024 rows. ``slots`` is checked by :mod:`~replayssm.ops.guards`;
    ``accepted`` is not read on the host."""
    ns = check_ring_commit_args(ring_pos, slots, accepted)
    _checks.contiguous(ring_pos=ring_pos, slots=slots, accepted=accepted)
    slots = guards.check_slots(slots, num_slots=ns)
    batch = slots.shape[0]
    if batch == 0:
        return
    bb = min(1024, triton.next_power_of_2(batch))
    chained, launch = chain_launch()
    _conv_ring_commit_kernel[(triton.cdiv(batch, bb),)](ring_pos, slots, accepted, batch, BB=bb, CHAINED=chained,
                                                        num_warps=4, **launch)


@register("conv_verify_tree", "triton")
def causal_conv_verify_tree_triton(x, conv_state, weight, bias, slots, trees, *, window_buf=None,
                                   ring_pos=None) -> torch.Tensor:
    """Triton version of :func:`causal_conv_verify_tree_reference` (same arguments and
    results), one launch. Layouts as :func:`causal_conv_verify_triton`'s."""
    from .tree_ops import check_tree_rows

    n, c, w = check_conv_args(x, conv_state, weight, bias, ring_pos)
    ns = conv_state.shape[0]
    nb, nn = check_tree_rows(n, trees, slots)
    for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight), ("bias", bias), ("window_buf", window_buf)):
        if t is not None:
            _checks.tensor(name, t, dtypes=CONV_DTYPES_TRITON)
    check_inner_contiguous(x=x)
    _checks.contiguous(weight=weight, bias=bias, slots=slots, ring_pos=ring_pos)
    check_tree_window(window_buf, ring_pos, conv_state, ns, c, nn, w)
    _checks.same_device(x, slots=slots, window_buf=window_buf)
    slots = guards.check_slots(slots, num_slots=ns)
    y = torch.empty(n, c, dtype=x.dtype, device=x.device)
    if nb == 0 or c == 0:
        return y
    dev = trees.on(x.device)
    bc = min(CONV_BLOCK, triton.next_power_of_2(c))
    ring = conv_state.shape[2] if ring_pos is not None else 0
    if ring:  # the ring is the window buffer
        window_buf = conv_state.transpose(1, 2)
    wbuf_strides = window_buf.stride() if window_buf is not None else (0, 0, 0)
    _conv_verify_tree_kernel[(triton.cdiv(c, bc), nb)](
        x, conv_state, weight, bias if bias is not None else weight, slots, dev.num_nodes, dev.parents, dev.depth, y,
        window_buf if window_buf is not None else y, ring_pos if ring_pos is not None else slots,
        x.stride(0), c, *conv_state.stride(), *wbuf_strides,
        W=w, TN=nn, BC=bc, HAS_BIAS=bias is not None, HAS_WBUF=window_buf is not None, R=ring, num_warps=4,
    )
    return y
