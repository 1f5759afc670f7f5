"""Rotary embedding applied in place, in fewer kernels than transformers' form.

Transformers rotates the first ``R`` channels of each head as ``x cos + rotate_half(x)
sin`` (``rotate_half(x) = (-x_2, x_1)`` by halves), then concatenates the untouched
channels back: about six kernels for queries and six for keys, plus copies. Here a
step first takes ``rope [N, 2, R]``, the rows ``cos`` and ``(sin_2, -sin_1)``
(:func:`rope_rows`; a static step gathers them from the engine's table,
:meth:`~replayssm.engine.adapter.HybridEngine.rope_table`), once for every layer;
:func:`rotate_` then writes
``rotate_half(x) sin = (-x_2 sin_1, x_1 sin_2)`` as ``x * (sin_2, -sin_1)`` with the
halves swapped, in place: four kernels for the queries and keys of a layer together,
or one where the engine's kernels are fused (``backend="triton"``: each token's heads in
a program, the products and sums rounded to the dtype as torch rounds them). A negation
is exact, so every product and sum rounds as transformers' do: the same bits.
"""

from __future__ import annotations

import torch

from ..ops.triton_common import INTERPRETER, triton

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import to_rtne


def rope_rows(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[N, 2, R]``: ``cos`` and the sine that :func:`rotate_` multiplies, ``(sin_2,
    -sin_1)``, from the rotary embedding's ``cos, sin [N, R]`` (``R`` even)."""
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[-1] % 2:
        raise ValueError(f"cos and sin must be alike [N, R] with R even, got {list(cos.shape)} and {list(sin.shape)}")
    half = cos.shape[-1] // 2
    return torch.stack([cos, torch.cat([sin[:, half:], -sin[:, :half]], -1)], 1)


def rope_at(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[*positions.shape, 2, R]``: the rows of a rotary table ``[L, 2, R]``
    (:meth:`~replayssm.engine.adapter.HybridEngine.rope_table`) at ``positions`` (below
    ``L``), in one gather."""
    return table.index_select(0, positions.reshape(-1)).view(*positions.shape, *table.shape[1:])


def rotate_(qk: torch.Tensor, rope: torch.Tensor, *, backend: str = "torch") -> None:
    """Rotate the first ``R`` channels of every head of ``qk [B, T, heads, D]`` in place
    with ``rope [B, T or 1, 2, R]`` (:func:`rope_rows`, one row per token or one per
    request); channels ``R..D`` are left as they are (partial rotary).

    ``backend``: ``"torch"`` (four elementwise ops) or ``"triton"`` (one launch, CUDA or
    the Triton interpreter; ``qk`` with contiguous heads, ``rope`` in its dtype): the
    same bits."""
    r = rope.shape[-1]
    if qk.dim() != 4 or rope.dim() != 4 or rope.shape[2] != 2 or r > qk.shape[-1] or r % 2:
        raise ValueError(f"qk must be [B, T, heads, D] and rope [B, T or 1, 2, R] with R even and <= D, got "
                         f"{list(qk.shape)} and {list(rope.shape)}")
    if rope.shape[0] != qk.shape[0] or rope.shape[1] not in (1, qk.shape[1]):
        raise ValueError(f"rope must have a row per token or per request of qk {list(qk.shape)}, got "
                         f"{list(rope.shape)}")
    if backend == "triton":
        _rotate_triton(qk, rope)
        return
    if backend != "torch":
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    half = r // 2
    rot = qk[..., :r]
    a = rot * rope[:, :, None, 0]
    b = rot * rope[:, :, None, 1]
    torch.add(a[..., :half], b[..., half:], out=rot[..., :half])
    torch.add(a[..., half:], b[..., :half], out=rot[..., half:])


ROTARY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rotate_triton(qk: torch.Tensor, rope: torch.Tensor) -> None:
    if triton is None or (qk.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton rotary needs CUDA tensors or the Triton interpreter")
    if qk.dtype not in ROTARY_DTYPES or rope.dtype != qk.dtype:
        raise TypeError(f"qk and rope must share one of {ROTARY_DTYPES} for the Triton rotary, got {qk.dtype} and "
                        f"{rope.dtype}")
    if qk.device != rope.device:
        raise ValueError(f"qk and rope must be on one device, got {qk.device} and {rope.device}")
    if qk.stride(3) != 1 or qk.stride(2) != qk.shape[3] or rope.stride(3) != 1:
        raise ValueError("the Triton rotary wants qk's heads contiguous ([..., heads, D] row-major) and rope's rows "
                         "contiguous")
    b, t, heads, d = qk.shape
    if qk.numel() == 0:
        return
    half = rope.shape[-1] // 2
    per_token = rope.shape[1] != 1 or t == 1
    _rotate_kernel[(b * t,)](
        qk, rope, t, heads, qk.stride(0), qk.stride(1), rope.stride(0), rope.stride(1) if per_token else 0,
        rope.stride(2), HALF=half, BH=triton.next_power_of_2(heads), BR=triton.next_power_of_2(half),
        D=d, num_warps=1 if heads * half <= 512 else 4,
        enable_fp_fusion=False,  # torch's separate multiply and add: no FMA (fp32 rounds both)
    )


if triton is not None:

    @triton.jit
    def _rotate_kernel(qk_ptr, rope_ptr, T, HEADS, s_b, s_t, r_b, r_t, r_2, HALF: tl.constexpr, BH: tl.constexpr,
                       BR: tl.constexpr, D: tl.constexpr):
        """Token ``program_id`` (row-major over ``B, T``): its heads' first ``2 HALF``
        channels, ``(x_1 c_1 + x_2 s'_2, x_2 c_2 + x_1 s'_1)`` with ``(c, s')`` its rope
        row (:func:`rope_rows`), each product and each sum rounded to the dtype as torch
        rounds them, stored over the inputs."""
        i = tl.program_id(0)
        i_b, i_t = i // T, i % T
        h = tl.arange(0, BH)[:, None]
        c = tl.arange(0, BR)[None, :]
        mask = (h < HEADS) & (c < HALF)
        x_at = qk_ptr + i_b.to(tl.int64) * s_b + i_t.to(tl.int64) * s_t + h * D + c
        r_at = rope_ptr + i_b.to(tl.int64) * r_b + i_t.to(tl.int64) * r_t + c
        rmask = c < HALF
        x1 = tl.load(x_at, mask=mask, other=0.0)
        x2 = tl.load(x_at + HALF, mask=mask, other=0.0)
        c1 = tl.load(r_at, mask=rmask, other=0.0).to(tl.float32)
        c2 = tl.load(r_at + HALF, mask=rmask, other=0.0).to(tl.float32)
        s1 = tl.load(r_at + r_2, mask=rmask, other=0.0).to(tl.float32)
        s2 = tl.load(r_at + r_2 + HALF, mask=rmask, other=0.0).to(tl.float32)
        ty = qk_ptr.dtype.element_ty
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        # torch's form: a = x * c and b = x * s' rounded, then a's half plus b's other half
        y1 = to_rtne(to_rtne(f1 * c1, ty).to(tl.float32) + to_rtne(f2 * s2, ty).to(tl.float32), ty)
        y2 = to_rtne(to_rtne(f2 * c2, ty).to(tl.float32) + to_rtne(f1 * s1, ty).to(tl.float32), ty)
        tl.store(x_at, y1, mask=mask)
        tl.store(x_at + HALF, y2, mask=mask)
