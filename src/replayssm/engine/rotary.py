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

from ..ops.triton_common import INTERPRETER, chain_launch, triton

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import chain_wait, mask_and, to_rtne


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
    ``L``), in one gather (an indexing, parallel over every element, where
    ``index_select`` loops over a few positions in a few blocks)."""
    return table[positions.reshape(-1)].view(*positions.shape, *table.shape[1:])


def rotate_(qk: torch.Tensor, rope: torch.Tensor, *, backend: str = "torch") -> None:
    """Rotate the first ``R`` channels of every head of ``qk [B, T, heads, D]`` in place
    with ``rope [B, T or 1, 2, R]`` (:func:`rope_rows`, one row per token or one per
    request); channels ``R..D`` are left as they are (partial rotary).

    ``backend``: ``"torch"`` (four elementwise ops) or ``"triton"`` (one launch, CUDA or
    the Triton interpreter; ``qk`` with contiguous heads, ``rope`` in its dtype): the
    same bits."""
    _check_rope(qk, rope)
    if backend == "triton":
        _rotate_triton(qk, rope)
        return
    if backend != "torch":
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    r = rope.shape[-1]
    half = r // 2
    rot = qk[..., :r]
    a = rot * rope[:, :, None, 0]
    b = rot * rope[:, :, None, 1]
    torch.add(a[..., :half], b[..., half:], out=rot[..., :half])
    torch.add(a[..., half:], b[..., :half], out=rot[..., half:])


ROTARY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_rope(qk: torch.Tensor, rope: torch.Tensor) -> None:
    """``qk [B, T, heads, D]`` and ``rope [B, T or 1, 2, R]`` with ``R`` even and at most ``D``."""
    r = rope.shape[-1]
    if qk.dim() != 4 or rope.dim() != 4 or rope.shape[2] != 2 or r > qk.shape[-1] or r % 2:
        raise ValueError(f"qk must be [B, T, heads, D] and rope [B, T or 1, 2, R] with R even and <= D, got "
                         f"{list(qk.shape)} and {list(rope.shape)}")
    if rope.shape[0] != qk.shape[0] or rope.shape[1] not in (1, qk.shape[1]):
        raise ValueError(f"rope must have a row per token or per request of qk {list(qk.shape)}, got "
                         f"{list(rope.shape)}")


def _rotate_triton(qk: torch.Tensor, rope: torch.Tensor, cache: tuple | None = None) -> None:
    """The Triton rotary on checked shapes; ``cache``: ``(v, k_cache, v_cache, slots,
    at)`` of :func:`rotate_into_cache_`, written in the same launch."""
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
    if cache is None:
        extra, write = (qk, qk, qk, qk, qk, 0, 0, 0, 0, 0, 0, 0, 0), {}
    else:
        v, kc, vc, slots, at = cache
        kv_heads = kc.shape[1]
        extra = (v, kc, vc, slots, at, v.stride(0), v.stride(1), v.stride(2), slots.stride(0), at.stride(0), at.stride(1),
                 kc.shape[0], kc.shape[2])
        write = dict(CACHE=True, KVH=kv_heads, BKV=triton.next_power_of_2(kv_heads), BD=triton.next_power_of_2(d))
    chained, launch = chain_launch()
    _rotate_kernel[(b * t,)](
        qk, rope, t, heads, qk.stride(0), qk.stride(1), rope.stride(0), rope.stride(1) if per_token else 0,
        rope.stride(2), *extra, HALF=half, BH=triton.next_power_of_2(heads), BR=triton.next_power_of_2(half),
        D=d, CHAINED=chained, num_warps=1 if heads * half <= 512 else 4, **write, **launch,
        enable_fp_fusion=False,  # torch's separate multiply and add: no FMA (fp32 rounds both)
    )


def rotate_into_cache_(qk: torch.Tensor, rope: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, at: torch.Tensor) -> None:
    """:func:`rotate_` (the Triton form) and the window's keys and values written into
    one layer's cache, in one launch: for every token ``(b, t)``,
    ``k_cache[slots[b], :, at[b, t]] = qk[b, t, heads:]`` (rotated) and
    ``v_cache[slots[b], :, at[b, t]] = v[b, t]``, the bits of :func:`rotate_` followed
    by the two indexed writes that an attention step runs.

    Args:
        qk: ``[B, T, heads + kv_heads, D]`` normed queries then keys, heads contiguous.
        rope: ``[B, T or 1, 2, R]`` rotary rows, ``qk``'s dtype.
        v: ``[B, T, kv_heads, D]`` values, contiguous along ``D`` (a strided view of the
            projections is fine).
        k_cache, v_cache: ``[slots, kv_heads, L, D]`` one layer's cache, ``qk``'s dtype,
            contiguous.
        slots: ``[B]`` int cache slot of each row; at: ``[B, T]`` int cache position
            of each token (int32 or int64, any strides). Checked on the device against the cache's bounds: a token
            whose slot or position falls outside is not written (the values come from
            the step's own buffers, which a CUDA graph reads at replay, so no host check
            can see them).
    """
    _check_rope(qk, rope)
    if v.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"v and k_cache must be 4-d, got {list(v.shape)} and {list(k_cache.shape)}")
    if any(x.device != qk.device for x in (v, k_cache, v_cache, slots, at)):
        raise ValueError(f"v, the caches, slots and at must be on qk's device {qk.device}")
    b, t, _, d = qk.shape
    kv_heads = k_cache.shape[1]
    if v.shape != (b, t, kv_heads, d) or v.stride(3) != 1:
        raise ValueError(f"v must be [B, T, kv_heads, D] = {[b, t, kv_heads, d]} contiguous along D, got "
                         f"{list(v.shape)} strides {list(v.stride())}")
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != d or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"k_cache and v_cache must be alike contiguous [slots, kv_heads, L, D={d}], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    if qk.shape[2] <= kv_heads:
        raise ValueError(f"qk must hold the queries before the {kv_heads} key heads, got {qk.shape[2]} heads")
    if not (v.dtype == k_cache.dtype == v_cache.dtype == qk.dtype):
        raise TypeError(f"v and the caches must be {qk.dtype} like qk, got {v.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    ints = (torch.int32, torch.int64)
    if slots.shape != (b,) or at.shape != (b, t) or slots.dtype not in ints or at.dtype not in ints:
        raise ValueError(f"slots must be an int [B={b}] tensor and at an int [B, T] = {[b, t]} one, got "
                         f"{slots.dtype} {list(slots.shape)} and {at.dtype} {list(at.shape)}")
    _rotate_triton(qk, rope, cache=(v, k_cache, v_cache, slots, at))


if triton is not None:

    @triton.jit
    def _rotate_kernel(qk_ptr, rope_ptr, T, HEADS, s_b, s_t, r_b, r_t, r_2,
                       v_ptr, kc_ptr, vc_ptr, slots_ptr, at_ptr, v_b, v_t, v_h, slots_s, at_b, at_t, n_slots, cap,
                       HALF: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, D: tl.constexpr,
                       CACHE: tl.constexpr = False, KVH: tl.constexpr = 1, BKV: tl.constexpr = 1,
                       BD: tl.constexpr = 1, CHAINED: tl.constexpr = False):
        """Token ``program_id`` (row-major over ``B, T``): its heads' first ``2 HALF``
        channels, ``(x_1 c_1 + x_2 s'_2, x_2 c_2 + x_1 s'_1)`` with ``(c, s')`` its rope
        row (:func:`rope_rows`), each product and each sum rounded to the dtype as torch
        rounds them, stored over the inputs. ``CHAINED``: launched by
        :func:`~replayssm.ops.triton_common.chain_launch`."""
        chain_wait(CHAINED)
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
        if CACHE:
            # The token's key heads (the last KVH) and values into the cache at its slot
            # and position: the rotated channels from registers, the others (which no
            # lane of this kernel writes) and the values copied from their buffers.
            slot = tl.load(slots_ptr + i_b.to(tl.int64) * slots_s).to(tl.int64)
            pos = tl.load(at_ptr + i_b.to(tl.int64) * at_b + i_t.to(tl.int64) * at_t).to(tl.int64)
            ok = (slot >= 0) & (slot < n_slots) & (pos >= 0) & (pos < cap)
            key = mask_and(mask & (h >= HEADS - KVH), ok)
            k_at = kc_ptr + ((slot * KVH + h - (HEADS - KVH)) * cap + pos) * D + c
            tl.store(k_at, y1, mask=key)
            tl.store(k_at + HALF, y2, mask=key)
            kh = tl.arange(0, BKV)[:, None]
            dc = tl.arange(0, BD)[None, :]
            row = (kh < KVH) & (dc < D)
            dst = ((slot * KVH + kh) * cap + pos) * D + dc
            rest = mask_and(row & (dc >= 2 * HALF), ok)
            kv = qk_ptr + i_b.to(tl.int64) * s_b + i_t.to(tl.int64) * s_t + (HEADS - KVH + kh) * D + dc
            tl.store(kc_ptr + dst, tl.load(kv, mask=rest, other=0.0), mask=rest)
            vv = v_ptr + i_b.to(tl.int64) * v_b + i_t.to(tl.int64) * v_t + kh * v_h + dc
            row_ok = mask_and(row, ok)
            tl.store(vc_ptr + dst, tl.load(vv, mask=row_ok, other=0.0), mask=row_ok)
