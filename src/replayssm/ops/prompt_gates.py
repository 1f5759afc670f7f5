"""A prompt pass's gates in one launch: ``g`` and ``beta`` of every token, zero past the
pass's real tokens.

    g    = -exp(A_log) * softplus(a + dt_bias)      (tokens t < real)
    beta = 1 / (1 + exp(-b))
    g = beta = 0                                    (tokens t >= real: the state passes on unchanged)

The chunked prompt kernel takes the gates as inputs. Computed with torch's elementwise
ops they cost about fifteen launches a GDN layer (plus two ``where`` and a cast for the
padding mask), which at a short prompt's size is launch time, not work. ``real`` is a
device tensor, so a CUDA graph replays the pass for any prompt length of its shape.
"""

from __future__ import annotations

import torch

from . import _checks
from .dispatch import pick, register
from .gates import gdn_gates

GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_prompt_gates_args(a, b, A_log, dt_bias, real, beta_dtype):
    """Validate :func:`prompt_gates`' arguments (metadata only); return ``(N, HV)``."""
    for name, x in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _checks.tensor(name, x, dtypes=_checks.FLOAT_DTYPES)
    _checks.tensor("a", a, ndim=2)
    n, hv = a.shape
    _checks.shape("b", b, [n, hv])
    _checks.shape("A_log", A_log, [hv])
    _checks.shape("dt_bias", dt_bias, [hv])
    _checks.same_device(a, b=b, A_log=A_log, dt_bias=dt_bias)
    if real is not None:
        _checks.tensor("real", real, ndim=1, dtypes=_checks.INDEX_DTYPES)
        _checks.shape("real", real, [1])
        _checks.same_device(a, real=real)
    if beta_dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"beta_dtype must be a float dtype, got {beta_dtype!r}")
    return n, hv


@register("prompt_gates", "reference")
def prompt_gates_reference(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, real: torch.Tensor | None = None,
    *, beta_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gates of a prompt pass's tokens, zero from token ``real[0]`` on.

    Args:
        a, b: ``[N, HV]`` raw gate projections, any float dtype.
        A_log, dt_bias: ``[HV]`` the layer's gate parameters.
        real: ``[1]`` int32/int64, the pass's real tokens (the first ``real[0]`` rows);
            ``None``: every token is real.
        beta_dtype: the dtype of ``beta`` (the chunked kernel takes it in ``v``'s).

    Returns:
        ``(g [N, HV] float32, beta [N, HV] beta_dtype)`` (float64 ``g`` for float64
        inputs); ``g <= 0`` is a log decay.
    """
    n, _ = check_prompt_gates_args(a, b, A_log, dt_bias, real, beta_dtype)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    if real is not None:
        keep = (torch.arange(n, device=a.device) < real.to(a.device))[:, None]
        g, beta = torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0)
    return g, beta.to(beta_dtype)


def prompt_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, real: torch.Tensor | None = None,
    *, beta_dtype: torch.dtype = torch.float32, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt pass's gates ``(g, beta)``, zero past ``real[0]`` tokens. Arguments and
    results: :func:`prompt_gates_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("prompt_gates", backend, a)(a, b, A_log, dt_bias, real, beta_dtype=beta_dtype)


# ---------------------------------------------------------------------------- Triton
try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None

GATE_BLOCK = 1024

if triton is not None:
    from .triton_common import gdn_gates as _tl_gdn_gates, to_rtne as _tl_to_rtne

    @triton.jit
    def _prompt_gates_kernel(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, real_ptr, g_ptr, beta_ptr, stride_a, stride_b,
                             N, HV: tl.constexpr, HAS_REAL: tl.constexpr, BLOCK: tl.constexpr):
        """Elements ``[pid BLOCK, (pid + 1) BLOCK)`` of the ``[N, HV]`` gates, row-major."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N * HV
        t = offs // HV
        h = offs % HV
        a = tl.load(a_ptr + t * stride_a + h, mask=mask, other=0.0)
        b = tl.load(b_ptr + t * stride_b + h, mask=mask, other=0.0)
        A_log = tl.load(A_log_ptr + h, mask=mask, other=0.0)
        dt_bias = tl.load(dt_bias_ptr + h, mask=mask, other=0.0)
        g, beta = _tl_gdn_gates(a, b, A_log, dt_bias)
        if HAS_REAL:
            keep = t < tl.load(real_ptr).to(tl.int64)
            g = tl.where(keep, g, 0.0)
            beta = tl.where(keep, beta, 0.0)
        tl.store(g_ptr + offs, g, mask=mask)
        tl.store(beta_ptr + offs, _tl_to_rtne(beta, beta_ptr.dtype.element_ty), mask=mask)


@register("prompt_gates", "triton")
def prompt_gates_triton(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, real: torch.Tensor | None = None,
    *, beta_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`prompt_gates_reference` (same arguments and results), one
    launch, nothing read on the host (capturable in a CUDA graph).

    Differences: no float64; ``a`` and ``b`` contiguous along heads (any token stride),
    the parameters contiguous. ``softplus`` is the kernels' form of :mod:`.triton_common`
    (``log1p`` through ``log``), so ``g`` agrees with the reference to a few fp32 ulps.
    """
    n, hv = check_prompt_gates_args(a, b, A_log, dt_bias, real, beta_dtype)
    for name, x in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _checks.tensor(name, x, dtypes=GATE_DTYPES)
    if beta_dtype not in GATE_DTYPES:
        raise TypeError(f"beta_dtype must be one of {GATE_DTYPES} on the Triton backend, got {beta_dtype!r}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b must be contiguous along heads (stride 1 on their last axis)")
    _checks.contiguous(A_log=A_log, dt_bias=dt_bias)
    g = torch.empty(n, hv, dtype=torch.float32, device=a.device)
    beta = torch.empty(n, hv, dtype=beta_dtype, device=a.device)
    if n * hv == 0:
        return g, beta
    block = min(GATE_BLOCK, triton.next_power_of_2(n * hv))
    _prompt_gates_kernel[(triton.cdiv(n * hv, block),)](
        a, b, A_log, dt_bias, real if real is not None else g, g, beta, a.stride(0), b.stride(0), n,
        HV=hv, HAS_REAL=real is not None, BLOCK=block, num_warps=4,
    )
    return g, beta
