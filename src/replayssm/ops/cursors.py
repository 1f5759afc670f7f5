"""Ring cursors of the ``circular`` strategy (DESIGN.md section 3).

Per request: ``write_pos`` (committed records since the checkpoint), ``cache_base``
(physical ring position of record 0) and ``is_flush``. At commit, with ``n`` accepted
tokens (bonus included) and window ``T``:

    if is_flush:  cache_base = (cache_base + write_pos) & (L - 1);  write_pos = n
    else:         write_pos = write_pos + n
    is_flush = write_pos + 2 T > L

``is_flush`` is raised one window early, so a window never overwrites history: after a
non-flush commit ``write_pos + T <= L``. A flush row folds its history into the
checkpoint at its next verify. Rolling back rejected tokens is simply not counting them.
With ``flush_every`` (the strategy's small-batch mode) ``is_flush`` is raised at every
commit instead, so a history is never longer than one step's accepted tokens.

Staggered flushes (the optional ``first_cycle`` flags, 1 for a slot that has not
flushed since it was admitted): requests admitted together would otherwise fill their
rings in step and all flush at the same step, one slow step every ``P = L - 2T + 1``
tokens of plain decoding. A slot's first cycle instead ends early, once
``write_pos >= 1 + slot % P``, which spreads the phases of consecutive slots over the
``P`` steps; the flag clears at that flush. One flush more per request, of fewer
records; the committed state is the same (a fold is exact whenever it runs).
"""

from __future__ import annotations

import torch

from . import _checks, guards
from .dispatch import pick, register


def check_cursor_args(write_pos, cache_base, is_flush, slots, accepted=None):
    _checks.tensor("write_pos", write_pos, ndim=1, dtypes=(torch.int32, torch.int64))
    ns = write_pos.shape[0]
    for name, x in (("cache_base", cache_base), ("is_flush", is_flush)):
        _checks.tensor(name, x, ndim=1, dtypes=(torch.int32, torch.int64))
        _checks.shape(name, x, [ns])
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if accepted is not None:
        _checks.tensor("accepted", accepted, ndim=1, dtypes=_checks.INDEX_DTYPES)
        _checks.shape("accepted", accepted, [slots.shape[0]])
    _checks.same_device(write_pos, cache_base=cache_base, is_flush=is_flush, slots=slots, accepted=accepted)
    return ns


def check_flush_every(flush_every):
    if not isinstance(flush_every, bool):
        raise TypeError(f"flush_every must be a bool, got {type(flush_every).__name__}")


def check_first_cycle(first_cycle, write_pos):
    if first_cycle is not None:
        _checks.tensor("first_cycle", first_cycle, ndim=1, dtypes=(torch.int32, torch.int64))
        _checks.shape("first_cycle", first_cycle, [write_pos.shape[0]])
        _checks.same_device(write_pos, first_cycle=first_cycle)


def first_flush_at(slot, window: int, ring_len: int):
    """``write_pos`` at which a slot's first cycle ends (module notes): ``1 + slot % P``
    with ``P = L - 2T + 1``, the natural period, so ``P`` itself is the usual rule."""
    return 1 + slot % (ring_len - 2 * window + 1)


