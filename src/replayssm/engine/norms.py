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

from ..ops.triton_common import INTERPRETER, triton

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import to_rtne

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


def _out_rows(out: torch.Tensor, x: torch.Tensor) -> tuple[int, int, int]:
    """``(inner, stride_outer, stride_inner)`` addressing the rows of ``out`` (like
    ``x``): row ``r`` of ``x.reshape(-1, D)`` goes to ``(r // inner) * stride_outer +
    (r % inner) * stride_inner``. Rows of one stride (any contiguous block, a column
    slice of a matrix) or of two (a slice of heads ``[N, heads, D]``)."""
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be a {x.dtype} tensor of shape {list(x.shape)} on {x.device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous along its last axis")
    rows = x.numel() // max(x.shape[-1], 1)
    lead = []  # the leading axes (size, stride), merged where one stride covers two
    for n, s in zip(out.shape[:-1], out.stride()[:-1]):
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
    raise ValueError(f"out's rows must have at most two strides, got shape {list(out.shape)} strides "
                     f"{list(out.stride())}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: str, gate: torch.Tensor | None = None,
             *, backend: str = "triton", out: torch.Tensor | None = None) -> torch.Tensor:
    """Normalise the last axis of ``x [..., D]`` (see the module docstring).

    Args:
        weight: ``[D]``; kind: ``"offset"`` or ``"gated"``; gate: ``z`` like ``x``
            (gated only).
        backend: ``"triton"`` (one launch) or ``"reference"``.
        out: ``None`` (a new tensor), or where to write the result: shaped like ``x``,
            contiguous along its last axis, its rows at one or two strides (a slice of
            a wider buffer, so that a concatenation of norms costs no copy).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if (gate is None) != (kind == "offset"):
        raise ValueError("a gated norm needs gate=z; an offset norm takes none")
    rows_out = None if out is None else _out_rows(out, x)
    if backend == "reference":
        y = rms_norm_reference(x, weight, eps, kind, gate)
        return y if out is None else out.copy_(y)
    if triton is None or (x.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton norm needs CUDA tensors or the Triton interpreter")
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    g2 = None
    if gate is not None:
        g2 = gate.reshape(-1, d)
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
    if out is None:
        y = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
        rows_out = (x2.shape[0], 0, d)
    else:
        y = out
    grid, block_r, block, warps = _norm_blocks(d, x2.shape[0])
    _rms_norm_kernel[(grid,)](
        x2, weight, g2 if g2 is not None else x2, y, x2, x2, x2.shape[0], d, eps, x2.stride(0),
        (g2 if g2 is not None else x2).stride(0), 0, *rows_out,
        BLOCK_R=block_r, BLOCK=block, GATED=kind == "gated", RESIDUAL=False, num_warps=warps,
    )
    return y.view(x.shape) if out is None else out


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
    _rms_norm_kernel[(grid,)](
        x, weight, x, y, residual, s, n, d, eps, x.stride(0), x.stride(0), residual.stride(0), n, 0, d,
        BLOCK_R=block_r, BLOCK=block, GATED=False, RESIDUAL=True, num_warps=warps,
    )
    return s, y


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, g_ptr, y_ptr, r_ptr, s_ptr, n_rows, n_cols, eps, stride_x, stride_g, stride_r,
                         inner_y, stride_yo, stride_yi, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
                         GATED: tl.constexpr, RESIDUAL: tl.constexpr):
        # Rows of the block share nothing: each row's sum runs over its own lanes, the
        # same ones whatever the block's position, so a row's result does not depend on
        # which rows share its program (nor on how many rows the call has).
        row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK)
        mask = (row < n_rows)[:, None] & (cols < n_cols)[None, :]
        xr = tl.load(x_ptr + row[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
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
            z = tl.load(g_ptr + row[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = hw * (z / (1.0 + tl.exp(-z)))
        else:
            y = h * (1.0 + w.to(tl.float32))
        y_row = (row // inner_y) * stride_yo + (row % inner_y) * stride_yi
        tl.store(y_ptr + y_row[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _norm_blocks(d: int, rows: int) -> tuple[int, int, int, int]:
    """``(grid, BLOCK_R, BLOCK, num_warps)`` of a norm over ``rows`` rows of ``d``: rows
    of ``BLOCK = next_power_of_2(d)`` lanes, ``BLOCK_R`` of them a program so that a
    program holds at least 2048 elements (one row of the hidden size, 16 of a value
    head's 128), depending on ``d`` alone so that a row's lanes never change."""
    block = triton.next_power_of_2(d)
    block_r = max(1, min(MAX_ROWS_PER_PROGRAM, 2048 // block))
    return triton.cdiv(rows, block_r), block_r, block, 4 if block_r * block >= 1024 else 1
