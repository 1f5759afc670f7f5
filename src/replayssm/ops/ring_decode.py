"""Plain decoding through the ring: the window-1 closed form (DESIGN.md section 9).

One token per request, from the frozen checkpoint ``S0`` and ``h`` committed records
``(u_c, k^_c, g_c)`` of the ring (section 2 with ``m = 1``, where the window's system is
one equation and needs no solve):

    S x   = exp(Gtot) S0 x + sum_c exp(Gtot - G_c) u_c (k^_c . x)     (x = k^, q^)
    u     = beta (v - exp(g) S k^)
    o     = exp(g) S q^ + u (k^ . q^)

``S`` is the committed state, never built: the checkpoint is read once, for two
products with it, and written only by a flush row. A row with ``is_flush`` set folds its
``write_pos`` committed raw records into its checkpoint first, through the exact
recurrence (the fold kernel's replay, so the stored checkpoint is the fold's bit for
bit), and then takes the token from the folded state with an empty history. The
token's record (raw ``k``, ``v``, ``g``, ``beta`` and ``u``) is written at logical
position ``write_pos``, physical ``(cache_base + write_pos) & (L - 1)``; cursors are not
changed (commit moves them, as after any verify).

This is :func:`~replayssm.ops.chunked.gdn_chunked_window` on one-token windows, with
no window system (so no coefficient kernel) and no masked window rows: one launch per
layer, or two side by side where the flush rows run apart (the shape table's
``split_flush``, see the Triton notes below). The results are that op's to rounding:
the reference below is it.
"""

from __future__ import annotations

import contextlib

import torch

from . import tuning
from .chunked import check_triton_window_call, gdn_chunked_window_reference, product_precision
from .dispatch import pick, register
from .records import RawRecords


@register("ring_decode", "reference")
def gdn_ring_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    checkpoint: torch.Tensor,
    ring: RawRecords,
    ring_u: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    write_pos: torch.Tensor,
    cache_base: torch.Tensor,
    is_flush: torch.Tensor,
) -> torch.Tensor:
    """One token per request through the ring, writing its record.

    Args:
        q, k: ``[N, H, K]``; v: ``[N, HV, V]``; a, b: ``[N, HV]``; A_log, dt_bias: ``[HV]``.
        checkpoint: ``[num_slots, HV, V, K]`` frozen states; flush rows fold their
            history into it first.
        ring: raw-record ring ``[num_slots, L, ...]``; ring_u: ``[num_slots, L, HV, V]``
            the records' corrected deltas.
        slots: ``[B]`` slot per request, ``-1`` for padding; cu_seqlens: ``[B + 1]``
            token offsets, every window one token (``N = B``).
        write_pos, cache_base, is_flush: ``[num_slots]`` int32 cursors (read only).

    Returns:
        ``o``: ``[N, HV, V]`` in the dtype of ``v``; padding rows are zero.

    This reference is :func:`~replayssm.ops.chunked.gdn_chunked_window_reference` with
    ``max_len = 1`` (float64-capable, any device).
    """
    return gdn_chunked_window_reference(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens,
                                        write_pos, cache_base, is_flush, max_len=1)


def gdn_ring_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    checkpoint: torch.Tensor,
    ring: RawRecords,
    ring_u: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    write_pos: torch.Tensor,
    cache_base: torch.Tensor,
    is_flush: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``circular``'s plain decoding step of one GDN layer: ``o [N, HV, V]`` for one token
    per request from its checkpoint and committed ring history (flush rows fold theirs
    first), its record written after the history. Arguments, shapes and results:
    :func:`gdn_ring_decode_reference`; the Triton version's limits:
    :func:`gdn_ring_decode_triton`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("ring_decode", backend, q)(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens,
                                           write_pos, cache_base, is_flush)


