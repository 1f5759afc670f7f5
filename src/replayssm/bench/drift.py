"""``replayssm drift``: long teacher-forced runs of every strategy against a float64 oracle.

DESIGN.md section 5 asks that a strategy claiming exactness does not drift over long
generations. This tool drives one GDN layer of realistic shape (Qwen3.5: ``H=16``,
``HV=32``, ``K=V=128`` by default on CUDA) through tens of thousands of speculative
steps and measures, every ``--every`` committed tokens, how far each strategy's
committed state is from a float64 oracle that runs the recurrence of section 1 on
exactly the accepted token stream.

A step, for ``--requests`` requests at once: random window lengths ``m`` in ``1..T``,
random layer inputs in the activation dtype (keys correlated from token to token, as
real keys are), ``verify``; then a random number of accepted tokens ``n`` in ``1..m``
and ``commit``. Teacher forcing: the accepted tokens' inputs are whatever was drawn,
and every variant sees the same ones.

Variants:

* the strategies (``snapshot``, ``fold``, ``circular``), each in its own
  :class:`~replayssm.state.StatePool`; all three claim an exact committed state;
* ``plain``: the float32 recurrence decoding the accepted tokens one by one (the same
  backend as the strategies). It is what "exact" means on a device: the exact
  strategies must equal it bit for bit, and its own distance to float64 is the fp32
  rounding that no float32 implementation can beat;
* ``open-loop`` (a control, not a strategy): the ``circular`` ring, but its flush folds
  the chunk-reconstructed corrected deltas ``u``, kept in the activation dtype, into
  the checkpoint with a matrix product (``S <- exp(G) S + sum_c exp(G - G_c) u_c k^_c^T``)
  instead of replaying raw records through the recurrence. DESIGN.md section 3 forbids
  this; the tool must tell it apart from the exact strategies.

Measures per variant and sample: the committed-state relative error
``||S - S64|| / ||S64||`` over all requests and heads, the worst per-(request, head)
relative error, and the relative error of the outputs of the accepted positions since
the previous sample. Each series is assessed (:func:`assess`) by its growth (median of
the last 10% of samples over the median of the first 10% after a 5% warm-up), its
log-log slope against tokens, and its excess over ``plain`` (median of the last 10%).

Verdicts (:func:`verdict`):

* an exact strategy **fails** if, for any series, its excess over ``plain`` exceeds
  ``--excess-factor`` (it has left the recurrence) or it grows (growth above
  ``--growth-factor`` with slope above ``--min-slope``) while ``plain`` does not;
* the control is **detected** by the same test. It only has to be detected when the
  activation dtype is coarser than float32 (with float32 activations rounding ``u`` to
  the activation dtype changes nothing).

Exit status: 0 when every exact strategy passes (and the control is detected where it
must be), 1 when an exact strategy fails, 3 when only the control goes undetected (the
check has no teeth on this configuration).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from ..ops import triton_common
from ..ops.dispatch import BACKENDS, resolve, triton_available
from ..ops.gates import expand_heads, l2_normalize
from ..ops.recurrent import gdn_recurrence, prepare_window, readout, state_update
from ..state import GDNShape, StatePool
from ..strategies import STRATEGY_NAMES
from .args import device_name, name_list, output_path, positive_float, positive_int
from .progress import ProgressBar, write_outputs

PLAIN = "plain"
CONTROL = "open-loop"

#: GDN layer shapes (H, HV, K, V). ``qwen3.5``: Qwen3.5-35B-A3B / Qwen3-Next-80B at TP1;
#: ``qwen3.5-hv64``: Qwen3.5-122B-A10B / 397B-A17B at TP1 (DESIGN.md section 6).
SHAPES = {
    "qwen3.5": GDNShape(num_heads=16, num_value_heads=32, head_k_dim=128, head_v_dim=128),
    "qwen3.5-hv64": GDNShape(num_heads=16, num_value_heads=64, head_k_dim=128, head_v_dim=128),
    "small": GDNShape(num_heads=4, num_value_heads=8, head_k_dim=64, head_v_dim=64),
    "tiny": GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=16),
}
ACT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SERIES = ("state", "state_worst_head", "output")

# Raw gate inputs: a ~ N(0, A_SCALE^2) with dt_bias = 0, so the per-token decay of head h
# is g = -exp(A_log[h]) * softplus(a). A_log is set so that the mean decay E[-g] of the
# heads spreads log-uniformly over --decay-range (memories from 1/max to 1/min tokens).
A_SCALE = 0.5
B_SCALE = 1.5  # beta = sigmoid(b), b ~ N(0, 1.5^2): beta spread over (0, 1)


def _softplus_mean(scale: float) -> float:
    """E[softplus(a)] for a ~ N(0, scale^2), by quadrature on a fine grid (float64)."""
    x = torch.linspace(-8.0, 8.0, 16001, dtype=torch.float64)
    w = torch.exp(-0.5 * x * x)
    return float((torch.nn.functional.softplus(scale * x) * w).sum() / w.sum())


# ---------------------------------------------------------------------- configuration
@dataclass
class DriftConfig:
    """Everything a drift run depends on (validated by :meth:`check`)."""

    tokens: int = 32768
    requests: int = 4
    window: int = 4
    ring_len: int = 16
    every: int = 256
    shape: str = "qwen3.5"
    act_dtype: str = "bf16"
    state_dtype: str = "fp32"
    device: str = "cpu"
    backend: str = "auto"
    strategies: tuple[str, ...] = STRATEGY_NAMES
    control: bool = True
    decay_range: tuple[float, float] = (1e-3, 0.5)
    key_correlation: float = 0.5
    growth_factor: float = 2.0
    min_slope: float = 0.1
    excess_factor: float = 4.0
    seed: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        for name in ("tokens", "requests", "window", "ring_len", "every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.tokens // self.every < 10:
            raise ValueError(
                f"tokens / every must give at least 10 samples to assess growth, got {self.tokens} / {self.every}"
            )
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {self.shape!r}")
        if self.act_dtype not in ACT_DTYPES:
            raise ValueError(f"act_dtype must be one of {sorted(ACT_DTYPES)}, got {self.act_dtype!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPES)}, got {self.state_dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        bad = [s for s in self.strategies if s not in STRATEGY_NAMES]
        if bad or len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies must be distinct names from {STRATEGY_NAMES}, got {list(self.strategies)}")
        if not self.strategies and not self.control:
            raise ValueError("nothing to run: no strategies and no control")
        lo, hi = self.decay_range
        if not (0 < lo <= hi < 20):
            raise ValueError(f"decay_range must satisfy 0 < min <= max < 20, got {self.decay_range}")
        if not 0 <= self.key_correlation < 1:
            raise ValueError(f"key_correlation must be in [0, 1), got {self.key_correlation}")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not self.excess_factor > 1:
            raise ValueError(f"excess_factor must be > 1, got {self.excess_factor}")
        if not self.min_slope >= 0:
            raise ValueError(f"min_slope must be >= 0, got {self.min_slope}")
        # The pool validates window / ring_len per strategy; circular (and the control)
        # need a power-of-two ring of at least 2T.
        if ("circular" in self.strategies or self.control) and (
            self.ring_len & (self.ring_len - 1) or self.ring_len < 2 * self.window
        ):
            raise ValueError(f"ring_len must be a power of two >= 2 * window = {2 * self.window}, got {self.ring_len}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available")
        if self.backend == "triton":
            if not triton_available():
                raise ValueError("backend triton needs the triton package (pip install triton)")
            if dev.type != "cuda" and not triton_common.INTERPRETER:
                raise ValueError(f"backend triton on {self.device} needs the Triton interpreter "
                                 "(TRITON_INTERPRET=1 in the environment); use --backend reference or auto")

    @property
    def control_required(self) -> bool:
        """The control must be detected only if rounding ``u`` to the activation dtype
        loses anything, i.e. for activation dtypes coarser than float32."""
        return self.control and ACT_DTYPES[self.act_dtype] != torch.float32


# ---------------------------------------------------------------------- inputs and gates
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


# ---------------------------------------------------------------------- oracle
class Oracle64:
    """The float64 recurrence (DESIGN.md section 1) on the accepted stream, vectorised
    over requests and heads with the reference ops' own :func:`state_update` and
    :func:`readout` (so the operation order is the reference's, in float64)."""

    def __init__(self, shape: GDNShape, requests: int, A_log: torch.Tensor, dt_bias: torch.Tensor, device):
        self.S = torch.zeros(requests, shape.num_value_heads, shape.head_v_dim, shape.head_k_dim, dtype=torch.float64, device=device)
        self.A_log = A_log.to(device, torch.float64)
        self.dt_bias = dt_bias.to(device, torch.float64)
        self.g_sum = torch.zeros(shape.num_value_heads, dtype=torch.float64, device=device)

    def advance(self, x: dict[str, torch.Tensor], accepted: torch.Tensor, max_accepted: int) -> torch.Tensor:
        """Run the first ``accepted[i]`` tokens of each request's window (``[B, T, ...]``
        inputs); returns float64 outputs ``[B, T, HV, V]`` (zero past ``accepted``)."""
        B, T = x["q"].shape[:2]
        # prepare_window works on token-major [m, heads, dim] tensors: flatten (B, T).
        d = {k: v.flatten(0, 1).double() for k, v in x.items()}
        prepared = prepare_window(d["q"], d["k"], d["v"], d["a"], d["b"], self.A_log, self.dt_bias, torch.float64)
        q_hat, k_hat, v, g, beta = (t.unflatten(0, (B, T)) for t in prepared)
        o = torch.zeros_like(v)
        for j in range(max_accepted):
            active = (accepted > j)[:, None, None, None]
            self.S = torch.where(active, state_update(self.S, k_hat[:, j], v[:, j], g[:, j], beta[:, j]), self.S)
            o[:, j] = torch.where(active[..., 0], readout(self.S, q_hat[:, j]), 0.0)
        keep = torch.arange(T, device=g.device)[None, :] < accepted[:, None]
        self.g_sum += g[keep].sum(0)
        return o


# ---------------------------------------------------------------------- variants
class Variant:
    """One way of keeping the committed state; subclasses below."""

    name: str
    claims_exact: bool | None  # None: the plain recurrence (the reference for "exact")

    def step(self, packed: dict, lengths: list[int], accepted: torch.Tensor, accepted_list: list[int], kept: dict) -> torch.Tensor:
        """Verify and commit one step; return the outputs of the accepted positions, in
        request order (``[sum(accepted), HV, V]``)."""
        raise NotImplementedError

    def committed(self) -> torch.Tensor:
        """The committed states ``[B, HV, V, K]``."""
        raise NotImplementedError


class StrategyVariant(Variant):
    """A strategy behind its own single-layer :class:`StatePool`."""

    def __init__(self, name: str, cfg: DriftConfig, params: dict, strategy: str | None = None):
        self.name = name
        self.claims_exact = True
        shape = SHAPES[cfg.shape]
        self.pool = StatePool(
            shape, 1, cfg.requests, strategy=strategy or name, window=cfg.window, ring_len=cfg.ring_len,
            state_dtype=STATE_DTYPES[cfg.state_dtype], act_dtype=ACT_DTYPES[cfg.act_dtype], device=cfg.device,
            backend=cfg.backend,
        )
        self.pool.set_layer_params(0, **params)
        self.slots = [self.pool.alloc() for _ in range(cfg.requests)]
        self._keep_cache: dict[tuple, torch.Tensor] = {}

    def _keep(self, lengths: list[int], accepted_list: list[int]) -> torch.Tensor:
        key = (tuple(lengths), tuple(accepted_list))
        idx = self._keep_cache.get(key)
        if idx is None:
            starts = np.cumsum([0] + lengths[:-1])
            idx = torch.tensor(
                [int(s) + j for s, n in zip(starts, accepted_list) for j in range(n)], dtype=torch.long, device=self.pool.device
            )
            if len(self._keep_cache) < 4096:
                self._keep_cache[key] = idx
        return idx

    def before_verify(self) -> None:
        pass

    def after_verify(self) -> None:
        pass

    def step(self, packed, lengths, accepted, accepted_list, kept):
        strat = self.pool.strategy
        batch = self.pool.batch(self.slots, lengths)
        self.before_verify()
        o = strat.verify(0, packed["q"], packed["k"], packed["v"], packed["a"], packed["b"], batch)
        self.after_verify()
        strat.commit(batch, accepted)
        return o[self._keep(lengths, accepted_list)]

    def committed(self):
        return self.pool.strategy.committed_state(0, self.slots)


class OpenLoopControl(StrategyVariant):
    """The ``circular`` ring with an open-loop flush (the control; see the module doc).

    The ring keeps each record's corrected delta ``u`` in the activation dtype (rounded
    right after the verify that wrote it), so verify's history and the flush both use
    the rounded ``u``. A flush row is folded here, before verify, by

        S <- exp(G_tot) S + sum_c exp(G_tot - G_c) u_c k^_c^T

    over its ``write_pos`` committed records; then its cursors move exactly as the
    strategy's own flush would (``cache_base += write_pos``, empty history), so the
    window's records land where they would have and the commit needs no change.
    """

    def __init__(self, cfg: DriftConfig, params: dict):
        super().__init__(CONTROL, cfg, params, strategy="circular")
        self.claims_exact = False
        self.act_dtype = ACT_DTYPES[cfg.act_dtype]

    def _history(self, slot: int, layer: int = 0):
        buf, L = self.pool.buffers, self.pool.ring_len
        wp = int(buf["write_pos"][slot])
        base = int(buf["cache_base"][slot])
        pos = [(base + c) & (L - 1) for c in range(wp)]
        return pos, buf["ring_u"][layer, slot, pos], buf["ring_k"][layer, slot, pos], buf["ring_g"][layer, slot, pos]

    def _fold(self, S: torch.Tensor, u: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The open-loop matrix fold of ``c`` records into ``S`` (``[HV, V, K]``)."""
        if u.shape[0] == 0:
            return S
        dtype = torch.float32 if S.dtype != torch.float64 else torch.float64
        k_hat = expand_heads(l2_normalize(k, dtype=dtype), S.shape[0])  # [c, HV, K]
        G = torch.cumsum(g.to(dtype), 0)  # [c, HV]
        w = torch.exp(G[-1][None] - G)  # decay from record c to the end of the history
        S32 = torch.exp(G[-1])[:, None, None] * S.to(dtype) + torch.einsum("ch,chv,chk->hvk", w, u.to(dtype), k_hat)
        return S32.to(S.dtype)

    def before_verify(self):
        buf, L = self.pool.buffers, self.pool.ring_len
        ckpt = buf["checkpoints"]
        flags = buf["is_flush"][self.slots].tolist()
        for s, flag in zip(self.slots, flags):
            if not flag:
                continue
            pos, u, k, g = self._history(s)
            ckpt[0, s] = self._fold(ckpt[0, s], u, k, g)
            buf["cache_base"][s] = (int(buf["cache_base"][s]) + len(pos)) & (L - 1)
            buf["write_pos"][s] = 0
            buf["is_flush"][s] = 0

    def after_verify(self):
        ring_u = self.pool.buffers["ring_u"]
        ring_u.copy_(ring_u.to(self.act_dtype).to(ring_u.dtype))

    def committed(self):
        ckpt = self.pool.buffers["checkpoints"]
        out = []
        for s in self.slots:
            _, u, k, g = self._history(s)
            out.append(self._fold(ckpt[0, s].clone(), u, k, g))
        return torch.stack(out)


class PlainRecurrence(Variant):
    """The float32 recurrence over the accepted tokens only (plain decoding)."""

    def __init__(self, cfg: DriftConfig, params: dict):
        self.name = PLAIN
        self.claims_exact = None
        s = SHAPES[cfg.shape]
        self.device = torch.device(cfg.device)
        self.backend = cfg.backend
        self.A_log, self.dt_bias = params["A_log"].to(self.device), params["dt_bias"].to(self.device)
        self.S = torch.zeros(cfg.requests, s.num_value_heads, s.head_v_dim, s.head_k_dim, dtype=STATE_DTYPES[cfg.state_dtype], device=self.device)
        self.slots = torch.arange(cfg.requests, dtype=torch.int32, device=self.device)

    def step(self, packed, lengths, accepted, accepted_list, kept):
        cu = torch.tensor(np.cumsum([0] + accepted_list), dtype=torch.int32, device=self.device)
        return gdn_recurrence(
            kept["q"], kept["k"], kept["v"], kept["a"], kept["b"], self.A_log, self.dt_bias, self.S, self.slots, cu,
            update_state=True, max_len=max(accepted_list), backend=self.backend,
        )

    def committed(self):
        return self.S.clone()


# ---------------------------------------------------------------------- assessment
def assess(tokens, errors, *, warmup_frac: float = 0.05, window_frac: float = 0.1, growth_factor: float = 2.0, min_slope: float = 0.1) -> dict:
    """Growth of an error series over a run.

    Samples before ``warmup_frac`` of the run are skipped (the state is still filling).
    Of the rest, ``early`` is the median of the first ``window_frac`` (at least 2
    samples) and ``late`` the median of the last ``window_frac``; ``growth = late /
    early``; ``slope`` is the least-squares slope of ``log(error)`` against
    ``log(tokens)`` over the same samples (0.5 for a random walk, 0 for a bounded
    error). ``grows`` when ``growth > growth_factor`` and ``slope > min_slope``.

    Raises:
        ValueError: mismatched lengths, fewer than 4 samples after the warm-up, or a
            negative error.
    """
    t = np.asarray(tokens, dtype=np.float64)
    e = np.asarray(errors, dtype=np.float64)
    if t.shape != e.shape or t.ndim != 1:
        raise ValueError(f"tokens and errors must be 1-D and of equal length, got {t.shape} and {e.shape}")
    if np.any(e < 0):
        raise ValueError("errors must be non-negative")
    finite = bool(np.all(np.isfinite(e)))
    post = t > warmup_frac * t.max() if t.size else t.astype(bool)
    tp, ep = t[post], e[post]
    if tp.size < 4:
        raise ValueError(f"need at least 4 samples after the {warmup_frac:.0%} warm-up, got {tp.size}")
    k = max(2, int(math.ceil(window_frac * tp.size)))
    early = float(np.median(ep[:k]))
    late = float(np.median(ep[-k:]))
    if not finite:
        growth, slope = math.inf, math.inf
    elif early > 0:
        growth = late / early
        pos = ep > 0
        slope = float(np.polyfit(np.log(tp[pos]), np.log(ep[pos]), 1)[0]) if pos.sum() >= 2 else 0.0
    else:
        growth = 1.0 if late == 0 else math.inf
        slope = 0.0 if late == 0 else math.inf
    return {
        "early": early,
        "late": late,
        "max": float(np.max(e)),
        "growth": growth,
        "slope": slope,
        "finite": finite,
        "grows": (not finite) or (growth > growth_factor and slope > min_slope),
    }


def verdict(assessment: dict, plain: dict, excess_factor: float) -> dict:
    """Compare one variant's assessments (per series) with ``plain``'s.

    ``excess`` = late error / plain's late error; a series *departs* when its excess
    exceeds ``excess_factor``, and *drifts* when it grows while plain's does not.
    ``flagged`` is true when any series departs or drifts.
    """
    out = {}
    for name, a in assessment.items():
        p = plain[name]
        if p["late"] > 0:
            excess = a["late"] / p["late"]
        else:
            excess = 1.0 if a["late"] == 0 else math.inf
        departs = (not a["finite"]) or excess > excess_factor
        drifts = a["grows"] and not p["grows"]
        out[name] = {"excess_over_plain": excess, "departs": departs, "drifts": drifts}
    out["flagged"] = any(v["departs"] or v["drifts"] for k, v in out.items() if k != "flagged")
    return out


# ---------------------------------------------------------------------- the run
@dataclass
class Series:
    tokens: list[int] = field(default_factory=list)
    state: list[float] = field(default_factory=list)
    state_worst_head: list[float] = field(default_factory=list)
    output: list[float] = field(default_factory=list)
    equal_to_plain: list[bool] = field(default_factory=list)


def _state_errors(S: torch.Tensor, S64: torch.Tensor) -> tuple[float, float]:
    d = S.double() - S64
    total = (d.norm() / S64.norm()).item()
    per_head = d.flatten(2).norm(dim=-1) / S64.flatten(2).norm(dim=-1).clamp_min(1e-300)
    return total, per_head.max().item()


def run_drift(cfg: DriftConfig, *, progress: bool = True) -> dict:
    """Run the drift experiment of ``cfg``; returns the JSON-ready result (see the
    module doc for what is measured and how it is judged)."""
    cfg.check()
    shape = SHAPES[cfg.shape]
    device = torch.device(cfg.device)
    act = ACT_DTYPES[cfg.act_dtype]
    A_log, dt_bias = gate_params(shape.num_value_heads, cfg.decay_range)
    conv_gen = torch.Generator().manual_seed(cfg.seed + 1)
    # The conv is not part of this experiment (it is copied exactly, not folded); the
    # pool still wants taps, so it gets random ones that are never used.
    params = {"A_log": A_log, "dt_bias": dt_bias, "conv_weight": torch.randn(shape.conv_dim, shape.conv_kernel, generator=conv_gen)}

    variants: list[Variant] = [StrategyVariant(name, cfg, params) for name in cfg.strategies]
    if cfg.control:
        variants.append(OpenLoopControl(cfg, params))
    plain = PlainRecurrence(cfg, params)
    everyone = variants + [plain]
    oracle = Oracle64(shape, cfg.requests, A_log, dt_bias, device)
    stream = InputStream(shape, cfg.requests, cfg.window, act, device, cfg.seed, cfg.key_correlation)
    host = torch.Generator().manual_seed(cfg.seed + 2)  # window lengths and acceptance

    series = {v.name: Series() for v in everyone}
    out_err2 = {v.name: torch.zeros((), dtype=torch.float64, device=device) for v in everyone}
    out_ref2 = torch.zeros((), dtype=torch.float64, device=device)
    committed = np.zeros(cfg.requests, dtype=np.int64)
    next_mark, steps = cfg.every, 0
    B, T = cfg.requests, cfg.window
    t_index = torch.arange(T, device=device)
    bar = ProgressBar(cfg.tokens, "drift", unit="tok", enabled=progress)
    t0 = time.perf_counter()

    def sample():
        S64 = oracle.S
        plain_S = plain.committed()
        ref = out_ref2.item()
        for v in everyone:
            S = plain_S if v is plain else v.committed()
            total, worst = _state_errors(S, S64)
            s = series[v.name]
            s.tokens.append(int(committed.min()))
            s.state.append(total)
            s.state_worst_head.append(worst)
            s.output.append(math.sqrt(out_err2[v.name].item() / ref) if ref > 0 else 0.0)
            s.equal_to_plain.append(bool(torch.equal(S, plain_S)))
            out_err2[v.name].zero_()
        out_ref2.zero_()

    while committed.min() < cfg.tokens:
        lengths = torch.randint(1, T + 1, (B,), generator=host)
        accepted_cpu = (torch.rand(B, generator=host) * lengths).long() + 1  # uniform in 1..m
        lengths_list, accepted_list = lengths.tolist(), accepted_cpu.tolist()
        accepted = accepted_cpu.to(device=device, dtype=torch.int32)
        x = stream.window_inputs()
        win_mask = t_index[None] < lengths.to(device)[:, None]
        keep_mask = t_index[None] < accepted[:, None]
        packed = {k: t[win_mask] for k, t in x.items()}
        kept = {k: t[keep_mask] for k, t in x.items()}

        o64 = oracle.advance(x, accepted, max(accepted_list))[keep_mask]
        out_ref2 += (o64 * o64).sum()
        for v in everyone:
            o = v.step(packed, lengths_list, accepted, accepted_list, kept)
            out_err2[v.name] += ((o.double() - o64) ** 2).sum()
        stream.accept(x["k"], accepted)
        committed += accepted_cpu.numpy()
        steps += 1
        done = int(committed.min())
        if done >= next_mark or done >= cfg.tokens:
            sample()
            while next_mark <= done:
                next_mark += cfg.every
        bar.set(done)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    bar.close()

    assessments = {}
    for v in everyone:
        s = series[v.name]
        assessments[v.name] = {
            name: assess(s.tokens, getattr(s, name), growth_factor=cfg.growth_factor, min_slope=cfg.min_slope)
            for name in SERIES
        }
    results = {}
    failed, control_detected = [], None
    for v in everyone:
        s = series[v.name]
        entry = {
            "claims_exact_state": v.claims_exact,
            "samples": asdict(s),
            "assessment": assessments[v.name],
            "bitwise_equal_to_plain": all(s.equal_to_plain),
        }
        if v is not plain:
            vd = verdict(assessments[v.name], assessments[PLAIN], cfg.excess_factor)
            entry["verdict"] = vd
            if v.claims_exact:
                entry["result"] = "fail" if vd["flagged"] else "pass"
                if vd["flagged"]:
                    failed.append(v.name)
            else:
                control_detected = vd["flagged"]
                entry["result"] = "detected" if vd["flagged"] else "undetected"
        else:
            entry["result"] = "reference"
        results[v.name] = entry

    if failed:
        exit_code = 1
    elif cfg.control_required and not control_detected:
        exit_code = 3
    else:
        exit_code = 0
    mean_decay = (-oracle.g_sum / int(committed.sum())).tolist()
    return {
        "tool": "replayssm drift",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(cfg), "strategies": list(cfg.strategies), "decay_range": list(cfg.decay_range)},
        "environment": _environment(device, cfg.backend),
        "shape": {"H": shape.num_heads, "HV": shape.num_value_heads, "K": shape.head_k_dim, "V": shape.head_v_dim},
        "gates": {
            "mean_decay_per_head": mean_decay,
            "memory_tokens_per_head": [1.0 / d if d > 0 else None for d in mean_decay],
        },
        "steps": steps,
        "tokens_per_request": int(committed.min()),
        "elapsed_s": elapsed,
        "variants": results,
        "failed": failed,
        "control_required": cfg.control_required,
        "control_detected": control_detected,
        "exit_code": exit_code,
    }


def _environment(device: torch.device, backend: str) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "backend": resolve(backend, device),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


# ---------------------------------------------------------------------- command line
def _decay_range(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two numbers), got {text!r}") from None
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DriftConfig()
    g = parser.add_argument_group("the run")
    g.add_argument("--tokens", type=positive_int, default=d.tokens, help=f"committed tokens per request (default {d.tokens})")
    g.add_argument("--requests", type=positive_int, default=d.requests, help=f"requests driven together (default {d.requests})")
    g.add_argument("--window", type=positive_int, default=d.window, help=f"T, the largest verify window (default {d.window})")
    g.add_argument("--ring-len", type=positive_int, default=d.ring_len, help=f"L for circular and the control (default {d.ring_len})")
    g.add_argument("--every", type=positive_int, default=None, help="sample the errors every N committed tokens (default tokens/128)")
    g.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="GDN layer shape (default qwen3.5 = H16 HV32 K128 V128 on CUDA, tiny = H2 HV4 K16 V16 on the CPU)")
    g.add_argument("--act-dtype", choices=sorted(ACT_DTYPES), default=d.act_dtype, help="activations and raw records (default bf16)")
    g.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default=d.state_dtype, help="checkpoints (default fp32)")
    g.add_argument("--device", type=device_name, default=None, help="cpu, cuda or cuda:N (default cuda when available, else cpu)")
    g.add_argument("--backend", choices=BACKENDS, default=d.backend, help="ops backend (default auto: Triton on CUDA)")
    g.add_argument("--strategies", type=name_list(STRATEGY_NAMES, allow_none=True), default=STRATEGY_NAMES, help="comma-separated (default snapshot,fold,circular)")
    g.add_argument("--no-control", action="store_true", help="skip the open-loop control")
    g.add_argument("--decay-range", type=_decay_range, default=d.decay_range,
                   help="MIN,MAX mean per-token decay -g of the heads, spread log-uniformly (default 0.001,0.5)")
    g.add_argument("--key-correlation", type=float, default=d.key_correlation,
                   help=f"correlation of consecutive keys (default {d.key_correlation})")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the inputs, window lengths and acceptance (default 0)")
    j = parser.add_argument_group("judging")
    j.add_argument("--growth-factor", type=positive_float, default=d.growth_factor,
                   help=f"late/early error ratio that counts as growth (default {d.growth_factor})")
    j.add_argument("--min-slope", type=float, default=d.min_slope,
                   help=f"log-log slope that counts as growth (default {d.min_slope})")
    j.add_argument("--excess-factor", type=positive_float, default=d.excess_factor,
                   help=f"error over the fp32 recurrence's that counts as leaving it (default {d.excess_factor})")
    o = parser.add_argument_group("output")
    o.add_argument("--json", type=output_path(".json"), default=None, help="write the full result (every sample) here")
    o.add_argument("--plot", type=output_path(".png"), default=None, help="write a PNG of the errors over tokens here")
    o.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args) -> DriftConfig:
    device = args.device if args.device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape or ("qwen3.5" if torch.device(device).type == "cuda" else "tiny")
    every = args.every if args.every is not None else max(1, args.tokens // 128)
    return DriftConfig(
        tokens=args.tokens, requests=args.requests, window=args.window, ring_len=args.ring_len, every=every,
        shape=shape, act_dtype=args.act_dtype, state_dtype=args.state_dtype, device=device, backend=args.backend,
        strategies=tuple(args.strategies), control=not args.no_control, decay_range=tuple(args.decay_range),
        key_correlation=args.key_correlation, growth_factor=args.growth_factor, min_slope=args.min_slope,
        excess_factor=args.excess_factor, seed=args.seed,
    )


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.2e}" if (x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4)) else f"{x:.2f}"


def _slope(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:+.2f}")


def print_report(result: dict, file=None) -> None:
    file = file or sys.stdout
    c, sh = result["config"], result["shape"]
    print(
        f"replayssm drift: {result['tokens_per_request']} tokens x {c['requests']} requests, {result['steps']} steps, "
        f"H={sh['H']} HV={sh['HV']} K={sh['K']} V={sh['V']}, T={c['window']}, L={c['ring_len']}, "
        f"{c['act_dtype']} activations, {c['state_dtype']} state, {result['environment']['device']} "
        f"({result['environment']['backend']}), {result['elapsed_s']:.1f} s",
        file=file,
    )
    print(
        "committed-state error vs float64 (median of first / last 10% of samples), growth = last/first, "
        "slope of log-log fit, x plain = last / fp32 recurrence's last",
        file=file,
    )
    head = f"{'variant':<10} {'state first':>11} {'state last':>11} {'growth':>7} {'slope':>6} {'x plain':>8} {'worst head':>11} {'output':>9} {'==plain':>7}  result"
    print(head, file=file)
    for name, v in result["variants"].items():
        a = v["assessment"]
        vd = v.get("verdict")
        print(
            f"{name:<10} {_fmt(a['state']['early']):>11} {_fmt(a['state']['late']):>11} {_fmt(a['state']['growth']):>7} "
            f"{_slope(a['state']['slope']):>6} {_fmt(vd['state']['excess_over_plain']) if vd else '1.00':>8} "
            f"{_fmt(a['state_worst_head']['late']):>11} {_fmt(a['output']['late']):>9} "
            f"{'yes' if v['bitwise_equal_to_plain'] else 'no':>7}  {v['result']}",
            file=file,
        )
    if result["variants"][PLAIN]["assessment"]["state"]["grows"]:
        print(
            "note: the fp32 recurrence's own error still grows over this run (heads with memories longer than "
            "the run); run longer or raise the --decay-range minimum",
            file=file,
        )
    if result["failed"]:
        print(f"FAIL: {', '.join(result['failed'])} left the exact recurrence or drift", file=file)
    if result["control_required"] and not result["control_detected"]:
        print("FAIL: the open-loop control was not detected: the check has no teeth on this configuration", file=file)
    if result["exit_code"] == 0:
        print("result: no exact strategy drifts" + ("; the open-loop control is detected" if result["control_detected"] else ""), file=file)


def check_args(args) -> None:
    """Validate the whole configuration (``ValueError``) before the run."""
    config_from_args(args).check()


def main(args) -> int:
    cfg = config_from_args(args)
    result = run_drift(cfg, progress=not args.quiet)
    print_report(result)
    write_outputs(result, args.json, args.plot, "plot_drift")
    return result["exit_code"]

