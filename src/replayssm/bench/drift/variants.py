"""The variants a drift run compares: the strategies behind their own pools, the
open-loop control, and plain decoding with the fp32 recurrence."""

from __future__ import annotations

import numpy as np
import torch

from ...ops import advance_cursors_reference, gdn_recurrence
from ...ops.chunked import apply_history
from ...ops.gates import expand_heads, l2_normalize
from ...state import StatePool
from .config import ACT_DTYPES, CONTROL, PLAIN, SHAPES, STATE_DTYPES, DriftConfig


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


def open_loop_fold(S: torch.Tensor, u: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The open-loop fold of ``c`` history records into a state ``S`` (``[HV, V, K]``):

        S <- exp(G_tot) S + sum_c exp(G_tot - G_c) u_c k^_c^T

    This is the closed form's own way of applying checkpoint + history to a vector
    (:func:`replayssm.ops.chunked.apply_history`), applied to the basis vectors, so the
    control folds exactly what ``circular``'s verify reads, with no fold of its own.
    ``u`` are the ring's corrected deltas, ``k`` the raw keys (``[c, H, K]``), ``g`` the
    log decays (``[c, HV]``). Computed in float32 (float64 for a float64 ``S``).
    """
    if u.shape[0] == 0:
        return S
    dtype = torch.float64 if S.dtype == torch.float64 else torch.float32
    hv, _, kd = S.shape
    k_hat = expand_heads(l2_normalize(k, dtype=dtype), hv)  # [c, HV, K]
    basis = torch.eye(kd, dtype=dtype, device=S.device)[:, None, :].expand(kd, hv, kd)  # [K, HV, K]
    columns = apply_history(S.to(dtype), u.to(dtype), k_hat, g.to(dtype), basis)  # [K, HV, V]: S e_k
    return columns.permute(1, 2, 0).to(S.dtype)


class OpenLoopControl(StrategyVariant):
    """The ``circular`` ring with an open-loop flush (the control; see the package doc).

    The ring keeps each record's corrected delta ``u`` in the activation dtype (rounded
    right after the verify that wrote it), so verify's history and the flush both use
    the rounded ``u``. Before a verify, each row that is due to flush gets its history
    folded into its checkpoint by :func:`open_loop_fold`, and its cursors moved by the
    library's own cursor op as a commit of zero tokens on a flush row
    (``cache_base += write_pos``, ``write_pos = 0``): the strategy's verify then sees an
    empty history and writes the window's records where its own flush would have.
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
        return buf["ring_u"][layer, slot, pos], buf["ring_k"][layer, slot, pos], buf["ring_g"][layer, slot, pos]

    def before_verify(self):
        buf = self.pool.buffers
        flush = [s for s, f in zip(self.slots, buf["is_flush"][self.slots].tolist()) if f]
        if not flush:
            return
        ckpt = buf["checkpoints"]
        for s in flush:
            ckpt[0, s] = open_loop_fold(ckpt[0, s], *self._history(s))
        rows = torch.tensor(flush, dtype=torch.int32, device=self.pool.device)
        advance_cursors_reference(buf["write_pos"], buf["cache_base"], buf["is_flush"], rows, torch.zeros_like(rows),
                                  self.pool.window, self.pool.ring_len)

    def after_verify(self):
        ring_u = self.pool.buffers["ring_u"]
        ring_u.copy_(ring_u.to(self.act_dtype).to(ring_u.dtype))

    def committed(self):
        ckpt = self.pool.buffers["checkpoints"]
        return torch.stack([open_loop_fold(ckpt[0, s].clone(), *self._history(s)) for s in self.slots])


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