# ---------------------------------------------------------------------------- Triton
# One program per (V block, request, value head), the whole V axis by default. A
# non-flush row loads its [BV, K] checkpoint tile once (the step's only state traffic)
# for S0 k^ and S0 q^, and adds the history's share from its records' keys, gates and
# u (a few hundred bytes a record next to the tile's BV x K). A flush row replays its
# records on the exact four-part tile instead and stores it: the exact kernels' tile
# and warps. Both kinds of row then share one code path for the token: the tile's
# products (the checkpoint's, or the folded tile's with an empty history), so the
# kernel holds one copy of them.
#
# Two ways to launch it (the shape table's ``split_flush``):
# * one launch for every row (0). The kernel then holds the flush's registers (the
#   exact replay's tile and records: ~250 a thread at 128 rows), so two programs share
#   an SM, and a flush row's chain of record steps keeps its SM slot while the rest of
#   the rows wait for one.
# * the rows apart (1, 2): a flush kernel of a few programs per SM that walk the
#   flush rows (found on the device: a prefix count of the batch's flags), and the
#   token kernel, compiled without the flush branch, for every other row. The two
#   touch disjoint rows (each row's checkpoint, records and output belong to one of
#   them), so nothing orders them: with 2 the flush kernel runs on a side stream
#   beside the token kernel (a fork and a join, which a CUDA graph keeps as two
#   branches), with 1 in order with it on the caller's stream.
#
# And two ways for a row that does not flush to take S0 k^ and S0 q^ (``dot_products``):
# FMA on the four-part tile held in registers (0; the tile's registers set the
# occupancy), or tl.dot on tensor cores with the checkpoint streamed through shared
# memory in K chunks (1): the raw key and query are rows 0 and 1 of a 16-row block and
# their norms scale the products after, so a 16-bit checkpoint multiplies 16-bit
# activations in their own dtype, exactly. The history's loads are issued before the
# stream so that their latency overlaps it.

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None

