"""Shared ``@triton.jit`` helpers of the GDN kernels (DESIGN.md section 1).

Every Triton kernel that advances a GDN state builds it from these helpers, in the
reference operation order of :mod:`replayssm.ops.gates` and
:func:`replayssm.ops.recurrent.state_update`:

    g    = -exp(A_log) * softplus(a + dt_bias)          (:func:`gdn_gates`)
    beta = 1 / (1 + exp(-b))
    k^   = k / sqrt(sum(k*k) + eps)                     (:func:`normalized`)
    S'   = exp(g) * S                                   (:func:`gdn_state_step`)
    u    = beta * (v - S' k^)
    S    = S' + u k^T

Exactness rule. On one device, every exact path (recurrent verify with snapshots or
``update_state``, the fold kernel, the circular flush) must reach the same fp32 state
bit for bit. They do when they all hold a state tile the same way and advance it with
the same helpers: a ``[BV, BK]`` tile (``BK = next_power_of_2(K)``, the whole key axis,
``V`` split in rows) is held as four ``[BV, BK/4]`` column parts (:func:`load_parts`),
keys and queries as four ``[BK/4]`` parts, and :func:`normalized` and
:func:`gdn_state_step` do the arithmetic. Rows are independent, so ``BV`` may differ
between kernels; ``BK`` must not, nor the lanes' layout of a row (other warp counts, where a table
row asks for them, only stack along V: :func:`exact_warps`). Why four parts: Triton
lays a block out from its shape, and an fp32 ``[BV, 32]`` part gets 4 consecutive keys
per thread x 8 lanes per row, so a thread holds 16 keys of a row and a row's dot
product is 16 in-thread fused multiply-adds plus 3 shuffle steps. One ``[BV, 128]`` tile
got 4 keys per thread x 32 lanes (5 shuffle steps for every 4 keys) and its key
normalisation crossed warps through shared memory (BENCHMARKS.md, tuning notes). A
16-bit tile gets the same layout: Triton would give its loads 8 keys per thread x 4
lanes (a 16-byte vector), which doubles the keys and queries each thread holds and the
in-thread chain of every row sum, so :func:`load_parts` and :func:`store_parts` cap the
tile pointers' contiguity at 4 (``tl.max_contiguous``, 8-byte vectors). A key's
:func:`normalized` runs on its ``[BK/4]`` vectors, whose sum of squares sm_90 compiles in
a one-dimensional layout (one key a lane, 32 lanes: TTGIR) in every exact kernel; a
kernel that normalises keys with no state tile (circular's coefficient kernel, which
writes the ring's normalised keys) holds them the same way, so its bits are the
recurrence's. Sums that decide bits are spelled
with explicit ``tl.fma``, so that no kernel depends on the compiler's contraction
choices.

Small helpers for kernel writers: :func:`store_parts`, :func:`record_key` (what a
ring stores for a key), :func:`row_dot` (``S x`` of parts), :func:`row_sum` (``tl.sum`` that stays cheap under the interpreter),
:func:`to_rtne` (a store's cast, rounded to nearest even on every backend),
:func:`block_rows` (the host's choice of a tile's row count),
:func:`dependent_launch` (whether a launch may overlap the kernel before it),
:func:`chained_launches` with :func:`chain_launch` and :func:`chain_wait` (a chain of
small kernels, each starting during the one before it), :func:`arrival_counters` with
:func:`last_to_arrive` (a launch split into parts that its last part merges),
:func:`mask_and` (block mask ``&`` scalar flag), :func:`window_program` (a window
kernel's program coordinates) and :func:`device_fn` (``triton.jit`` for straight-line
device helpers).

Precision: divisions and square roots use the IEEE-rounded ``div_rn`` / ``sqrt_rn``
(Triton's plain ``/`` and ``sqrt`` are approximate on NVIDIA GPUs); ``exp`` and ``log``
are Triton's fast versions, a few ulp from ``torch``'s; a key is normalised as ``k *
(1 / sqrt(...))`` (one division per vector instead of one per key; within an ulp of
``k / sqrt(...)``). So the kernels agree with the reference to fp32 rounding, not bit
for bit, while agreeing with each other exactly.

The module imports without Triton (``triton`` is then ``None`` and no helper exists).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

from .gates import NORM_EPS, SOFTPLUS_THRESHOLD

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

#: ``num_warps`` of every kernel that advances a state exactly (see the module notes),
#: unless its table row asks for another count (:func:`exact_warps`).
EXACT_NUM_WARPS = 4

def exact_warps(warps: int, bv: int) -> int:
    """``num_warps`` of an exact kernel on ``[bv, BK]`` tiles, given the shape table's
    ``warps`` (1, 2, 4 or 8).

    A four-part tile's row is laid out the same whatever the warps: 4 keys a thread x 8
    lanes, 4 rows a warp (fp32 and 16-bit states: sm_90 TTGIR), and the warps stack
    along V. So every row sum over K keeps its order, and the states their bits, as long
    as each warp gets whole 4-row groups of its own: 8 warps need 64 rows, and up to 4
    warps ``4 x warps`` rows. A smaller tile takes the most warps it gives whole groups
    (4 at 16 rows, 2 at 8, 1 at 4), so no tile splits a row across warps whatever the
    table asks. Fewer warps a program mean more programs an SM, each with fewer rows.
    The bits at 1, 2 and 8 warps are GPU tests."""
    if warps == 8 and bv >= 64:
        return warps
    w = min(warps, EXACT_NUM_WARPS)
    while w > 1 and bv < 4 * w:
        w //= 2
    return w


#: Column parts of an exact kernel's state tile (see the module notes); the helpers
#: below are written for four.
EXACT_PARTS = 4

def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (1 elsewhere: the interpreter runs
    one program at a time), the unit that launch sizes are counted in."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream on which a split kernel pair runs its second kernel beside the
    first (a fork and a join, which a CUDA graph keeps as two branches): one per CUDA
    device, shared by every op, so a captured step holds one such stream."""
    return _side_stream(device.index if device.index is not None else torch.cuda.current_device())