@register("advance_cursors", "reference")
def advance_cursors_reference(
    write_pos: torch.Tensor,
    cache_base: torch.Tensor,
    is_flush: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    window: int,
    ring_len: int,
    *,
    flush_every: bool = False,
    first_cycle: torch.Tensor | None = None,
) -> None:
    """Commit ``accepted[i]`` tokens for every row ``i`` with ``slots[i] >= 0``, in place.

    Args:
        write_pos, cache_base, is_flush: ``[num_slots]`` int32 cursors.
        slots: ``[B]`` slot per row, ``-1`` rows are ignored; live slots are unique.
        accepted: ``[B]`` accepted tokens per row, ``1 <= n <= window`` (not checked
            here: the strategy validates it once per step).
        window: ``T``, the largest window.
        ring_len: ``L``, a power of two with ``L >= 2 T``.
        flush_every: raise ``is_flush`` for every committed row (fold the history at
            the next verify), not only when the ring is about to fill.
        first_cycle: optional ``[num_slots]`` int32 flags (1: the slot has not flushed
            since admission): stagger the first flushes (module notes); cleared, in
            place, when the flagged flush happens.
    """
    check_cursor_args(write_pos, cache_base, is_flush, slots, accepted)
    check_flush_every(flush_every)
    check_first_cycle(first_cycle, write_pos)
    live = slots >= 0
    s = slots[live].long()
    n = accepted[live].to(write_pos.dtype)
    wp, base, flush = write_pos[s], cache_base[s], is_flush[s] != 0
    new_base = torch.where(flush, (base + wp) & (ring_len - 1), base)
    new_wp = torch.where(flush, n, wp + n)
    write_pos[s] = new_wp
    cache_base[s] = new_base
    new_flush = (new_wp + 2 * window > ring_len) | flush_every
    if first_cycle is not None:
        first = (first_cycle[s] != 0) & ~flush
        new_flush = new_flush | (first & (new_wp >= first_flush_at(s, window, ring_len)))
        first_cycle[s] = first.to(first_cycle.dtype)
    is_flush[s] = new_flush.to(is_flush.dtype)


@register("reset_cursors", "reference")
def reset_cursors_reference(write_pos, cache_base, is_flush, slots) -> None:
    """Empty the history of every slot in ``slots`` (``-1`` ignored): all cursors to 0."""
    check_cursor_args(write_pos, cache_base, is_flush, slots)
    s = slots[slots >= 0].long()
    for x in (write_pos, cache_base, is_flush):
        x[s] = 0