if triton is not None:
    from .fold import _ring_pos, replay_and_store_tile as _replay_and_store_tile
    from .recurrent import exact_block_k
    from .triton_common import EXACT_NUM_WARPS, NORM_EPS, block_rows, exact_warps, register_cap, side_stream
    from .triton_common import chain_launch, chain_wait, sm_count
    from .triton_common import device_fn as _tl_device_fn, folding_rows as _tl_folding_rows
    from .triton_common import gdn_gates as _tl_gdn_gates, load_parts as _tl_load_parts, mask_and as _tl_mask_and
    from .triton_common import row_dot as _tl_row_dot, row_sum as _tl_row_sum, sum_sq as _tl_sum_sq
    from .triton_common import inv_norm as _tl_inv_norm
    from .triton_common import store_parts as _tl_store_parts, to_rtne as _tl_to_rtne

    @_tl_device_fn
    def _token_rows(o_at, rv_at, ru_at, pos, SRV_POS: tl.constexpr, v_at, offs, mask, S_k, S_q, e, beta, kq):
        """The token's corrected delta and output on rows ``offs`` from their ``S k^`` and
        ``S q^`` (the committed state's, ``[R]``), stored with the token's ``v`` record at
        ring position ``pos`` (``SRV_POS`` apart in ``rv_at`` and ``ru_at``):
        ``u = beta (v - exp(g) S k^)``, ``o = exp(g) S q^ + u (k^ . q^)``."""
        xv = tl.load(v_at + offs, mask=mask, other=0.0)
        u = beta * (xv.to(tl.float32) - e * S_k)
        tl.store(o_at + offs, _tl_to_rtne(e * S_q + u * kq, o_at.dtype.element_ty), mask=mask)
        tl.store(rv_at + (pos * SRV_POS + offs), xv.to(rv_at.dtype.element_ty), mask=mask)
        tl.store(ru_at + (pos * SRV_POS + offs), u, mask=mask)

    @_tl_device_fn
    def _checkpoint_products(ckpt_at, k_at, q_at, r_k, r_q, offs_v, mask_v, K: tl.constexpr, BK: tl.constexpr,
                             KC: tl.constexpr, BV: tl.constexpr, DOT_PRECISION: tl.constexpr,
                             NUM_STAGES: tl.constexpr):
        """``S0 k^`` and ``S0 q^`` (``[BV]`` each) on tensor cores: the checkpoint streamed in
        ``KC``-wide chunks (pipelined ``NUM_STAGES`` deep, none of it held in registers)
        times the raw key and query as loaded (rows 0 and 1 of a 16-row block, tl.dot's
        least side), scaled by their inverse norms ``r_k``, ``r_q`` after the products.
        A 16-bit checkpoint with 16-bit activations multiplies in their own dtype (exact
        products, fp32 sums); otherwise both sides go to fp32 at ``DOT_PRECISION``."""
        offs_c = tl.arange(0, KC)
        offs_x = tl.arange(0, 16)
        is_k = offs_x == 0
        is_q = offs_x == 1
        # Column 0 the key, column 1 the query, the rest zero: one masked load, each
        # column's pointer at its key or its query, built [KC, 16] as tl.dot takes it.
        x_at = tl.where(is_k, k_at, q_at)[None, :]
        x_ok = (offs_x < 2)[None, :]
        SX = tl.zeros([BV, 16], dtype=tl.float32)
        for kc in tl.range(0, BK, KC, num_stages=NUM_STAGES):
            offs_k = kc + offs_c
            mask_k = offs_k < K
            S_c = tl.load(ckpt_at + offs_v[:, None] * K + offs_k[None, :], mask=mask_v[:, None] & mask_k[None, :],
                          other=0.0)
            x_c = tl.load(x_at + offs_k[:, None], mask=x_ok & mask_k[:, None], other=0.0)
            if S_c.dtype == x_c.dtype:
                SX = tl.dot(S_c, x_c, SX, input_precision=DOT_PRECISION)
            else:
                SX = tl.dot(S_c.to(tl.float32), x_c.to(tl.float32), SX, input_precision=DOT_PRECISION)
        S0_k = _tl_row_sum(tl.where(is_k[None, :], SX, 0.0), 1) * r_k
        S0_q = _tl_row_sum(tl.where(is_q[None, :], SX, 0.0), 1) * r_q
        return S0_k, S0_q

    @triton.jit
    def _ring_row(
        i_v, i_b, i_hv,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
        ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
        slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, o_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_a_tok, stride_b_tok,
        scale, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr,
        ROUND_STATE: tl.constexpr, AHEAD: tl.constexpr, EARLY_TILE: tl.constexpr,
        FLUSH_ROWS: tl.constexpr, TOKEN_ROWS: tl.constexpr,
        DOT: tl.constexpr, KC: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
        CHAINED: tl.constexpr,
    ):
        """Output, corrected delta and record of V block ``i_v`` (``BV`` rows) of request
        ``i_b``'s value head ``i_hv`` (see the module notes), for the rows its kernel
        owns: flush rows where ``FLUSH_ROWS``, the others (padding included) where
        ``TOKEN_ROWS``. A branch that its kernel never takes is not compiled. ``DOT``: a
        row that does not flush takes its products with the checkpoint on tensor cores
        (:func:`_checkpoint_products`) instead of FMA on the four-part tile. ``CHAINED``
        (:func:`~replayssm.ops.triton_common.chain_launch`): the row reads its slot,
        cursors and (``EARLY_TILE``) checkpoint tile, which the kernel before it does
        not write, then waits for that kernel before its first store and before reading
        the token's activations."""
        i_h = i_hv // (HV // H)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        bos = tl.load(cu_ptr + i_b).to(tl.int64)
        length = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
        KQ: tl.constexpr = BK // 4
        RING_KEYS_NORMED: tl.constexpr = rk_ptr.dtype.element_ty == tl.float32  # ops.records.keys_normalized
        offs_c = tl.arange(0, KQ)  # key index within a part
        all_c = offs_c >= 0
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < V
        o_at = o_ptr + (bos * HV + i_hv) * V  # o is a fresh contiguous [N, HV, V]
        if (slot < 0) | (length <= 0):
            chain_wait(CHAINED)  # o may be memory the kernel before still reads
            if TOKEN_ROWS:
                # Padding row: zero outputs, nothing else.
                tl.store(o_at + offs_v, tl.full([BV], 0, o_ptr.dtype.element_ty),
                         mask=_tl_mask_and(mask_v, length > 0))
        else:
            ckpt_at = ckpt_ptr + (slot * HV + i_hv) * (V * K)
            tile = offs_v[:, None] * K + offs_c[None, :]
            if EARLY_TILE:
                # The checkpoint tile first, before the row's kind is known: its loads wait
                # only for the slot, not for the cursors.
                S0, S1, S2, S3 = _tl_load_parts(ckpt_at, tile, mask_v[:, None], offs_c[None, :], K, KQ)
            # (Otherwise the tile is loaded in the row's branch, and defined there alone.)
            # Ring positions in 32 bits, wrapped by a mask where L is a power of two (as
            # the exact replay's, fold.replay_tile); the slot's offset into the rings
            # stays 64-bit (a pool's rings can pass 2^31 elements).
            wp = tl.load(wp_ptr + slot).to(tl.int32)
            base = tl.load(base_ptr + slot).to(tl.int32)
            folds = (tl.load(flush_ptr + slot) != 0) & (wp > 0)
            # Everything the kernel before may write (the activations; o's memory) after
            # the wait; the slot, cursors and tile above it are not among them.
            chain_wait(CHAINED)
            # Which rows this kernel owns, and whether they fold: decided at run time in
            # one launch, at compile time in the split kernels (the flush kernel is only
            # ever given flush rows), so each of those compiles one branch.
            if FLUSH_ROWS and TOKEN_ROWS:
                owned = True
                folds_here = folds
            elif TOKEN_ROWS:
                owned = ~folds
                folds_here = False
            else:
                owned = True
                folds_here = True
            if owned:
                # The slot's records of this program's heads, at ring position 0.
                rk_at = rk_ptr + slot * (L * H * K) + i_h * K
                rv_at = rv_ptr + slot * (L * HV * V) + i_hv * V
                ru_at = ru_ptr + slot * (L * HV * V) + i_hv * V
                rg_at = rg_ptr + slot * (L * HV) + i_hv
                rb_at = rb_ptr + slot * (L * HV) + i_hv
                pos = _ring_pos(base + wp, L)  # the token's record: logical position write_pos
                v_at = v_ptr + bos * stride_v_tok + i_hv * stride_v_head
                q_at = q_ptr + bos * stride_q_tok + i_h * stride_q_head
                k_at = k_ptr + bos * stride_k_tok + i_h * stride_k_head
                q0, q1, q2, q3 = _tl_load_parts(q_at, offs_c, all_c, offs_c, K, KQ)
                k0, k1, k2, k3 = _tl_load_parts(k_at, offs_c, all_c, offs_c, K, KQ)
                g, beta = _tl_gdn_gates(tl.load(a_ptr + bos * stride_a_tok + i_hv),
                                        tl.load(b_ptr + bos * stride_b_tok + i_hv),
                                        tl.load(A_log_ptr + i_hv), tl.load(dt_bias_ptr + i_hv))
                # The token's query feeds its output and u alone (stated to rounding): rsqrt,
                # not sqrt_rn and div_rn. So does its key where the ring keeps raw keys (a
                # flush replays those); a ring of normalised keys stores k^ with the exact
                # kernels' bits (ops.records.keys_normalized), which the products then share.
                if RING_KEYS_NORMED:
                    r_k = _tl_inv_norm(k0, k1, k2, k3, eps)
                else:
                    r_k = tl.math.rsqrt(_tl_sum_sq(k0, k1, k2, k3) + eps)
                r_q = tl.math.rsqrt(_tl_sum_sq(q0, q1, q2, q3) + eps) * scale
                kh0, kh1, kh2, kh3 = k0 * r_k, k1 * r_k, k2 * r_k, k3 * r_k
                qh0, qh1, qh2, qh3 = q0 * r_q, q1 * r_q, q2 * r_q, q3 * r_q
                e = tl.exp(g)
                kq = _tl_row_sum(tl.fma(kh3, qh3, tl.fma(kh2, qh2, tl.fma(kh1, qh1, kh0 * qh0))), 0)
                if DOT:
                    # Tensor cores: a row that does not flush holds no tile in registers.
                    if folds_here:
                        if not EARLY_TILE:
                            S0, S1, S2, S3 = _tl_load_parts(ckpt_at, tile, mask_v[:, None], offs_c[None, :], K, KQ)
                        # (F, not S: the tile exists on this branch alone.)
                        F0, F1, F2, F3 = _fold(S0, S1, S2, S3, ckpt_at, tile, rk_at, rv_at, rg_at, rb_at, base, wp,
                                               offs_c, offs_v, mask_v, eps, H, HV, K, V, L, KQ, AHEAD, ROUND_STATE)
                        S_k = _tl_row_dot(F0, F1, F2, F3, kh0, kh1, kh2, kh3)
                        S_q = _tl_row_dot(F0, F1, F2, F3, qh0, qh1, qh2, qh3)
                    else:
                        S_k, S_q = _history_and_products(ckpt_at, rk_at, rg_at, ru_at, base, wp, offs_c, offs_v,
                                                         mask_v, k_at, q_at, kh0, kh1, kh2, kh3, qh0, qh1, qh2, qh3,
                                                         r_k, r_q, eps, H, HV, K, V, L, BK, KQ, BV, KC, NUM_STAGES,
                                                         DOT_PRECISION)
                else:
                    # FMA on the tile: one S k^ and S q^ for both kinds of row, from the
                    # folded tile (whose history is then empty) or the checkpoint's.
                    if folds_here:
                        if not EARLY_TILE:
                            S0, S1, S2, S3 = _tl_load_parts(ckpt_at, tile, mask_v[:, None], offs_c[None, :], K, KQ)
                        S0, S1, S2, S3 = _fold(S0, S1, S2, S3, ckpt_at, tile, rk_at, rv_at, rg_at, rb_at, base, wp,
                                               offs_c, offs_v, mask_v, eps, H, HV, K, V, L, KQ, AHEAD, ROUND_STATE)
                        e_Gh = tl.full([], 1.0, tl.float32)
                        c_k = tl.zeros([L], tl.float32)
                        c_q = tl.zeros([L], tl.float32)
                    else:
                        # The history's weights before the tile's products, so that its
                        # keys are dead by then.
                        e_Gh, c_k, c_q = _history_weights(rk_at, rg_at, base, wp, offs_c, kh0, kh1, kh2, kh3,
                                                          qh0, qh1, qh2, qh3, eps, H, HV, K, L, KQ)
                        if not EARLY_TILE:
                            # The whole tile at once: the most bytes in flight an FMA program
                            # can have (a chunked FMA stream was slower, BENCHMARKS.md).
                            S0, S1, S2, S3 = _tl_load_parts(ckpt_at, tile, mask_v[:, None], offs_c[None, :], K, KQ)
                    S_k = _tl_row_dot(S0, S1, S2, S3, kh0, kh1, kh2, kh3)
                    S_q = _tl_row_dot(S0, S1, S2, S3, qh0, qh1, qh2, qh3)
                    if TOKEN_ROWS:
                        # The history's u after the products (fewer registers live across
                        # them); none on a flush row (c = 0, and its u are not read).
                        if FLUSH_ROWS:
                            n_hist = tl.where(folds, 0, wp)
                        else:
                            n_hist = wp
                        S_k, S_q = _add_history(S_k, S_q, e_Gh, c_k, c_q, ru_at, base, n_hist, offs_v, mask_v, HV, V, L)
                _token_rows(o_at, rv_at, ru_at, pos, HV * V, v_at, offs_v, mask_v, S_k, S_q, e, beta, kq)
                # The raw key and the gates, once per (request, key head) and value head,
                # after every load (the history's records are read from the same ring).
                k_writer = (i_hv % (HV // H) == 0) & (i_v == 0)
                if RING_KEYS_NORMED:
                    _tl_store_parts(rk_at, pos * (H * K) + offs_c, _tl_mask_and(all_c, k_writer), offs_c, K, KQ,
                                    kh0, kh1, kh2, kh3)
                else:
                    _tl_store_parts(rk_at, pos * (H * K) + offs_c, _tl_mask_and(all_c, k_writer), offs_c, K, KQ,
                                    k0, k1, k2, k3)
                tl.store(rg_at + pos * HV, g, mask=i_v == 0)
                tl.store(rb_at + pos * HV, beta, mask=i_v == 0)

    @triton.jit
    def _fold(S0, S1, S2, S3, ckpt_at, tile, rk_at, rv_at, rg_at, rb_at, base, wp, offs_c, offs_v, mask_v, eps,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, KQ: tl.constexpr,
              AHEAD: tl.constexpr, ROUND_STATE: tl.constexpr):
        """A flush row: fold the history into the checkpoint tile (the fold's replay and
        store); return the folded rows as stored, where the token starts from (an empty
        history)."""
        return _replay_and_store_tile(
            S0, S1, S2, S3, ckpt_at, tile, rk_at, rv_at, rg_at, rb_at,
            base, tl.minimum(wp, L), offs_c, offs_v, mask_v, H * K, HV * V, HV, HV, eps, K, L, KQ, AHEAD,
            ROUND_STATE, False)  # each key normalised at its step's head: faster in this kernel (fold.replay_tile)

    @_tl_device_fn
    def _weights(h0, h1, h2, h3, g_h, hist, offs_h, kh0, kh1, kh2, kh3, qh0, qh1, qh2, qh3, eps,
                 NORMED: tl.constexpr):
        """The committed history's share of ``S x`` (a row that does not flush; a flush
        row with no records has none),
            S x = exp(Gtot) S0 x + sum_c exp(g_{c+1} + ... + g_h) u_c (k^_c . x),
        as ``(exp(Gtot), c_k, c_q)``, ``c_x[c] = exp(g_{c+1} + ... + g_h) (k^_c . x)``, from
        the records' keys (four parts ``[L, KQ]``; ``NORMED``: normalised, else raw) and
        gates ``g_h`` (zero past the history)."""
        if NORMED:
            r_h = 1.0
        else:
            # 1 / |k_c| (to rounding, as the token's: rsqrt)
            r_h = tl.math.rsqrt(_tl_row_sum(tl.fma(h3, h3, tl.fma(h2, h2, tl.fma(h1, h1, h0 * h0))), 1) + eps)
        later = offs_h[None, :] > offs_h[:, None]
        w_h = tl.where(hist, tl.exp(_tl_row_sum(tl.where(later, g_h[None, :], 0.0), 1)), 0.0) * r_h
        c_k = _tl_row_dot(h0, h1, h2, h3, kh0, kh1, kh2, kh3) * w_h
        c_q = _tl_row_dot(h0, h1, h2, h3, qh0, qh1, qh2, qh3) * w_h
        return tl.exp(_tl_row_sum(g_h, 0)), c_k, c_q

    @_tl_device_fn
    def _history_records(rk_at, rg_at, base, wp, offs_c, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                         L: tl.constexpr, KQ: tl.constexpr):
        """The ``wp`` records from ring position ``base`` that :func:`_weights` reads:
        ``(offs_h, hist, h0, h1, h2, h3, g_h)``, their keys' four parts and gates
        (zero past the history: unused ring entries may hold NaN, masked loads give 0)."""
        offs_h = tl.arange(0, L)
        hist = offs_h < wp
        pos_h = _ring_pos(base + offs_h, L)
        h0, h1, h2, h3 = _tl_load_parts(rk_at, pos_h[:, None] * (H * K) + offs_c[None, :], hist[:, None],
                                        offs_c[None, :], K, KQ)
        return offs_h, hist, h0, h1, h2, h3, tl.load(rg_at + pos_h * HV, mask=hist, other=0.0)

    @_tl_device_fn
    def _history_weights(rk_at, rg_at, base, wp, offs_c, kh0, kh1, kh2, kh3, qh0, qh1, qh2, qh3, eps,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L: tl.constexpr, KQ: tl.constexpr):
        """:func:`_weights` of the ``wp`` records from ring position ``base``."""
        offs_h, hist, h0, h1, h2, h3, g_h = _history_records(rk_at, rg_at, base, wp, offs_c, H, HV, K, L, KQ)
        return _weights(h0, h1, h2, h3, g_h, hist, offs_h, kh0, kh1, kh2, kh3, qh0, qh1, qh2, qh3, eps,
                        rk_at.dtype.element_ty == tl.float32)  # ops.records.keys_normalized

    @_tl_device_fn
    def _history_u(ru_at, base, n_hist, offs_v, mask_v, HV: tl.constexpr, V: tl.constexpr, L: tl.constexpr):
        """The ``[BV, L]`` corrected deltas of the ``n_hist`` records from ring position
        ``base`` (zero past them: unused entries may hold NaN)."""
        offs_h = tl.arange(0, L)
        return tl.load(ru_at + (_ring_pos(base + offs_h, L)[None, :] * (HV * V) + offs_v[:, None]),
                       mask=mask_v[:, None] & (offs_h < n_hist)[None, :], other=0.0)

    @_tl_device_fn
    def _with_history(S0_k, S0_q, e_Gh, c_k, c_q, u_h):
        """``S k^`` and ``S q^`` from the checkpoint's products, the history's weights
        and its corrected deltas ``u_h [BV, L]``."""
        return (e_Gh * S0_k + _tl_row_sum(u_h * c_k[None, :], 1),
                e_Gh * S0_q + _tl_row_sum(u_h * c_q[None, :], 1))

    @_tl_device_fn
    def _add_history(S0_k, S0_q, e_Gh, c_k, c_q, ru_at, base, n_hist, offs_v, mask_v, HV: tl.constexpr,
                     V: tl.constexpr, L: tl.constexpr):
        """:func:`_with_history`, the history's ``u`` loaded here (after the products)."""
        return _with_history(S0_k, S0_q, e_Gh, c_k, c_q, _history_u(ru_at, base, n_hist, offs_v, mask_v, HV, V, L))

    @triton.jit
    def _history_and_products(ckpt_at, rk_at, rg_at, ru_at, base, wp, offs_c, offs_v, mask_v, k_at, q_at,
                              kh0, kh1, kh2, kh3, qh0, qh1, qh2, qh3, r_k, r_q, eps,
                              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
                              BK: tl.constexpr, KQ: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
                              NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """A row that does not flush, on tensor cores: ``S k^`` and ``S q^`` from the
        checkpoint's products (:func:`_checkpoint_products`) and the history's share."""
        # Every history load issued before the checkpoint's stream, so that their
        # latencies overlap its chunks' instead of following them.
        offs_h, hist, h0, h1, h2, h3, g_h = _history_records(rk_at, rg_at, base, wp, offs_c, H, HV, K, L, KQ)
        u_h = _history_u(ru_at, base, wp, offs_v, mask_v, HV, V, L)
        S0_k, S0_q = _checkpoint_products(ckpt_at, k_at, q_at, r_k, r_q, offs_v, mask_v, K, BK, KC, BV,
                                          DOT_PRECISION, NUM_STAGES)
        e_Gh, c_k, c_q = _weights(h0, h1, h2, h3, g_h, hist, offs_h, kh0, kh1, kh2, kh3, qh0, qh1, qh2, qh3, eps,
                                  rk_at.dtype.element_ty == tl.float32)  # ops.records.keys_normalized
        return _with_history(S0_k, S0_q, e_Gh, c_k, c_q, u_h)

    @triton.jit
    def _ring_decode_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
        ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
        slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, o_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_a_tok, stride_b_tok,
        scale, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr,
        ROUND_STATE: tl.constexpr, AHEAD: tl.constexpr, EARLY_TILE: tl.constexpr, FLUSH_ROWS: tl.constexpr,
        DOT: tl.constexpr, KC: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
        CHAINED: tl.constexpr = False,
    ):
        """Grid ``(V blocks, requests, HV)``: every row's token (``FLUSH_ROWS``) or every
        row's but the flush rows' (the flush kernel's). ``CHAINED``: see :func:`_ring_row`."""
        _ring_row(tl.program_id(0), tl.program_id(1), tl.program_id(2),
                  q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
                  ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
                  slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, o_ptr,
                  stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                  stride_a_tok, stride_b_tok, scale, eps,
                  H, HV, K, V, L, BK, BV, ROUND_STATE, AHEAD, EARLY_TILE, FLUSH_ROWS, True,
                  DOT, KC, NUM_STAGES, DOT_PRECISION, CHAINED)

    @triton.jit
    def _ring_flush_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
        ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
        slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, o_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_a_tok, stride_b_tok,
        scale, eps, batch,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, BB: tl.constexpr,
        ROUND_STATE: tl.constexpr, AHEAD: tl.constexpr, EARLY_TILE: tl.constexpr,
    ):
        """A few programs that walk the flush rows' (V block, value head) items: item
        ``t`` of ``n x HV x NV`` is the ``t // (HV NV)``-th flush row of the batch (``BB``
        >= ``batch`` rows, counted on the device), so the grid is fixed by the batch alone
        (CUDA graphs) and costs nothing where no row flushes."""
        NV: tl.constexpr = (V + BV - 1) // BV
        before, count = _tl_folding_rows(slots_ptr, cu_ptr, wp_ptr, flush_ptr, batch, BB)
        items = count * (HV * NV)
        for t in range(tl.program_id(0), items, tl.num_programs(0)):
            j = t // (HV * NV)
            i_b = tl.sum((before <= j).to(tl.int32), 0)  # the j-th flush row (from 0): j rows before it
            i_hv = (t % (HV * NV)) // NV
            _ring_row(t % NV, i_b, i_hv,
                      q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
                      ckpt_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, ru_ptr,
                      slots_ptr, cu_ptr, wp_ptr, base_ptr, flush_ptr, o_ptr,
                      stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                      stride_a_tok, stride_b_tok, scale, eps,
                      H, HV, K, V, L, BK, BV, ROUND_STATE, AHEAD, EARLY_TILE, True, False,
                      False, BK, 1, "ieee", False)


def launch_ring_decode(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos,
                       cache_base, is_flush, o) -> None:
    """Launch the ring decoding kernels on validated arguments: one launch, or the flush
    rows' kernel beside the token kernel (the shape table's ``split_flush``; module notes)."""
    h, kd = q.shape[1], q.shape[2]
    hv, vd = v.shape[1], v.shape[2]
    batch = slots.shape[0]
    cfg = tuning.lookup("ring_decode", K=kd, V=vd, state_dtype=checkpoint.dtype, batch=batch, device=q.device.type)
    bk = exact_block_k(kd)
    args = (q, k, v, a, b, A_log, dt_bias, checkpoint, ring.k, ring.v, ring.g, ring.beta, ring_u,
            slots, cu_seqlens, write_pos, cache_base, is_flush, o,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
            kd**-0.5, NORM_EPS)
    common = dict(H=h, HV=hv, K=kd, V=vd, L=ring.ring_len, BK=bk, ROUND_STATE=checkpoint.dtype != torch.float32,
                  AHEAD=cfg["records_ahead"])
    split = cfg["split_flush"]
    dot = bool(cfg["dot_products"])
    if dot and cfg["early_tile"]:
        raise ValueError("ring_decode: dot_products streams the checkpoint through its chunks; early_tile loads it "
                         "first: one or the other (the shape table's row for this call has both)")
    side = None  # the flush kernel's stream with split_flush = 2 (CUDA; elsewhere one stream runs both)
    if split == 2 and q.device.type == "cuda":
        side = side_stream(q.device)
        side.wait_stream(torch.cuda.current_stream(q.device))
    if split:
        fbv = min(cfg["block_v"], triton.next_power_of_2(vd))
        programs = min(cfg["flush_programs"] * sm_count(q.device), batch * hv * triton.cdiv(vd, fbv))
        # 2 warps (flush_warps) lay a tile's K axis out as 4 do, 4 keys a thread across 8
        # lanes (sm_90 TTGIR), so each row's sums over K, and the replayed state, keep
        # their bits; only the rows a warp holds change (the GPU test of launch choices).
        warps = exact_warps(cfg["flush_warps"] if cfg["flush_warps"] < EXACT_NUM_WARPS else cfg["num_warps"], fbv)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _ring_flush_kernel[(programs,)](*args, batch, **common, BV=fbv, BB=triton.next_power_of_2(batch),
                                            EARLY_TILE=True, num_warps=warps)
    bv = block_rows(vd, batch * hv, q.device, cfg["token_block_v" if split else "block_v"])
    # A flush row replays exactly, so its row sums must be the fold's: the same parts,
    # lanes and order at any warp count (exact_warps). At other counts than 4 only the
    # history's sums over its records (outputs and u, stated to rounding) change order,
    # since their record axis lies across warps.
    # One launch takes part in a chain (triton_common.chained_launches): its rows read
    # their checkpoints while the kernel before (the conv) runs. Rows apart stay in
    # stream order: a chained token kernel beside the flush kernel measured slower at
    # batch 16 (BENCHMARKS.md, "Ring decoding chained").
    chained, launch = (False, {}) if split else chain_launch()
    _ring_decode_kernel[(triton.cdiv(vd, bv), batch, hv)](
        *args, **common, BV=bv, EARLY_TILE=bool(cfg["early_tile"]), FLUSH_ROWS=not split,
        DOT=dot, KC=max(16, min(cfg["k_chunk"], bk)), NUM_STAGES=cfg["num_stages"],
        DOT_PRECISION=product_precision(q.dtype), CHAINED=chained,
        num_warps=exact_warps(cfg["num_warps"], bv), **register_cap(cfg["max_registers"], q.device), **launch)
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)


