"""The state pool and the packed-batch descriptor.

Nothing here imports :mod:`replayssm.strategies`: strategies build on this package and
register themselves (:mod:`.registry`) for ``StatePool(..., strategy=name)``.
"""

from .batch import Batch
from .layout import STATE_DTYPES, BufferSpec, GDNShape, PoolConfig, PoolExhausted, StepProtocolError
from .pool import StatePool, as_index, buffer_specs
from .registry import register_strategy, registered_strategies, strategy_class

__all__ = [
    "STATE_DTYPES",
    "Batch",
    "BufferSpec",
    "GDNShape",
    "PoolConfig",
    "PoolExhausted",
    "StatePool",
    "StepProtocolError",
    "as_index",
    "buffer_specs",
    "register_strategy",
    "registered_strategies",
    "strategy_class",
]
