"""Argument validation shared by the ops.

Every public op validates shapes, dtypes and devices before it touches any state, and
names the offending argument in the error. Checks here read only tensor metadata; none
of them synchronises with the device.
"""

from __future__ import annotations

from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
#: integer dtypes accepted where values are read on the host (slots handed to a pool)
INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def tensor(name: str, x, *, ndim: int | None = None, dtypes: Sequence[torch.dtype] | None = None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")
    return x


def shape(name: str, x: torch.Tensor, expected: Sequence[int | None]):
    """Check ``x.shape`` against ``expected``; ``None`` entries match anything."""
    if x.dim() != len(expected) or any(e is not None and s != e for s, e in zip(x.shape, expected)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(x.shape)}")


def same_device(reference: torch.Tensor, **named: torch.Tensor | None):
    for name, x in named.items():
        if x is not None and x.device != reference.device:
            raise ValueError(f"{name} is on {x.device}, expected {reference.device}")


def contiguous(**named: torch.Tensor | None):
    for name, x in named.items():
        if x is not None and not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def packed(name: str, x: torch.Tensor, dims: int, why: str = ""):
    """Check that the last ``dims`` axes of ``x`` are laid out packed (row-major with no
    gaps, the last axis of stride 1); the axes before them may have any strides (a slot
    or layer stride of an engine's layout). ``why`` ends the error message."""
    if x is None or dims <= 0:
        return
    expected = 1
    for axis in range(x.dim() - 1, x.dim() - 1 - min(dims, x.dim()), -1):
        if x.shape[axis] > 1 and x.stride(axis) != expected:
            inner = list(x.shape[x.dim() - dims:])
            raise ValueError(
                f"{name} must be packed over its last {dims} axes {inner} (strides {tuple(x.stride())})"
                + (f": {why}" if why else "")
            )
        expected *= x.shape[axis]


def power_of_two(name: str, value: int):
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")


def gqa(num_heads: int, num_value_heads: int):
    if num_heads < 1 or num_value_heads % num_heads:
        raise ValueError(
            f"value heads ({num_value_heads}) must be a positive multiple of key heads ({num_heads})"
        )


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64 (the oracle), else float32."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
