"""The state pool and the packed-batch descriptor."""

from .batch import Batch
from .pool import BufferSpec, GDNShape, PoolExhausted, StatePool

__all__ = ["Batch", "BufferSpec", "GDNShape", "PoolExhausted", "StatePool"]
