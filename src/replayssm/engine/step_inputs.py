"""A static step's inputs, and the MTP drafter's after it, gathered in one kernel each.

A step starts from the slots of its rows: each row's window of token ids and its
committed length, then the positions of its tokens (the length plus each token's offset
in the window: its index in a chain, its depth in a draft tree), their embedding rows
and their
rotary rows. As torch ops that is five small kernels (two indexings, an add, two row
gathers), each a launch at batch 1. :func:`gather_step_inputs` writes all five in one
launch, one program per (row, token). :func:`draft_inputs` does the same for the MTP
drafter's greedy chain after a step (seven small kernels as torch ops). Everything is a
copy, a clamp or an integer sum: the results are the ops' exactly.
"""

from __future__ import annotations

import torch

from ..ops.triton_common import INTERPRETER, chain_launch, triton

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import chain_wait
    from ..ops.triton_common import mask_and as _tl_mask_and

#: Embedding columns a program copies at once (a power of two).
EMBED_BLOCK = 1024


def gather_step_inputs_reference(windows, kv_len, slot_idx, embed, rope_table=None, offsets=None):
    """See :func:`gather_step_inputs` (the torch ops a step ran)."""
    ids = windows[slot_idx]
    starts = kv_len[slot_idx]
    if offsets is None:
        offsets = torch.arange(windows.shape[1], device=windows.device)
    positions = starts[:, None] + offsets
    h = embed[ids.reshape(-1)]
    rope = None
    if rope_table is not None:
        rope = rope_table[positions.reshape(-1)].view(*positions.shape, *rope_table.shape[1:])
    return ids, starts, positions, h, rope


