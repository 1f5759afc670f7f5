"""The packed-batch descriptor shared by every layer of one step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..ops import guards


@dataclass(eq=False)
class Batch:
    """Which requests a step covers and where their tokens sit in the packed inputs.

    Built by :meth:`replayssm.state.StatePool.batch`, which validates it once; layers
    and commit reuse it without touching its values again (no host synchronisation
    inside a step).

    Attributes:
        slots: ``[B]`` int32 slot per request, ``-1`` for padding rows.
        cu_seqlens: ``[B + 1]`` int32 token offsets of the windows.
        lengths: the window lengths, on the host.
        max_len: ``max(lengths)`` (0 for an empty batch).
        host_slots: the slots on the host (``None`` if the batch was built from device
            tensors only); read by the pool's step checks without a device read.
        generations: per row, the pool's allocation generation of the slot when the
            batch was built (``None``: unknown); a step refuses a slot that changed
            hands since.

    A batch from :meth:`build` records the host copies of its index tensors for the
    kernels' guards (:mod:`replayssm.ops.guards`), which therefore read nothing back;
    change its slots only through :meth:`set_slots`.
    """

    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    host_slots: tuple[int, ...] | None = None
    generations: tuple[int, ...] | None = None
    max_len: int = field(init=False)
    _device_lengths: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self):
        self.max_len = max(self.lengths, default=0)

    @property
    def device_lengths(self) -> torch.Tensor:
        """``[B]`` int32 window lengths on the batch's device (from ``cu_seqlens``, built
        once, without a host read)."""
        if self._device_lengths is None:
            self._device_lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int32)
        return self._device_lengths

    def set_slots(self, slots: Sequence[int]) -> None:
        """Rewrite the rows' slots in place (a static batch whose rows change between
        steps, e.g. one a CUDA graph was captured with); the caller has checked them.
        Keeps the recorded host copy in step with the device values. ``slots`` is
        converted once (any integer sequence, e.g. a numpy array)."""
        self.host_slots = guards.copy_to_device(self.slots, self._slots_of(slots))

    def _slots_of(self, slots: Sequence[int]):
        host = guards.host_ints(slots)
        if host.size != self.size:
            raise ValueError(f"need {self.size} slots, got {host.size}")
        return host

    def set_windows(self, slots: Sequence[int], lengths: Sequence[int], *, upload: bool = True) -> None:
        """Rewrite the rows' slots and window lengths in place (a static prompt batch a
        CUDA graph was captured with); the caller has checked the slots. The token count
        and the bound :attr:`max_len` (the captured shape's) stay: the lengths must sum
        to :attr:`num_tokens` and each lie in ``1 .. max_len``.

        ``upload=False``: only the host side changes (the values recorded for the
        guards); the caller's graph writes the device tensors through
        :meth:`load_windows` before any kernel reads them, from a buffer it uploads
        anyway (one host copy a pass instead of three)."""
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != self.size:
            raise ValueError(f"need {self.size} lengths, got {len(lengths)}")
        if sum(lengths) != self.num_tokens or not all(1 <= n <= self.max_len for n in lengths):
            raise ValueError(f"lengths {list(lengths)} must each be in 1..{self.max_len} and sum to "
                             f"{self.num_tokens}")
        if upload:
            self.set_slots(slots)
            guards.copy_to_device(self.cu_seqlens, itertools.accumulate(lengths, initial=0))
        else:
            self.host_slots = tuple(self._slots_of(slots).tolist())
            guards.record_host_values(self.slots, self.host_slots)
            guards.record_host_values(self.cu_seqlens, itertools.accumulate(lengths, initial=0))
        self.lengths = lengths
        self._device_lengths = None

    def load_windows(self, slots: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """Copy the rows' slots and offsets from device tensors (``[B]`` and ``[B + 1]``,
        any integer dtype) that hold what :meth:`set_windows` announced with
        ``upload=False``; inside a captured graph, every replay copies them. The host
        records stay those values."""
        self.slots.copy_(slots)
        self.cu_seqlens.copy_(cu_seqlens)
        guards.record_host_values(self.slots, self.host_slots)  # the copies bumped their versions
        guards.record_host_values(self.cu_seqlens, itertools.accumulate(self.lengths, initial=0))

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def live_slots(self) -> list[int]:
        slots = self.host_slots if self.host_slots is not None else self.slots.tolist()
        return [s for s in slots if s >= 0]

    @classmethod
    def build(
        cls, slots: Sequence[int], lengths: Sequence[int], device, *, generations: Sequence[int] | None = None
    ) -> "Batch":
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        host = tuple(int(s) for s in slots)
        return cls(
            slots=guards.host_index(host, device),
            cu_seqlens=guards.host_index(cu, device),
            lengths=tuple(int(n) for n in lengths),
            host_slots=host,
            generations=None if generations is None else tuple(generations),
        )
