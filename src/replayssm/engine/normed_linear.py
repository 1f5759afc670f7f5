"""A linear layer with the norm before it and the step after it in its own launch.

A decoder layer at small batch is a chain of tiny kernels: a norm, a matmul, an
activation, a matmul, a residual add with the next norm. On the MTP head of a small
model each costs its launch (about 2 µs on an H100), not its bytes, and a draft depth is
15 of them. :func:`normed_linear` is one matmul ``y = A W^T`` whose operand ``A`` is
built as it is loaded and whose result is finished before it is stored:

* **input** (``A``): the rows ``x`` as they are; or an ``offset`` RMS norm of them
  (``x / rms(x) * (1 + g)`` in fp32, rounded to the dtype, as
  :func:`~replayssm.engine.norms.rms_norm` computes it: each program sums its rows'
  squares, from the tile it multiplies where a half of ``K`` fits one, else in a pass
  before the product's loop); with ``pair``,
  ``A = [norm(x), norm(x2)]``, two normed halves along ``K`` (the MTP head's ``fc``
  input: the token's embedding and the target's hidden state). The rows of the first
  half can be looked up (``rows``: an embedding lookup, or picking one row per request).
* **output**: ``y`` rounded to the dtype; or plus a residual, ``r + y`` (each rounded as
  torch rounds the matmul and the add); or a gated unit, ``silu(y_gate) * y_up`` from
  the two halves of a ``[2 I, K]`` weight (each program computes matching columns of
  both, the bits of :func:`~replayssm.engine.activations.silu_mul` after the matmul);
  or, for greedy tokens, each row's argmax over the columns (each program reduces its
  block of columns, and the last program of a row block to finish, or a second launch,
  reduces the blocks: the logits are never stored).
* ``normed_out`` keeps the normed operand where a later step reads it (the MTP head's
  output, which the next depth takes as its hidden state).

The products run on tensor cores with fp32 accumulation in the order of the tiles, so
the values match torch's matmul to rounding, not bit for bit: these kernels are for the
drafter, whose numbers change which tokens are proposed, never which are accepted.
:func:`normed_linear_reference` composes the same arithmetic from torch's ops.
"""

from __future__ import annotations

import torch

from ..ops.triton_common import ARRIVAL_COUNTERS, INTERPRETER, chain_launch, check_arrivals, triton
from .argmax import MERGE_VALUES, merge_argmax_parts

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import chain_wait, expf, to_rtne
    from .argmax import merge_if_last

#: What the kernel multiplies (fp32 products at IEEE precision, not TF32).
NORMED_LINEAR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: What its output does after the matmul (see the module docstring).
OUTPUTS = ("store", "residual", "glu", "argmax")

#: ``(rows, BLOCK_M)``: the tile height for a call of at most ``rows`` rows (the MTP
#: head's draft depths have one row a request, its update ``T`` a request); 16 is the
#: tensor cores' least. 64 rows take two blocks of 32, whose tiles fit one
#: (:data:`ONE_TILE_BYTES`; offline sm_90, bf16: 94-128 registers a thread, no spills),
#: where one block of 64 loops over ``K`` at 171-219.
_BLOCK_M = ((16, 16), (64, 32), (1 << 62, 64))
#: Columns a program: narrow for narrow layers, so that a layer of a few hundred
#: columns still spreads its weight read over a dozen SMs at batch 1.
_BLOCK_N = ((1024, 32), (1 << 62, 64))
#: Bytes of a program's tiles of a half (its rows and its weights' rows, ``(BLOCK_M +
#: BLOCK_N) x K``, the up rows too for a gated unit) up to which it takes the whole half
#: at once: the weights' block is loaded first, the rows once (their squares summed
#: from registers), one product: one memory round trip where a loop makes several (at
#: a small model's widths the matmul is that latency, not its bytes). 16 rows of 512
#: in bf16 with 32 weight rows; more would spill (offline sm_90: 64 rows of 256 took
#: 242 registers a thread in bf16, and spilled in fp32).
ONE_TILE_BYTES = 48 * 1024
#: ``K`` a step of the loop past :data:`ONE_TILE_BYTES`, for 16-bit operands (half of it
#: for fp32).
BLOCK_K = 128


