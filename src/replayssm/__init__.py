"""replayssm: exact, low-traffic speculative decoding for Gated DeltaNet layers.

A frozen checkpoint plus a small ring of per-token records per request; the window's
outputs in closed form; rollback by moving a cursor; an exact fold of the ring into the
checkpoint. See DESIGN.md for the math and the contracts.

The names in :data:`__all__` are the stable surface (README, "Stability"): text
generation (:class:`LLM`, :class:`SamplingParams`, :class:`Output`), the engine under
it (:func:`load_model`, :class:`HybridEngine`, :class:`StepGenerator`) and the state
pool for engines of your own (:class:`StatePool`, :class:`GDNShape`, :class:`Batch`).
Importing the package is cheap: the engine's names load on first use.
"""

from .version import __version__

# The strategies register themselves with the state pool's registry on import; the
# state package never imports them (strategies build on state, not the reverse).
from . import strategies as _strategies  # noqa: E402,F401
from .state import Batch, GDNShape, StatePool  # noqa: E402
from .strategies import STRATEGY_NAMES  # noqa: E402

#: name -> module of the stable names that load on first use (they pull in the engine)
_LAZY = {
    "LLM": "replayssm.llm",
    "Output": "replayssm.llm",
    "OutputStats": "replayssm.llm",
    "SamplingParams": "replayssm.engine.sampling",
    "HybridEngine": "replayssm.engine.adapter",
    "StepGenerator": "replayssm.engine.generator",
    "load_model": "replayssm.engine.loading",
    "load_tokenizer": "replayssm.engine.loading",
}

__all__ = [
    "LLM",
    "Output",
    "OutputStats",
    "SamplingParams",
    "load_model",
    "load_tokenizer",
    "HybridEngine",
    "StepGenerator",
    "StatePool",
    "GDNShape",
    "Batch",
    "STRATEGY_NAMES",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'replayssm' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
