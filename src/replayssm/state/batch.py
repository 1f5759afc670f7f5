"""The packed-batch descriptor shared by every layer of one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


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
    """

    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    host_slots: tuple[int, ...] | None = None
    generations: tuple[int, ...] | None = None
    max_len: int = field(init=False)

    def __post_init__(self):
        self.max_len = max(self.lengths, default=0)

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
            slots=torch.tensor(host, dtype=torch.int32, device=device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            lengths=tuple(int(n) for n in lengths),
            host_slots=host,
            generations=None if generations is None else tuple(generations),
        )
