"""The strategy interface: ``verify`` inside each GDN layer, ``commit`` once per step.

A step is: for every GDN layer, ``conv_verify`` (optional, the layer's causal conv) and
``verify`` (the window's outputs, no change to committed state); then, after sampling,
one ``commit(batch, accepted)`` for all layers. Rejected tokens leave no trace.
Prefill and plain decoding use ``conv_prefill`` / ``prefill``, which advance the state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from ..ops import _checks
from ..ops.conv import causal_conv_commit, causal_conv_verify
from ..ops.recurrent import check_layer_inputs, gdn_recurrence
from ..state.batch import Batch

if TYPE_CHECKING:
    from ..state.pool import BufferSpec, StatePool


class StepProtocolError(RuntimeError):
    """A strategy call out of order (a layer verified twice, commit without verify...)."""


class Strategy:
    """Base class: validation, step bookkeeping and the conv; subclasses do the state.

    Subclasses implement :meth:`_verify`, :meth:`_commit_states` and, where the
    checkpoint alone is not the committed state, :meth:`committed_state`.
    """

    name: str = ""
    #: whether verify outputs equal the recurrence's bit for bit
    exact_outputs: bool = True

    def __init__(self, pool: "StatePool"):
        self.pool = pool
        self._step_batch: Batch | None = None
        self._verified: set[int] = set()
        self._conv_verified: set[int] = set()

    # ------------------------------------------------------------------ config
    @classmethod
    def check_config(cls, *, window: int, ring_len: int) -> None:
        """Raise ``ValueError`` if ``window`` / ``ring_len`` do not suit the strategy."""

    @classmethod
    def buffer_specs(cls, pool: "StatePool") -> dict[str, "BufferSpec"]:
        """The extra buffers the strategy needs, by name."""
        return {}

    # ------------------------------------------------------------------ helpers
    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return self.pool.buffers

    def _check_batch(self, batch: Batch, *, step: bool) -> None:
        if not isinstance(batch, Batch):
            raise TypeError(f"batch must be a Batch (from StatePool.batch), got {type(batch).__name__}")
        if batch.slots.device != self.pool.device:
            raise ValueError(f"batch is on {batch.slots.device}, the pool on {self.pool.device}")
        if step:
            if batch.max_len > self.pool.window:
                raise ValueError(f"batch windows reach {batch.max_len} tokens, the pool's window is {self.pool.window}")
            if self._step_batch is not None and batch is not self._step_batch:
                raise StepProtocolError("every layer of a step must use the same batch; commit before a new one")

    def _check_inputs(self, layer: int, q, k, v, a, b, batch: Batch) -> None:
        self.pool.check_layer(layer)
        n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, self.pool.params["A_log"][layer], self.pool.params["dt_bias"][layer])
        s = self.pool.shape
        if (h, kd, hv, vd) != (s.num_heads, s.head_k_dim, s.num_value_heads, s.head_v_dim):
            raise ValueError(
                f"inputs have (H, K, HV, V) = {(h, kd, hv, vd)}, the pool expects "
                f"{(s.num_heads, s.head_k_dim, s.num_value_heads, s.head_v_dim)}"
            )
        if n != batch.num_tokens:
            raise ValueError(f"inputs have {n} tokens, the batch {batch.num_tokens}")
        _checks.same_device(batch.slots, q=q)

    def _gates(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.pool.layer_params(layer)
        return p["A_log"], p["dt_bias"]

    # ------------------------------------------------------------------ conv
    def conv_verify(self, layer: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The layer's causal conv over the window, ``x [N, C] -> [N, C]``; the conv
        state advances only at :meth:`commit`."""
        self._check_batch(batch, step=True)
        self.pool.check_layer(layer)
        if layer in self._conv_verified:
            raise StepProtocolError(f"layer {layer}'s conv was already verified this step; commit first")
        p = self.pool.layer_params(layer)
        y = causal_conv_verify(
            x, self.buffers["conv_state"][layer], p["conv_weight"], p["conv_bias"], batch.slots, batch.cu_seqlens,
            window_buf=self.buffers["conv_window"][layer], backend=self.pool.backend,
        )
        self._step_batch = batch
        self._conv_verified.add(layer)
        return y

    def conv_prefill(self, layer: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The layer's causal conv over prompt tokens, advancing the conv state."""
        self._check_batch(batch, step=False)
        p = self.pool.layer_params(layer)
        return causal_conv_verify(
            x, self.buffers["conv_state"][layer], p["conv_weight"], p["conv_bias"], batch.slots, batch.cu_seqlens,
            update_state=True, max_len=batch.max_len or None, backend=self.pool.backend,
        )

    # ------------------------------------------------------------------ state
    def verify(self, layer: int, q, k, v, a, b, batch: Batch) -> torch.Tensor:
        """Outputs of every window position, without changing the committed state.

        Args:
            layer: GDN layer index.
            q, k: ``[N, H, K]`` post-conv; v: ``[N, HV, V]``; a, b: ``[N, HV]`` raw gates.
            batch: the step's :class:`Batch` (windows of ``1..window`` tokens).

        Returns:
            ``o``: ``[N, HV, V]`` in the dtype of ``v``; padding rows are zero.
        """
        self._check_batch(batch, step=True)
        self._check_inputs(layer, q, k, v, a, b, batch)
        if layer in self._verified:
            raise StepProtocolError(f"layer {layer} was already verified this step; commit first")
        A_log, dt_bias = self._gates(layer)
        o = self._verify(layer, q, k, v, a, b, A_log, dt_bias, batch)
        self._step_batch = batch
        self._verified.add(layer)
        return o

    def commit(self, batch: Batch, accepted: torch.Tensor | Sequence[int]) -> None:
        """Keep the first ``accepted[i]`` tokens of each window, for all layers.

        Args:
            batch: the batch every layer verified this step.
            accepted: ``[B]`` accepted tokens per request (bonus included),
                ``1 <= n <= length`` for live rows; ignored for padding rows.
        """
        self._check_batch(batch, step=True)
        if self._step_batch is None or self._verified != set(range(self.pool.num_layers)):
            missing = sorted(set(range(self.pool.num_layers)) - self._verified)
            raise StepProtocolError(f"commit needs every layer verified first; missing layers {missing}")
        if self._conv_verified and self._conv_verified != self._verified:
            raise StepProtocolError("conv_verify ran for some layers but not all")
        accepted = self._check_accepted(batch, accepted)
        if self._conv_verified:
            causal_conv_commit(
                self.buffers["conv_state"], self.buffers["conv_window"], batch.slots, accepted, backend=self.pool.backend
            )
        self._commit_states(batch, accepted)
        self._step_batch = None
        self._verified.clear()
        self._conv_verified.clear()

    def _check_accepted(self, batch: Batch, accepted) -> torch.Tensor:
        if not isinstance(accepted, torch.Tensor):
            accepted = torch.tensor(list(accepted), dtype=torch.int32, device=self.pool.device)
        _checks.tensor("accepted", accepted, ndim=1, dtypes=_checks.INDEX_DTYPES)
        _checks.shape("accepted", accepted, [batch.size])
        _checks.same_device(batch.slots, accepted=accepted)
        capturing = accepted.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:  # a value check reads the device; skip it inside graph capture
            for i, (s, n, m) in enumerate(zip(batch.slots.tolist(), accepted.tolist(), batch.lengths)):
                if s >= 0 and not 1 <= n <= m:
                    raise ValueError(f"accepted[{i}] = {n} must be in [1, {m}] (the window length)")
        return accepted.to(torch.int32)

    def prefill(self, layer: int, q, k, v, a, b, batch: Batch) -> torch.Tensor:
        """Run prompt (or plain decode) tokens and advance the committed state.

        Requests must have no pending history (true right after ``alloc``).
        """
        self._check_batch(batch, step=False)
        self._check_inputs(layer, q, k, v, a, b, batch)
        self._check_prefill_rows(batch)
        A_log, dt_bias = self._gates(layer)
        return gdn_recurrence(
            q, k, v, a, b, A_log, dt_bias, self.buffers["checkpoints"][layer], batch.slots, batch.cu_seqlens,
            update_state=True, max_len=batch.max_len or None, backend=self.pool.backend,
        )

    def _check_prefill_rows(self, batch: Batch) -> None:
        pass

    def committed_state(self, layer: int, slots: Sequence[int]) -> torch.Tensor:
        """A copy of the committed states ``[len(slots), HV, V, K]`` (between steps)."""
        self.pool.check_layer(layer)
        for s in slots:
            self.pool.check_live(s)
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.pool.device)
        return self.buffers["checkpoints"][layer, idx].clone()

    # ------------------------------------------------------------------ subclass hooks
    def _verify(self, layer, q, k, v, a, b, A_log, dt_bias, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def _commit_states(self, batch: Batch, accepted: torch.Tensor) -> None:
        raise NotImplementedError