def gather_step_inputs(windows: torch.Tensor, kv_len: torch.Tensor, slot_idx: torch.Tensor, embed: torch.Tensor,
                       rope_table: torch.Tensor | None = None, offsets: torch.Tensor | None = None, *,
                       backend: str = "triton"):
    """The inputs of a step of ``B`` rows of ``T`` tokens, graph-safe.

    Args:
        windows: ``[S + 1, T]`` int64, each slot's next window (the sink's last); its
            rows at any stride (the first ``T`` columns of a wider buffer).
        kv_len: ``[S + 1]`` int64, each slot's committed length on the device.
        slot_idx: ``[B]`` int64, the rows' slots (the sink for padding rows), below
            ``S + 1``.
        embed: ``[V, H]`` the embedding table.
        rope_table: ``None``, or ``[L, 2, R]`` rotary rows of every cache position
            (:meth:`~replayssm.engine.adapter.HybridEngine.rope_table`).
        offsets: ``None`` (a chain: token ``t`` at ``starts + t``), or ``[T]`` int64 each
            token's offset from its row's committed length (a draft tree's depths).
        backend: ``"triton"`` (one launch; CUDA or the Triton interpreter) or
            ``"reference"`` (the torch ops).

    Returns:
        ``(ids [B, T], starts [B], positions [B, T], h [B * T, H], rope [B, T, 2, R] or
        None)``: the rows' windows, committed lengths, token positions ``starts +
        offsets``,
        embedding rows and rotary rows. On the Triton backend a token id outside
        ``[0, V)`` gets a zero embedding row and a position outside ``[0, L)`` zero
        rotary rows (checked on the device; the reference's indexing raises, or wraps a
        negative index).
    """
    ints = (("windows", windows), ("kv_len", kv_len), ("slot_idx", slot_idx))
    for name, x in ints + ((("offsets", offsets),) if offsets is not None else ()):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if windows.dim() != 2 or kv_len.shape != (windows.shape[0],) or slot_idx.dim() != 1:
        raise ValueError(f"windows must be [S + 1, T], kv_len [S + 1] and slot_idx [B], got {list(windows.shape)}, "
                         f"{list(kv_len.shape)} and {list(slot_idx.shape)}")
    if not isinstance(embed, torch.Tensor) or embed.dim() != 2:
        raise ValueError(f"embed must be a [V, H] tensor, got {getattr(embed, 'shape', type(embed).__name__)}")
    if rope_table is not None and (rope_table.dim() != 3 or rope_table.shape[1] != 2):
        raise ValueError(f"rope_table must be [L, 2, R], got {list(rope_table.shape)}")
    if offsets is not None and offsets.shape != (windows.shape[1],):
        raise ValueError(f"offsets must be [{windows.shape[1]}] (a window's tokens), got {list(offsets.shape)}")
    tensors = (windows, kv_len, slot_idx, embed) + tuple(x for x in (rope_table, offsets) if x is not None)
    if any(x.device != windows.device for x in tensors):
        raise ValueError(f"windows, kv_len, slot_idx, embed and rope_table must be on one device, got "
                         f"{[str(x.device) for x in tensors]}")
    if backend == "reference":
        return gather_step_inputs_reference(windows, kv_len, slot_idx, embed, rope_table, offsets)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if triton is None or (windows.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton gather_step_inputs needs CUDA tensors or the Triton interpreter")
    if not all(x.is_contiguous() for x in tensors[1:]) or (windows.stride(1) != 1 and windows.shape[1] > 1):
        raise ValueError("kv_len, slot_idx, embed, rope_table and offsets must be contiguous, and windows along its "
                         "last axis")
    b, t = slot_idx.shape[0], windows.shape[1]
    v, hid = embed.shape
    dev = windows.device
    ids = torch.empty((b, t), dtype=torch.int64, device=dev)
    starts = torch.empty(b, dtype=torch.int64, device=dev)
    positions = torch.empty((b, t), dtype=torch.int64, device=dev)
    h = torch.empty((b * t, hid), dtype=embed.dtype, device=dev)
    rope = None if rope_table is None else torch.empty((b, t, 2, rope_table.shape[2]), dtype=rope_table.dtype,
                                                       device=dev)
    if b > 0 and t > 0:
        rows = 0 if rope_table is None else 2 * rope_table.shape[2]
        _step_inputs_kernel[(b, t)](
            windows, kv_len, slot_idx, offsets if offsets is not None else kv_len, embed,
            rope_table if rope_table is not None else embed, ids, starts, positions,
            h, rope if rope is not None else h, windows.stride(0), windows.shape[0], v, hid,
            0 if rope_table is None else rope_table.shape[0],
            T=t, OFFSETS=offsets is not None, BLOCK_H=min(EMBED_BLOCK, triton.next_power_of_2(hid)), ROPE=rows,
            BLOCK_R=triton.next_power_of_2(max(rows, 1)), num_warps=4,
        )
    return ids, starts, positions, h, rope


if triton is not None:

    @triton.jit
    def _step_inputs_kernel(win_ptr, kv_ptr, slot_ptr, off_ptr, emb_ptr, rope_ptr, ids_ptr, starts_ptr, pos_ptr,
                            h_ptr, rope_out_ptr, stride_w, n_slots, n_vocab, n_hidden, n_rope, T: tl.constexpr,
                            OFFSETS: tl.constexpr, BLOCK_H: tl.constexpr,
                            ROPE: tl.constexpr, BLOCK_R: tl.constexpr):
        """Row ``program_id(0)``'s token ``program_id(1)``: its id, position and start
        (token 0 writes the row's start), its embedding row and its rotary rows."""
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1)
        row = b * T + t
        slot = tl.load(slot_ptr + b)
        ok = (slot >= 0) & (slot < n_slots)  # checked by the caller; a bad slot reads nothing
        tok = tl.load(win_ptr + slot * stride_w + t, mask=ok, other=-1)
        start = tl.load(kv_ptr + slot, mask=ok, other=0)
        if OFFSETS:
            pos = start + tl.load(off_ptr + t)
        else:
            pos = start + t
        tl.store(ids_ptr + row, tok)
        tl.store(pos_ptr + row, pos)
        if t == 0:
            tl.store(starts_ptr + b, start)
        tok_ok = (tok >= 0) & (tok < n_vocab)
        cols = tl.arange(0, BLOCK_H)
        for c0 in range(0, n_hidden, BLOCK_H):
            c = c0 + cols
            e = tl.load(emb_ptr + tok * n_hidden + c, mask=_tl_mask_and(c < n_hidden, tok_ok), other=0.0)
            tl.store(h_ptr + row * n_hidden + c, e, mask=c < n_hidden)
        if ROPE > 0:
            r = tl.arange(0, BLOCK_R)
            pos_ok = (pos >= 0) & (pos < n_rope)
            x = tl.load(rope_ptr + pos * ROPE + r, mask=_tl_mask_and(r < ROPE, pos_ok), other=0.0)
            tl.store(rope_out_ptr + row * ROPE + r, x, mask=r < ROPE)