def _pick(table, n: int) -> int:
    return next(b for limit, b in table if n <= limit)


def normed_linear_reference(x: torch.Tensor, weight: torch.Tensor, *, norm: tuple | None = None,
                            pair: tuple | None = None, rows: torch.Tensor | None = None, row_group: int = 0,
                            output: str = "store", residual: torch.Tensor | None = None,
                            normed_out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`normed_linear` (torch's ops; the same roundings, torch's matmul)."""
    from .activations import silu_mul_reference
    from .norms import rms_norm_reference

    if rows is not None:
        idx = rows.long() + torch.arange(rows.shape[0], device=rows.device) * row_group
        ok = (idx >= 0) & (idx < x.shape[0])
        a = torch.where(ok[:, None], x[idx.clamp(0, x.shape[0] - 1)], torch.zeros((), dtype=x.dtype, device=x.device))
    else:
        a = x
    if norm is not None:
        a = rms_norm_reference(a, norm[0], norm[1], "offset")
    if pair is not None:
        x2, g2, eps2 = pair
        a = torch.cat([a, rms_norm_reference(x2, g2, eps2, "offset")], -1)
    if normed_out is not None:
        normed_out.copy_(a)
    if output == "glu":
        i = weight.shape[0] // 2
        return silu_mul_reference(torch.nn.functional.linear(a, weight[:i]), torch.nn.functional.linear(a, weight[i:]))
    y = torch.nn.functional.linear(a, weight)
    if output == "residual":
        return residual + y
    if output == "argmax":
        return y.argmax(-1)
    return y


def _check_rows(name: str, t: torch.Tensor, width: int, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2 or t.shape[1] != width or t.dtype != dtype or t.device != device or (t.stride(1) != 1 and width > 1):
        raise ValueError(f"{name} must be a {dtype} [N, {width}] tensor on {device}, contiguous along its last axis, "
                         f"got {t.dtype} {list(t.shape)} strides {list(t.stride())} on {t.device}")


def _check_norm(name: str, norm, width: int, device: torch.device) -> tuple[torch.Tensor, float]:
    if not (isinstance(norm, tuple) and len(norm) == 2 and isinstance(norm[0], torch.Tensor)
            and isinstance(norm[1], (int, float)) and not isinstance(norm[1], bool)):
        raise TypeError(f"{name} must be (weight, eps) of an offset norm, got {type(norm).__name__}")
    g, eps = norm
    if g.shape != (width,) or g.device != device or not g.is_contiguous():
        raise ValueError(f"{name}'s weight must be a contiguous [{width}] tensor on {device}, got {list(g.shape)} on "
                         f"{g.device}")
    if not eps > 0:
        raise ValueError(f"{name}'s eps must be positive, got {eps!r}")
    return g, float(eps)


def normed_linear(x: torch.Tensor, weight: torch.Tensor, *, norm: tuple | None = None, pair: tuple | None = None,
                  rows: torch.Tensor | None = None, row_group: int = 0, output: str = "store",
                  residual: torch.Tensor | None = None, normed_out: torch.Tensor | None = None,
                  arrivals: torch.Tensor | None = None, backend: str = "triton") -> torch.Tensor:
    """``y = A W^T`` with ``A``'s norm and ``y``'s next step in one launch (see the module
    docstring).

    Args:
        x: ``[R, K1]`` input rows (model dtype, contiguous along ``K1``).
        weight: ``[N, K]`` (``[2 I, K]`` for ``output="glu"``: gate rows, then up rows),
            ``K = K1`` or ``2 K1`` with ``pair``; contiguous, the dtype of ``x``.
        norm: ``None`` (``x`` as it is), or ``(g [K1], eps)``: an offset RMS norm of each row.
        pair: ``None``, or ``(x2 [M, K1], g2 [K1], eps2)``: ``A = [norm(x), norm(x2)]``
            (``norm`` required), the second half's rows one per output row.
        rows: ``None`` (``M = R``, row ``m`` of ``A`` from row ``m`` of ``x``), or int
            ``[M]``: row ``m`` from row ``m * row_group + rows[m]`` of ``x`` (an embedding
            lookup with ``row_group=0``; one row of each request's ``row_group`` with
            it). Checked on the device: a row outside ``[0, R)`` reads as zeros.
        output: ``"store"``, ``"residual"`` (``residual [M, N]`` plus the product),
            ``"glu"`` (``silu(gate) * up``, ``[M, I]``) or ``"argmax"`` (int64 ``[M]``: each
            row's first greatest column of the product rounded to the dtype; a NaN counts
            as the greatest).
        normed_out: ``None``, or a ``[M, K]`` tensor of the dtype: ``A`` as the product read it.
        arrivals: ``None``, or with ``"argmax"`` counters from
            :func:`~replayssm.ops.triton_common.arrival_counters`: the last program of each
            block of rows merges the column blocks in this launch (a second launch
            otherwise, and where the blocks outnumber one merge's read).
        backend: ``"triton"`` (CUDA, or the Triton interpreter; fp16, bf16 or fp32) or
            ``"reference"`` (torch's ops, any floating dtype: float64 for an oracle).

    Returns:
        ``[M, N]`` (``[M, I]`` for ``"glu"``, int64 ``[M]`` for ``"argmax"``), a new tensor.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be tensors")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 2 or x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"x must be [R, K] and contiguous along K, got {list(x.shape)} strides {list(x.stride())}")
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    dev, dt, k1 = x.device, x.dtype, x.shape[1]
    if pair is not None and norm is None:
        raise ValueError("pair needs norm: both halves of A are normed")
    k = 2 * k1 if pair is not None else k1
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != dt or weight.device != dev \
            or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous {dt} [N, {k}] tensor on {dev}, got {weight.dtype} "
                         f"{list(weight.shape)} on {weight.device}")
    if output == "glu" and weight.shape[0] % 2:
        raise ValueError(f"weight of a gated unit must have an even number of rows (gate, then up), got "
                         f"{weight.shape[0]}")
    n = weight.shape[0] // 2 if output == "glu" else weight.shape[0]
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1 \
                or rows.device != dev:
            raise ValueError(f"rows must be an int [M] tensor on {dev}, got {getattr(rows, 'dtype', type(rows))} "
                             f"{list(getattr(rows, 'shape', []))}")
        m = rows.shape[0]
    else:
        m = x.shape[0]
    if isinstance(row_group, bool) or not isinstance(row_group, int) or row_group < 0:
        raise ValueError(f"row_group must be a non-negative int, got {row_group!r}")
    if row_group and rows is None:
        raise ValueError("row_group needs rows")
    g1 = eps1 = None
    if norm is not None:
        g1, eps1 = _check_norm("norm", norm, k1, dev)
    x2 = g2 = eps2 = None
    if pair is not None:
        if not isinstance(pair, tuple) or len(pair) != 3:
            raise TypeError("pair must be (x2, g2, eps2)")
        x2 = pair[0]
        _check_rows("pair's x2", x2, k1, dt, dev)
        if x2.shape[0] != m:
            raise ValueError(f"pair's x2 must have one row per output row ({m}), got {x2.shape[0]}")
        g2, eps2 = _check_norm("pair's norm", pair[1:], k1, dev)
    if output == "residual":
        if residual is None:
            raise ValueError("output='residual' needs residual")
        _check_rows("residual", residual, n, dt, dev)
        if residual.shape[0] != m:
            raise ValueError(f"residual must be [{m}, {n}], got {list(residual.shape)}")
    elif residual is not None:
        raise ValueError(f"residual is for output='residual', not {output!r}")
    if normed_out is not None:
        _check_rows("normed_out", normed_out, k, dt, dev)
        if normed_out.shape[0] != m:
            raise ValueError(f"normed_out must be [{m}, {k}], got {list(normed_out.shape)}")
    if arrivals is not None and output != "argmax":
        raise ValueError(f"arrivals are for output='argmax', not {output!r}")
    check_arrivals(arrivals, dev)
    if backend == "reference":
        return normed_linear_reference(x, weight, norm=norm, pair=pair, rows=rows, row_group=row_group, output=output,
                                       residual=residual, normed_out=normed_out)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if dt not in NORMED_LINEAR_DTYPES:
        raise TypeError(f"x must be one of {NORMED_LINEAR_DTYPES} for the Triton normed linear, got {dt}")
    if triton is None or (dev.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton normed linear needs CUDA tensors or the Triton interpreter")

    bm, bn = _pick(_BLOCK_M, m), _pick(_BLOCK_N, n)
    width = max(16, triton.next_power_of_2(k1))
    one_tile = (bm + bn * (2 if output == "glu" else 1)) * width * x.element_size() <= ONE_TILE_BYTES
    bk = width if one_tile else min(width, BLOCK_K if x.element_size() <= 2 else BLOCK_K // 2)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    pb = triton.next_power_of_2(grid[1])  # the column blocks a row block's merge reads at once
    arrive = arrivals is not None and bm * pb <= MERGE_VALUES and grid[0] <= ARRIVAL_COUNTERS
    if output == "argmax":
        y = torch.empty((m,), dtype=torch.int64, device=dev)
        best = torch.empty((m, grid[1]), dtype=torch.float32, device=dev)
        where = torch.empty((m, grid[1]), dtype=torch.int64, device=dev)
    else:
        y = torch.empty((m, n), dtype=dt, device=dev)
        best = where = y
    if m == 0:
        return y
    chained, launch = chain_launch()
    _normed_linear_kernel[grid](
        x, x.stride(0), x.shape[0], rows if rows is not None else x, row_group, k1,
        g1 if g1 is not None else x, eps1 or 1.0,
        x2 if x2 is not None else x, x2.stride(0) if x2 is not None else 0, g2 if g2 is not None else x, eps2 or 1.0,
        weight, weight.stride(0), n, m,
        residual if residual is not None else x, residual.stride(0) if residual is not None else 0,
        y, y.stride(0), best, where, grid[1], arrivals if arrive else y,
        normed_out if normed_out is not None else x, normed_out.stride(0) if normed_out is not None else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GATHER=rows is not None, NORM=norm is not None, PAIR=pair is not None,
        OUTPUT=OUTPUTS.index(output), STORE_NORMED=normed_out is not None, ONE_TILE=one_tile,
        PRECISION="ieee" if dt == torch.float32 else "tf32", CHAINED=chained, ARRIVE=arrive,
        PB=pb if arrive else 1, num_warps=4, **launch,
    )
    if output == "argmax" and not arrive:
        merge_argmax_parts(best, where, y)
    return y


if triton is not None:

    @triton.jit
    def _half_weights(w_ptr, w_col, stride_w, k_len, cols, col_ok, up_rows, BLOCK_K: tl.constexpr,
                      GLU: tl.constexpr):
        """A one-tile half's weights ``[BLOCK_K, BLOCK_N]`` (``k_len`` columns from
        ``w_col`` on), and with ``GLU`` the up rows' (else the first again)."""
        lanes = tl.arange(0, BLOCK_K)
        w_at = w_ptr + cols[None, :] * stride_w + w_col + lanes[:, None]
        ok = col_ok[None, :] & (lanes < k_len)[:, None]
        w = tl.load(w_at, mask=ok, other=0.0)
        w2 = w
        if GLU:
            w2 = tl.load(w_at + up_rows * stride_w, mask=ok, other=0.0)
        return w, w2

    @triton.jit
    def _normed_half(acc, acc2, x_ptr, src, row_ok, stride_x, k_len, g_ptr, eps, w_ptr, w_col, stride_w, cols,
                     col_ok, up_rows, h_ptr, h_rows, stride_h, h_ok, w, w2,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
                     STORE_NORMED: tl.constexpr, ONE_TILE: tl.constexpr, PRECISION: tl.constexpr):
        """``acc += A_half W_half^T`` over one half of ``K`` (``k_len`` columns from
        ``w_col`` on): rows ``src`` of ``x``, normed where ``NORM``; with ``GLU`` also
        ``acc2`` against the up rows (``up_rows`` on); with ``STORE_NORMED`` the operand
        into ``h`` where ``h_ok``. ``ONE_TILE``: the half in one block of ``BLOCK_K``,
        against the weights ``w`` and ``w2`` already loaded (:func:`_half_weights`);
        otherwise those are unused and the loop loads its own."""
        lanes = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + src[:, None] * stride_x
        w_at = w_ptr + cols[None, :] * stride_w + w_col
        if ONE_TILE:
            k_ok = lanes < k_len
            a = tl.load(x_rows + lanes[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                xf = a.to(tl.float32)
                # the norm kernel's arithmetic: x * (1 / sqrt(mean + eps)) * (1 + g)
                rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 1) / k_len + eps)
                g = tl.load(g_ptr + lanes, mask=k_ok, other=0.0).to(tl.float32)
                a = to_rtne(xf * rstd[:, None] * (1.0 + g)[None, :], x_ptr.dtype.element_ty)
            if STORE_NORMED:
                tl.store(h_ptr + h_rows[:, None] * stride_h + w_col + lanes[None, :], a,
                         mask=h_ok[:, None] & k_ok[None, :])
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GLU:
                acc2 = tl.dot(a, w2, acc2, input_precision=PRECISION)
        else:
            rstd = tl.full((BLOCK_M,), 1.0, tl.float32)
            if NORM:  # the rows' squares first, a pass over K
                squares = tl.zeros((BLOCK_M,), tl.float32)
                for k0 in range(0, k_len, BLOCK_K):
                    kk = k0 + lanes
                    xv = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & (kk < k_len)[None, :], other=0.0)
                    xv = xv.to(tl.float32)
                    squares += tl.sum(xv * xv, 1)
                rstd = 1.0 / tl.sqrt_rn(squares / k_len + eps)
            for k0 in range(0, k_len, BLOCK_K):
                kk = k0 + lanes
                k_ok = kk < k_len
                a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                if NORM:
                    g = tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                    a = to_rtne(a.to(tl.float32) * rstd[:, None] * (1.0 + g)[None, :], x_ptr.dtype.element_ty)
                if STORE_NORMED:
                    tl.store(h_ptr + h_rows[:, None] * stride_h + w_col + kk[None, :], a,
                             mask=h_ok[:, None] & k_ok[None, :])
                w = tl.load(w_at + kk[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
                if GLU:
                    w2 = tl.load(w_at + up_rows * stride_w + kk[:, None], mask=col_ok[None, :] & k_ok[:, None],
                                 other=0.0)
                    acc2 = tl.dot(a, w2, acc2, input_precision=PRECISION)
        return acc, acc2

    @triton.jit
    def _normed_linear_kernel(x_ptr, stride_x, x_rows, rows_ptr, row_group, k1, g1_ptr, eps1,
                              x2_ptr, stride_x2, g2_ptr, eps2, w_ptr, stride_w, n_cols, n_rows,
                              r_ptr, stride_r, y_ptr, stride_y, best_ptr, where_ptr, parts, arrivals_ptr,
                              h_ptr, stride_h,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GATHER: tl.constexpr, NORM: tl.constexpr, PAIR: tl.constexpr, OUTPUT: tl.constexpr,
                              STORE_NORMED: tl.constexpr, ONE_TILE: tl.constexpr, PRECISION: tl.constexpr,
                              CHAINED: tl.constexpr, ARRIVE: tl.constexpr, PB: tl.constexpr):
        """Rows ``[pid_m BLOCK_M, +BLOCK_M)`` and columns ``[pid_n BLOCK_N, +BLOCK_N)`` of
        :func:`normed_linear` (``OUTPUT`` indexes :data:`OUTPUTS`; ``CHAINED``: launched
        by :func:`~replayssm.ops.triton_common.chain_launch`; ``ARRIVE``: the argmax's
        last program of the row block merges its ``parts``, ``PB`` >= them, into ``y``)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        out_rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = out_rows < n_rows
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        w_a = tl.zeros((BLOCK_K, BLOCK_N), w_ptr.dtype.element_ty)  # the loop path's placeholders
        w2_a, w_b, w2_b = w_a, w_a, w_a
        if ONE_TILE:
            # the weights first: their load is the long one, no kernel writes them, so in
            # a chain it overlaps the kernel before
            w_a, w2_a = _half_weights(w_ptr, 0, stride_w, k1, cols, col_ok, n_cols, BLOCK_K, OUTPUT == 2)
            if PAIR:
                w_b, w2_b = _half_weights(w_ptr, k1, stride_w, k1, cols, col_ok, n_cols, BLOCK_K, OUTPUT == 2)
        chain_wait(CHAINED)
        if GATHER:
            src = out_rows * row_group + tl.load(rows_ptr + out_rows, mask=row_ok, other=0).to(tl.int64)
            src_ok = row_ok & (src >= 0) & (src < x_rows)  # a row outside x reads nothing
        else:
            src = out_rows
            src_ok = row_ok
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        h_ok = row_ok & (tl.zeros((BLOCK_M,), tl.int32) + pid_n == 0)  # one program of each row block keeps A
        acc, acc2 = _normed_half(acc, acc2, x_ptr, src, src_ok, stride_x, k1, g1_ptr, eps1, w_ptr, 0, stride_w,
                                 cols, col_ok, n_cols, h_ptr, out_rows, stride_h, h_ok, w_a, w2_a,
                                 BLOCK_M, BLOCK_K, NORM, OUTPUT == 2, STORE_NORMED, ONE_TILE, PRECISION)
        if PAIR:
            acc, acc2 = _normed_half(acc, acc2, x2_ptr, out_rows, row_ok, stride_x2, k1, g2_ptr, eps2, w_ptr, k1,
                                     stride_w, cols, col_ok, n_cols, h_ptr, out_rows, stride_h, h_ok, w_b, w2_b,
                                     BLOCK_M, BLOCK_K, True, OUTPUT == 2, STORE_NORMED, ONE_TILE, PRECISION)
        dtype = x_ptr.dtype.element_ty
        # torch rounds the matmul's result to the dtype before the next op reads it
        y = to_rtne(acc, dtype).to(tl.float32)
        mask = row_ok[:, None] & col_ok[None, :]
        out = y_ptr + out_rows[:, None] * stride_y + cols[None, :]
        if OUTPUT == 0:
            tl.store(out, y.to(dtype), mask=mask)
        elif OUTPUT == 1:
            r = tl.load(r_ptr + out_rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(out, to_rtne(r + y, dtype), mask=mask)
        elif OUTPUT == 2:
            # silu_mul's arithmetic: silu(gate) rounded, times up, rounded
            up = to_rtne(acc2, dtype).to(tl.float32)
            act = to_rtne(tl.div_rn(y, 1.0 + expf(-y)), dtype).to(tl.float32)
            tl.store(out, to_rtne(act * up, dtype), mask=mask)
        else:
            # this block's first greatest column per row (a NaN's first, if any), as argmax_rows
            v = tl.where(col_ok[None, :], y, float("-inf"))
            nan = v != v
            nan_at = tl.min(tl.where(nan, cols[None, :], n_cols), 1)
            top, at = tl.max(tl.where(nan, float("-inf"), v), 1, return_indices=True,
                             return_indices_tie_break_left=True)
            at = tl.where(nan_at < n_cols, nan_at, pid_n * BLOCK_N + at)
            top = tl.where(nan_at < n_cols, float("nan"), top)
            tl.store(best_ptr + out_rows * parts + pid_n, top, mask=row_ok)
            tl.store(where_ptr + out_rows * parts + pid_n, at.to(tl.int64), mask=row_ok)
            if ARRIVE:
                merge_if_last(best_ptr, where_ptr, y_ptr, arrivals_ptr + pid_m, out_rows, row_ok, parts, PB)
