"""Shared ``@triton.jit`` helpers of the GDN kernels (DESIGN.md section 1).

Every Triton kernel that advances a GDN state builds it from these helpers, in the
reference operation order of :mod:`replayssm.ops.gates` and
:func:`replayssm.ops.recurrent.state_update`:

    g    = -exp(A_log) * softplus(a + dt_bias)          (:func:`gdn_gates`)
    beta = 1 / (1 + exp(-b))
    k^   = k / sqrt(sum(k*k) + eps)                     (:func:`l2norm`)
    S'   = exp(g) * S                                   (:func:`gdn_state_step`)
    u    = beta * (v - S' k^)
    S    = S' + u k^T

Exactness rule. On one device, every exact path (recurrent verify with snapshots or
``update_state``, the fold kernel, the circular flush) must reach the same fp32 state
bit for bit. They do when they all call :func:`l2norm` and :func:`gdn_state_step` on
full-``K`` tiles: the state tile is ``[BV, BK]`` with ``BK = next_power_of_2(K)`` (the
whole key axis in one block, so the ``S' k^`` reduction has one shape everywhere) and
``V`` split in rows. Rows are independent, so ``BV`` may differ between kernels; ``BK``
must not. Triton lays a reduction out from the tile shape and ``num_warps``; keep
``BV >= num_warps`` and use :data:`EXACT_NUM_WARPS` so that a row of the tile never
spans warps and the ``K`` reduction runs in the same order in every kernel. (Compiled
for sm_90 with Triton 3.6 and 3.9, an fp32 ``[BV, 128]`` tile gets 4 consecutive keys
per thread x 32 lanes per row for every ``BV`` in 8..32, and the ``[128]`` key vector
of :func:`l2norm` one element per thread over the 4 warps, in the recurrence and the
fold kernels alike.)

Small helpers for kernel writers: :func:`row_sum` (``tl.sum`` that stays cheap under
the interpreter), :func:`mask_and` (block mask ``&`` scalar flag),
:func:`window_program` (a window kernel's program coordinates) and :func:`device_fn`
(``triton.jit`` for straight-line device helpers).

Precision: divisions and square roots use the IEEE-rounded ``div_rn`` / ``sqrt_rn``
(Triton's plain ``/`` and ``sqrt`` are approximate on NVIDIA GPUs); ``exp`` and ``log``
are Triton's fast versions, a few ulp from ``torch``'s. So the kernels agree with the
reference to fp32 rounding, not bit for bit, while agreeing with each other exactly.

The module imports without Triton (``triton`` is then ``None`` and no helper exists).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None
    tl = None

#: Whether the kernels were defined for the Triton interpreter (``TRITON_INTERPRET=1``
#: at import time). ``triton.jit`` reads the variable when a kernel is defined, so
#: setting it later has no effect on kernels already imported.
INTERPRETER = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"

#: ``num_warps`` of every kernel that advances a state exactly (see the module notes).
EXACT_NUM_WARPS = 4

#: ``eps`` of the key/query normalisation, as in :data:`replayssm.ops.gates.NORM_EPS`.
NORM_EPS = 1e-6

#: ``softplus(x) = x`` above this, as in :data:`replayssm.ops.gates.SOFTPLUS_THRESHOLD`.
SOFTPLUS_THRESHOLD = 20.0


def device_fn(fn):
    """``triton.jit`` for device helpers (functions that kernels call).

    Under the interpreter the helper stays a plain Python function: the interpreter
    patches ``triton.language`` once per kernel launch, but re-patches it at every call
    of a jitted helper (milliseconds each), which made the per-token helpers dominate
    CPU test time. The operations, and so the numbers, are the same either way. Only
    straight-line helpers qualify (no loops or branches on tensors).
    """
    return fn if INTERPRETER else triton.jit(fn)


if triton is not None:
    # Module globals reach jitted code only as constexpr.
    _SOFTPLUS_THRESHOLD = tl.constexpr(SOFTPLUS_THRESHOLD)

    if INTERPRETER:

        def row_sum(x, axis, keep_dims=False):
            """``tl.sum`` of an fp32 block (interpreter form: the reduction itself,
            without the jitted ``tl.sum`` wrapper and its per-call patching cost)."""
            return tl.reduce(x, axis, tl.standard._sum_combine, keep_dims=keep_dims)

    else:

        @triton.jit
        def row_sum(x, axis: tl.constexpr, keep_dims: tl.constexpr = False):
            """``tl.sum`` of an fp32 block along ``axis``."""
            return tl.sum(x, axis, keep_dims=keep_dims)

    @device_fn
    def gdn_gates(a, b, A_log, dt_bias):
        """Decay ``g`` and write strength ``beta`` (fp32) from raw gates.

        ``a``, ``b`` are loaded values (scalars or blocks, any float dtype) and
        ``A_log``, ``dt_bias`` the head's parameters, broadcastable to them.
        ``softplus(x) = log1p(exp(x))`` below the threshold; ``log1p`` is evaluated as
        ``log(1 + e) * e / ((1 + e) - 1)``, which keeps full relative accuracy where
        ``1 + e`` rounds (Triton has no ``log1p``).
        """
        x = a.to(tl.float32) + dt_bias.to(tl.float32)
        # Clamp before exp: the branch above the threshold is discarded, but exp(x)
        # would overflow to inf and the discarded lane would compute inf * 0.
        e = tl.exp(tl.minimum(x, _SOFTPLUS_THRESHOLD))
        one_plus = 1.0 + e
        d = one_plus - 1.0
        # Where 1 + e rounds to 1, log1p(e) = e to fp32 precision; the guard also keeps
        # the discarded lane away from 0 / 0.
        d_safe = tl.where(d == 0.0, 1.0, d)
        log1p_e = tl.where(d == 0.0, e, tl.log(one_plus) * tl.div_rn(e, d_safe))
        softplus = tl.where(x > _SOFTPLUS_THRESHOLD, x, log1p_e)
        g = -tl.exp(A_log.to(tl.float32)) * softplus
        beta = tl.div_rn(tl.full(b.shape, 1.0, tl.float32), 1.0 + tl.exp(-b.to(tl.float32)))
        return g, beta

    @device_fn
    def l2norm(x, eps):
        """``x / sqrt(sum(x*x) + eps)`` over the last axis of a ``[BK]`` or ``[N, BK]`` block.

        Masked lanes must be loaded as zero; they stay zero. Returns fp32.
        """
        x = x.to(tl.float32)
        ss = row_sum(x * x, len(x.shape) - 1, keep_dims=True)
        return tl.div_rn(x, tl.sqrt_rn(ss + eps))

    @device_fn
    def gdn_state_step(S, k_hat, v, g, beta):
        """One exact GDN step of a ``[BV, BK]`` fp32 state tile (rows: values, cols: keys).

        ``k_hat`` is the normalised key ``[BK]`` (full ``K``, masked lanes zero), ``v``
        the ``[BV]`` fp32 values of the tile's rows, ``g`` and ``beta`` fp32 scalars.
        Returns the new tile.
        """
        S = tl.exp(g) * S
        u = beta * (v - row_sum(S * k_hat[None, :], 1))
        S = S + u[:, None] * k_hat[None, :]
        return S

    @device_fn
    def window_program(slots_ptr, cu_ptr, H, HV):
        """Where a window kernel's program works, for grids ``(V blocks, windows, HV)``.

        Returns ``(i_v, i_b, i_hv, i_h, slot, bos, length)``: the V block, the window, the
        value head and the key head it reads (GQA), then the window's slot (``-1`` for
        padding), first token and token count, as int64 (pool buffers pass 2**31
        elements at real sizes).
        """
        i_v = tl.program_id(0)
        i_b = tl.program_id(1)
        i_hv = tl.program_id(2)
        i_h = i_hv // (HV // H)
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        bos = tl.load(cu_ptr + i_b).to(tl.int64)
        length = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
        return i_v, i_b, i_hv, i_h, slot, bos, length

    @device_fn
    def mask_and(mask, flag):
        """``mask & flag`` for a block ``mask`` and a scalar boolean tensor ``flag``.

        Spelled as a block comparison because the Triton interpreter turns a broadcast
        scalar boolean into integers, which loads and stores then reject as masks.
        """
        return mask & (tl.full(mask.shape, 0, tl.int32) + flag.to(tl.int32) != 0)
