"""Greedy tokens: the argmax of each row of logits, in one launch for a step's rows.

A greedy step takes ``logits.argmax(-1)`` three or four times (the target's window, and
each depth of the MTP head's drafts). torch's reduction kernel spends 4-15 µs on it at
a small model's shapes (``[16, 4096]`` bf16, 128 KB, took 15.5 µs a call on an H100,
what eight norm kernels cost). :func:`argmax_rows` gives each row one program (the vocabulary in blocks of
:data:`ARGMAX_BLOCK`, a running best in registers); when the rows are too few to fill
the GPU and the vocabulary is long (a Qwen3.5 vocabulary at batch 1), it splits each row
into parts and reduces the parts' bests: in a second launch, or, given arrival counters
(:func:`~replayssm.ops.triton_common.arrival_counters`), in the same launch by the last
part of each row to finish.

Ties and NaNs follow torch: the first index of the greatest value, where a NaN counts as
greater than any number (the first NaN's index).
"""

from __future__ import annotations

import torch

from ..ops.triton_common import ARRIVAL_COUNTERS, INTERPRETER, chain_launch, check_arrivals, sm_count, triton

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import chain_wait, last_to_arrive

#: Columns a program takes at once (a power of two; shorter rows take their own length).
ARGMAX_BLOCK = 4096
#: What the kernel reads (values compare in fp32, which holds each of these exactly).
ARGMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Programs per SM that a split aims for (below it a row is split into parts).
_PROGRAMS_PER_SM = 4
#: Values a merge reads at once (rows x parts; a loop over more parts). A last part
#: merges in its own launch only where its rows' parts fit one read: a loop of
#: dependent reads would cost more than the second launch it saves.
MERGE_VALUES = 1024
#: Parts the second launch's program reads at once: a whole vocabulary's column blocks
#: (4096 x 64 columns) in one read.
_SECOND_LAUNCH_VALUES = 4096


def argmax_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """See :func:`argmax_rows` (torch's own)."""
    return x.argmax(-1)


def _split(rows: int, cols: int, block: int, device: torch.device) -> tuple[int, int]:
    """``(parts, columns a part)`` of each row: one part unless the rows leave SMs idle
    and the row has blocks to share (the parts' columns a multiple of ``block``)."""
    blocks = triton.cdiv(cols, block)
    want = triton.cdiv(_PROGRAMS_PER_SM * sm_count(device), max(rows, 1))
    per_part = triton.cdiv(blocks, max(1, min(blocks, want))) * block
    return triton.cdiv(cols, per_part), per_part


