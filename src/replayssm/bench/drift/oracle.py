"""The float64 oracle of a drift run: the recurrence of DESIGN.md section 1 written out
here, from the formulas, and not through the library's ops.

It must not share code with what it judges: the strategies and the ``plain`` variant
all run through the library's gate, normalisation and state-update functions, so an
oracle built from those would agree with a bug in them. Only the float64 arithmetic
makes it an oracle; the tests check it against the reference ops in float64.
"""

from __future__ import annotations

import torch

from ...state import GDNShape

#: DESIGN.md section 1: ``k^ = k / sqrt(sum(k*k) + 1e-6)``
NORM_EPS = 1e-6


def _softplus(x: torch.Tensor) -> torch.Tensor:
    # DESIGN.md section 1: softplus(x) = x if x > 20 else log1p(exp(x))
    return torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20))))


class Oracle64:
    """The float64 recurrence on the accepted stream, vectorised over requests and
    heads. ``S`` holds the committed states ``[B, HV, V, K]``; ``g_sum`` the decays
    ``g`` summed over the accepted tokens (the measured mean decay per head)."""

    def __init__(self, shape: GDNShape, requests: int, A_log: torch.Tensor, dt_bias: torch.Tensor, device):
        self.shape = shape
        self.S = torch.zeros(requests, shape.num_value_heads, shape.head_v_dim, shape.head_k_dim, dtype=torch.float64, device=device)
        self.A_log = A_log.to(device, torch.float64)
        self.dt_bias = dt_bias.to(device, torch.float64)
        self.g_sum = torch.zeros(shape.num_value_heads, dtype=torch.float64, device=device)

    def advance(self, x: dict[str, torch.Tensor], accepted: torch.Tensor, max_accepted: int) -> torch.Tensor:
        """Run the first ``accepted[i]`` tokens of each request's window (``[B, T, ...]``
        inputs); returns float64 outputs ``[B, T, HV, V]`` (zero past ``accepted``)."""
        s = self.shape
        group = s.num_value_heads // s.num_heads  # value head hv reads key head hv // group
        q, k, v, a, b = (x[name].double() for name in ("q", "k", "v", "a", "b"))
        g = -torch.exp(self.A_log) * _softplus(a + self.dt_bias)  # [B, T, HV]
        beta = 1.0 / (1.0 + torch.exp(-b))
        k_hat = k / torch.sqrt((k * k).sum(-1, keepdim=True) + NORM_EPS)
        q_hat = q / torch.sqrt((q * q).sum(-1, keepdim=True) + NORM_EPS) * s.head_k_dim**-0.5
        k_hat = k_hat.repeat_interleave(group, dim=2)  # [B, T, HV, K]
        q_hat = q_hat.repeat_interleave(group, dim=2)
        B, T = q.shape[:2]
        o = torch.zeros(B, T, s.num_value_heads, s.head_v_dim, dtype=torch.float64, device=q.device)
        for j in range(max_accepted):
            active = (accepted > j)[:, None, None, None]
            S = torch.exp(g[:, j])[..., None, None] * self.S
            u = beta[:, j, :, None] * (v[:, j] - torch.einsum("bhvk,bhk->bhv", S, k_hat[:, j]))
            S = S + u[..., :, None] * k_hat[:, j, :, None, :]
            self.S = torch.where(active, S, self.S)
            o[:, j] = torch.where(active[..., 0], torch.einsum("bhvk,bhk->bhv", self.S, q_hat[:, j]), 0.0)
        keep = torch.arange(T, device=g.device)[None, :] < accepted[:, None]
        self.g_sum += g[keep].sum(0)
        return o
