"""Greedy tokens: the argmax of each row of logits, in one launch for a step's rows.

A greedy step takes ``logits.argmax(-1)`` three or four times (the target's window, and
each depth of the MTP head's drafts). torch's reduction kernel spends 4-15 µs on it at
a small model's shapes (``[16, 4096]`` bf16, 128 KB, took 15.5 µs a call on an H100,
what eight norm kernels cost). :func:`argmax_rows` gives each row one program (the vocabulary in blocks of
:data:`ARGMAX_BLOCK`, a running best in registers); when the rows are too few to fill
the GPU and the vocabulary is long (a Qwen3.5 vocabulary at batch 1), it splits each row
into parts and reduces the parts' bests in a second launch.

Ties and NaNs follow torch: the first index of the greatest value, where a NaN counts as
greater than any number (the first NaN's index).
"""

from __future__ import annotations

import torch

from ..ops.triton_common import INTERPRETER, chain_launch, sm_count, triton

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import chain_wait

#: Columns a program takes at once (a power of two; shorter rows take their own length).
ARGMAX_BLOCK = 4096
#: What the kernel reads (values compare in fp32, which holds each of these exactly).
ARGMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Programs per SM that a split aims for (below it a row is split into parts).
_PROGRAMS_PER_SM = 4


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


def argmax_rows(x: torch.Tensor, *, backend: str = "triton") -> torch.Tensor:
    """``x.argmax(-1)`` for logits ``x [..., V]``: an int64 tensor of ``x.shape[:-1]``.

    ``x``'s last axis must be contiguous and its other axes one stride apart (a view of
    rows, e.g. ``[B * T, V]`` seen as ``[B, T, V]``); no copy is made. float16, bfloat16
    or float32.

    ``backend``: ``"triton"`` (CUDA, or the Triton interpreter) or ``"reference"``
    (torch's ``argmax``). Both give the first index of the row's greatest value, a NaN
    counting as the greatest.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., V] with V > 0, got {list(x.shape)}")
    if backend == "reference":
        return argmax_rows_reference(x)
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
        _argmax_kernel[(rows, 1)](flat, flat.stride(0), cols, per_part, out, out, out, 1, BLOCK=block, PARTS=False,
                                  num_warps=warps)
        return out
    best = torch.empty((rows, parts), dtype=torch.float32, device=x.device)
    where = torch.empty((rows, parts), dtype=torch.int64, device=x.device)
    _argmax_kernel[(rows, parts)](flat, flat.stride(0), cols, per_part, out, best, where, parts, BLOCK=block, PARTS=True,
                                  num_warps=warps)
    merge_argmax_parts(best, where, out.view(rows))
    return out


def merge_argmax_parts(best: torch.Tensor, where: torch.Tensor, out: torch.Tensor) -> None:
    """The second launch of a split argmax: ``out [R]`` (int64) the index ``where[r, p]``
    of each row's first part ``p`` holding a NaN, else its first part holding the
    greatest ``best[r, p]`` (fp32 ``best`` and int64 ``where``, contiguous ``[R, P]``:
    each part's value and index, ties already resolved to the first within a part)."""
    rows, parts = best.shape
    if rows:
        chained, launch = chain_launch()
        _argmax_parts_kernel[(rows,)](best, where, out, parts, BLOCK=triton.next_power_of_2(parts), CHAINED=chained,
                                      num_warps=1, **launch)


if triton is not None:

    @triton.jit
    def _argmax_kernel(x_ptr, stride_row, n_cols, per_part, out_ptr, best_ptr, where_ptr, parts,
                       BLOCK: tl.constexpr, PARTS: tl.constexpr):
        """Row ``program_id(0)``'s part ``program_id(1)`` (columns ``[part * per_part,
        +per_part)``): its first greatest value's index (a NaN's first, if any), into
        ``out[row]``, or with ``PARTS`` the value and index into ``best, where [row, part]``."""
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
        else:
            tl.store(out_ptr + row, at)

    @triton.jit
    def _argmax_parts_kernel(best_ptr, where_ptr, out_ptr, parts, BLOCK: tl.constexpr, CHAINED: tl.constexpr):
        """Row ``program_id(0)``: the first part holding a NaN, else the first part
        holding the greatest value; its index into ``out[row]``. ``CHAINED``: launched
        by :func:`~replayssm.ops.triton_common.chain_launch`."""
        chain_wait(CHAINED)
        row = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        mask = lanes < parts
        v = tl.load(best_ptr + row * parts + lanes, mask=mask, other=float("-inf"))
        where = tl.load(where_ptr + row * parts + lanes, mask=mask, other=0)
        nan = (v != v) & mask
        first_nan = tl.min(tl.where(nan, lanes, BLOCK), 0)
        _, i = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
        pick = tl.where(first_nan < BLOCK, first_nan, i)
        tl.store(out_ptr + row, tl.sum(tl.where(lanes == pick, where, 0), 0))
