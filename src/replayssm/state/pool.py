"""The state pool: checkpoints, conv states, strategy buffers, cursors, slot lifecycle.

One pool serves all GDN layers of a model. Every per-layer buffer is laid out
``[num_layers, num_slots, ...]`` and every per-request buffer ``[num_slots, ...]``, so a
slot's data is one index away in each, and forking or resetting a request is a copy or
fill along the slot axis. The strategy (``snapshot``, ``fold`` or ``circular``, looked up
in :mod:`replayssm.state.registry`) declares the extra buffers it needs as
:class:`BufferSpec` values; the pool allocates and accounts for them without knowing
what they mean, and the strategy reads them through its own typed view.

Caller-owned buffers. An engine that owns its memory hands its tensors in
(``StatePool(..., buffers={"checkpoints": ssm_states, ...})``): the pool checks each
against its :class:`BufferSpec` (:func:`buffer_specs` lists them before a pool exists)
and works on it in place; it allocates only the buffers not handed in. Slot and layer
strides are free wherever the kernels allow (``BufferSpec.packed``), so views into an
engine's interleaved layout serve as they are.

Open steps. Between a step's first ``verify`` / ``conv_verify`` and its ``commit`` (or
``abort``) the step's slots hold half-done work (scratch written, for ``circular`` some
layers' histories already folded). The pool refuses to free, fork, reset or re-allocate
them meanwhile (:class:`StepProtocolError`, nothing changed): a freed and re-allocated
slot would otherwise receive the old request's commit.
"""

from __future__ import annotations

import operator
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from ..ops import _checks, guards
from ..ops.dispatch import BACKENDS, resolve
from .batch import Batch
from .layout import STATE_DTYPES, BufferSpec, GDNShape, PoolConfig, PoolExhausted, StepProtocolError
from .registry import strategy_class

__all__ = [
    "STATE_DTYPES", "BufferSpec", "GDNShape", "PoolExhausted", "StatePool", "StepProtocolError", "as_index",
    "buffer_specs",
]

#: the pool's own buffers; a strategy's specs may not reuse these names
CORE_BUFFERS = ("checkpoints", "conv_state", "conv_window", "conv_pos")
#: the committed state an engine may have written before a slot joins (``alloc(keep_state=True)``)
STATE_BUFFERS = ("checkpoints", "conv_state", "conv_pos")


def conv_ring_len(window: int, conv_kernel: int) -> int:
    """Entries of a conv ring (:mod:`replayssm.ops.conv`) for windows of ``window``
    tokens: the ``W - 1`` history entries and a window, rounded up to a power of two."""
    return 1 << (window + conv_kernel - 2).bit_length()


