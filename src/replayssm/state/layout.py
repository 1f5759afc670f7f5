"""What the pool and the strategies share: head geometry, buffer specs, pool errors.

This module imports nothing from :mod:`replayssm.strategies`: strategies depend on the
state package, never the other way round. A strategy declares its buffers as
:class:`BufferSpec` values keyed by name; the pool allocates, resets, forks and accounts
for them without knowing what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import _checks

#: dtypes a pool may keep its states in
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


class PoolExhausted(RuntimeError):
    """Raised by :meth:`StatePool.alloc` / :meth:`StatePool.fork` when every slot is taken."""


class StepProtocolError(RuntimeError):
    """A call out of order: a layer verified twice, commit without verify, or a slot
    freed, forked, reset or re-allocated while a step that covers it is open."""


@dataclass(frozen=True)
class GDNShape:
    """Head geometry of one GDN layer (DESIGN.md section 1).

    Attributes:
        num_heads: ``H``, key/query heads.
        num_value_heads: ``HV``, value heads (a multiple of ``H``).
        head_k_dim: ``K``.
        head_v_dim: ``V``.
        conv_kernel: ``W``, width of the causal conv over ``q|k|v``.
    """

    num_heads: int
    num_value_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    def __post_init__(self):
        for name in ("num_heads", "num_value_heads", "head_k_dim", "head_v_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be an int >= 2, got {self.conv_kernel!r}")
        _checks.gqa(self.num_heads, self.num_value_heads)

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: ``2 H K + HV V`` (``q|k|v``)."""
        return 2 * self.num_heads * self.head_k_dim + self.num_value_heads * self.head_v_dim

    @property
    def state_numel(self) -> int:
        return self.num_value_heads * self.head_v_dim * self.head_k_dim

    def tp_shard(self, world_size: int) -> "GDNShape":
        """The geometry one rank of ``world_size``-way tensor parallelism holds: ``H /
        world_size`` key heads and ``HV / world_size`` value heads (DESIGN.md section 8).
        A sharded pool is a pool of this smaller shape; nothing else changes."""
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if self.num_heads % world_size:
            raise ValueError(f"{self.num_heads} key heads do not split over {world_size} ranks")
        return GDNShape(self.num_heads // world_size, self.num_value_heads // world_size, self.head_k_dim,
                        self.head_v_dim, self.conv_kernel)

    def tp_conv_channels(self, rank: int, world_size: int) -> list[int]:
        """Which of the ``q|k|v`` conv channels rank ``rank`` holds, in its own order:
        its key heads' slice of the ``q`` block, the same slice of the ``k`` block, then
        its value heads' slice of the ``v`` block (the conv is depthwise, so a shard's
        channels, taps and bias are those rows)."""
        part = self.tp_shard(world_size)
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        qk = part.num_heads * self.head_k_dim
        vv = part.num_value_heads * self.head_v_dim
        key = self.num_heads * self.head_k_dim
        return ([*range(rank * qk, (rank + 1) * qk)] + [*range(key + rank * qk, key + (rank + 1) * qk)]
                + [*range(2 * key + rank * vv, 2 * key + (rank + 1) * vv)])


@dataclass(frozen=True)
class BufferSpec:
    """A buffer of a pool: what the pool allocates, or what a caller's tensor must be.

    ``shape`` excludes the leading ``[num_layers, num_slots]`` (``per_layer``) or
    ``[num_slots]`` axes. ``fill`` is the initial value; float scratch starts as NaN so
    that a read of a never-written entry cannot go unnoticed. ``committed``: whether the
    buffer holds committed state between steps (saved and restored by
    ``Strategy.save_states``) or only a step's scratch.

    Layout of a caller's tensor: ``packed`` is how many trailing axes of the full tensor
    must be packed (row-major without gaps, the last of stride 1); every axis before
    them may have any (nonzero) stride, e.g. the layer and slot strides of an engine
    that interleaves layers or pages. ``why`` says which kernels need the packing.

    ``swap_last``: the pool allocates the buffer with its last two axes swapped in
    memory (a ``[..., b, a]`` tensor seen as ``[..., a, b]``), the layout its kernels
    read fastest; a caller's tensor may have either.

    ``alt_dtype``: a second dtype a caller's tensor may have, which the kernels read in
    another form (a ring's keys: raw in the activations' 16-bit dtype, as SGLang's rings
    hold them, where the pool keeps them normalised in float32;
    :func:`~replayssm.ops.records.keys_normalized`).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    per_layer: bool = True
    fill: float = float("nan")
    committed: bool = True
    packed: int = 0
    why: str = ""
    swap_last: bool = False
    alt_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.swap_last and (len(self.shape) < 2 or self.packed):
            raise ValueError(f"swap_last needs at least two axes and no packed ones, got shape {self.shape} "
                             f"packed {self.packed}")

    def full_shape(self, num_layers: int, num_slots: int) -> tuple[int, ...]:
        """The shape of the whole buffer, leading axes included."""
        return ((num_layers, num_slots) if self.per_layer else (num_slots,)) + tuple(self.shape)

    def allocate(self, num_layers: int, num_slots: int, device: torch.device) -> torch.Tensor:
        """A fresh buffer of :meth:`full_shape` filled with :attr:`fill`, in the memory
        order :attr:`swap_last` asks for."""
        full = self.full_shape(num_layers, num_slots)
        if not self.swap_last:
            return torch.full(full, self.fill, dtype=self.dtype, device=device)
        swapped = full[:-2] + (full[-1], full[-2])
        return torch.full(swapped, self.fill, dtype=self.dtype, device=device).transpose(-1, -2)


@dataclass(frozen=True)
class PoolConfig:
    """What a strategy's buffers depend on (``Strategy.buffer_specs`` receives this, or
    the pool itself, which has the same attributes)."""

    shape: GDNShape
    window: int
    ring_len: int
    state_dtype: torch.dtype
    act_dtype: torch.dtype
