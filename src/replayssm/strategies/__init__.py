"""Speculative-verify strategies behind one interface (DESIGN.md section 3)."""

from .base import Strategy, StepProtocolError
from .circular import CircularStrategy
from .fold import FoldStrategy
from .snapshot import SnapshotStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SnapshotStrategy, FoldStrategy, CircularStrategy)
}

__all__ = ["STRATEGIES", "CircularStrategy", "FoldStrategy", "SnapshotStrategy", "StepProtocolError", "Strategy"]