def draft_inputs_reference(emitted, accepted, positions, rope_table, depths: int):
    """See :func:`draft_inputs` (the torch ops the drafter ran)."""
    from .rotary import rope_at

    next_pos = positions[:, 0] + accepted
    depth_pos = torch.arange(depths, device=positions.device)[:, None] + next_pos[None]
    return (emitted.clamp(min=0), (accepted - 1).clamp(min=0), next_pos, rope_at(rope_table, positions), depth_pos,
            rope_at(rope_table, depth_pos))


def draft_inputs(emitted: torch.Tensor, accepted: torch.Tensor, positions: torch.Tensor, rope_table: torch.Tensor,
                 depths: int, *, backend: str = "triton"):
    """What the MTP drafter's greedy chain needs after a step of ``B`` rows of ``T``
    tokens, graph-safe, in one launch: the head's update pass over the step's pairs and
    its ``depths`` draft depths after it.

    Args:
        emitted: ``[B, T]`` int64, each row's emitted tokens, ``-1`` past its accepted
            ones, contiguous along ``T``.
        accepted: ``[B]`` int32 or int64, tokens each row emitted (at least 1 for a
            live row), any stride (a column of the step's output buffer).
        positions: ``[B, T]`` int64, the step's token positions (any strides).
        rope_table: ``[L, 2, R]`` rotary rows of every cache position
            (:meth:`~replayssm.engine.adapter.HybridEngine.rope_table`), contiguous.
        depths: draft depths after the first draft (``k - 1`` for ``k`` drafts), ``>= 0``.
        backend: ``"triton"`` (one launch; CUDA or the Triton interpreter) or
            ``"reference"`` (the torch ops).

    Returns:
        ``(tokens [B, T], last [B], next_pos [B], rope [B, T, 2, R], depth_pos [depths,
        B], depth_rope [depths, B, 2, R])``: the emitted tokens with ``-1`` as ``0``;
        each row's last accepted window entry ``max(accepted - 1, 0)``; its next
        position ``positions[:, 0] + accepted``; the rotary rows at ``positions``; depth
        ``j``'s positions ``next_pos + j`` and their rotary rows. On the Triton backend a
        position outside ``[0, L)`` gets zero rotary rows (checked on the device; the
        reference's indexing raises, or wraps a negative index).
    """
    if isinstance(depths, bool) or not isinstance(depths, int) or depths < 0:
        raise ValueError(f"depths must be a non-negative int, got {depths!r}")
    for name, x, dtypes in (("emitted", emitted, (torch.int64,)), ("accepted", accepted, (torch.int32, torch.int64)),
                            ("positions", positions, (torch.int64,))):
        if not isinstance(x, torch.Tensor) or x.dtype not in dtypes:
            raise TypeError(f"{name} must be a {' or '.join(str(d) for d in dtypes)} tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
    if emitted.dim() != 2 or emitted.shape[1] < 1 or positions.shape != emitted.shape \
            or accepted.shape != emitted.shape[:1]:
        raise ValueError(f"emitted and positions must be alike [B, T >= 1] and accepted [B], got {list(emitted.shape)}, "
                         f"{list(positions.shape)} and {list(accepted.shape)}")
    if not isinstance(rope_table, torch.Tensor) or rope_table.dim() != 3 or rope_table.shape[1] != 2:
        raise ValueError(f"rope_table must be [L, 2, R], got {list(getattr(rope_table, 'shape', []))}")
    if any(x.device != emitted.device for x in (accepted, positions, rope_table)):
        raise ValueError("emitted, accepted, positions and rope_table must be on one device")
    if backend == "reference":
        return draft_inputs_reference(emitted, accepted, positions, rope_table, depths)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if triton is None or (emitted.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton draft_inputs needs CUDA tensors or the Triton interpreter")
    if not rope_table.is_contiguous() or emitted.stride(1) != 1 and emitted.shape[1] > 1:
        raise ValueError("rope_table must be contiguous, and emitted along its last axis")
    (b, t), dev = emitted.shape, emitted.device
    r = rope_table.shape[2]
    tokens = torch.empty((b, t), dtype=torch.int64, device=dev)
    last, next_pos = torch.empty((2, b), dtype=torch.int64, device=dev).unbind(0)
    rope = torch.empty((b, t, 2, r), dtype=rope_table.dtype, device=dev)
    depth_pos = torch.empty((depths, b), dtype=torch.int64, device=dev)
    depth_rope = torch.empty((depths, b, 2, r), dtype=rope_table.dtype, device=dev)
    if b > 0:
        chained, launch = chain_launch()
        _draft_inputs_kernel[(b, t + depths)](
            emitted, accepted, positions, rope_table, tokens, last, next_pos, rope, depth_pos, depth_rope,
            emitted.stride(0), accepted.stride(0), positions.stride(0), positions.stride(1), b, rope_table.shape[0],
            T=t, ROPE=2 * r, BLOCK_R=triton.next_power_of_2(2 * r), CHAINED=chained, num_warps=1, **launch,
        )
    return tokens, last, next_pos, rope, depth_pos, depth_rope


if triton is not None:

    @triton.jit
    def _draft_inputs_kernel(em_ptr, acc_ptr, pos_ptr, rope_ptr, tok_ptr, last_ptr, next_ptr, rope_out_ptr,
                             dpos_ptr, drope_ptr, stride_e, stride_a, stride_pb, stride_pt, n_rows, n_rope,
                             T: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, CHAINED: tl.constexpr):
        """Row ``program_id(0)``: its window entry ``program_id(1)`` (its token, and its
        position's rotary rows; entry 0 also the row's last accepted entry and next
        position), or from ``T`` on draft depth ``program_id(1) - T`` (its position and
        rotary rows). ``CHAINED``: launched by
        :func:`~replayssm.ops.triton_common.chain_launch`."""
        chain_wait(CHAINED)
        b = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1).to(tl.int64)
        first = tl.load(pos_ptr + b * stride_pb)
        acc = tl.load(acc_ptr + b * stride_a).to(tl.int64)
        if i < T:
            tok = tl.load(em_ptr + b * stride_e + i)
            tl.store(tok_ptr + b * T + i, tl.maximum(tok, 0))
            pos = tl.load(pos_ptr + b * stride_pb + i * stride_pt)
            out = rope_out_ptr + (b * T + i) * ROPE
            if i == 0:
                tl.store(last_ptr + b, tl.maximum(acc - 1, 0))
                tl.store(next_ptr + b, first + acc)
        else:
            pos = first + acc + (i - T)
            tl.store(dpos_ptr + (i - T) * n_rows + b, pos)
            out = drope_ptr + ((i - T) * n_rows + b) * ROPE
        r = tl.arange(0, BLOCK_R)
        pos_ok = (pos >= 0) & (pos < n_rope)
        x = tl.load(rope_ptr + pos * ROPE + r, mask=_tl_mask_and(r < ROPE, pos_ok), other=0.0)
        tl.store(out + r, x, mask=r < ROPE)