def as_index(name: str, value) -> int:
    """``value`` as a Python int: ints, numpy integer scalars and one-element integer
    tensors are accepted (a CUDA tensor is read, one synchronisation); bools, floats and
    anything else raise ``TypeError`` naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def buffer_specs(
    shape: GDNShape,
    *,
    strategy: str | type = "circular",
    window: int = 4,
    ring_len: int = 16,
    state_dtype: torch.dtype = torch.float32,
    act_dtype: torch.dtype = torch.float32,
    conv_ring: bool = False,
) -> dict[str, BufferSpec]:
    """Every buffer a pool of this configuration holds, by name: what an engine
    allocates to hand its own tensors in (DESIGN.md, "Buffers an engine may own").

    ``conv_ring``: the conv history and window as one ring a slot (``conv_state [C,
    R]``, :func:`conv_ring_len` entries, and ``conv_pos``, each slot's position) instead
    of ``conv_state [C, W - 1]`` and ``conv_window``: a commit moves the position
    instead of copying the accepted inputs into the state.

    Each buffer is ``spec.full_shape(num_layers, num_slots)`` of ``spec.dtype``; its
    first axes may have any strides, its last ``spec.packed`` axes must be packed.
    """
    strategy_cls = strategy_class(strategy)
    cfg = PoolConfig(shape, window, ring_len, state_dtype, act_dtype)
    s = shape
    specs = {
        "checkpoints": BufferSpec(
            (s.num_value_heads, s.head_v_dim, s.head_k_dim), state_dtype, fill=0.0,
            packed=strategy_cls.checkpoint_packed,
            why=strategy_cls.packed_reason or "the kernels read and write a state [HV, V, K] as one packed block",
        ),
        # Any strides: a [slots, W - 1, C] state passed transposed serves as it is, and
        # is how the pool keeps its own: a conv kernel's loads and stores of a channel
        # block's W - 1 entries are then W - 1 contiguous rows, not one short row per
        # channel (the commit and the conv read them at every step).
        "conv_state": BufferSpec((s.conv_dim, s.conv_kernel - 1), act_dtype, fill=0.0, swap_last=True),
        "conv_window": BufferSpec((window, s.conv_dim), act_dtype, committed=False),
    }
    if conv_ring:
        del specs["conv_window"]
        specs["conv_state"] = BufferSpec((s.conv_dim, conv_ring_len(window, s.conv_kernel)), act_dtype, fill=0.0,
                                         swap_last=True)
        specs["conv_pos"] = BufferSpec((), torch.int32, per_layer=False, fill=0, packed=1,
                                       why="the conv kernels index the slots' positions")
    extra = dict(strategy_cls.buffer_specs(cfg))
    for name, spec in extra.items():
        if name in specs or not isinstance(name, str) or not isinstance(spec, BufferSpec):
            raise ValueError(f"strategy {strategy_cls.__name__} declares an invalid or reserved buffer {name!r}")
    specs.update(extra)
    return specs
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
        buffers: tensors the caller owns, by buffer name (any subset of
            :func:`buffer_specs`); the pool uses them in place, keeps their contents
            (slots get their fill at :meth:`alloc`) and allocates the rest.
        conv_ring: keep each slot's conv history and window as one ring
            (:func:`buffer_specs`), committed by moving its position.

    Buffers (see :meth:`nbytes`): :attr:`checkpoints` ``[layers, slots, HV, V, K]``,
    :attr:`conv_state` ``[layers, slots, C, W - 1]``, :attr:`conv_window` ``[layers,
    slots, T, C]`` (with ``conv_ring``: :attr:`conv_state` ``[layers, slots, C, R]`` and
    :attr:`conv_pos` ``[slots]``, no window buffer) and the strategy's own (typed access through the strategy, e.g.
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
        buffers: Mapping[str, torch.Tensor] | None = None,
        conv_ring: bool = False,
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
        if not isinstance(conv_ring, bool):
            raise TypeError(f"conv_ring must be a bool, got {type(conv_ring).__name__}")
        device = torch.device(device)
        strategy_cls.check_config(window=window, ring_len=ring_len, backend=resolve(backend, device))

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
        #: whether the conv history and window are one ring a slot (``conv_pos`` its positions)
        self.conv_ring = conv_ring

        s = shape
        specs = buffer_specs(shape, strategy=strategy_cls, window=window, ring_len=ring_len,
                             state_dtype=state_dtype, act_dtype=act_dtype, conv_ring=conv_ring)
        if buffers is not None and not isinstance(buffers, Mapping):
            raise TypeError(f"buffers must be a mapping of name -> tensor, got {type(buffers).__name__}")
        given = dict(buffers or {})
        unknown = sorted(set(given) - set(specs))
        if unknown:
            raise ValueError(
                f"buffers has {unknown}, which a {strategy_cls.name} pool does not hold (it holds {list(specs)})"
            )
        self._specs: dict[str, BufferSpec] = specs
        self._buffers: dict[str, torch.Tensor] = {}
        for name, spec in specs.items():
            full = spec.full_shape(num_layers, num_slots)
            if name in given:
                self._buffers[name] = self._check_given(name, spec, given[name], full)
            else:
                self._buffers[name] = spec.allocate(num_layers, num_slots, self.device)
        #: names of the buffers the caller handed in (the pool owns the others)
        self.caller_buffers: frozenset[str] = frozenset(given)
        #: read-only view name -> tensor of every buffer (the tensors themselves are the
        #: live storage); for accounting, tests and tools. Strategies use typed access.
        self.buffers: Mapping[str, torch.Tensor] = MappingProxyType(self._buffers)
        self.checkpoints: torch.Tensor = self._buffers["checkpoints"]
        self.conv_state: torch.Tensor = self._buffers["conv_state"]
        self.conv_window: torch.Tensor | None = self._buffers.get("conv_window")
        self.conv_pos: torch.Tensor | None = self._buffers.get("conv_pos")

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
        # Liveness on the device, for batches whose slots are checked there (graph capture).
        self._live_mask = torch.zeros(num_slots, dtype=torch.bool, device=self.device)
        guards.error_word(self.device)  # created now, not inside a later graph capture
        # Bumped whenever a slot changes hands (alloc, free): a batch remembers the
        # generations it was built for, so a step cannot open on a slot that was freed
        # (and maybe re-allocated to another request) since.
        self._generation: list[int] = [0] * num_slots
        # Live slots of the open step (between its first verify and its commit/abort);
        # a step whose slots were checked on the device only covers every slot.
        self._step_slots: frozenset[int] = frozenset()
        self._step_covers_all = False
        self.strategy = strategy_cls(self)

    def _check_given(self, name: str, spec: BufferSpec, x, full: tuple[int, ...]) -> torch.Tensor:
        where = f"buffers[{name!r}]"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != full:
            raise ValueError(f"{where} must have shape {list(full)}, got {list(x.shape)}")
        if x.dtype not in (spec.dtype, spec.alt_dtype):
            also = f" or {spec.alt_dtype}" if spec.alt_dtype is not None else ""
            raise TypeError(f"{where} must have dtype {spec.dtype}{also}, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"{where} is on {x.device}, the pool on {self.device}")
        for axis, (n, st) in enumerate(zip(x.shape, x.stride())):
            if n > 1 and st == 0:
                raise ValueError(f"{where} has stride 0 on axis {axis}: its entries would share memory")
        _checks.packed(where, x, spec.packed, spec.why)
        return x

    @property
    def config(self) -> PoolConfig:
        """What the strategy's buffers depend on."""
        return PoolConfig(self.shape, self.window, self.ring_len, self.state_dtype, self.act_dtype)

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

    def alloc(self, slot: int | None = None, *, keep_state: bool = False) -> int:
        """Take a free slot and reset it (zero checkpoint and conv state, empty ring).

        Args:
            slot: the slot to take (engines that assign their own cache indices; any
                integer type), or ``None`` for the next free one.
            keep_state: keep the slot's checkpoints and conv state as they are (an
                engine that wrote a request's state into its own buffers, e.g. from a
                prefix cache); everything else (scratch, ring, cursors) is reset.

        Raises:
            PoolExhausted: ``slot`` is ``None`` and every slot is in use.
            ValueError: ``slot`` is out of range or not free.
        """
        if not isinstance(keep_state, bool):
            raise TypeError(f"keep_state must be a bool, got {type(keep_state).__name__}")
        if slot is None:
            if not self._free:
                raise PoolExhausted(f"all {self.num_slots} slots are in use")
            slot = self._free[0]
        else:
            slot = self.check_slot(slot)
            if slot not in self._free:
                raise ValueError(f"slot {slot} is not free (it is allocated to a request)")
        self._check_not_in_step(slot, "allocate")
        self._reset_slots([slot], keep=STATE_BUFFERS if keep_state else ())
        self._free.remove(slot)
        self._take(slot)
        return slot

    def alloc_many(self, n: int) -> list[int]:
        """Take the next ``n`` free slots and reset them, as ``n`` calls of :meth:`alloc`
        would (the same slots, in the same order), with one device write per buffer for
        all of them instead of one per slot: what a batch of joining requests costs.

        Raises:
            PoolExhausted: fewer than ``n`` slots are free (none is taken).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise PoolExhausted(f"{n} slots asked for, {len(self._free)} of {self.num_slots} free")
        slots = self._free[:n]
        for slot in slots:
            self._check_not_in_step(slot, "allocate")
        if slots:
            self._reset_slots(slots)
            del self._free[:n]
            self._take_many(slots)
        return slots

    def _take(self, slot: int) -> None:
        self._take_many([slot])

    def _take_many(self, slots: list[int]) -> None:
        self._live.update(slots)
        self._live_mask.index_fill_(0, guards.to_device(slots, self.device), True)
        for slot in slots:
            self._generation[slot] += 1

    def free(self, slot: int) -> None:
        """Return ``slot`` to the pool. Freeing a slot that is not live raises, and so
        does freeing a slot of an open step (commit or abort the step first)."""
        self.free_many((slot,))

    def free_many(self, slots: Sequence[int]) -> None:
        """Return every slot of ``slots`` to the pool, in order, with one device write
        (the liveness mask) for all of them. Each is checked as :meth:`free` checks it,
        and for appearing twice, before any is freed: a failed call frees none."""
        slots = [self.check_slot(s) for s in slots]
        seen = set()
        for slot in slots:
            if slot not in self._live or slot in seen:
                raise ValueError(f"slot {slot} is not allocated (double free?)")
            self._check_not_in_step(slot, "free")
            seen.add(slot)
        if not slots:
            return
        self._live.difference_update(slots)
        self._free += slots
        for slot in slots:
            self._generation[slot] += 1
        self._live_mask.index_fill_(0, guards.to_device(slots, self.device), False)

    def fork(self, src: int) -> int:
        """Copy request ``src`` (checkpoint, conv, ring, cursors) into a new slot."""
        src = self.check_live(src)
        self._check_not_in_step(src, "fork")
        if not self._free:
            raise PoolExhausted(f"all {self.num_slots} slots are in use")
        dst = self._free.pop(0)
        for name, buf in self._buffers.items():
            if self._specs[name].per_layer:
                buf[:, dst] = buf[:, src]
            else:
                buf[dst] = buf[src]
        self._take(dst)
        return dst

    def reset(self, slot: int) -> None:
        """Restart a live request from the zero state."""
        slot = self.check_live(slot)
        self._check_not_in_step(slot, "reset")
        self._reset_slots([slot])

    def _reset_slots(self, slots: Iterable[int], keep: Sequence[str] = ()) -> None:
        # index_fill_, not ``buf[idx] = fill``: an indexed assignment of a Python scalar
        # goes through index_put_, whose host side cost the GPU's decode loop ~0.4 ms a
        # call at batch 64-256 (BENCHMARKS.md, "A closed batch against a loaded server").
        idx = guards.to_device(slots, self.device)  # pinned, no synchronisation
        for name, buf in self._buffers.items():
            if name in keep:
                continue
            spec = self._specs[name]
            buf.index_fill_(1 if spec.per_layer else 0, idx, spec.fill)

    def conv_history(self) -> torch.Tensor:
        """Every slot's committed conv inputs ``[layers, slots, C, W - 1]``, oldest first:
        :attr:`conv_state` itself, or gathered from the conv ring at each slot's position
        (a copy)."""
        if not self.conv_ring:
            return self.conv_state
        w1, r = self.shape.conv_kernel - 1, self.conv_state.shape[-1]
        rows = (self.conv_pos.long()[:, None] - w1 + torch.arange(w1, device=self.device)) % r  # [slots, W - 1]
        index = rows[None, :, None, :].expand(*self.conv_state.shape[:3], w1)
        return self.conv_state.gather(3, index)

    @property
    def specs(self) -> Mapping[str, BufferSpec]:
        """Read-only name -> :class:`BufferSpec` of every buffer."""
        return MappingProxyType(self._specs)

    def generation(self, slot: int) -> int:
        """How many times ``slot`` changed hands (alloc, fork into it, free)."""
        return self._generation[self.check_slot(slot)]

    # ------------------------------------------------------------------ open steps
    @property
    def step_slots(self) -> frozenset[int]:
        """Live slots of the open step (empty between steps)."""
        return self._step_slots

    def _check_not_in_step(self, slot: int, what: str) -> None:
        if slot in self._step_slots or self._step_covers_all:
            raise StepProtocolError(
                f"cannot {what} slot {slot}: it belongs to the open step (commit or abort the step first)"
            )

    def open_step(self, batch: Batch) -> None:
        """Mark ``batch``'s live slots as in a step (called by the strategy at the
        step's first verify). Checks, on the host, that every slot is still held by the
        request the batch was built for; a batch whose slots were checked on the device
        (graph capture) covers every slot until the step ends."""
        if batch.host_slots is None and guards.on_device(batch.slots):
            self._step_slots, self._step_covers_all = frozenset(), True
            return
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
        self._step_slots, self._step_covers_all = frozenset(), False

    def check_errors(self, *, wait: bool = True) -> None:
        """Raise :class:`~replayssm.ops.guards.DeviceCheckError` if a device-side check
        (inside a CUDA graph, or of a CUDA ``accepted`` at commit) found bad index
        values since the last check. ``wait=False`` reads nothing from the device (the
        strategies look that way at every step); a graph-replaying engine calls this
        after its per-step read."""
        guards.check_errors(self.device, wait=wait)

    # ------------------------------------------------------------------ validation
    def check_layer(self, layer) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def check_slot(self, slot, name: str = "slot") -> int:
        """``slot`` as an int in ``[0, num_slots)`` (any integer type is accepted)."""
        value = as_index(name, slot)
        if not 0 <= value < self.num_slots:
            raise ValueError(f"{name} must be an int in [0, {self.num_slots}), got {slot!r}")
        return value

    def check_live(self, slot, name: str = "slot") -> int:
        """``slot`` as an int, which must be allocated."""
        value = self.check_slot(slot, name)
        if value not in self._live:
            raise ValueError(f"slot {value} is not allocated")
        return value

    def batch(self, slots, lengths, *, prefill: bool = False) -> Batch:
        """Validate and pack a step's requests.

        Args:
            slots: live slot per request, ``-1`` for padding rows: a sequence of any
                integer type, a numpy integer array, or a 1-D integer tensor. A tensor on
                the pool's device is read once (one synchronisation, the step's check);
                inside CUDA graph capture it is checked on the device instead (bad rows
                become padding, reported by :meth:`check_errors`) and ``lengths`` must
                be one int.
            lengths: tokens per request (one int for all); ``1 <= n <= window`` unless
                ``prefill`` (then any ``n >= 1``).
        """
        guards.check_errors(self.device, wait=False)
        if isinstance(slots, torch.Tensor):
            _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INTEGER_DTYPES)
            if slots.device.type != "cpu" and slots.device != self.device:
                raise ValueError(f"slots is on {slots.device}, the pool on {self.device}")
            if slots.device.type != "cpu" and guards.on_device(slots):
                return self._device_batch(slots, lengths, prefill)
            slots = slots.tolist()
        slots, lengths = self.check_rows(slots, lengths, prefill=prefill)
        generations = tuple(self._generation[s] if s >= 0 else 0 for s in slots)
        return Batch.build(slots, lengths, self.device, generations=generations)

    def check_rows(self, slots, lengths, *, prefill: bool = False) -> tuple[list[int], list[int]]:
        """:meth:`batch`'s checks of host ``slots`` and ``lengths`` (same arguments, no
        device tensor), without building the batch: for a caller that writes them into a
        static batch. Returns both as lists of ints."""
        if isinstance(slots, np.ndarray) and slots.dtype.kind not in "iu":
            raise TypeError(f"slots must hold integers, got a numpy array of {slots.dtype}")
        slots = [as_index(f"slots[{i}]", s) for i, s in enumerate(slots)]
        if isinstance(lengths, (int, np.integer)) and not isinstance(lengths, (bool, np.bool_)):
            lengths = [int(lengths)] * len(slots)
        lengths = [as_index(f"lengths[{i}]", n) for i, n in enumerate(lengths)]
        if len(lengths) != len(slots):
            raise ValueError(f"lengths has {len(lengths)} entries for {len(slots)} slots")
        seen = set()
        for i, s in enumerate(slots):
            if s == -1:
                continue
            self.check_live(s, f"slots[{i}]")
            if s in seen:
                raise ValueError(f"slot {s} appears twice in the batch")
            seen.add(s)
        for i, n in enumerate(lengths):
            self._check_length(i, n, prefill)
        return slots, lengths

    def _check_length(self, i: int, n: int, prefill: bool) -> None:
        if n < 1 or (not prefill and n > self.window):
            bound = "" if prefill else f" and <= window {self.window}"
            raise ValueError(f"lengths[{i}] must be an int >= 1{bound}, got {n!r}")

    def _device_batch(self, slots: torch.Tensor, lengths, prefill: bool) -> Batch:
        """A batch of device slots inside graph capture: checked by tensor ops (range,
        repeats, liveness); the offsets are built on the device (uniform windows)."""
        if not isinstance(lengths, int) or isinstance(lengths, bool):
            raise TypeError("inside CUDA graph capture, lengths must be one int (every window the same length)")
        self._check_length(0, lengths, prefill)
        b = slots.shape[0]
        cu = torch.arange(b + 1, dtype=torch.int32, device=self.device) * lengths
        safe, cu = guards.sanitize_window(
            slots.to(torch.int32), cu, num_slots=self.num_slots, num_tokens=b * lengths, max_len=lengths,
            live_mask=self._live_mask,
        )
        return Batch(slots=safe, cu_seqlens=cu, lengths=(lengths,) * b)

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