def block_rows(vd: int, rows: int, device: torch.device, most: int, least: int = 1) -> int:
    """Rows ``BV`` of a kernel's ``[BV, *]`` state tile, for ``rows`` (windows x heads)
    tiles of ``vd`` rows each.

    On CUDA: ``most`` (at least ``least``, at most ``vd`` rounded up to a power of two),
    halved down to 16 while the device would get fewer than two programs per SM, so that
    small batches still fill the GPU. Rows are independent, so any ``BV`` gives the same
    numbers. Elsewhere (the interpreter): 16, so that small test heads still span several
    blocks.
    """
    full = triton.next_power_of_2(vd)
    if device.type != "cuda":
        return min(16, full)
    sms = sm_count(device)
    bv = max(least, min(most, full))
    while bv > 16 and rows * triton.cdiv(vd, bv) < 2 * sms:
        bv //= 2
    return bv


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def dependent_launch(device: torch.device) -> bool:
    """Whether a kernel on ``device`` may be launched as a programmatic dependent of the
    kernel before it in its stream (CUDA on compute capability 9.0 and up: grid
    dependency control). Such a kernel's programs start while the kernel before it still
    runs, so they must wait (``gdc_wait``) before they read anything that kernel writes;
    a CUDA graph keeps the relation as a programmatic edge. Elsewhere (older GPUs, the
    interpreter) launches stay in stream order, and the kernels' waits compile away."""
    if device.type != "cuda" or INTERPRETER:
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


_chain = threading.local()


