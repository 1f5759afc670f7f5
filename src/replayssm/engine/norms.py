"""RMS norms of Qwen3.5 / Qwen3-Next in one kernel each, for static steps on the GPU.

Transformers' norm modules are five to eight elementwise and reduction kernels each
(cast, square, mean, add, rsqrt, multiply, scale, cast); a step of the 8-layer
benchmark model runs about 25 of them, so at batch 1 their launches, not their bytes,
cost a quarter of the step. :func:`rms_norm` does a block of rows per program (at least
2048 elements, so that the gated norms' rows of one value head, 128 long and 32 a token,
are not one tiny program each), in one launch with the modules' own arithmetic:

* ``offset`` norms (``Qwen3_5RMSNorm``, ``Qwen3NextRMSNorm``): ``y = x / rms(x) * (1 + w)``
  in fp32, cast to the input dtype;
* ``gated`` norms (``*RMSNormGated``, after a GDN layer): ``y = (w * (x / rms(x)))`` with
  ``x / rms(x)`` cast to the input dtype and the product rounded to it, then times
  ``silu(z)`` in fp32, cast to the input dtype.

:func:`norm_kind` tells which a module is (``None``: not one of these, use the module).
"""

from __future__ import annotations

import torch

from ..ops.triton_common import INTERPRETER, chain_launch, triton

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import chain_wait, device_fn, to_rtne

KINDS = ("offset", "gated")
#: Most rows a norm program takes (see :func:`_norm_blocks`); 1 is a program a row.
MAX_ROWS_PER_PROGRAM = 16


def norm_kind(module) -> str | None:
    """``"offset"``, ``"gated"`` or ``None`` for a transformers norm module."""
    name = type(module).__name__
    if name.endswith("RMSNormGated") and hasattr(module, "variance_epsilon"):
        return "gated"
    if name in ("Qwen3_5RMSNorm", "Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm") and hasattr(module, "eps"):
        return "offset"
    return None


