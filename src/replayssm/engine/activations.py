"""The gated MLP's activation, ``silu(gate) * up``, in one kernel for static steps.

Transformers' dense Qwen MLP runs ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: the
activation and the product are two elementwise kernels, each reading and writing
``[N, intermediate]``. :func:`silu_mul` does both in one pass with the module's
rounding: ``silu(g)`` in fp32 rounded to the input dtype, then its product with ``up``
in fp32 rounded again (torch rounds each op's result to the tensors' dtype), with
CUDA's ``expf`` and an IEEE division as torch's SiLU kernel: on the GPU the module's
bits.
:func:`dense_silu_mlp` tells which MLP modules it applies to.
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


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """See :func:`silu_mul` (the module's two ops)."""
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "triton") -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up [..., D]`` alike (dtype, shape, device), in one
    launch; returns a new contiguous tensor of their shape. Rows at any stride are read
    in place (the two halves of one ``[N, 2D]`` matmul output, say).

    ``backend``: ``"triton"`` (CUDA, or the Triton interpreter) or ``"reference"``.
    """
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError("gate and up must be tensors")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate and up must be alike, got {gate.dtype} {list(gate.shape)} on {gate.device} and "
                         f"{up.dtype} {list(up.shape)} on {up.device}")
    if backend == "reference":
        return silu_mul_reference(gate, up)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if gate.dtype not in SILU_MUL_DTYPES:
        raise TypeError(f"gate and up must be one of {SILU_MUL_DTYPES} for the Triton silu_mul, got {gate.dtype}")
    if triton is None or (gate.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton silu_mul needs CUDA tensors or the Triton interpreter")
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