@contextlib.contextmanager
def chained_launches(device: torch.device, enabled: bool = True, *, ordered_start: bool = True):
    """Within the block, the kernels that take part (:func:`chain_launch`) launch as
    programmatic dependents of the kernel before them, where :func:`dependent_launch`
    allows it on ``device`` and ``enabled`` holds; elsewhere, and after the block, in
    stream order. With ``ordered_start`` (the default) the block's first such kernel
    launches in stream order, so what the block reads before its first wait was
    finished before the block; without it, that kernel too overlaps whatever kernel
    comes before the block (fit where its programs read only weights before waiting).

    For a chain of small kernels, each a few microseconds of which most is its start
    (the programs' dispatch, the first loads' memory latency): each program of a
    chained kernel loads what the kernel before it does not write (weights; a state
    kernel's state), then waits for the kernel before it (:func:`chain_wait`), then
    lets the next kernel's programs start. So a kernel's start overlaps the one before
    it, one kernel ahead at most. The numbers are those of launches in stream order:
    each program reads its inputs only after the kernel that wrote them has finished.
    A CUDA graph captured in the block keeps each relation as a programmatic edge."""
    before = getattr(_chain, "on", False), getattr(_chain, "next_in_order", False)
    _chain.on = enabled and dependent_launch(device)
    _chain.next_in_order = ordered_start
    try:
        yield
    finally:
        _chain.on, _chain.next_in_order = before


def chain_active() -> bool:
    """Whether :func:`chain_launch` chains launches here (inside an enabled
    :func:`chained_launches` on a device that allows it)."""
    return getattr(_chain, "on", False)


def chain_launch() -> tuple[bool, dict]:
    """``(chained, launch options)`` for a kernel that takes part in
    :func:`chained_launches`: pass ``chained`` as its ``CHAINED`` constexpr (its
    programs then call :func:`chain_wait` before reading any input a kernel of the step
    writes) and the options to its launch. A kernel launched in stream order with
    ``CHAINED`` (a block's ordered start) waits for nothing and still lets the next
    kernel start early."""
    on = chain_active()
    if on and _chain.next_in_order:
        _chain.next_in_order = False
        return True, {}
    return on, ({"launch_pdl": True} if on else {})


#: Counters in one :func:`arrival_counters` buffer: the most rows (or row blocks) one
#: split launch can count its parts' arrivals on.
ARRIVAL_COUNTERS = 4096


def arrival_counters(device: torch.device | str) -> torch.Tensor:
    """Zeroed int32 counters ``[ARRIVAL_COUNTERS]`` for launches split into parts that
    their last part merges (:func:`last_to_arrive`: a split argmax's, the window
    attention's key split): each part counts its arrival on its row's counter, and the
    last to arrive merges the parts and sets the counter back to zero, so the merge costs
    no launch of its own. The owner keeps the buffer for its life (a CUDA graph holds its
    address) and gives it only to calls that run one after another: two calls counting
    on one buffer at the same time would merge too early."""
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


def check_arrivals(arrivals: torch.Tensor | None, device: torch.device) -> None:
    """A ``ValueError`` unless ``arrivals`` is ``None`` or an :func:`arrival_counters` buffer
    on ``device`` (its values are the caller's promise: zero between calls)."""
    if arrivals is None:
        return
    if not isinstance(arrivals, torch.Tensor) or arrivals.dtype != torch.int32 or arrivals.dim() != 1 \
            or not arrivals.is_contiguous() or arrivals.device != device or arrivals.numel() < ARRIVAL_COUNTERS:
        raise ValueError(f"arrivals must be a contiguous int32 [{ARRIVAL_COUNTERS}] tensor on {device} "
                         f"(arrival_counters), got {getattr(arrivals, 'dtype', type(arrivals).__name__)} "
                         f"{list(getattr(arrivals, 'shape', []))}")


