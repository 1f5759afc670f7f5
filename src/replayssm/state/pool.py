"""The state pool: checkpoints, conv states, strategy buffers, cursors, slot lifecycle.

One pool serves all GDN layers of a model. Every per-layer buffer is laid out
``[num_layers, num_slots, ...]`` and every per-request buffer ``[num_slots, ...]``, so a
slot's data is one index away in each, and forking or resetting a request is a copy or
fill along the slot axis. The strategy (``snapshot``, ``fold`` or ``circular``, looked up
in :mod:`replayssm.state.registry`) declares the extra buffers it needs as
:class:`BufferSpec` values; the pool allocates and accounts for them without knowing
what they mean, and the strategy reads them through its own typed view.

Open steps. Between a step's first ``verify`` / ``conv_verify`` and its ``commit`` (or
``abort``) the step's slots hold half-done work (scratch written, for ``circular`` some
layers' histories already folded). The pool refuses to free, fork, reset or re-allocate
them meanwhile (:class:`StepProtocolError`, nothing changed): a freed and re-allocated
slot would otherwise receive the old request's commit.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

import torch

from ..ops import _checks
from ..ops.dispatch import BACKENDS
from .batch import Batch
from .layout import STATE_DTYPES, BufferSpec, GDNShape, PoolExhausted, StepProtocolError
from .registry import strategy_class

__all__ = ["STATE_DTYPES", "BufferSpec", "GDNShape", "PoolExhausted", "StatePool", "StepProtocolError"]

#: the pool's own buffers; a strategy's specs may not reuse these names
CORE_BUFFERS = ("checkpoints", "conv_state", "conv_window")
class StatePool:
    """GDN recurrent state of ``num_slots`` requests over ``num_layers`` layers.

    Args:
        shape: head geometry shared by the GDN layers.
        num_layers: number of GDN layers.
        num_slots: number of concurrent requests.
        strategy: ``"snapshot"``, ``"fold"`` or ``"circular"`` (a registered name), or a
            strategy class.
        window: ``T``, the largest verify window (draft tokens + bonus position).
        ring_len: ``L`` for ``circular`` (power of two, ``L >= 2T``); ignored otherwise.
        state_dtype: dtype of checkpoints and snapshots (float32, bfloat16, float64).
        act_dtype: dtype of activations (conv state, raw records).
        device: where every buffer lives.
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` for the strategy's ops.

    Buffers (see :meth:`nbytes`): :attr:`checkpoints` ``[layers, slots, HV, V, K]``,
    :attr:`conv_state` ``[layers, slots, C, W - 1]``, :attr:`conv_window` ``[layers,
    slots, T, C]`` and the strategy's own (typed access through the strategy, e.g.
    ``pool.strategy.buf.ring_k``). :attr:`buffers` is a read-only name -> tensor view of
    all of them. Gate and conv parameters of each layer are registered with
    :meth:`set_layer_params` before the first verify.
    """

    def __init__(
        self,
        shape: GDNShape,
        num_layers: int,
        num_slots: int,
        *,
        strategy: str | type = "circular",
        window: int = 4,
        ring_len: int = 16,
        state_dtype: torch.dtype = torch.float32,
        act_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        backend: str = "auto",
    ):
        if not isinstance(shape, GDNShape):
            raise TypeError(f"shape must be a GDNShape, got {type(shape).__name__}")
        for name, value in (("num_layers", num_layers), ("num_slots", num_slots), ("window", window)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        strategy_cls = strategy_class(strategy)
        if state_dtype not in STATE_DTYPES:
            raise TypeError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype}")
        if act_dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(f"act_dtype must be a float dtype, got {act_dtype}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        strategy_cls.check_config(window=window, ring_len=ring_len)

        self.shape = shape
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.window = window
        self.ring_len = ring_len
        self.state_dtype = state_dtype
        self.act_dtype = act_dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" means the current device; pin it so tensors compare equal to it.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend

        s = shape
        specs = {
            "checkpoints": BufferSpec((s.num_value_heads, s.head_v_dim, s.head_k_dim), state_dtype, fill=0.0),
            "conv_state": BufferSpec((s.conv_dim, s.conv_kernel - 1), act_dtype, fill=0.0),
            "conv_window": BufferSpec((window, s.conv_dim), act_dtype, committed=False),
        }
        extra = dict(strategy_cls.buffer_specs(self))
        for name, spec in extra.items():
            if name in specs or not isinstance(name, str) or not isinstance(spec, BufferSpec):
                raise ValueError(f"strategy {strategy_cls.__name__} declares an invalid or reserved buffer {name!r}")
        specs.update(extra)
        self._specs: dict[str, BufferSpec] = specs
        self._buffers: dict[str, torch.Tensor] = {}
        for name, spec in specs.items():
            lead = (num_layers, num_slots) if spec.per_layer else (num_slots,)
            self._buffers[name] = torch.full(lead + spec.shape, spec.fill, dtype=spec.dtype, device=self.device)
        #: read-only view name -> tensor of every buffer (the tensors themselves are the
        #: live storage); for accounting, tests and tools. Strategies use typed access.
        self.buffers: Mapping[str, torch.Tensor] = MappingProxyType(self._buffers)
        self.checkpoints: torch.Tensor = self._buffers["checkpoints"]
        self.conv_state: torch.Tensor = self._buffers["conv_state"]
        self.conv_window: torch.Tensor = self._buffers["conv_window"]

        self.params = {
            "A_log": torch.full((num_layers, s.num_value_heads), float("nan"), device=self.device),
            "dt_bias": torch.full((num_layers, s.num_value_heads), float("nan"), device=self.device),
            "conv_weight": torch.full((num_layers, s.conv_dim, s.conv_kernel), float("nan"), device=self.device, dtype=act_dtype),
            "conv_bias": torch.zeros((num_layers, s.conv_dim), device=self.device, dtype=act_dtype),
        }
        self._params_set = [False] * num_layers
        self._layer_views: list[MappingProxyType | None] = [None] * num_layers
        self._free: list[int] = list(range(num_slots))
        self._live: set[int] = set()
        # Bumped whenever a slot changes hands (alloc, free): a batch remembers the
        # generations it was built for, so a step cannot open on a slot that was freed
        # (and maybe re-allocated to another request) since.
        self._generation: list[int] = [0] * num_slots
        # Live slots of the open step (between its first verify and its commit/abort).
        self._step_slots: frozenset[int] = frozenset()
        self.strategy = strategy_cls(self)

    # ------------------------------------------------------------------ parameters
    def set_layer_params(
        self,
        layer: int,
        *,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None = None,
    ) -> None:
        """Register one layer's gate parameters (``[HV]``) and conv taps (``[C, W]``,
        or HF's ``[C, 1, W]``) with optional bias ``[C]``."""
        self.check_layer(layer)
        s = self.shape
        hv, c, w = s.num_value_heads, s.conv_dim, s.conv_kernel
        _checks.tensor("A_log", A_log, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("A_log", A_log, [hv])
        _checks.tensor("dt_bias", dt_bias, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("dt_bias", dt_bias, [hv])
        _checks.tensor("conv_weight", conv_weight, dtypes=_checks.FLOAT_DTYPES)
        if conv_weight.dim() == 3 and conv_weight.shape[1] == 1:
            conv_weight = conv_weight[:, 0]
        _checks.shape("conv_weight", conv_weight, [c, w])
        if conv_bias is not None:
            _checks.tensor("conv_bias", conv_bias, dtypes=_checks.FLOAT_DTYPES)
            _checks.shape("conv_bias", conv_bias, [c])
        self.params["A_log"][layer] = A_log.to(self.device, torch.float32)
        self.params["dt_bias"][layer] = dt_bias.to(self.device, torch.float32)
        self.params["conv_weight"][layer] = conv_weight.to(self.device, self.act_dtype)
        self.params["conv_bias"][layer] = 0.0 if conv_bias is None else conv_bias.to(self.device, self.act_dtype)
        self._params_set[layer] = True

    def layer_params(self, layer: int) -> MappingProxyType:
        """Read-only views of one layer's registered parameters (``A_log``, ``dt_bias``,
        ``conv_weight``, ``conv_bias``), built once per layer rather than per call."""
        self.check_layer(layer)
        if not self._params_set[layer]:
            raise RuntimeError(f"layer {layer} has no parameters: call set_layer_params({layer}, ...) first")
        views = self._layer_views[layer]
        if views is None:  # built once: set_layer_params writes into these views in place
            views = self._layer_views[layer] = MappingProxyType({name: p[layer] for name, p in self.params.items()})
        return views

    # ------------------------------------------------------------------ slots
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def live_slots(self) -> list[int]:
        return sorted(self._live)

    def alloc(self, slot: int | None = None) -> int:
        """Take a free slot and reset it (zero checkpoint and conv state, empty ring).

        Args:
            slot: the slot to take (engines that assign their own cache indices), or
                ``None`` for the next free one.

        Raises:
            PoolExhausted: ``slot`` is ``None`` and every slot is in use.
            ValueError: ``slot`` is out of range or not free.
        """
        if slot is None:
            if not self._free:
                raise PoolExhausted(f"all {self.num_slots} slots are in use")
            slot = self._free[0]
        else:
            self.check_slot(slot)
            if slot not in self._free:
                raise ValueError(f"slot {slot} is not free (it is allocated to a request)")
        self._check_not_in_step(slot, "allocate")
        self._reset_slots([slot])
        self._free.remove(slot)
        self._live.add(slot)
        self._generation[slot] += 1
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot`` to the pool. Freeing a slot that is not live raises, and so
        does freeing a slot of an open step (commit or abort the step first)."""
        self.check_slot(slot)
        if slot not in self._live:
            raise ValueError(f"slot {slot} is not allocated (double free?)")
        self._check_not_in_step(slot, "free")
        self._live.remove(slot)
        self._free.append(slot)
        self._generation[slot] += 1

    def fork(self, src: int) -> int:
        """Copy request ``src`` (checkpoint, conv, ring, cursors) into a new slot."""
        self.check_live(src)
        self._check_not_in_step(src, "fork")
        if not self._free:
            raise PoolExhausted(f"all {self.num_slots} slots are in use")
        dst = self._free.pop(0)
        for name, buf in self._buffers.items():
            if self._specs[name].per_layer:
                buf[:, dst] = buf[:, src]
            else:
                buf[dst] = buf[src]
        self._live.add(dst)
        self._generation[dst] += 1
        return dst

    def reset(self, slot: int) -> None:
        """Restart a live request from the zero state."""
        self.check_live(slot)
        self._check_not_in_step(slot, "reset")
        self._reset_slots([slot])

    def _reset_slots(self, slots: Iterable[int]) -> None:
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        for name, buf in self._buffers.items():
            spec = self._specs[name]
            if spec.per_layer:
                buf[:, idx] = spec.fill
            else:
                buf[idx] = spec.fill

    @property
    def specs(self) -> Mapping[str, BufferSpec]:
        """Read-only name -> :class:`BufferSpec` of every buffer."""
        return MappingProxyType(self._specs)

    def generation(self, slot: int) -> int:
        """How many times ``slot`` changed hands (alloc, fork into it, free)."""
        self.check_slot(slot)
        return self._generation[slot]

    # ------------------------------------------------------------------ open steps
    @property
    def step_slots(self) -> frozenset[int]:
        """Live slots of the open step (empty between steps)."""
        return self._step_slots

    def _check_not_in_step(self, slot: int, what: str) -> None:
        if slot in self._step_slots:
            raise StepProtocolError(
                f"cannot {what} slot {slot}: it belongs to the open step (commit or abort the step first)"
            )

    def open_step(self, batch: Batch) -> None:
        """Mark ``batch``'s live slots as in a step (called by the strategy at the
        step's first verify). Checks, on the host, that every slot is still held by the
        request the batch was built for."""
        slots = batch.host_slots if batch.host_slots is not None else tuple(batch.slots.tolist())
        for i, s in enumerate(slots):
            if s < 0:
                continue
            if s not in self._live:
                raise StepProtocolError(f"slot {s} (batch row {i}) was freed after the batch was built")
            if batch.generations is not None and batch.generations[i] != self._generation[s]:
                raise StepProtocolError(
                    f"slot {s} (batch row {i}) was freed and re-allocated after the batch was built"
                )
        self._step_slots = frozenset(s for s in slots if s >= 0)

    def close_step(self) -> None:
        """End the open step (called by the strategy at commit / abort)."""
        self._step_slots = frozenset()

    # ------------------------------------------------------------------ validation
    def check_layer(self, layer) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def check_slot(self, slot) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots}), got {slot!r}")

    def check_live(self, slot) -> None:
        self.check_slot(slot)
        if slot not in self._live:
            raise ValueError(f"slot {slot} is not allocated")

    def batch(self, slots: Sequence[int], lengths: Sequence[int] | int, *, prefill: bool = False) -> Batch:
        """Validate and pack a step's requests.

        Args:
            slots: live slot per request, ``-1`` for padding rows.
            lengths: tokens per request (one int for all); ``1 <= n <= window`` unless
                ``prefill`` (then any ``n >= 1``).
        """
        slots = list(slots)
        if isinstance(lengths, int):
            lengths = [lengths] * len(slots)
        lengths = list(lengths)
        if len(lengths) != len(slots):
            raise ValueError(f"lengths has {len(lengths)} entries for {len(slots)} slots")
        seen = set()
        for i, s in enumerate(slots):
            if s == -1:
                continue
            if not isinstance(s, int) or isinstance(s, bool):
                raise TypeError(f"slots[{i}] must be an int, got {type(s).__name__}")
            self.check_live(s)
            if s in seen:
                raise ValueError(f"slot {s} appears twice in the batch")
            seen.add(s)
        for i, n in enumerate(lengths):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1 or (not prefill and n > self.window):
                bound = "" if prefill else f" and <= window {self.window}"
                raise ValueError(f"lengths[{i}] must be an int >= 1{bound}, got {n!r}")
        generations = tuple(self._generation[s] if s >= 0 else 0 for s in slots)
        return Batch.build(slots, lengths, self.device, generations=generations)

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> dict[str, int]:
        """Exact bytes of every state buffer (parameters excluded), plus ``"total"``."""
        out = {name: buf.numel() * buf.element_size() for name, buf in self._buffers.items()}
        out["total"] = sum(out.values())
        return out

    def nbytes_per_slot(self) -> dict[str, int]:
        """Bytes one request occupies in each buffer (all layers), plus ``"total"``."""
        out = {name: b // self.num_slots for name, b in self.nbytes().items() if name != "total"}
        out["total"] = sum(out.values())
        return out

    def scratch_nbytes_per_slot(self) -> int:
        """Per-request bytes beyond checkpoint and conv state: the strategy's price."""
        per = self.nbytes_per_slot()
        return per["total"] - per["checkpoints"] - per["conv_state"]

    def __repr__(self) -> str:
        return (
            f"StatePool(strategy={self.strategy.name!r}, layers={self.num_layers}, slots={self.num_slots}, "
            f"live={len(self._live)}, shape={self.shape}, window={self.window}, "
            f"state_dtype={self.state_dtype}, act_dtype={self.act_dtype}, device={self.device})"
        )