def advance_cursors(
    write_pos: torch.Tensor,
    cache_base: torch.Tensor,
    is_flush: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    window: int,
    ring_len: int,
    *,
    flush_every: bool = False,
    first_cycle: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """``circular``'s commit: move each slot's ring cursors past its ``accepted``
    records (DESIGN.md section 3). Arguments: :func:`advance_cursors_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("advance_cursors", backend, write_pos)(write_pos, cache_base, is_flush, slots, accepted, window,
                                                       ring_len, flush_every=flush_every, first_cycle=first_cycle)


def reset_cursors(
    write_pos: torch.Tensor, cache_base: torch.Tensor, is_flush: torch.Tensor, slots: torch.Tensor,
    *, backend: str = "auto",
) -> None:
    """Empty the rings of ``slots`` (a new request). Arguments: :func:`reset_cursors_reference`.

    ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, the
    reference elsewhere; an explicit backend that cannot run raises, there is no silent
    fallback).
    """
    return pick("reset_cursors", backend, write_pos)(write_pos, cache_base, is_flush, slots)


# ---------------------------------------------------------------------------- Triton
# Elementwise over the batch rows; one launch, no host synchronisation.

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference backend works without Triton
    triton = None

CURSOR_BLOCK = 128

if triton is not None:
    from .triton_common import chain_launch, chain_wait

    @triton.jit
    def _advance_cursors_kernel(
        wp_ptr, base_ptr, flush_ptr, first_ptr, slots_ptr, acc_ptr, batch, window, ring_len,
        BLOCK: tl.constexpr, FLUSH_EVERY: tl.constexpr, STAGGER: tl.constexpr, CHAINED: tl.constexpr = False,
    ):
        chain_wait(CHAINED)  # its every input may be the kernel before's
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        slot = tl.load(slots_ptr + rows, mask=rows < batch, other=-1).to(tl.int64)
        live = slot >= 0
        at = tl.where(live, slot, 0)
        # Counts outside [0, window] are the caller's error (the strategy checks them once
        # per step); clamped, they cannot move a cursor out of the ring.
        n = tl.minimum(tl.maximum(tl.load(acc_ptr + rows, mask=live, other=0), 0), window).to(wp_ptr.dtype.element_ty)
        wp = tl.load(wp_ptr + at, mask=live, other=0)
        base = tl.load(base_ptr + at, mask=live, other=0)
        flush = tl.load(flush_ptr + at, mask=live, other=0) != 0
        new_base = tl.where(flush, (base + wp) & (ring_len - 1), base)
        new_wp = tl.where(flush, n, wp + n)
        tl.store(wp_ptr + at, new_wp, mask=live)
        tl.store(base_ptr + at, new_base.to(base_ptr.dtype.element_ty), mask=live)
        if FLUSH_EVERY:
            new_flush = live
        else:
            new_flush = new_wp + 2 * window > ring_len
        if STAGGER:
            first = (tl.load(first_ptr + at, mask=live, other=0) != 0) & (flush == 0)
            new_flush = new_flush | (first & (new_wp >= 1 + at % (ring_len - 2 * window + 1)))
            tl.store(first_ptr + at, first.to(first_ptr.dtype.element_ty), mask=live)
        tl.store(flush_ptr + at, new_flush.to(flush_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _reset_cursors_kernel(wp_ptr, base_ptr, flush_ptr, slots_ptr, batch, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        slot = tl.load(slots_ptr + rows, mask=rows < batch, other=-1).to(tl.int64)
        live = slot >= 0
        at = tl.where(live, slot, 0)
        tl.store(wp_ptr + at, tl.full([BLOCK], 0, wp_ptr.dtype.element_ty), mask=live)
        tl.store(base_ptr + at, tl.full([BLOCK], 0, base_ptr.dtype.element_ty), mask=live)
        tl.store(flush_ptr + at, tl.full([BLOCK], 0, flush_ptr.dtype.element_ty), mask=live)


def _check_cursor_launch(write_pos, cache_base, is_flush, slots, accepted=None):
    _checks.contiguous(write_pos=write_pos, cache_base=cache_base, is_flush=is_flush, slots=slots, accepted=accepted)


@register("advance_cursors", "triton")
def advance_cursors_triton(
    write_pos: torch.Tensor,
    cache_base: torch.Tensor,
    is_flush: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    window: int,
    ring_len: int,
    *,
    flush_every: bool = False,
    first_cycle: torch.Tensor | None = None,
) -> None:
    """Triton version of :func:`advance_cursors_reference` (same arguments and results).

    Cursors and indices must be contiguous; live slots must be unique (one program
    row per slot, as :meth:`~replayssm.state.StatePool.batch` guarantees). ``slots`` is
    checked by :mod:`~replayssm.ops.guards`; ``accepted`` is not read on the host and is
    clamped to ``[0, window]`` (the reference takes it as given).
    """
    check_cursor_args(write_pos, cache_base, is_flush, slots, accepted)
    check_flush_every(flush_every)
    check_first_cycle(first_cycle, write_pos)
    _check_cursor_launch(write_pos, cache_base, is_flush, slots, accepted)
    _checks.contiguous(first_cycle=first_cycle)
    for name, value in (("window", window), ("ring_len", ring_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    _checks.power_of_two("ring_len", ring_len)
    slots = guards.check_slots(slots, num_slots=write_pos.shape[0])
    batch = slots.shape[0]
    if batch == 0:
        return
    chained, launch = chain_launch()
    _advance_cursors_kernel[(triton.cdiv(batch, CURSOR_BLOCK),)](
        write_pos, cache_base, is_flush, write_pos if first_cycle is None else first_cycle, slots, accepted, batch,
        window, ring_len, BLOCK=CURSOR_BLOCK, FLUSH_EVERY=flush_every, STAGGER=first_cycle is not None,
        CHAINED=chained, num_warps=4, **launch,
    )


@register("reset_cursors", "triton")
def reset_cursors_triton(write_pos, cache_base, is_flush, slots) -> None:
    """Triton version of :func:`reset_cursors_reference` (same arguments and results)."""
    check_cursor_args(write_pos, cache_base, is_flush, slots)
    _check_cursor_launch(write_pos, cache_base, is_flush, slots)
    slots = guards.check_slots(slots, num_slots=write_pos.shape[0])
    batch = slots.shape[0]
    if batch == 0:
        return
    _reset_cursors_kernel[(triton.cdiv(batch, CURSOR_BLOCK),)](
        write_pos, cache_base, is_flush, slots, batch, BLOCK=CURSOR_BLOCK, num_warps=4
    )