def argmax_rows(x: torch.Tensor, *, backend: str = "triton", arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """``x.argmax(-1)`` for logits ``x [..., V]``: an int64 tensor of ``x.shape[:-1]``.

    ``x``'s last axis must be contiguous and its other axes one stride apart (a view of
    rows, e.g. ``[B * T, V]`` seen as ``[B, T, V]``); no copy is made. float16, bfloat16
    or float32.

    ``backend``: ``"triton"`` (CUDA, or the Triton interpreter) or ``"reference"``
    (torch's ``argmax``). Both give the first index of the row's greatest value, a NaN
    counting as the greatest.

    ``arrivals``: ``None``, or counters from
    :func:`~replayssm.ops.triton_common.arrival_counters` (the Triton backend;
    the reference ignores them): a row split into parts is then merged by its last part
    in the same launch (rows past the counters' number take a second launch).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., V] with V > 0, got {list(x.shape)}")
    if backend == "reference":
        return argmax_rows_reference(x)
    check_arrivals(arrivals, x.device)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if x.dtype not in ARGMAX_DTYPES:
        raise TypeError(f"x must be one of {ARGMAX_DTYPES} for the Triton argmax, got {x.dtype}")
    if triton is None or (x.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton argmax needs CUDA tensors or the Triton interpreter")
    cols = x.shape[-1]
    lead = x.shape[:-1]
    rows = x.numel() // cols
    try:
        flat = x.view(rows, cols)  # no copy: the rows must be one stride apart
    except RuntimeError:
        flat = None
    if flat is None or (flat.stride(1) != 1 and cols > 1):
        raise ValueError(f"x's last axis must be contiguous and its rows one stride apart, got shape "
                         f"{list(x.shape)} strides {list(x.stride())}")
    out = torch.empty(lead, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    block = min(ARGMAX_BLOCK, triton.next_power_of_2(cols))
    warps = 8 if block >= 4096 else 4
    parts, per_part = _split(rows, cols, block, x.device)
    if parts == 1:
        _argmax_kernel[(rows, 1)](flat, flat.stride(0), cols, per_part, out, out, out, 1, out, BLOCK=block,
                                  PARTS=False, ARRIVE=False, PB=1, num_warps=warps)
        return out
    best = torch.empty((rows, parts), dtype=torch.float32, device=x.device)
    where = torch.empty((rows, parts), dtype=torch.int64, device=x.device)
    arrive = arrivals is not None and rows <= ARRIVAL_COUNTERS and parts <= MERGE_VALUES
    _argmax_kernel[(rows, parts)](flat, flat.stride(0), cols, per_part, out, best, where, parts,
                                  arrivals if arrive else out, BLOCK=block, PARTS=True, ARRIVE=arrive,
                                  PB=merge_block(parts, MERGE_VALUES), num_warps=warps)
    if not arrive:
        merge_argmax_parts(best, where, out.view(rows))
    return out


def merge_block(parts: int, values: int) -> int:
    """Parts a merge reads at once for each of its rows: all of them, up to ``values``."""
    return min(values, triton.next_power_of_2(parts))


def merge_argmax_parts(best: torch.Tensor, where: torch.Tensor, out: torch.Tensor) -> None:
    """The second launch of a split argmax: ``out [R]`` (int64) the index ``where[r, p]``
    of each row's first part ``p`` holding a NaN, else its first part holding the
    greatest ``best[r, p]`` (fp32 ``best`` and int64 ``where``, contiguous ``[R, P]``:
    each part's value and index, ties already resolved to the first within a part)."""
    rows, parts = best.shape
    if rows:
        chained, launch = chain_launch()
        _argmax_parts_kernel[(rows,)](best, where, out, parts, PB=merge_block(parts, _SECOND_LAUNCH_VALUES),
                                      CHAINED=chained, num_warps=1, **launch)


if triton is not None:

    @triton.jit
    def _argmax_kernel(x_ptr, stride_row, n_cols, per_part, out_ptr, best_ptr, where_ptr, parts, arrivals_ptr,
                       BLOCK: tl.constexpr, PARTS: tl.constexpr, ARRIVE: tl.constexpr, PB: tl.constexpr):
        """Row ``program_id(0)``'s part ``program_id(1)`` (columns ``[part * per_part,
        +per_part)``): its first greatest value's index (a NaN's first, if any), into
        ``out[row]``, or with ``PARTS`` the value and index into ``best, where [row, part]``
        (and with ``ARRIVE`` the row's last part merges them into ``out[row]``:
        :func:`merge_if_last`)."""
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        start = part * per_part
        end = tl.minimum(start + per_part, n_cols)
        lanes = tl.arange(0, BLOCK)
        top = tl.full((), float("-inf"), tl.float32)
        at = start.to(tl.int64)  # an all -inf part: its first column, as torch
        nan_at = tl.full((), n_cols, tl.int64)  # n_cols: no NaN yet
        for lo in range(start, end, BLOCK):
            cols = lo + lanes
            v = tl.load(x_ptr + row * stride_row + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
            nan = v != v
            nan_at = tl.minimum(nan_at, tl.min(tl.where(nan, cols, n_cols), 0).to(tl.int64))
            m, i = tl.max(tl.where(nan, float("-inf"), v), 0, return_indices=True, return_indices_tie_break_left=True)
            # strictly greater: an earlier block's equal value keeps the first index
            at = tl.where(m > top, (lo + i).to(tl.int64), at)
            top = tl.maximum(top, m)
        at = tl.where(nan_at < n_cols, nan_at, at)
        top = tl.where(nan_at < n_cols, float("nan"), top)
        if PARTS:
            tl.store(best_ptr + row * parts + part, top)
            tl.store(where_ptr + row * parts + part, at)
            if ARRIVE:
                one = tl.arange(0, 1)
                merge_if_last(best_ptr, where_ptr, out_ptr, arrivals_ptr + row, row + one, one == 0, parts, PB)
        else:
            tl.store(out_ptr + row, at)

    @triton.jit
    def merge_parts(best_ptr, where_ptr, rows, row_ok, parts, PB: tl.constexpr, FRESH: tl.constexpr):
        """The argmax of rows ``rows [R]`` (int64, where ``row_ok``) from their parts'
        values and indices ``best, where [., parts]`` (contiguous; ties already resolved
        within a part): the first part's index holding a NaN, else the first part's
        holding the greatest value, read ``PB`` parts at a time. ``FRESH``: the parts were
        written by other programs of this launch, so the loads skip L1."""
        lanes = tl.arange(0, PB)
        top = tl.zeros_like(rows).to(tl.float32) + float("-inf")
        at = tl.zeros_like(rows) - 1  # none taken yet
        seen_nan = tl.zeros_like(rows) != 0
        for p0 in range(0, parts, PB):
            p = p0 + lanes
            ok = row_ok[:, None] & (p < parts)[None, :]
            off = rows[:, None] * parts + p[None, :]
            if FRESH:
                v = tl.load(best_ptr + off, mask=ok, other=float("-inf"), cache_modifier=".cg")
                w = tl.load(where_ptr + off, mask=ok, other=0, cache_modifier=".cg")
            else:
                v = tl.load(best_ptr + off, mask=ok, other=float("-inf"))
                w = tl.load(where_ptr + off, mask=ok, other=0)
            nan = (v != v) & ok
            first_nan = tl.min(tl.where(nan, lanes[None, :], PB), 1)
            m, i = tl.max(tl.where(nan, float("-inf"), v), 1, return_indices=True, return_indices_tie_break_left=True)
            has_nan = first_nan < PB
            pick = tl.where(has_nan, first_nan, i)
            here = tl.sum(tl.where(lanes[None, :] == pick[:, None], w, 0), 1)
            # an earlier block's NaN, or its equal value, keeps its index
            take = ~seen_nan & (has_nan | (m > top) | (at < 0))
            at = tl.where(take, here, at)
            top = tl.where(take, m, top)
            seen_nan = seen_nan | has_nan
        return at

    @triton.jit
    def merge_if_last(best_ptr, where_ptr, out_ptr, counter_ptr, rows, row_ok, parts, PB: tl.constexpr):
        """After a program has stored its part of rows ``rows`` (:func:`merge_parts`'
        layout): the last of the ``parts`` to arrive (:func:`last_to_arrive`) merges the
        rows into ``out_ptr[rows]`` and sets the counter back to zero."""
        if last_to_arrive(counter_ptr, parts):
            tl.store(out_ptr + rows, merge_parts(best_ptr, where_ptr, rows, row_ok, parts, PB, True), mask=row_ok)
            tl.store(counter_ptr, 0)

    @triton.jit
    def _argmax_parts_kernel(best_ptr, where_ptr, out_ptr, parts, PB: tl.constexpr, CHAINED: tl.constexpr):
        """Row ``program_id(0)``: :func:`merge_parts` into ``out[row]``. ``CHAINED``:
        launched by :func:`~replayssm.ops.triton_common.chain_launch`."""
        chain_wait(CHAINED)
        one = tl.arange(0, 1)
        rows = tl.program_id(0).to(tl.int64) + one
        tl.store(out_ptr + rows, merge_parts(best_ptr, where_ptr, rows, one == 0, parts, PB, False))
