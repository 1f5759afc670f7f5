"""Gates and normalisation of the GDN step (DESIGN.md section 1).

    g    = -exp(A_log) * softplus(a + dt_bias)     softplus(x) = x if x > 20 else log1p(exp(x))
    beta = 1 / (1 + exp(-b))
    k^   = k / sqrt(sum(k*k) + 1e-6)
    q^   = q / sqrt(sum(q*q) + 1e-6) * K**-0.5

These are the plain-PyTorch reference forms. They compute in float32, or in float64 when
any input is float64, so that the same code serves as the float64 oracle. The Triton
kernels recompute the gates in-kernel with the same operation order.
"""

from __future__ import annotations

import torch

from . import _checks

SOFTPLUS_THRESHOLD = 20.0
NORM_EPS = 1e-6


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay ``g`` and write strength ``beta`` from the raw gate projections.

    Args:
        a: ``[..., HV]`` raw decay projection, any float dtype.
        b: ``[..., HV]`` raw write-strength projection, same shape as ``a``.
        A_log: ``[HV]`` per-head log decay rate.
        dt_bias: ``[HV]`` per-head bias added to ``a``.

    Returns:
        ``(g, beta)``, each ``[..., HV]`` in float32 (float64 if any input is float64).
        ``g <= 0`` is a log decay; ``beta`` lies in ``(0, 1)``.
    """
    for name, x in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _checks.tensor(name, x, dtypes=_checks.FLOAT_DTYPES)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {list(a.shape)} and {list(b.shape)}")
    hv = a.shape[-1] if a.dim() else 0
    _checks.shape("A_log", A_log, [hv])
    _checks.shape("dt_bias", dt_bias, [hv])
    _checks.same_device(a, b=b, A_log=A_log, dt_bias=dt_bias)
    dtype = _checks.compute_dtype(a, b, A_log, dt_bias)
    x = a.to(dtype) + dt_bias.to(dtype)
    softplus = torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))
    g = -torch.exp(A_log.to(dtype)) * softplus
    beta = 1.0 / (1.0 + torch.exp(-b.to(dtype)))
    return g, beta


def l2_normalize(x: torch.Tensor, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x / sqrt(sum(x*x, -1) + 1e-6) * scale`` along the last axis, in ``dtype``.

    ``dtype`` defaults to float32 (float64 for float64 input). Keys use ``scale=1``,
    queries ``scale=K**-0.5``.
    """
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES)
    dtype = dtype or _checks.compute_dtype(x)
    x = x.to(dtype)
    y = x / torch.sqrt((x * x).sum(-1, keepdim=True) + NORM_EPS)
    return y * scale if scale != 1.0 else y


def expand_heads(x: torch.Tensor, num_value_heads: int, head_dim: int = -2) -> torch.Tensor:
    """Repeat key heads so that value head ``hv`` sees key head ``hv // (HV // H)``."""
    h = x.shape[head_dim]
    _checks.gqa(h, num_value_heads)
    group = num_value_heads // h
    return x if group == 1 else x.repeat_interleave(group, dim=head_dim)