@register("ring_decode", "triton")
def gdn_ring_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    checkpoint: torch.Tensor,
    ring: RawRecords,
    ring_u: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    write_pos: torch.Tensor,
    cache_base: torch.Tensor,
    is_flush: torch.Tensor,
) -> torch.Tensor:
    """Triton version of :func:`gdn_ring_decode_reference` (same arguments and results),
    one launch or two (``split_flush``).

    Limits as :func:`~replayssm.ops.chunked.gdn_chunked_window_triton`'s: float32 or
    bfloat16 checkpoints, float32 ``ring_u`` and ring gates, contiguous buffers and index
    tensors; tensor values are not read on the host (CUDA-graph capturable), so the
    caller guarantees one token per window, unique live slots and ``write_pos < L``.

    Precision: a flush row's folded checkpoint is the fold kernel's, bit for bit (the
    same replay, tile and warps). Outputs and ``u`` are the reference's to fp32 rounding
    with FMA products (the table's ``dot_products = 0``). On tensor cores (1) a 16-bit
    checkpoint times 16-bit keys and queries multiplies exactly and sums in fp32; an fp32
    checkpoint with 16-bit activations rounds to tf32 in the product, as the closed
    form's does (:func:`~replayssm.ops.chunked.product_precision`), and fp32 activations
    keep fp32 ("ieee") products.
    """
    slots, cu_seqlens, n = check_triton_window_call(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots,
                                                    cu_seqlens, write_pos, cache_base, is_flush, 1)
    o = torch.empty(n, v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    if slots.shape[0]:
        launch_ring_decode(q, k, v, a, b, A_log, dt_bias, checkpoint, ring, ring_u, slots, cu_seqlens, write_pos,
                           cache_base, is_flush, o)
    return o
