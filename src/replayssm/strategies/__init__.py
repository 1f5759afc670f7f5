"""Speculative-verify strategies behind one interface (DESIGN.md section 3)."""

from .base import Strategy, StepProtocolError
from .circular import CircularStrategy
from .fold import FoldStrategy
from .snapshot import SnapshotStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SnapshotStrategy, FoldStrategy, CircularStrategy)
}
#: the strategy names, in the order tables and plots show them (the one list of them)
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)

__all__ = ["STRATEGIES", "STRATEGY_NAMES", "CircularStrategy", "FoldStrategy", "SnapshotStrategy", "StepProtocolError", "Strategy"]
