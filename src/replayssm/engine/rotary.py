"""Rotary embedding applied in place, in fewer kernels than transformers' form.

Transformers rotates the first ``R`` channels of each head as ``x cos + rotate_half(x)
sin`` (``rotate_half(x) = (-x_2, x_1)`` by halves), then concatenates the untouched
channels back: about six kernels for queries and six for keys, plus copies. Here a
step first builds ``rope [N, 2, R]``, the rows ``cos`` and ``(sin_2, -sin_1)``
(:func:`rope_rows`), once for every layer; :func:`rotate_` then writes
``rotate_half(x) sin = (-x_2 sin_1, x_1 sin_2)`` as ``x * (sin_2, -sin_1)`` with the
halves swapped, in place: four kernels for the queries and keys of a layer together.
A negation is exact, so every product and sum rounds as transformers' do: the same
bits.
"""

from __future__ import annotations

import torch


def rope_rows(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[N, 2, R]``: ``cos`` and the sine that :func:`rotate_` multiplies, ``(sin_2,
    -sin_1)``, from the rotary embedding's ``cos, sin [N, R]`` (``R`` even)."""
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[-1] % 2:
        raise ValueError(f"cos and sin must be alike [N, R] with R even, got {list(cos.shape)} and {list(sin.shape)}")
    half = cos.shape[-1] // 2
    return torch.stack([cos, torch.cat([sin[:, half:], -sin[:, :half]], -1)], 1)


def rotate_(qk: torch.Tensor, rope: torch.Tensor) -> None:
    """Rotate the first ``R`` channels of every head of ``qk [B, T, heads, D]`` in place
    with ``rope [B, T or 1, 2, R]`` (:func:`rope_rows`, one row per token or one per
    request); channels ``R..D`` are left as they are (partial rotary)."""
    r = rope.shape[-1]
    if qk.dim() != 4 or rope.dim() != 4 or rope.shape[2] != 2 or r > qk.shape[-1] or r % 2:
        raise ValueError(f"qk must be [B, T, heads, D] and rope [B, T or 1, 2, R] with R even and <= D, got "
                         f"{list(qk.shape)} and {list(rope.shape)}")
    half = r // 2
    rot = qk[..., :r]
    a = rot * rope[:, :, None, 0]
    b = rot * rope[:, :, None, 1]
    torch.add(a[..., :half], b[..., half:], out=rot[..., :half])
    torch.add(a[..., half:], b[..., :half], out=rot[..., half:])
