"""Strategy classes by name, for ``StatePool(..., strategy="circular")``.

The pool looks a strategy up here and never imports :mod:`replayssm.strategies`; the
strategies register themselves with :func:`register_strategy` when their package is
imported (``import replayssm`` does that). A strategy class provides ``name``,
``check_config(window=, ring_len=, backend=)`` (``backend``: the concrete one),
``buffer_specs(config) -> dict[str, BufferSpec]`` (a ``PoolConfig`` or the pool),
``checkpoint_packed`` / ``packed_reason`` (the layout its kernels need of the
checkpoints) and a constructor taking the pool.
"""

from __future__ import annotations

_STRATEGIES: dict[str, type] = {}


def register_strategy(cls: type) -> type:
    """Make ``cls`` available to the pool under ``cls.name`` (usable as a decorator)."""
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a strategy class needs a non-empty str name, {cls.__name__} has {name!r}")
    if _STRATEGIES.get(name, cls) is not cls:
        raise ValueError(f"strategy name {name!r} is already registered by {_STRATEGIES[name].__name__}")
    _STRATEGIES[name] = cls
    return cls


def registered_strategies() -> dict[str, type]:
    """A copy of the registry: name -> strategy class, in registration order."""
    return dict(_STRATEGIES)


def strategy_class(strategy) -> type:
    """The strategy class for a registered name, or ``strategy`` itself if it is a class."""
    if isinstance(strategy, type):
        return strategy
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(_STRATEGIES)}, got {strategy!r}")
    return _STRATEGIES[strategy]