def register_cap(max_registers: int, device: torch.device) -> dict:
    """Launch options that cap a kernel's registers per thread at ``max_registers`` on
    CUDA (``maxnreg``; 0: the compiler's choice). A cap changes where values live
    (registers or local memory), not the instructions that compute them, so no number
    moves; the interpreter has no registers to cap."""
    return {"maxnreg": max_registers} if max_registers and device.type == "cuda" and not INTERPRETER else {}


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

    if INTERPRETER:

        def to_rtne(x, dtype):
            """``x`` (fp32) cast to ``dtype`` for a store, rounded to nearest even.

            Interpreter form: its fp32 -> bf16 cast truncates (with or without
            ``fp_downcast_rounding="rtne"``), while the GPU rounds to nearest even; this
            rounds the bits by hand so that CPU and GPU store the same bf16 values.
            NaN stays NaN (quiet); values past bf16's range round to inf as on the GPU.
            """
            if dtype != tl.bfloat16 or x.dtype != tl.float32:
                return x.to(dtype)
            bits = x.to(tl.uint32, bitcast=True)
            # Add half an ulp of bf16 (minus one when the kept lowest bit is even: ties
            # go to even), then drop the 16 low bits.
            rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
            quiet_nan = (bits >> 16) | 0x40
            out = tl.where(x == x, rounded, quiet_nan)
            return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    else:

        @triton.jit
        def to_rtne(x, dtype: tl.constexpr):
            """``x`` cast to ``dtype`` for a store, rounded to nearest even (stated, not
            left to the default, so that every store names its rounding)."""
            return x.to(dtype, fp_downcast_rounding="rtne")

    @device_fn
    def as_stored(x0, x1, x2, x3, dtype: tl.constexpr):
        """Four fp32 parts as a store in ``dtype`` leaves them (:func:`to_rtne`), back in
        fp32: for a kernel that goes on from a state it stores in 16 bits."""
        return (to_rtne(x0, dtype).to(tl.float32), to_rtne(x1, dtype).to(tl.float32),
                to_rtne(x2, dtype).to(tl.float32), to_rtne(x3, dtype).to(tl.float32))

    if INTERPRETER:

        def expf(x):
            """``exp(x)`` of an fp32 block (interpreter form: numpy's, correctly rounded
            or nearly; the interpreter has no libdevice)."""
            return tl.exp(x)

    else:
        from triton.language.extra import libdevice as _libdevice

        @triton.jit
        def expf(x):
            """``exp(x)`` as CUDA's ``expf`` computes it (libdevice), the function torch's
            elementwise kernels call, where ``tl.exp`` is the faster ``ex2.approx``: for
            kernels that must round as a torch op does."""
            return _libdevice.exp(x)

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
    def load_parts(ptr, offs, mask, col, K: tl.constexpr, KQ: tl.constexpr):
        """Four fp32 parts ``x[offs + p * KQ]``, ``p = 0..3``, of a key-axis block.

        ``offs`` addresses part 0 (``[KQ]`` for a vector, ``[BV, KQ]`` for a state tile),
        ``col`` is its key index (``[KQ]``, broadcast along ``offs``) and ``mask`` a block
        mask broadcastable to ``offs`` (rows, validity). Keys ``>= K`` load as zero.
        """
        p0 = ptr + offs
        if len(p0.shape) == 2:
            # A tile: 4 keys a thread whatever the dtype (see the module notes). The
            # hint sits on a pointer made here, since one on an argument is dropped.
            p0 = tl.max_contiguous(p0, [1, 4])
        x0 = tl.load(p0, mask=mask & (col < K), other=0.0).to(tl.float32)
        x1 = tl.load(p0 + KQ, mask=mask & (col + KQ < K), other=0.0).to(tl.float32)
        x2 = tl.load(p0 + 2 * KQ, mask=mask & (col + 2 * KQ < K), other=0.0).to(tl.float32)
        x3 = tl.load(p0 + 3 * KQ, mask=mask & (col + 3 * KQ < K), other=0.0).to(tl.float32)
        return x0, x1, x2, x3

    @device_fn
    def store_parts(ptr, offs, mask, col, K: tl.constexpr, KQ: tl.constexpr, x0, x1, x2, x3):
        """Store four parts as :func:`load_parts` loads them (cast to ``ptr``'s dtype,
        rounded to nearest even)."""
        dtype = ptr.dtype.element_ty
        p0 = ptr + offs
        if len(p0.shape) == 2:
            p0 = tl.max_contiguous(p0, [1, 4])  # as load_parts: no layout change to store
        tl.store(p0, to_rtne(x0, dtype), mask=mask & (col < K))
        tl.store(p0 + KQ, to_rtne(x1, dtype), mask=mask & (col + KQ < K))
        tl.store(p0 + 2 * KQ, to_rtne(x2, dtype), mask=mask & (col + 2 * KQ < K))
        tl.store(p0 + 3 * KQ, to_rtne(x3, dtype), mask=mask & (col + 3 * KQ < K))

    @device_fn
    def sum_sq(x0, x1, x2, x3):
        """``sum(x*x)`` of a vector held as four fp32 ``[KQ]`` parts."""
        return row_sum(tl.fma(x3, x3, tl.fma(x2, x2, tl.fma(x1, x1, x0 * x0))), 0)

    @device_fn
    def inv_norm(x0, x1, x2, x3, eps):
        """``1 / sqrt(sum(x*x) + eps)`` of a vector held as four fp32 ``[KQ]`` parts,
        IEEE-rounded (the exact kernels' normalisation)."""
        return tl.div_rn(1.0, tl.sqrt_rn(sum_sq(x0, x1, x2, x3) + eps))

    @device_fn
    def normalized(x0, x1, x2, x3, eps, scale):
        """The four parts of ``x / sqrt(sum(x*x) + eps) * scale`` (``scale`` 1 for keys),
        computed as ``x * (scale / sqrt(...))``."""
        r = inv_norm(x0, x1, x2, x3, eps) * scale
        return x0 * r, x1 * r, x2 * r, x3 * r

    @device_fn
    def record_key(rk_ptr, k0, k1, k2, k3, eps):
        """The four parts a record stores at ``rk_ptr`` (a ring's keys) for a raw key's:
        :func:`normalized` where the ring's keys are fp32, the raw parts otherwise
        (:func:`~replayssm.ops.records.keys_normalized`). A kernel that also steps with
        the key computes the same normalisation, so the record holds its bits."""
        if rk_ptr.dtype.element_ty == tl.float32:
            return normalized(k0, k1, k2, k3, eps, 1.0)
        else:
            return k0, k1, k2, k3

    @device_fn
    def row_dot(S0, S1, S2, S3, x0, x1, x2, x3):
        """``S x``: ``[BV]`` for a state tile and a vector, each held as four parts."""
        p = tl.fma(S3, x3[None, :], tl.fma(S2, x2[None, :], tl.fma(S1, x1[None, :], S0 * x0[None, :])))
        return row_sum(p, 1)

    @device_fn
    def gdn_step(S0, S1, S2, S3, k0, k1, k2, k3, v, g, beta):
        """One exact GDN step of a state tile held as four fp32 ``[BV, KQ]`` parts.

        ``k0..k3`` are the normalised key's parts (:func:`normalized`), ``v`` the
        ``[BV]`` fp32 values of the tile's rows, ``g`` and ``beta`` fp32 scalars.
        Returns the new tile's parts and the step's corrected delta ``u [BV]`` (the
        ring keeps it for the closed form).
        """
        e = tl.exp(g)
        S0 = e * S0
        S1 = e * S1
        S2 = e * S2
        S3 = e * S3
        u = beta * (v - row_dot(S0, S1, S2, S3, k0, k1, k2, k3))
        return (tl.fma(u[:, None], k0[None, :], S0), tl.fma(u[:, None], k1[None, :], S1),
                tl.fma(u[:, None], k2[None, :], S2), tl.fma(u[:, None], k3[None, :], S3), u)

    @device_fn
    def gdn_state_step(S0, S1, S2, S3, k0, k1, k2, k3, v, g, beta):
        """:func:`gdn_step`'s new tile parts alone."""
        N0, N1, N2, N3, u = gdn_step(S0, S1, S2, S3, k0, k1, k2, k3, v, g, beta)
        return N0, N1, N2, N3

    @device_fn
    def folding_rows(slots_ptr, cu_ptr, wp_ptr, flush_ptr, batch, BB: tl.constexpr):
        """The batch's rows that fold this step (live, ``is_flush`` set, ``write_pos >
        0``), counted on the device for kernels that walk them (``BB >= batch``):
        ``(before, count)``, ``before[r]`` the folding rows up to and including row
        ``r``. The ``j``-th of them (from 0) is row ``sum(before <= j)``."""
        rows = tl.arange(0, BB)
        in_batch = rows < batch
        slot_b = tl.load(slots_ptr + rows, mask=in_batch, other=-1)
        length_b = tl.load(cu_ptr + rows + 1, mask=in_batch, other=0) - tl.load(cu_ptr + rows, mask=in_batch, other=0)
        live = (slot_b >= 0) & (length_b > 0)
        at = tl.where(live, slot_b, 0)
        folds = live & (tl.load(flush_ptr + at, mask=live, other=0) != 0) & (tl.load(wp_ptr + at, mask=live, other=0) > 0)
        return tl.cumsum(folds.to(tl.int32), 0), tl.sum(folds.to(tl.int32), 0)

    @device_fn
    def short_tail_row(j, slots_ptr, cu_ptr, wp_ptr, flush_ptr, batch, tail, BB: tl.constexpr):
        """The batch row at position ``j`` of an order that moves the last ``tail`` rows
        that do not fold (:func:`folding_rows`) to the end and keeps the others in batch
        order (``BB >= batch``). A grid laid out in that order ends on short programs,
        so no fold's chain starts in its last waves; with ``tail`` at least the rows
        that do not fold, the folding rows come first."""
        before, count = folding_rows(slots_ptr, cu_ptr, wp_ptr, flush_ptr, batch, BB)
        rows = tl.arange(0, BB)
        in_batch = rows < batch
        rest = rows + 1 - before  # the rows that do not fold, up to and including r
        keep = batch - count - tl.minimum(tail, batch - count)  # of those, the ones that stay in place
        head = tl.where(in_batch, rows + 1 - tl.maximum(rest - keep, 0), BB + 1)  # rows in place up to r
        n_head = count + keep
        return tl.where(j < n_head, tl.sum((head <= j).to(tl.int32), 0),
                        tl.sum((tl.where(in_batch, rest, BB + 1) <= keep + j - n_head).to(tl.int32), 0))

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

    @triton.jit
    def chain_wait(CHAINED: tl.constexpr):
        """In a kernel launched by :func:`chain_launch` with ``CHAINED``: wait until the
        kernel before it has finished and its writes are visible, then let the kernel
        after it start its programs (they too wait before reading). Without
        ``CHAINED``, nothing (the launch is in stream order)."""
        if CHAINED:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def last_to_arrive(counter_ptr, parts):
        """After a program has stored its part of a split launch: count its arrival on
        ``counter_ptr`` (an :func:`arrival_counters` entry, zero before the launch's
        first part); whether it is the ``parts``-th, the last. The last reads the other
        parts (past L1: ``cache_modifier=".cg"``), merges them and stores 0 at
        ``counter_ptr`` for the next launch. The barrier orders every thread's stores
        before thread 0's release, which publishes them; the last program's acquire
        sees them all."""
        tl.debug_barrier()
        return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == parts - 1

    @device_fn
    def mask_and(mask, flag):
        """``mask & flag`` for a block ``mask`` and a scalar boolean tensor ``flag``.

        Spelled as a block comparison because the Triton interpreter turns a broadcast
        scalar boolean into integers, which loads and stores then reject as masks.
        """
        return mask & (tl.full(mask.shape, 0, tl.int32) + flag.to(tl.int32) != 0)
