"""Speculative-verify strategies behind one interface (DESIGN.md section 3).

Importing this package registers the strategies with :mod:`replayssm.state.registry`,
which is how ``StatePool(..., strategy="circular")`` finds them (``import replayssm``
imports this package).
"""

from ..state.layout import StepProtocolError
from ..state.registry import register_strategy
from .base import KERNEL_CHUNK, SavedStates, Strategy, StrategyBuffers, chunk_list, chunk_list_length
from .circular import CircularBuffers, CircularStrategy
from .fold import FoldStrategy, RecordBuffers
from .snapshot import SnapshotBuffers, SnapshotStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: register_strategy(cls) for cls in (SnapshotStrategy, FoldStrategy, CircularStrategy)
}
#: the strategy names, in the order tables and plots show them (the one list of them)
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)

__all__ = [
    "STRATEGIES",
    "STRATEGY_NAMES",
    "KERNEL_CHUNK",
    "CircularBuffers",
    "CircularStrategy",
    "FoldStrategy",
    "RecordBuffers",
    "SavedStates",
    "SnapshotBuffers",
    "SnapshotStrategy",
    "StepProtocolError",
    "Strategy",
    "StrategyBuffers",
    "chunk_list",
    "chunk_list_length",
]
