"""The generator of a drift run: gate parameters and the teacher-forced input stream."""

from __future__ import annotations

import math

import torch

from ...state import GDNShape
from .config import A_SCALE, B_SCALE


def _softplus_mean(scale: float) -> float:
    """E[softplus(a)] for a ~ N(0, scale^2), by quadrature on a fine grid (float64)."""
    x = torch.linspace(-8.0, 8.0, 16001, dtype=torch.float64)
    w = torch.exp(-0.5 * x * x)
    return float((torch.nn.functional.softplus(scale * x) * w).sum() / w.sum())


def gate_params(num_value_heads: int, decay_range: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_log, dt_bias)`` giving mean decays ``E[-g]`` spread log-uniformly (in head
    order) over ``decay_range``, for raw gates ``a ~ N(0, A_SCALE^2)``."""
    lo, hi = decay_range
    mean_decay = torch.logspace(math.log10(lo), math.log10(hi), num_value_heads, dtype=torch.float64)
    A_log = torch.log(mean_decay / _softplus_mean(A_SCALE)).float()
    return A_log, torch.zeros(num_value_heads)


class InputStream:
    """Random layer inputs for windows of ``B`` requests, in the activation dtype.

    ``q``, ``v`` are standard normal, ``a ~ N(0, A_SCALE^2)``, ``b ~ N(0, B_SCALE^2)``.
    Keys follow an AR(1) chain per request and key head, ``k_t = rho k_{t-1} +
    sqrt(1 - rho^2) eps``, continued from the request's last accepted key, so that
    neighbouring keys overlap as in real text (this is what makes the closed form's
    ``(I + A)`` far from the identity). Tensors come as ``[B, T, ...]``; a window of
    ``m_i`` tokens is the prefix ``[i, :m_i]``.
    """

    def __init__(self, shape: GDNShape, requests: int, window: int, act_dtype, device, seed: int, key_correlation: float):
        self.shape, self.B, self.T = shape, requests, window
        self.act_dtype = act_dtype
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.rho = key_correlation
        self.last_k = self._randn(requests, shape.num_heads, shape.head_k_dim)

    def _randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=self.device)

    def window_inputs(self) -> dict[str, torch.Tensor]:
        s, B, T = self.shape, self.B, self.T
        eps = self._randn(B, T, s.num_heads, s.head_k_dim)
        keys, prev = [], self.last_k
        for j in range(T):
            prev = self.rho * prev + math.sqrt(1 - self.rho**2) * eps[:, j]
            keys.append(prev)
        x = {
            "q": self._randn(B, T, s.num_heads, s.head_k_dim),
            "k": torch.stack(keys, 1),
            "v": self._randn(B, T, s.num_value_heads, s.head_v_dim),
            "a": self._randn(B, T, s.num_value_heads) * A_SCALE,
            "b": self._randn(B, T, s.num_value_heads) * B_SCALE,
        }
        return {name: t.to(self.act_dtype) for name, t in x.items()}

    def accept(self, k: torch.Tensor, accepted: torch.Tensor) -> None:
        """Continue each request's key chain from its last accepted key."""
        rows = torch.arange(self.B, device=self.device)
        self.last_k = k[rows, accepted.long() - 1].float()
