"""The variants a drift run compares: the strategies behind their own pools, the
open-loop control, and plain decoding with the fp32 recurrence."""

from __future__ import annotations

import numpy as np
import torch

from ...ops import gdn_recurrence
from ...state import GDNShape, StatePool
from ...strategies.open_loop import OpenLoopControlStrategy
from .config import ACT_DTYPES, CONTROL, PLAIN, STATE_DTYPES, DriftConfig


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

    def __init__(self, name: str, cfg: DriftConfig, shape: GDNShape, params: dict, strategy=None):
        self.name = name
        self.claims_exact = True
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

    def step(self, packed, lengths, accepted, accepted_list, kept):
        strat = self.pool.strategy
        batch = self.pool.batch(self.slots, lengths)
        o = strat.verify(0, packed["q"], packed["k"], packed["v"], packed["a"], packed["b"], batch)
        strat.commit(batch, accepted)
        return o[self._keep(lengths, accepted_list)]

    def committed(self):
        return self.pool.strategy.committed_state(0, self.slots)


class OpenLoopControl(StrategyVariant):
    """The ``circular`` ring with an open-loop flush (the control; see the package doc
    and :class:`replayssm.strategies.open_loop.OpenLoopControlStrategy`)."""

    def __init__(self, cfg: DriftConfig, shape: GDNShape, params: dict):
        super().__init__(CONTROL, cfg, shape, params, strategy=OpenLoopControlStrategy)
        self.claims_exact = False


class PlainRecurrence(Variant):
    """The float32 recurrence over the accepted tokens only (plain decoding)."""

    def __init__(self, cfg: DriftConfig, shape: GDNShape, params: dict):
        self.name = PLAIN
        self.claims_exact = None
        s = shape
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
