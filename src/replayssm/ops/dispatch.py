"""Backend selection for the ops.

Each op registers a ``"reference"`` implementation (plain PyTorch) and, where it has one,
a ``"triton"`` implementation. ``backend="auto"`` picks Triton for CUDA tensors and the
reference elsewhere; asking for Triton explicitly also works on the CPU when the Triton
interpreter is enabled (``TRITON_INTERPRET=1`` before the kernels are imported). There is
no silent fallback: an explicit backend that is unavailable raises.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

BACKENDS = ("auto", "reference", "triton")
_REGISTRY: dict[tuple[str, str], Callable] = {}
# Modules whose import registers the Triton implementations.
_TRITON_MODULES = ("replayssm.ops.triton_kernels",)


def register(op: str, backend: str):
    def wrap(fn):
        _REGISTRY[(op, backend)] = fn
        return fn

    return wrap


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _load_triton():
    for name in _TRITON_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


def resolve(backend: str, device: torch.device) -> str:
    """Turn ``"auto"`` into a concrete backend for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" and triton_available() else "reference"


def pick(op: str, backend: str, like: torch.Tensor) -> Callable:
    """The implementation of ``op`` for ``backend`` and tensors like ``like``."""
    concrete = resolve(backend, like.device)
    if concrete == "triton":
        if like.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' on {like.device} tensors needs TRITON_INTERPRET=1 set before import"
            )
        _load_triton()
    fn = _REGISTRY.get((op, concrete))
    if fn is None:
        raise NotImplementedError(f"op {op!r} has no {concrete!r} implementation")
    return fn
