"""The gated MLP's activation, ``silu(gate) * up``, in one kernel for static steps.

Transformers' dense Qwen MLP runs ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: the
activation and the product are two elementwise kernels, each reading and writing
``[N, intermediate]``. :func:`silu_mul` does both in one pass with the module's
rounding: ``silu(g)`` in fp32 rounded to the input dtype, then its product with ``up``
in fp32 rounded again (torch rounds each op's result to the tensors' dtype), with
CUDA's ``expf`` and an IEEE division as torch's SiLU kernel: on the GPU the module's
bits.
:func:`dense_silu_mlp` tells which MLP modules it applies to.

The full-attention layers' output gate, ``o * sigmoid(gate)`` (the gate a strided view
of the query projection's output), is two kernels the same way; :func:`sigmoid_mul` is
one, with torch's roundings: its sigmoid kernel computes ``1 / (1 + exp(-x))`` in fp32
(CUDA's ``expf``, an IEEE division) and rounds the quotient once to the tensors' dtype,
then the product rounds.
"""

from __future__ import annotations

import torch

from ..ops.triton_common import INTERPRETER, triton

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import expf, to_rtne

#: Elements a program takes (a power of two).
SILU_MUL_BLOCK = 2048
#: What the kernel takes (it computes in fp32 and rounds to the inputs' dtype).
SILU_MUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dense_silu_mlp(mlp) -> bool:
    """Whether ``mlp`` is a dense gated MLP with a SiLU activation (``gate_proj``,
    ``up_proj``, ``down_proj``; transformers' Qwen3.5 / Qwen3-Next ``*MLP``)."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))


def _reference(op: str, names: tuple[str, str], a, b, backend: str, ndim: int | None = None) -> bool:
    """Check the two inputs of an elementwise kernel (tensors alike in shape, dtype and
    device, ``ndim`` axes where given; a dtype the kernel takes on CUDA or under the
    interpreter) and its ``backend``; ``True`` for the reference."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"{names[0]} and {names[1]} must be tensors")
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or ndim not in (None, a.dim()):
        shape = " [N, heads, D]" if ndim == 3 else ""
        raise ValueError(f"{names[0]} and {names[1]} must be alike{shape}, got {a.dtype} {list(a.shape)} on "
                         f"{a.device} and {b.dtype} {list(b.shape)} on {b.device}")
    if backend == "reference":
        return True
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if a.dtype not in SILU_MUL_DTYPES:
        raise TypeError(f"{names[0]} and {names[1]} must be one of {SILU_MUL_DTYPES} for the Triton {op}, got "
                        f"{a.dtype}")
    if triton is None or (a.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError(f"the Triton {op} needs CUDA tensors or the Triton interpreter")
    return False


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """See :func:`silu_mul` (the module's two ops)."""
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "triton") -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up [..., D]`` alike (dtype, shape, device), in one
    launch; returns a new contiguous tensor of their shape. Rows at any stride are read
    in place (the two halves of one ``[N, 2D]`` matmul output, say).

    ``backend``: ``"triton"`` (CUDA, or the Triton interpreter) or ``"reference"``.
    """
    if _reference("silu_mul", ("gate", "up"), gate, up, backend):
        return silu_mul_reference(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if n == 0:
        return out
    d = gate.shape[-1] if gate.dim() else 1
    g2, u2 = gate.reshape(-1, d), up.reshape(-1, d)  # views unless a row is not one stride
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    _silu_mul_kernel[(triton.cdiv(n, SILU_MUL_BLOCK),)](g2, u2, out, n, d, g2.stride(0), u2.stride(0),
                                                        BLOCK=SILU_MUL_BLOCK, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, D, stride_g, stride_u, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        row = offs // D  # y is contiguous; the inputs' rows are at their own strides
        col = offs - row * D
        g = tl.load(g_ptr + row * stride_g + col, mask=mask, other=0.0)
        u = tl.load(u_ptr + row * stride_u + col, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        # torch's SiLU: x / (1 + expf(-x)) in fp32 (an IEEE division), rounded to the
        # dtype; on CUDA the same bits as torch's kernel
        a = to_rtne(tl.div_rn(gf, 1.0 + expf(-gf)), g.dtype).to(tl.float32)
        tl.store(y_ptr + offs, to_rtne(a * u.to(tl.float32), y_ptr.dtype.element_ty), mask=mask)


def sigmoid_mul_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """See :func:`sigmoid_mul` (the two ops)."""
    return x * torch.sigmoid(gate)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, *, backend: str = "triton") -> torch.Tensor:
    """``x * sigmoid(gate)`` for ``x, gate [N, heads, D]`` alike in dtype, shape and device,
    in one launch; returns a new contiguous ``[N, heads, D]``. Either may be strided on
    its first two axes (the output gate is a view of the query projection's output);
    the last axis must be contiguous.

    ``backend``: ``"triton"`` (CUDA, or the Triton interpreter) or ``"reference"``.
    """
    if _reference("sigmoid_mul", ("x", "gate"), x, gate, backend, ndim=3):
        return sigmoid_mul_reference(x, gate)
    if x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("x's and gate's last axes must be contiguous")
    n, heads, d = x.shape
    out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _sigmoid_mul_kernel[(triton.cdiv(out.numel(), SILU_MUL_BLOCK),)](
        x, gate, out, out.numel(), heads, d, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1),
        BLOCK=SILU_MUL_BLOCK, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _sigmoid_mul_kernel(x_ptr, g_ptr, y_ptr, n, HEADS, D, sx_0, sx_1, sg_0, sg_1, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        row = offs // D  # y is contiguous; the inputs' (token, head) rows at their own strides
        col = offs - row * D
        tok, head = row // HEADS, row % HEADS
        xv = tl.load(x_ptr + tok * sx_0 + head * sx_1 + col, mask=mask, other=0.0)
        gv = tl.load(g_ptr + tok * sg_0 + head * sg_1 + col, mask=mask, other=0.0)
        # torch's sigmoid: 1 / (1 + expf(-x)) in fp32 (an IEEE division), rounded once
        # to the dtype, then the product rounded: on CUDA the same bits as torch's kernels
        gf = gv.to(tl.float32)
        sg = to_rtne(tl.div_rn(1.0, 1.0 + expf(-gf)), gv.dtype).to(tl.float32)
        tl.store(y_ptr + offs, to_rtne(xv.to(tl.float32) * sg, y_ptr.dtype.element_ty), mask=mask)
