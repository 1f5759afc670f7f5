"""Backend selection for the ops.

Each op registers a ``"reference"`` implementation (plain PyTorch) and, next to it in
the same module, a ``"triton"`` implementation. ``backend="auto"`` picks Triton for
CUDA tensors and the reference elsewhere. Asking for Triton explicitly also works on
the CPU when the Triton interpreter was enabled (``TRITON_INTERPRET=1`` before
``replayssm`` is imported: ``triton.jit`` reads it when a kernel is defined). There is
no silent fallback: an explicit backend that is unavailable raises.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import triton_common

BACKENDS = ("auto", "reference", "triton")
_REGISTRY: dict[tuple[str, str], Callable] = {}


def register(op: str, backend: str):
    def wrap(fn):
        _REGISTRY[(op, backend)] = fn
        return fn

    return wrap


def triton_available() -> bool:
    return triton_common.triton is not None


def resolve(backend: str, device: torch.device) -> str:
    """Turn ``"auto"`` into a concrete backend for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" and triton_available() else "reference"


def pick(op: str, backend: str, like: torch.Tensor) -> Callable:
    """The implementation of ``op`` for ``backend`` and tensors like ``like``."""
    if not isinstance(like, torch.Tensor):
        raise TypeError(f"the first tensor argument of {op!r} must be a torch.Tensor, got {type(like).__name__}")
    concrete = resolve(backend, like.device)
    if concrete == "triton":
        if not triton_available():
            raise RuntimeError(f"backend='triton' for {op!r} needs the triton package (pip install triton)")
        if like.device.type != "cuda" and not triton_common.INTERPRETER:
            raise ValueError(
                f"backend='triton' on {like.device} tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before importing replayssm"
            )
    fn = _REGISTRY.get((op, concrete))
    if fn is None:
        raise NotImplementedError(f"op {op!r} has no {concrete!r} implementation")
    return fn