def norm_eps(module) -> float:
    return float(module.variance_epsilon if norm_kind(module) == "gated" else module.eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: str,
                       gate: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`rms_norm` (the modules' arithmetic, op by op)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "offset":
        return (h * (1.0 + weight.float())).to(x.dtype)
    h = weight * h.to(x.dtype)
    return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)


def _row_strides(t: torch.Tensor, name: str) -> tuple[int, int, int]:
    """``(inner, stride_outer, stride_inner)`` addressing the rows of ``t [..., D]``:
    row ``r`` of ``t.reshape(-1, D)`` lies at ``(r // inner) * stride_outer + (r % inner)
    * stride_inner``. Rows of one stride (any contiguous block, a column slice of a
    matrix) or of two (a slice of heads ``[N, heads, D]`` of a wider matrix, which no
    single stride reaches: reshaping would copy). ``name`` names ``t`` in the errors."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last axis, got strides {list(t.stride())}")
    rows = t.numel() // max(t.shape[-1], 1)
    lead = []  # the leading axes (size, stride), merged where one stride covers two
    for n, s in zip(t.shape[:-1], t.stride()[:-1]):
        if n == 1:
            continue
        if lead and lead[-1][1] == n * s:
            lead[-1] = (lead[-1][0] * n, s)
        else:
            lead.append((n, s))
    if len(lead) <= 1:
        return rows, 0, lead[0][1] if lead else 0
    if len(lead) == 2:
        (_, s_outer), (n_inner, s_inner) = lead
        return n_inner, s_outer, s_inner
    raise ValueError(f"{name}'s rows must have at most two strides, got shape {list(t.shape)} strides "
                     f"{list(t.stride())}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: str, gate: torch.Tensor | None = None,
             *, backend: str = "triton", out: torch.Tensor | None = None) -> torch.Tensor:
    """Normalise the last axis of ``x [..., D]`` (see the module docstring).

    ``x``, ``gate`` and ``out`` are read and written in place: each contiguous along
    its last axis, its rows at one or two strides (``[N, heads, D]`` heads of a wider
    matrix, say the queries and keys as column slices of one projection's output ``[N,
    W]``, strides ``(W, 2D, 1)`` and ``(W, D, 1)``); anything else raises.

    Args:
        weight: ``[D]``; kind: ``"offset"`` or ``"gated"``; gate: ``z`` shaped like
            ``x`` (gated only).
        backend: ``"triton"`` (one launch) or ``"reference"``.
        out: ``None`` (a new tensor), or where to write the result, shaped like ``x``
            (a slice of a wider buffer, so that a concatenation of norms costs no copy).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if (gate is None) != (kind == "offset"):
        raise ValueError("a gated norm needs gate=z; an offset norm takes none")
    rows_x = rows_g = _row_strides(x, "x")
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"gate must be shaped like x {list(x.shape)}, got {list(gate.shape)}")
        rows_g = _row_strides(gate, "gate")
    rows_out = None
    if out is not None:
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"out must be a {x.dtype} tensor of shape {list(x.shape)} on {x.device}, got "
                             f"{out.dtype} {list(out.shape)} on {out.device}")
        rows_out = _row_strides(out, "out")
    if backend == "reference":
        y = rms_norm_reference(x, weight, eps, kind, gate)
        return y if out is None else out.copy_(y)
    if triton is None or (x.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton norm needs CUDA tensors or the Triton interpreter")
    d = x.shape[-1]
    rows = x.numel() // max(d, 1)
    if out is None:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rows_out = (rows, 0, d)
    else:
        y = out
    grid, block_r, block, warps = _norm_blocks(d, rows)
    chained, launch = chain_launch()
    _rms_norm_kernel[(grid,)](
        x, weight, x if gate is None else gate, y, x, x, rows, d, eps, *rows_x, *rows_g, 0, *rows_out,
        *_NO_SECOND(x, weight, y), BLOCK_R=block_r, BLOCK=block, GATED=kind == "gated", RESIDUAL=False, PAIR=False,
        GATHER=False, CHAINED=chained, num_warps=warps, **launch,
    )
    return y


def rms_norm_pair(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                  x2: torch.Tensor, weight2: torch.Tensor, eps2: float, out2: torch.Tensor, *,
                  rows: torch.Tensor | None = None, backend: str = "triton") -> None:
    """Two ``offset`` norms of one width in one launch: ``out = rms_norm(x)`` and ``out2 =
    rms_norm(x2)`` (each with its own weight and eps), as two :func:`rms_norm` calls
    compute them, bit for bit: the same kernel runs each row, the second norm's rows in
    programs after the first's. For norms a layer runs side by side (an attention
    layer's queries and keys; the MTP head's two input halves), where each launch at
    batch 1 costs more than its bytes.

    Args:
        x: ``[..., D]`` rows to normalise, or with ``rows`` the ``[R, D]`` table they are
            looked up in (an embedding), contiguous along ``D``; weight ``[D]``.
        out: where to write, shaped like ``x`` (``[len(rows), D]`` with ``rows``); a slice
            of a wider buffer is fine (rows at one or two strides, as :func:`rms_norm`).
        x2, weight2, eps2, out2: the second norm, of the same ``D`` and dtype.
        rows: ``None``, or int ``[N]`` indices (any stride) of ``x``'s rows to normalise
            (the lookup and the norm in one kernel). Checked on the device, where they
            live: an index outside ``[0, R)`` reads no memory and gives a row of zeros.
        backend: ``"triton"`` (one launch) or ``"reference"`` (two norms, op by op).
    """
    d = x.shape[-1]
    if x2.shape[-1] != d or weight.shape != (d,) or weight2.shape != (d,):
        raise ValueError(f"x and x2 must share their width D with weight and weight2 [D], got x {list(x.shape)}, "
                         f"x2 {list(x2.shape)}, weight {list(weight.shape)}, weight2 {list(weight2.shape)}")
    if x2.dtype != x.dtype:
        raise ValueError(f"x2 must be {x.dtype} like x, got {x2.dtype}")
    if rows is not None:
        if rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1 or rows.device != x.device:
            raise ValueError(f"rows must be an int [N] tensor on {x.device}, got {rows.dtype} {list(rows.shape)} "
                             f"on {rows.device}")
        if x.dim() != 2:
            raise ValueError(f"with rows, x must be the [R, D] table they index, got {list(x.shape)}")
    shape = x.shape if rows is None else (rows.shape[0], d)
    for name, o, want, like in (("out", out, shape, x), ("out2", out2, x2.shape, x2)):
        if o.shape != want or o.dtype != like.dtype or o.device != like.device:
            raise ValueError(f"{name} must be a {like.dtype} tensor of shape {list(want)} on {like.device}, got "
                             f"{o.dtype} {list(o.shape)} on {o.device}")
    rows_x, rows_out = _row_strides(x, "x"), _row_strides(out, "out")
    rows_x2, rows_out2 = _row_strides(x2, "x2"), _row_strides(out2, "out2")
    if backend == "reference":
        out.copy_(rms_norm_reference(x if rows is None else x[rows], weight, eps, "offset"))
        out2.copy_(rms_norm_reference(x2, weight2, eps2, "offset"))
        return
    if triton is None or (x.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton norm needs CUDA tensors or the Triton interpreter")
    n, n2 = out.numel() // max(d, 1), x2.numel() // max(d, 1)
    grid, block_r, block, warps = _norm_blocks(d, n)
    grid2 = _norm_blocks(d, n2)[0]  # the same rows a program, lanes and warps: they depend on d alone
    if grid + grid2 == 0:
        return
    chained, launch = chain_launch()
    _rms_norm_kernel[(grid + grid2,)](
        x, weight, x, out, rows if rows is not None else x, x, n, d, eps, *rows_x, 0, 0, 0,
        0 if rows is None else rows.stride(0), *rows_out,
        x2, weight2, out2, grid, n2, eps2, *rows_x2, *rows_out2,
        BLOCK_R=block_r, BLOCK=block, GATED=False, RESIDUAL=False, PAIR=True, GATHER=rows is not None,
        CHAINED=chained, num_warps=warps, **launch,
    )


def _NO_SECOND(x, weight, y) -> tuple:
    """The second norm's arguments of :func:`_rms_norm_kernel` where it has none (``PAIR``
    off): placeholders the kernel never reads."""
    return (x, weight, y, 1 << 30, 0, 1.0, 1, 0, 0, 1, 0, 0)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 backend: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` with ``s = x + residual`` (rounded to the dtype, as torch's
    add rounds it) for an ``offset`` norm, in one launch: a residual add and the norm
    after it, as a decoder layer runs them. ``x, residual [N, D]`` alike; both results
    are new ``[N, D]`` tensors."""
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"x and residual must be alike [N, D] with weight [D], got {list(x.shape)} "
                         f"{x.dtype}, {list(residual.shape)} {residual.dtype}, {list(weight.shape)}")
    if backend == "reference":
        s = x + residual
        return s, rms_norm_reference(s, weight, eps, "offset")
    if triton is None or (x.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton norm needs CUDA tensors or the Triton interpreter")
    x, residual = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, residual))
    n, d = x.shape
    s, y = torch.empty((2, n, d), dtype=x.dtype, device=x.device).unbind(0)
    grid, block_r, block, warps = _norm_blocks(d, n)
    chained, launch = chain_launch()
    _rms_norm_kernel[(grid,)](
        x, weight, x, y, residual, s, n, d, eps, n, 0, x.stride(0), n, 0, x.stride(0), residual.stride(0), n, 0, d,
        *_NO_SECOND(x, weight, y), BLOCK_R=block_r, BLOCK=block, GATED=False, RESIDUAL=True, PAIR=False, GATHER=False,
        CHAINED=chained, num_warps=warps, **launch,
    )
    return s, y


if triton is not None:

    @device_fn
    def _norm_block(pid, x_ptr, w_ptr, g_ptr, y_ptr, r_ptr, s_ptr, n_rows, n_cols, eps, inner_x, stride_xo, stride_xi,
                    inner_g, stride_go, stride_gi, stride_r, inner_y, stride_yo, stride_yi,
                    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                    GATHER: tl.constexpr):
        """Block ``pid`` of a norm's rows (:func:`_rms_norm_kernel`'s arguments)."""
        # Rows of the block share nothing: each row's sum runs over its own lanes, the
        # same ones whatever the block's position, so a row's result does not depend on
        # which rows share its program (nor on how many rows the call has).
        row = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK)
        mask = (row < n_rows)[:, None] & (cols < n_cols)[None, :]
        # x, gate and y address their rows at one or two strides each (_row_strides);
        # with GATHER, row r of the norm is row r_ptr[r * stride_r] of x (an embedding lookup)
        if GATHER:
            # (x is then the [R, D] table, whose rows _row_strides counts in inner_x: an
            # index outside [0, R) reads nothing, on the device)
            src = tl.load(r_ptr + row * stride_r, mask=row < n_rows, other=0).to(tl.int64)
            x_mask = mask & ((src >= 0) & (src < inner_x))[:, None]
        else:
            src = row
            x_mask = mask
        x_row = (src // inner_x) * stride_xo + (src % inner_x) * stride_xi
        xr = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=x_mask, other=0.0)
        if RESIDUAL:  # s = x + residual, rounded to the dtype, is both an output and the norm's input
            rr = tl.load(r_ptr + row[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
            xr = to_rtne(xr.to(tl.float32) + rr.to(tl.float32), s_ptr.dtype.element_ty)
            tl.store(s_ptr + row[:, None] * n_cols + cols[None, :], xr, mask=mask)
        x = xr.to(tl.float32)
        var = tl.sum(x * x, 1) / n_cols
        h = x * (1.0 / tl.sqrt_rn(var + eps))[:, None]
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)[None, :]
        if GATED:
            # the module rounds x / rms(x) and its product with w to the input dtype
            hw = (w * h.to(xr.dtype)).to(xr.dtype).to(tl.float32)
            g_row = (row // inner_g) * stride_go + (row % inner_g) * stride_gi
            z = tl.load(g_ptr + g_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = hw * (z / (1.0 + tl.exp(-z)))
        else:
            y = h * (1.0 + w.to(tl.float32))
        y_row = (row // inner_y) * stride_yo + (row % inner_y) * stride_yi
        tl.store(y_ptr + y_row[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, g_ptr, y_ptr, r_ptr, s_ptr, n_rows, n_cols, eps, inner_x, stride_xo, stride_xi,
                         inner_g, stride_go, stride_gi, stride_r, inner_y, stride_yo, stride_yi,
                         x2_ptr, w2_ptr, y2_ptr, grid_1, n_rows_2, eps_2, inner_x2, stride_x2o, stride_x2i,
                         inner_y2, stride_y2o, stride_y2i,
                         BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                         PAIR: tl.constexpr, GATHER: tl.constexpr, CHAINED: tl.constexpr):
        # PAIR (rms_norm_pair): the programs from grid_1 on run a second offset norm of
        # the same width (x2 -> y2) through the same block code, so its rows get the
        # bits a launch of their own gives; GATHER (with PAIR) is the first norm's.
        # CHAINED: launched by chain_launch.
        chain_wait(CHAINED)
        pid = tl.program_id(0)
        if PAIR:
            if pid >= grid_1:
                _norm_block(pid - grid_1, x2_ptr, w2_ptr, x2_ptr, y2_ptr, x2_ptr, x2_ptr, n_rows_2, n_cols, eps_2,
                            inner_x2, stride_x2o, stride_x2i, 1, 0, 0, 0, inner_y2, stride_y2o, stride_y2i,
                            BLOCK_R, BLOCK, False, False, False)
            else:
                _norm_block(pid, x_ptr, w_ptr, g_ptr, y_ptr, r_ptr, s_ptr, n_rows, n_cols, eps, inner_x, stride_xo,
                            stride_xi, inner_g, stride_go, stride_gi, stride_r, inner_y, stride_yo, stride_yi,
                            BLOCK_R, BLOCK, False, False, GATHER)
        else:
            _norm_block(pid, x_ptr, w_ptr, g_ptr, y_ptr, r_ptr, s_ptr, n_rows, n_cols, eps, inner_x, stride_xo,
                        stride_xi, inner_g, stride_go, stride_gi, stride_r, inner_y, stride_yo, stride_yi,
                        BLOCK_R, BLOCK, GATED, RESIDUAL, False)


def _norm_blocks(d: int, rows: int) -> tuple[int, int, int, int]:
    """``(grid, BLOCK_R, BLOCK, num_warps)`` of a norm over ``rows`` rows of ``d``: rows
    of ``BLOCK = next_power_of_2(d)`` lanes, ``BLOCK_R`` of them a program so that a
    program holds at least 2048 elements (one row of the hidden size, 16 of a value
    head's 128), depending on ``d`` alone so that a row's lanes never change."""
    block = triton.next_power_of_2(d)
    block_r = max(1, min(MAX_ROWS_PER_PROGRAM, 2048 // block))
    return triton.cdiv(rows, block_r), block_r, block, 4 if block_r * block >= 1024 else 1
