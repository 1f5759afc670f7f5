"""Exact fold of raw records into checkpoints, all layers in one call (DESIGN.md section 3).

For each request row ``i`` with slot ``s = slots[i] >= 0`` and every layer ``l``:

    S = checkpoints[l, s]
    for c in 0 .. count[i] - 1:
        r = (start[i] + c) mod R
        S = state_update(S, k^(ring_k[l, s, r]), ring_v[l, s, r], ring_g[l, s, r], ring_beta[l, s, r])
    checkpoints[l, s] = S

This is the closed-loop fold: it replays the raw records through the same
:func:`~replayssm.ops.recurrent.state_update` that the recurrence uses, so a state
folded here equals the state the recurrence reaches on the same tokens, bit for bit.
``fold`` calls it with ``start = 0, count = accepted`` at every commit; ``circular``
calls it with ``start = cache_base, count = write_pos`` for flush rows.
"""

from __future__ import annotations

import torch

from . import _checks, guards
from .dispatch import pick, register
from .gates import expand_heads
from .records import slots_error, unit_keys
from .recurrent import STATE_DTYPES_TRITON, check_inner_contiguous, exact_block_k, exact_tile, state_update


def check_fold_args(checkpoints, ring_k, ring_v, ring_g, ring_beta, slots, start, count):
    """Validate the fold's arguments (metadata only); return ``(layers, num_slots, R)``."""
    _checks.tensor("checkpoints", checkpoints, ndim=5, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    nl, ns, hv, vd, kd = checkpoints.shape
    _checks.tensor("ring_k", ring_k, ndim=5, dtypes=_checks.FLOAT_DTYPES)
    r, h = ring_k.shape[2], ring_k.shape[3]
    _checks.shape("ring_k", ring_k, [nl, ns, r, h, kd])
    _checks.gqa(h, hv)
    _checks.tensor("ring_v", ring_v, ndim=5, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("ring_v", ring_v, [nl, ns, r, hv, vd])
    for name, x in (("ring_g", ring_g), ("ring_beta", ring_beta)):
        _checks.tensor(name, x, ndim=4, dtypes=(torch.float32, torch.float64))
        _checks.shape(name, x, [nl, ns, r, hv])
    for name, x in (("slots", slots), ("start", start), ("count", count)):
        _checks.tensor(name, x, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if not (slots.numel() == start.numel() == count.numel()):
        raise ValueError(
            f"slots, start and count must have one entry per row, got {slots.numel()}, {start.numel()}, {count.numel()}"
        )
    _checks.same_device(
        checkpoints, ring_k=ring_k, ring_v=ring_v, ring_g=ring_g, ring_beta=ring_beta, slots=slots, start=start, count=count
    )
    return nl, ns, r


def replay_records(S, k, v, g, beta):
    """Replay raw records ``[c, ...]`` into the state ``S`` (``[HV, V, K]``), in order.

    ``k`` is ``[c, H, K]`` pre-normalisation, ``v`` ``[c, HV, V]``, ``g``/``beta``
    ``[c, HV]``; everything is computed in the dtype of ``S``.
    """
    dtype = S.dtype
    k_hat = expand_heads(unit_keys(k, dtype), S.shape[0])
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    for c in range(k.shape[0]):
        S = state_update(S, k_hat[c], v[c], g[c], beta[c])
    return S


@register("fold", "reference")
def gdn_fold_reference(
    checkpoints: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_g: torch.Tensor,
    ring_beta: torch.Tensor,
    slots: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """Fold ``count[i]`` raw records of every layer into the checkpoints, in place.

    Args:
        checkpoints: ``[layers, num_slots, HV, V, K]`` float32/bfloat16/float64.
        ring_k: ``[layers, num_slots, R, H, K]`` keys: normalised in float32, raw in a
            16-bit dtype or float64 (:func:`~replayssm.ops.records.keys_normalized`).
        ring_v: ``[layers, num_slots, R, HV, V]`` raw values (activation dtype).
        ring_g, ring_beta: ``[layers, num_slots, R, HV]`` float32 gates.
        slots: ``[B]`` slot per row, ``-1`` rows are skipped.
        start: ``[B]`` physical ring position of the first record to fold.
        count: ``[B]`` number of records to fold, ``0 <= count <= R``.
    """
    nl, ns, r = check_fold_args(checkpoints, ring_k, ring_v, ring_g, ring_beta, slots, start, count)
    sl, st, ct = slots.tolist(), start.tolist(), count.tolist()
    error = slots_error(sl, ns, unique=False)
    if error:
        raise ValueError(error)
    for i, s in enumerate(sl):
        if s >= 0 and not 0 <= ct[i] <= r:
            raise ValueError(f"count[{i}] = {ct[i]} is outside [0, {r}]")
    dtype = _checks.compute_dtype(checkpoints, ring_v)
    for i, s in enumerate(sl):
        if s < 0 or ct[i] == 0:
            continue
        pos = [(st[i] + c) % r for c in range(ct[i])]
        for layer in range(nl):
            S = replay_records(
                checkpoints[layer, s].to(dtype),
                ring_k[layer, s, pos], ring_v[layer, s, pos], ring_g[layer, s, pos], ring_beta[layer, s, pos],
            )
            checkpoints[layer, s] = S.to(checkpoints.dtype)


def gdn_fold(
    checkpoints: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_g: torch.Tensor,
    ring_beta: torch.Tensor,
    slots: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Fold ``count`` raw records per slot, from ``start``, into its checkpoint through
    the exact recurrence, every layer at once. Arguments and shapes: :func:`gdn_fold_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("fold", backend, checkpoints)(checkpoints, ring_k, ring_v, ring_g, ring_beta, slots, start, count)


# ---------------------------------------------------------------------------- Triton
# One launch for all layers: one program per (V block, row, layer x value head). It
# reads its [BV, K] checkpoint slice once, replays the row's records through the same
# exact step as the recurrence kernel (same helpers, same four-part full-K tile, same
# num_warps) and writes the slice back once.

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None

if triton is not None:
    from .triton_common import NORM_EPS, chain_launch, chain_wait, device_fn as _tl_device_fn
    from .triton_common import gdn_state_step as _tl_state_step
    from .triton_common import load_parts as _tl_load_parts, normalized as _tl_normalized
    from .triton_common import as_stored as _tl_as_stored, store_parts as _tl_store_parts

    @_tl_device_fn
    def _ring_pos(pos, L: tl.constexpr):
        """``pos mod L`` for a non-negative position: a mask where ``L`` is a power of two."""
        if (L & (L - 1)) == 0:
            return pos & (L - 1)
        else:
            return pos % L

    @_tl_device_fn
    def _load_record_at(rk_at, rv_at, rg_at, rb_at, pos, offs_c, mask_v, offs_v, srk_pos, srv_pos, srg_pos, srb_pos,
                        K: tl.constexpr, KQ: tl.constexpr):
        """The record at ring position ``pos`` for one value head, from pointers already
        at its (layer, slot, head) (``*_at``; any position strides): the raw key's four
        parts (fp32), ``v`` (fp32), ``g``, ``beta``. The position must lie inside the
        ring; only the block masks apply (keys past ``K``, rows past ``V``)."""
        k0, k1, k2, k3 = _tl_load_parts(rk_at, pos * srk_pos + offs_c, offs_c >= 0, offs_c, K, KQ)
        v = tl.load(rv_at + pos * srv_pos + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        return k0, k1, k2, k3, v, tl.load(rg_at + pos * srg_pos), tl.load(rb_at + pos * srb_pos)

    @triton.jit
    def replay_history(ckpt_at, tile, rk_at, rv_at, rg_at, rb_at, base, count, offs_c, offs_v, mask_v,
                       srk_pos, srv_pos, srg_pos, srb_pos, eps, K: tl.constexpr, L: tl.constexpr, KQ: tl.constexpr,
                       AHEAD: tl.constexpr = 1):
        """Load a ``[BV, K]`` checkpoint tile as four parts and replay ``count`` raw
        records from ring position ``base`` (of ``L``) through the exact step; return the
        tile's parts. The records are read from pointers already at their (layer, slot,
        head) with per-position strides (:func:`_load_record_at`). Every exact replay (the
        fold, circular's flush and small-batch path) is this loop. Hand pipelining:
        record c + ``AHEAD`` (1 or 2) loads during step c (record c + 1's key is
        normalised right after it, :func:`replay_tile`). Which depth is faster depends
        on the kernel around the loop (registers against exposed load latency), so it is
        the caller's, from the shape table. The depth changes no number. Unused ring
        entries may hold NaN: a record read past ``count`` is never stepped."""
        S0, S1, S2, S3 = _tl_load_parts(ckpt_at, tile, mask_v[:, None], offs_c[None, :], K, KQ)
        return replay_tile(S0, S1, S2, S3, rk_at, rv_at, rg_at, rb_at, base, count, offs_c, offs_v, mask_v,
                           srk_pos, srv_pos, srg_pos, srb_pos, eps, K, L, KQ, AHEAD)

    @triton.jit
    def replay_tile(S0, S1, S2, S3, rk_at, rv_at, rg_at, rb_at, base, count, offs_c, offs_v, mask_v,
                    srk_pos, srv_pos, srg_pos, srb_pos, eps, K: tl.constexpr, L: tl.constexpr, KQ: tl.constexpr,
                    AHEAD: tl.constexpr = 1, NORM_AFTER: tl.constexpr = True):
        """:func:`replay_history` on a tile already loaded (its four parts): for a kernel
        that loads the checkpoint before it knows whether the row replays.

        ``NORM_AFTER``: record c + 1's key is normalised right after step c, in the
        step's block, where its reductions interleave with the step's (sqrt_rn and
        div_rn end a block, so a norm at the loop's head runs alone); off, each record's
        key is normalised at the head of its own step. Which is faster depends on the
        kernel around the loop, so it is the caller's (BENCHMARKS.md, "The exact
        replay's loop in fewer instructions"). It changes no number."""
        # Ring positions in 32 bits (a position times its stride stays far below 2^31),
        # wrapped by a mask where L is a power of two; every position lies inside the
        # row's ring, so the loads need no validity masks: a record read past ``count``
        # is never stepped (the loop ends first), whatever it holds. (A signed 64-bit
        # modulo and the masks were about 8% of the loop's instructions.)
        at = base.to(tl.int32)
        strides = (srk_pos, srv_pos, srg_pos, srb_pos)
        k0n, k1n, k2n, k3n, v_n, g_n, b_n = _load_record_at(rk_at, rv_at, rg_at, rb_at, _ring_pos(at, L), offs_c,
                                                            mask_v, offs_v, *strides, K, KQ)
        if AHEAD == 2:
            k0a, k1a, k2a, k3a, v_a, g_a, b_a = _load_record_at(rk_at, rv_at, rg_at, rb_at, _ring_pos(at + 1, L),
                                                                offs_c, mask_v, offs_v, *strides, K, KQ)
        # A ring of fp32 keys holds them normalised, with the bits computed here from a
        # raw key (ops.records.keys_normalized): such a key is stepped with as loaded.
        NORMED: tl.constexpr = rk_at.dtype.element_ty == tl.float32
        if NORM_AFTER and not NORMED:
            k0n, k1n, k2n, k3n = _tl_normalized(k0n, k1n, k2n, k3n, eps, 1.0)
        for c in range(0, count):
            k0, k1, k2, k3, v, g, beta = k0n, k1n, k2n, k3n, v_n, g_n, b_n
            if AHEAD == 2:
                k0n, k1n, k2n, k3n, v_n, g_n, b_n = k0a, k1a, k2a, k3a, v_a, g_a, b_a
                k0a, k1a, k2a, k3a, v_a, g_a, b_a = _load_record_at(
                    rk_at, rv_at, rg_at, rb_at, _ring_pos(at + c + 2, L), offs_c, mask_v, offs_v, *strides, K, KQ)
            else:
                k0n, k1n, k2n, k3n, v_n, g_n, b_n = _load_record_at(
                    rk_at, rv_at, rg_at, rb_at, _ring_pos(at + c + 1, L), offs_c, mask_v, offs_v, *strides, K, KQ)
            if not NORM_AFTER and not NORMED:
                k0, k1, k2, k3 = _tl_normalized(k0, k1, k2, k3, eps, 1.0)
            S0, S1, S2, S3 = _tl_state_step(S0, S1, S2, S3, k0, k1, k2, k3, v, g, beta)
            if NORM_AFTER and not NORMED:
                k0n, k1n, k2n, k3n = _tl_normalized(k0n, k1n, k2n, k3n, eps, 1.0)
        return S0, S1, S2, S3

    @triton.jit
    def replay_and_store_tile(S0, S1, S2, S3, ckpt_at, tile, rk_at, rv_at, rg_at, rb_at, base, count, offs_c, offs_v,
                              mask_v, srk_pos, srv_pos, srg_pos, srb_pos, eps, K: tl.constexpr, L: tl.constexpr,
                              KQ: tl.constexpr, AHEAD: tl.constexpr, ROUND_STATE: tl.constexpr,
                              NORM_AFTER: tl.constexpr = True):
        """A flush inside another kernel: :func:`replay_tile` on a loaded checkpoint tile,
        the folded tile stored at ``ckpt_at + tile`` (this kernel's store, so the
        checkpoint is the fold's bit for bit), and the tile returned as stored (rounded
        to the checkpoint's dtype with ``ROUND_STATE``), which is where the caller's
        window or token starts from."""
        S0, S1, S2, S3 = replay_tile(S0, S1, S2, S3, rk_at, rv_at, rg_at, rb_at, base, count, offs_c, offs_v, mask_v,
                                     srk_pos, srv_pos, srg_pos, srb_pos, eps, K, L, KQ, AHEAD, NORM_AFTER)
        _tl_store_parts(ckpt_at, tile, mask_v[:, None], offs_c[None, :], K, KQ, S0, S1, S2, S3)
        if ROUND_STATE:
            S0, S1, S2, S3 = _tl_as_stored(S0, S1, S2, S3, ckpt_at.dtype.element_ty)
        return S0, S1, S2, S3

    @triton.jit
    def _fold_kernel(
        ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, slots_ptr, start_ptr, count_ptr, flush_ptr,
        sc_layer, sc_slot, srk_layer, srk_slot, srk_pos, srk_head, srv_layer, srv_slot, srv_pos, srv_head,
        srg_layer, srg_slot, srg_pos, srg_head, srb_layer, srb_slot, srb_pos, srb_head,
        eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, R: tl.constexpr, PER_SLOT: tl.constexpr, AHEAD: tl.constexpr,
        CHAINED: tl.constexpr = False,
    ):
        chain_wait(CHAINED)  # its every input may be the kernel before's
        i_v = tl.program_id(0)
        i_b = tl.program_id(1)
        i_lhv = tl.program_id(2)
        i_l = (i_lhv // HV).to(tl.int64)  # int64: layer strides of real pools pass 2**31
        i_hv = i_lhv % HV
        i_h = i_hv // (HV // H)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        if slot < 0:
            return
        if PER_SLOT:
            # circular's flush: the cursors themselves, indexed by slot; rows without
            # is_flush fold nothing.
            start = tl.load(start_ptr + slot).to(tl.int64)
            count = tl.where(tl.load(flush_ptr + slot) != 0, tl.load(count_ptr + slot), 0).to(tl.int64)
        else:
            start = tl.load(start_ptr + i_b).to(tl.int64)
            count = tl.load(count_ptr + i_b).to(tl.int64)
        count = tl.minimum(count, R)
        if count <= 0:
            return  # nothing to fold: the slice is neither read nor written
        start = ((start % R) + R) % R  # a negative start must not address before the ring
        # This program's records: (layer, slot, head) offsets once, positions per record.
        rk_at = rk_ptr + i_l * srk_layer + slot * srk_slot + i_h * srk_head
        rv_at = rv_ptr + i_l * srv_layer + slot * srv_slot + i_hv * srv_head
        rg_at = rg_ptr + i_l * srg_layer + slot * srg_slot + i_hv * srg_head
        rb_at = rb_ptr + i_l * srb_layer + slot * srb_slot + i_hv * srb_head

        KQ: tl.constexpr = BK // 4
        offs_c = tl.arange(0, KQ)  # key index within a part
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < V
        tile = offs_v[:, None] * K + offs_c[None, :]
        ckpt_at = ckpt_ptr + i_l * sc_layer + slot * sc_slot + i_hv * (V * K)  # [HV, V, K] packed
        S0, S1, S2, S3 = replay_history(ckpt_at, tile, rk_at, rv_at, rg_at, rb_at, start, count, offs_c, offs_v, mask_v,
                                        srk_pos, srv_pos, srg_pos, srb_pos, eps, K, R, KQ, AHEAD)
        _tl_store_parts(ckpt_at, tile, mask_v[:, None], offs_c[None, :], K, KQ, S0, S1, S2, S3)

    def launch_fold(checkpoints, ring_k, ring_v, ring_g, ring_beta, slots, start, count, flush=None, *,
                    block_v: int | None = None, records_ahead: int | None = None) -> None:
        """Launch the fold kernel on validated 5-D buffers (one launch): checkpoints packed
        per (layer, slot), rings with any strides but a contiguous last axis.

        Without ``flush``: row ``i`` folds ``count[i]`` records from ``start[i]``. With
        ``flush`` (``[num_slots]``): ``start``, ``count`` and ``flush`` are per-slot
        cursors (``cache_base``, ``write_pos``, ``is_flush``) and only rows whose slot
        has ``flush`` set fold; the other rows exit at once. ``block_v`` caps the tile
        height and ``records_ahead`` the replay's record prefetch depth (defaults: the
        shape table's ``exact_write`` row); neither changes any number.
        """
        nl, ns, hv, vd, kd = checkpoints.shape
        h, r = ring_k.shape[3], ring_k.shape[2]
        batch = slots.shape[0]
        if batch == 0 or nl == 0 or r == 0:
            return
        row, bv, warps = exact_tile(kd, vd, batch, hv, checkpoints.dtype, checkpoints.device, layers=nl,
                                    most=block_v)
        grid = (triton.cdiv(vd, bv), batch, nl * hv)
        chained, launch = chain_launch()
        _fold_kernel[grid](
            checkpoints, ring_k, ring_v, ring_g, ring_beta, slots, start, count, count if flush is None else flush,
            checkpoints.stride(0), checkpoints.stride(1), *ring_k.stride()[:4], *ring_v.stride()[:4],
            *ring_g.stride(), *ring_beta.stride(), NORM_EPS,
            H=h, HV=hv, K=kd, V=vd, BK=exact_block_k(kd), BV=bv, R=r, PER_SLOT=flush is not None,
            AHEAD=records_ahead or row["records_ahead"], CHAINED=chained, num_warps=warps, **launch,
        )


@register("fold", "triton")
def gdn_fold_triton(
    checkpoints: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_g: torch.Tensor,
    ring_beta: torch.Tensor,
    slots: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """Triton version of :func:`gdn_fold_reference` (same arguments), one launch.

    Differences: float32/bfloat16 checkpoints only, float32 gates. Layouts: checkpoints
    packed per (layer, slot) (``[HV, V, K]``; any layer and slot strides), the rings any
    strides with ``ring_k`` / ``ring_v`` contiguous along their last axis, index tensors
    contiguous. ``slots`` is checked by :mod:`~replayssm.ops.guards` (once per step on
    the host; on the device inside a CUDA graph); live slots must be unique. ``start``
    and ``count`` are not read on the host: a count above ``R`` folds ``R`` records, a
    negative one none, and a start is taken modulo ``R``.
    """
    nl, ns, r = check_fold_args(checkpoints, ring_k, ring_v, ring_g, ring_beta, slots, start, count)
    _checks.tensor("checkpoints", checkpoints, dtypes=STATE_DTYPES_TRITON)
    _checks.tensor("ring_k", ring_k, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    _checks.tensor("ring_v", ring_v, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    for name, x in (("ring_g", ring_g), ("ring_beta", ring_beta)):
        _checks.tensor(name, x, dtypes=(torch.float32,))
    _checks.packed("checkpoints", checkpoints, 3)
    check_inner_contiguous(ring_k=ring_k, ring_v=ring_v)
    _checks.contiguous(slots=slots, start=start, count=count)
    slots = guards.check_slots(slots, num_slots=ns)
    launch_fold(checkpoints, ring_k, ring_v, ring_g, ring_beta, slots, start, count)
