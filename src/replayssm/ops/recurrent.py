"""Token-by-token GDN recurrence over a packed batch of windows (DESIGN.md section 1).

Per value head, from a state ``S`` (``V x K``):

    S' = exp(g) * S
    u  = beta * (v - S' k^)
    S  = S' + u k^T
    o  = S q^

This file holds the reference (plain PyTorch, any float dtype incl. float64, CPU or
GPU). ``state_update`` and ``readout`` are the single definition of the step's operation
order: every exact path of the reference (verify, snapshot commit, fold replay, flush)
goes through them on ``[HV, V, K]`` tensors, so their results agree bit for bit.

It also holds the Triton kernel (fp32/bf16, end of the file), built from the helpers of
:mod:`replayssm.ops.triton_common` that every exact Triton path shares.
"""

from __future__ import annotations

import torch

from . import _checks, guards, tuning
from .dispatch import pick, register
from .gates import expand_heads, gdn_gates, l2_normalize
from .records import RawRecords, check_varlen
from .triton_common import block_rows, chain_launch, exact_warps


def state_update(S: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """One exact step of the state, in the reference operation order.

    Args:
        S: ``[..., HV, V, K]`` state in the compute dtype.
        k_hat: ``[..., HV, K]`` normalised key, already expanded to value heads.
        v: ``[..., HV, V]`` value in the compute dtype.
        g, beta: ``[..., HV]`` gates.

    Returns:
        The new state, same shape and dtype as ``S``.
    """
    S = torch.exp(g)[..., None, None] * S
    u = beta[..., None] * (v - (S * k_hat[..., None, :]).sum(-1))
    return S + u[..., :, None] * k_hat[..., None, :]


def readout(S: torch.Tensor, q_hat: torch.Tensor) -> torch.Tensor:
    """``o = S q^``: ``[..., HV, V, K] x [..., HV, K] -> [..., HV, V]``."""
    return (S * q_hat[..., None, :]).sum(-1)


def check_max_len(max_len) -> int | None:
    """Validate the optional ``max_len`` keyword (``None`` or an int >= 1)."""
    if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
        raise ValueError(f"max_len must be None or an int >= 1, got {max_len!r}")
    return max_len


def check_layer_inputs(q, k, v, a, b, A_log, dt_bias) -> tuple[int, int, int, int, int]:
    """Validate one layer's packed inputs; return ``(N, H, K, HV, V)``.

    ``HV`` is taken from the layer's parameters (``A_log``), so that an input with the
    wrong number of value heads is the one named in the error.
    """
    _checks.tensor("A_log", A_log, ndim=1, dtypes=_checks.FLOAT_DTYPES)
    hv = A_log.shape[0]
    _checks.tensor("dt_bias", dt_bias, ndim=1, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("dt_bias", dt_bias, [hv])
    _checks.tensor("q", q, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    n, h, kd = q.shape
    _checks.tensor("k", k, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("k", k, [n, h, kd])
    _checks.tensor("v", v, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("v", v, [n, hv, None])
    vd = v.shape[2]
    _checks.gqa(h, hv)
    for name, x in (("a", a), ("b", b)):
        _checks.tensor(name, x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape(name, x, [n, hv])
    _checks.same_device(q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    return n, h, kd, hv, vd


def prepare_window(q, k, v, a, b, A_log, dt_bias, dtype: torch.dtype):
    """Gates, normalised and head-expanded keys/queries of a token range, in ``dtype``.

    Returns ``(q_hat, k_hat, v, g, beta)`` with shapes ``[m, HV, K]``, ``[m, HV, K]``,
    ``[m, HV, V]``, ``[m, HV]``, ``[m, HV]``. ``g`` and ``beta`` are float32 (float64 in
    the oracle) whatever ``dtype`` is.
    """
    hv, kd = v.shape[1], q.shape[2]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    k_hat = expand_heads(l2_normalize(k, dtype=dtype), hv)
    q_hat = expand_heads(l2_normalize(q, kd**-0.5, dtype=dtype), hv)
    return q_hat, k_hat, v.to(dtype), g.to(dtype), beta.to(dtype)


@register("recurrence", "reference")
def gdn_recurrence_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    snapshots: torch.Tensor | None = None,
    records: RawRecords | None = None,
    update_state: bool = False,
    max_len: int | None = None,
) -> torch.Tensor:
    """Run the exact recurrence over every window of a packed batch.

    Args:
        q, k: ``[N, H, K]`` post-conv queries and keys (pre-normalisation).
        v: ``[N, HV, V]`` post-conv values; ``HV`` a multiple of ``H``.
        a, b: ``[N, HV]`` raw gate projections.
        A_log, dt_bias: ``[HV]`` gate parameters.
        state: ``[num_slots, HV, V, K]`` float32, bfloat16 or float64 states; window ``i``
            starts from ``state[slots[i]]``.
        slots: ``[B]`` slot of each window, ``-1`` for padding (zero output, no writes).
        cu_seqlens: ``[B + 1]`` token offsets of the windows in the packed batch.
        snapshots: optional ``[num_slots, T, HV, V, K]``; the state after token ``j`` of
            window ``i`` is written to ``snapshots[slots[i], j]`` (the ``snapshot``
            strategy's scratch). ``T`` must cover the longest window.
        records: optional raw-record rings; token ``j`` of window ``i`` is stored at
            ``[slots[i], j]``. A side channel: it never changes the outputs.
        update_state: write the final state of each window back to ``state`` (plain
            decoding and prefill).
        max_len: optional bound on every window's length. The Triton backend needs a
            bound from ``snapshots``, ``records`` or ``max_len`` (it never reads
            ``cu_seqlens`` on the host); the reference checks the windows against it.

    Returns:
        ``o``: ``[N, HV, V]`` in the dtype of ``v``.

    The recurrence runs in float32 (float64 if ``state`` or the inputs are float64) and
    rounds to the state dtype only where it writes.
    """
    n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, A_log, dt_bias)
    _checks.tensor("state", state, ndim=4, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    num_slots = state.shape[0]
    _checks.shape("state", state, [num_slots, hv, vd, kd])
    _checks.same_device(q, state=state, slots=slots, cu_seqlens=cu_seqlens)
    max_len = check_max_len(max_len)
    if snapshots is not None:
        _checks.tensor("snapshots", snapshots, ndim=5, dtypes=(torch.float32, torch.bfloat16, torch.float64))
        _checks.shape("snapshots", snapshots, [num_slots, None, hv, vd, kd])
        _checks.same_device(q, snapshots=snapshots)
        max_len = snapshots.shape[1] if max_len is None else min(max_len, snapshots.shape[1])
    if records is not None:
        records.check("records", num_slots, h, kd, hv, vd)
        _checks.same_device(q, records=records.k)
        max_len = records.ring_len if max_len is None else min(max_len, records.ring_len)
    cu, sl = check_varlen(cu_seqlens, slots, n, num_slots, max_len)

    dtype = _checks.compute_dtype(q, k, v, state)
    o = torch.zeros(n, hv, vd, dtype=v.dtype, device=v.device)
    for i, slot in enumerate(sl):
        bos, eos = cu[i], cu[i + 1]
        if slot < 0 or eos == bos:
            continue
        q_hat, k_hat, vv, g, beta = prepare_window(
            q[bos:eos], k[bos:eos], v[bos:eos], a[bos:eos], b[bos:eos], A_log, dt_bias, dtype
        )
        S = state[slot].to(dtype)
        for j in range(eos - bos):
            S = state_update(S, k_hat[j], vv[j], g[j], beta[j])
            o[bos + j] = readout(S, q_hat[j]).to(o.dtype)
            if snapshots is not None:
                snapshots[slot, j] = S.to(snapshots.dtype)
        if records is not None:
            for j in range(eos - bos):
                records.write(slot, j, k[bos + j], v[bos + j], g[j], beta[j])
        if update_state:
            state[slot] = S.to(state.dtype)
    return o


def gdn_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    snapshots: torch.Tensor | None = None,
    records: RawRecords | None = None,
    update_state: bool = False,
    max_len: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The exact GDN recurrence over packed windows: outputs ``o [N, HV, V]``, and
    optionally per-token snapshots, raw records and the advanced state. Arguments,
    shapes and results: :func:`gdn_recurrence_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("recurrence", backend, q)(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens,
                                          snapshots=snapshots, records=records, update_state=update_state,
                                          max_len=max_len)


# ---------------------------------------------------------------------------- Triton
# One program per (V block, window, value head): it loads its [BV, K] slice of the start
# state once, runs the window's tokens through the exact step in registers and writes
# only what the caller asked for (outputs always; snapshots, raw records, final state
# optionally). Reads each state element once; the snapshot path adds T writes.

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None

STATE_DTYPES_TRITON = (torch.float32, torch.bfloat16)
ACT_DTYPES_TRITON = (torch.float16, torch.bfloat16, torch.float32)
# Windows longer than this (prompts) loop to each row's length rather than to the bound:
# verify and decode windows keep their compile-time trip count.
STEPS_BY_LENGTH_ABOVE = 16


def window_bound(max_len: int | None, *shape_bounds: int | None) -> int:
    """The loop bound ``T`` of a window kernel: the smallest given bound.

    Kernels loop over ``range(T)`` with ``T`` a compile-time constant, masked by each
    row's length. Bounds above 16 (prefill) are rounded up to a power of two so that
    prompts of different lengths share a few compiled variants.
    """
    bounds = [b for b in (max_len, *shape_bounds) if b is not None]
    if not bounds:
        raise ValueError(
            "the Triton backend needs a bound on the window length: pass max_len= (or snapshots / records)"
        )
    t = min(bounds)
    return t if t <= 16 else triton.next_power_of_2(t)


def exact_tile(kd: int, vd: int, batch: int, hv: int, state_dtype: torch.dtype, device: torch.device, *,
               read_only: bool = False, snapshots: bool = False, layers: int = 1,
               most: int | None = None) -> tuple[dict, int, int]:
    """An exact kernel's launch for ``batch`` windows of ``hv`` value heads (times
    ``layers`` for the fold): ``(row, BV, num_warps)``, its shape-table row
    (:func:`exact_row`), the rows ``BV`` of its state tile (the row's height, or
    ``most``, through :func:`~replayssm.ops.triton_common.block_rows`) and the row's
    warps as that tile takes them (:func:`~replayssm.ops.triton_common.exact_warps`,
    which keeps the states' bits)."""
    row = exact_row(kd, vd, batch, state_dtype, read_only, snapshots)
    bv = block_rows(vd, batch * hv * layers, device, most or row["block_v"])
    return row, bv, exact_warps(row["num_warps"], bv)


def exact_row(kd: int, vd: int, batch: int, state_dtype: torch.dtype, read_only: bool, snapshots: bool = False) -> dict:
    """The shape table's row for an exact kernel: ``exact_read_only`` for a verify that
    writes no state, ``exact_snapshot`` for one that stores a snapshot per token, else
    ``exact_write``."""
    family = "exact_read_only" if read_only else "exact_snapshot" if snapshots else "exact_write"
    return tuning.lookup(family, K=kd, V=vd, state_dtype=state_dtype, batch=batch)


def exact_block_k(kd: int) -> int:
    """``BK`` of an exact kernel's state tile: the whole key axis, a power of two held as
    four column parts (see :mod:`replayssm.ops.triton_common`), so at least 4."""
    return max(4, triton.next_power_of_2(kd))


def check_index_pair(slots: torch.Tensor, cu_seqlens: torch.Tensor):
    """Metadata checks of ``slots`` / ``cu_seqlens`` (values are the caller's contract)."""
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if cu_seqlens.numel() != slots.numel() + 1:
        raise ValueError(
            f"cu_seqlens must have len(slots) + 1 = {slots.numel() + 1} entries, got {cu_seqlens.numel()}"
        )
    _checks.contiguous(slots=slots, cu_seqlens=cu_seqlens)


def check_inner_contiguous(**named: torch.Tensor):
    """Activations may be strided views (e.g. splits of the conv output) as long as
    their last axis is contiguous."""
    for name, x in named.items():
        if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last axis, got strides {tuple(x.stride())}")


if triton is not None:
    from .triton_common import NORM_EPS, chain_wait, device_fn as _tl_device_fn, gdn_gates as _tl_gdn_gates
    from .triton_common import gdn_step as _tl_step, load_parts as _tl_load_parts, mask_and as _tl_mask_and
    from .triton_common import record_key as _tl_record_key
    from .triton_common import normalized as _tl_normalized, row_dot as _tl_row_dot, store_parts as _tl_store_parts
    from .triton_common import to_rtne as _tl_to_rtne, window_program as _tl_window_program

    @_tl_device_fn
    def _load_token(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, tok, valid, all_c, mask_v, i_h, i_hv, offs_c, offs_v,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok,
        K: tl.constexpr, KQ: tl.constexpr,
    ):
        """Raw inputs of token ``tok`` for one (key head, value head, V block), with the
        block masks that fold in the token's validity: ``(mask_c, mask_v)``, then ``q``
        and ``k`` as four fp32 parts each, then ``v``, ``a``, ``b``; zeros where
        ``valid`` (scalar) is off. ``all_c`` / ``mask_v`` are the key and V block masks."""
        mask_c = _tl_mask_and(all_c, valid)
        mask_v = _tl_mask_and(mask_v, valid)
        q0, q1, q2, q3 = _tl_load_parts(q_ptr, tok * stride_q_tok + i_h * stride_q_head + offs_c, mask_c, offs_c, K, KQ)
        k0, k1, k2, k3 = _tl_load_parts(k_ptr, tok * stride_k_tok + i_h * stride_k_head + offs_c, mask_c, offs_c, K, KQ)
        v = tl.load(v_ptr + tok * stride_v_tok + i_hv * stride_v_head + offs_v, mask=mask_v, other=0.0)
        a = tl.load(a_ptr + tok * stride_a_tok + i_hv, mask=valid, other=0.0)
        b = tl.load(b_ptr + tok * stride_b_tok + i_hv, mask=valid, other=0.0)
        return mask_c, mask_v, q0, q1, q2, q3, k0, k1, k2, k3, v, a, b

    @_tl_device_fn
    def exact_token(S0, S1, S2, S3, q0, q1, q2, q3, k0, k1, k2, k3, v, a, b, A_log, dt_bias, valid, eps, scale):
        """One token of the exact recurrence on a state tile (this kernel's, the tree
        kernels' and the replay kernels'): its gates, normalised key and query, the step
        (the tile kept where ``valid`` is off) and the output. Returns the tile's parts,
        ``o``, ``u`` (the step's corrected delta), ``g`` and ``beta``."""
        g, beta = _tl_gdn_gates(a, b, A_log, dt_bias)
        kh0, kh1, kh2, kh3 = _tl_normalized(k0, k1, k2, k3, eps, 1.0)
        qh0, qh1, qh2, qh3 = _tl_normalized(q0, q1, q2, q3, eps, scale)
        N0, N1, N2, N3, u = _tl_step(S0, S1, S2, S3, kh0, kh1, kh2, kh3, v.to(tl.float32), g, beta)
        S0 = tl.where(valid, N0, S0)
        S1 = tl.where(valid, N1, S1)
        S2 = tl.where(valid, N2, S2)
        S3 = tl.where(valid, N3, S3)
        return S0, S1, S2, S3, _tl_row_dot(S0, S1, S2, S3, qh0, qh1, qh2, qh3), u, g, beta

    @_tl_device_fn
    def _key_parts(ptr, offs_c, K: tl.constexpr, KQ: tl.constexpr):
        """A key-axis vector's four fp32 parts at ``ptr + offs_c + p * KQ`` with no row
        or validity mask (the recurrence kernel's tokens always lie in their window):
        keys ``>= K`` load as zero, and where ``K`` fills the block (``K == 4 * KQ``,
        the real shapes) no lane is masked at all."""
        if K == 4 * KQ:
            x0 = tl.load(ptr + offs_c).to(tl.float32)
            x1 = tl.load(ptr + offs_c + KQ).to(tl.float32)
            x2 = tl.load(ptr + offs_c + 2 * KQ).to(tl.float32)
            x3 = tl.load(ptr + offs_c + 3 * KQ).to(tl.float32)
        else:
            x0 = tl.load(ptr + offs_c, mask=offs_c < K, other=0.0).to(tl.float32)
            x1 = tl.load(ptr + offs_c + KQ, mask=offs_c + KQ < K, other=0.0).to(tl.float32)
            x2 = tl.load(ptr + offs_c + 2 * KQ, mask=offs_c + 2 * KQ < K, other=0.0).to(tl.float32)
            x3 = tl.load(ptr + offs_c + 3 * KQ, mask=offs_c + 3 * KQ < K, other=0.0).to(tl.float32)
        return x0, x1, x2, x3

    @_tl_device_fn
    def _window_token(q_at, k_at, v_at, a_at, b_at, tok, offs_c, offs_v, mask_v,
                      stride_q_tok, stride_k_tok, stride_v_tok, stride_a_tok, stride_b_tok,
                      K: tl.constexpr, KQ: tl.constexpr, FULL_V: tl.constexpr):
        """Raw inputs of the window's token ``tok`` (``q_at`` .. ``b_at`` address its
        first token at this program's heads): ``q`` and ``k`` as four fp32 parts each,
        then ``v``, ``a``, ``b``. Unlike :func:`_load_token` no load is masked by the
        token's validity (the kernel loads only tokens of its window: no zeroed
        registers or predicates a token), and ``mask_v`` (rows ``< V``) applies only
        where the tile's rows can pass ``V`` (not ``FULL_V``)."""
        q0, q1, q2, q3 = _key_parts(q_at + tok * stride_q_tok, offs_c, K, KQ)
        k0, k1, k2, k3 = _key_parts(k_at + tok * stride_k_tok, offs_c, K, KQ)
        if FULL_V:
            v = tl.load(v_at + tok * stride_v_tok + offs_v)
        else:
            v = tl.load(v_at + tok * stride_v_tok + offs_v, mask=mask_v, other=0.0)
        a = tl.load(a_at + tok * stride_a_tok)
        b = tl.load(b_at + tok * stride_b_tok)
        return q0, q1, q2, q3, k0, k1, k2, k3, v, a, b

    @triton.jit
    def _recurrence_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
        state_ptr, slots_ptr, cu_ptr, o_ptr,
        snap_ptr, rec_k_ptr, rec_v_ptr, rec_g_ptr, rec_beta_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_a_tok, stride_b_tok, stride_state_slot, stride_snap_slot,
        srk_slot, srk_pos, srk_head, srv_slot, srv_pos, srv_head, srg_slot, srg_pos, srg_head,
        srb_slot, srb_pos, srb_head,
        scale, eps,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, T: tl.constexpr,
        HAS_SNAPSHOTS: tl.constexpr, HAS_RECORDS: tl.constexpr, UPDATE_STATE: tl.constexpr,
        STEPS_BY_LENGTH: tl.constexpr, LOAD_AHEAD: tl.constexpr = True, CHAINED: tl.constexpr = False,
    ):
        # CHAINED (launched by triton_common.chain_launch; read-only windows): the
        # window's slot and length, the gates' weights and the state tile load before the
        # wait for the kernel before, the window's tokens after it. A step's kernels
        # write neither the slots nor a layer's state before its verify (the caller keeps
        # the kernel just before from writing them: gdn_recurrence_triton chains only
        # unguarded indices).
        i_v, i_b, i_hv, i_h, slot, bos, length = _tl_window_program(slots_ptr, cu_ptr, H, HV)
        # A window's positions in 32 bits (its length is at most the bound T, or a
        # prompt's), so the loop's counter and the stores' offsets stay 32-bit; only the
        # window's first token (bos) is 64-bit, folded into base pointers.
        length = length.to(tl.int32)
        # Short windows loop to the bound T (a compile-time trip count); prompts loop to
        # the row's own length, so a short row in a long step costs its own tokens only.
        # A position past the row's end skips the step's body, so every token the body
        # sees is valid: no load or store masked by validity, no tile kept.
        if STEPS_BY_LENGTH:
            steps = length
        else:
            steps = T

        KQ: tl.constexpr = BK // 4
        # Rows past V only where V is not a multiple of the tile's height.
        FULL_V: tl.constexpr = V % BV == 0
        offs_c = tl.arange(0, KQ)  # key index within a part
        all_c = offs_c >= 0
        offs_v = i_v * BV + tl.arange(0, BV)
        if FULL_V:
            mask_v = tl.arange(0, BV) >= 0
        else:
            mask_v = offs_v < V
        o_row = o_ptr + (bos * HV + i_hv) * V + offs_v  # o is a fresh contiguous [N, HV, V]

        if (slot < 0) | (length < 1):
            # Padding row (or an empty window, outside the contract): zero outputs,
            # nothing else (an empty window's state would be written back unchanged).
            chain_wait(CHAINED)
            for i in range(0, steps):
                tl.store(o_row + i * HV * V, tl.full([BV], 0, o_ptr.dtype.element_ty), mask=_tl_mask_and(mask_v, i < length))
            return

        A_log = tl.load(A_log_ptr + i_hv)
        dt_bias = tl.load(dt_bias_ptr + i_hv)
        tile = offs_v[:, None] * K + offs_c[None, :]
        state_at = state_ptr + slot * stride_state_slot + i_hv * (V * K)  # [HV, V, K] packed per slot
        S0, S1, S2, S3 = _tl_load_parts(state_at, tile, mask_v[:, None], offs_c[None, :], K, KQ)
        chain_wait(CHAINED)
        # The window's first token at this program's heads (64-bit); a token's loads add
        # its position within the window times the token stride, in 32 bits below the
        # prompt bound (at most 16 tokens times a layer's activation row).
        q_at = q_ptr + bos * stride_q_tok + i_h * stride_q_head
        k_at = k_ptr + bos * stride_k_tok + i_h * stride_k_head
        v_at = v_ptr + bos * stride_v_tok + i_hv * stride_v_head
        a_at = a_ptr + bos * stride_a_tok + i_hv
        b_at = b_ptr + bos * stride_b_tok + i_hv
        last = length - 1
        if HAS_SNAPSHOTS:
            snap_at = snap_ptr + slot * stride_snap_slot + i_hv * (V * K)  # token i's at + i * HV * V * K
        if HAS_RECORDS:
            # The key once per key head: by the group's first value head, first V block.
            k_mask = _tl_mask_and(all_c, (i_hv % (HV // H) == 0) & (i_v == 0))
            # g and beta once per value head: by its first V block.
            gb_writer = i_v == 0
            # This program's records (any slot and head strides), positions added per token.
            rk_at = rec_k_ptr + slot * srk_slot + i_h * srk_head
            rv_at = rec_v_ptr + slot * srv_slot + i_hv * srv_head
            rg_at = rec_g_ptr + slot * srg_slot + i_hv * srg_head
            rb_at = rec_beta_ptr + slot * srb_slot + i_hv * srb_head

        # With LOAD_AHEAD, software pipelining by hand: the next token's loads are issued
        # before this token's step, so their latency hides behind the arithmetic, at the
        # cost of a second token's inputs live in registers (on sm_90, 255 registers a
        # thread instead of 168 for a 64-row verify of 4 tokens: two programs an SM
        # instead of three). Without it each step loads its own token first, and other
        # programs hide the latency. The arithmetic is the same either way. The last
        # step's look-ahead loads the window's last token again (in the window, unused)
        # rather than a masked one past it.
        if LOAD_AHEAD:
            q0n, q1n, q2n, q3n, k0n, k1n, k2n, k3n, v_n, a_n, b_n = _window_token(
                q_at, k_at, v_at, a_at, b_at, 0, offs_c, offs_v, mask_v,
                stride_q_tok, stride_k_tok, stride_v_tok, stride_a_tok, stride_b_tok, K, KQ, FULL_V,
            )
        for i in range(0, steps):
            if i < length:
                if LOAD_AHEAD:
                    q0, q1, q2, q3, k0, k1, k2, k3, v, a, b = q0n, q1n, q2n, q3n, k0n, k1n, k2n, k3n, v_n, a_n, b_n
                    tok = tl.minimum(i + 1, last)
                else:
                    tok = i
                if STEPS_BY_LENGTH:
                    tok = tok.to(tl.int64)  # a prompt's position times its stride may pass 2**31
                q0t, q1t, q2t, q3t, k0t, k1t, k2t, k3t, v_t, a_t, b_t = _window_token(
                    q_at, k_at, v_at, a_at, b_at, tok, offs_c, offs_v, mask_v,
                    stride_q_tok, stride_k_tok, stride_v_tok, stride_a_tok, stride_b_tok, K, KQ, FULL_V,
                )
                if LOAD_AHEAD:
                    q0n, q1n, q2n, q3n, k0n, k1n, k2n, k3n, v_n, a_n, b_n = q0t, q1t, q2t, q3t, k0t, k1t, k2t, k3t, v_t, a_t, b_t
                else:
                    q0, q1, q2, q3, k0, k1, k2, k3, v, a, b = q0t, q1t, q2t, q3t, k0t, k1t, k2t, k3t, v_t, a_t, b_t
                # A valid token (True): exact_token's step replaces the tile outright.
                S0, S1, S2, S3, o, u, g, beta = exact_token(S0, S1, S2, S3, q0, q1, q2, q3, k0, k1, k2, k3, v, a, b,
                                                            A_log, dt_bias, True, eps, scale)
                tl.store(o_row + i * HV * V, _tl_to_rtne(o, o_ptr.dtype.element_ty), mask=mask_v)
                if HAS_SNAPSHOTS:
                    _tl_store_parts(snap_at + i * (HV * V * K), tile, mask_v[:, None], offs_c[None, :], K, KQ,
                                    S0, S1, S2, S3)
                if HAS_RECORDS:
                    # Side channel only: stores, no change to the arithmetic above (the key
                    # as the ring keeps it: the step's own normalisation in an fp32 ring, the
                    # raw parts through fp32 and back, lossless, in a 16-bit one).
                    r0, r1, r2, r3 = _tl_record_key(rk_at, k0, k1, k2, k3, eps)
                    _tl_store_parts(rk_at, i * srk_pos + offs_c, k_mask, offs_c, K, KQ, r0, r1, r2, r3)
                    tl.store(rv_at + i * srv_pos + offs_v, v.to(rec_v_ptr.dtype.element_ty), mask=mask_v)
                    tl.store(rg_at + i * srg_pos, g, mask=gb_writer)
                    tl.store(rb_at + i * srb_pos, beta, mask=gb_writer)
        if UPDATE_STATE:
            _tl_store_parts(state_at, tile, mask_v[:, None], offs_c[None, :], K, KQ, S0, S1, S2, S3)


@register("recurrence", "triton")
def gdn_recurrence_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    snapshots: torch.Tensor | None = None,
    records: RawRecords | None = None,
    update_state: bool = False,
    max_len: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`gdn_recurrence_reference` (same arguments and results).

    Differences: float64 is not supported (the reference is the float64 oracle).
    Layouts: ``state`` packed per slot (``[HV, V, K]``; any slot stride), ``snapshots``
    packed per slot (``[T, HV, V, K]``), the records any strides on their slot, position
    and head axes with the last axis contiguous (SGLang's ``[slots, heads, R, dim]``
    rings, transposed, fit), activations contiguous along their last axis.
    ``records.g`` and ``records.beta`` must be float32. Windows must have ``1..T``
    tokens with ``T`` the bound from ``snapshots``, ``records`` or ``max_len``, and live
    slots be unique and in range: :mod:`~replayssm.ops.guards` checks that once per step
    on the host, or on the device inside a CUDA graph (bad rows run as padding).

    Inside :func:`~replayssm.ops.triton_common.chained_launches`, a read-only call (no
    ``snapshots``, no ``update_state``) on the caller's own indices launches as the
    programmatic dependent of the kernel before it: its programs read ``slots``,
    ``cu_seqlens`` and their state tiles before they wait for that kernel, which must
    not be writing them.
    """
    n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, A_log, dt_bias)
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        _checks.tensor(name, x, dtypes=ACT_DTYPES_TRITON)
    check_inner_contiguous(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    _checks.tensor("state", state, ndim=4, dtypes=STATE_DTYPES_TRITON)
    num_slots = state.shape[0]
    _checks.shape("state", state, [num_slots, hv, vd, kd])
    _checks.packed("state", state, 3)
    check_index_pair(slots, cu_seqlens)
    _checks.same_device(q, state=state, slots=slots, cu_seqlens=cu_seqlens)
    max_len = check_max_len(max_len)
    snap_len = ring_len = None
    if snapshots is not None:
        _checks.tensor("snapshots", snapshots, ndim=5, dtypes=STATE_DTYPES_TRITON)
        _checks.shape("snapshots", snapshots, [num_slots, None, hv, vd, kd])
        _checks.packed("snapshots", snapshots, 4)
        _checks.same_device(q, snapshots=snapshots)
        snap_len = snapshots.shape[1]
    if records is not None:
        if not isinstance(records, RawRecords):
            raise TypeError(f"records must be RawRecords, got {type(records).__name__}")
        records.check("records", num_slots, h, kd, hv, vd)
        for field in ("g", "beta"):
            _checks.tensor(f"records.{field}", getattr(records, field), dtypes=(torch.float32,))
        check_inner_contiguous(**{f"records.{f}": getattr(records, f) for f in ("k", "v")})
        _checks.same_device(q, records=records.k)
        ring_len = records.ring_len
    o = torch.empty(n, hv, vd, dtype=v.dtype, device=v.device)
    batch = slots.shape[0]
    if batch == 0:
        return o
    t = window_bound(max_len, snap_len, ring_len)
    given = slots
    bound = min(b for b in (max_len, snap_len, ring_len) if b)
    slots, cu_seqlens = guards.check_indices(slots, cu_seqlens, num_slots=num_slots, num_tokens=n, max_len=bound)
    if slots is not given:
        o.zero_()  # rewritten on the device: rows made padding zero only what they cover
    bk = exact_block_k(kd)
    row, bv, warps = exact_tile(kd, vd, batch, hv, state.dtype, q.device,
                                read_only=snapshots is None and not update_state, snapshots=snapshots is not None)
    dummy = o  # stands in for absent optional buffers; never dereferenced
    rec = records if records is not None else RawRecords(dummy, dummy, dummy, dummy)
    rec_strides = [x.stride(d) if records is not None else 0 for x in rec for d in range(3)]
    grid = (triton.cdiv(vd, bv), batch, hv)
    # Chained (triton_common.chained_launches) only where it reads states and nothing
    # else: a state writer's early loads slowed the writer, where a read-only verify's
    # sped it up (BENCHMARKS.md, "The state kernels as a chain, on and off"). And only on
    # the caller's own indices: guarded ones were rewritten just now.
    read_only = snapshots is None and not update_state
    chained, launch = chain_launch() if slots is given and read_only else (False, {})
    _recurrence_kernel[grid](
        q, k, v, a, b, A_log, dt_bias,
        state, slots, cu_seqlens, o,
        snapshots if snapshots is not None else dummy, rec.k, rec.v, rec.g, rec.beta,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        state.stride(0), snapshots.stride(0) if snapshots is not None else 0, *rec_strides,
        kd**-0.5, NORM_EPS,
        H=h, HV=hv, K=kd, V=vd, BK=bk, BV=bv, T=t,
        HAS_SNAPSHOTS=snapshots is not None, HAS_RECORDS=records is not None, UPDATE_STATE=bool(update_state),
        STEPS_BY_LENGTH=t > STEPS_BY_LENGTH_ABOVE, LOAD_AHEAD=bool(row["load_ahead"]), CHAINED=chained,
        num_warps=warps, **launch,
    )
    return o
