"""Index guards of the Triton launchers: slots, ``cu_seqlens``, window bounds, cursors.

The reference ops check index values on the host (they loop there anyway). The Triton
kernels address memory with them, so an out-of-range slot or a ``cu_seqlens`` past the
token count would read and write outside the buffers. Every Triton launcher therefore
passes its index tensors through a guard of this module before it launches, and the
guard works in one of two ways:

* **On the host** (no CUDA graph is being captured): the values are read and checked as
  the reference checks them (:func:`~replayssm.ops.records.varlen_error`, one statement
  of the contract); a bad value raises ``ValueError`` before any kernel runs. The values
  are read once per step, not once per layer: tensors the library built from host lists
  (a :class:`~replayssm.state.Batch`) carry their host copy
  (:func:`record_host_values`), and a caller's tensor is remembered after its first
  read by identity and version counter, so the layers of a step, which share the same
  tensors, read nothing more.
* **On the device** (inside ``torch.cuda.graph`` capture, where nothing may be read on
  the host): a tensor without a trusted host copy is rewritten by a few tensor ops.
  Rows with a bad slot, window or cursor become padding rows (slot ``-1``: zero outputs,
  nothing written), ``cu_seqlens`` is clamped into ``[0, N]`` and made non-decreasing,
  and a bit per kind of error is ORed into a persistent per-device error word. The next
  host check (:func:`check_errors`; ``StatePool.check_errors``; the strategies look at
  the start of every step) raises :class:`DeviceCheckError` naming what was wrong.

Values that only count (accepted tokens, fold counts, ring starts) are clamped inside
the kernels, which keeps them in bounds at no cost; the strategies check them once per
step (on the device when they live there, so commit does not synchronise; on CUDA in
one launch, :func:`clamp_accepted`, where its tensor ops were thirteen kernels a step).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Iterable, Sequence

import numpy as np
import torch

from .records import slots_error, varlen_error
from .triton_common import INTERPRETER, triton

if triton is not None:
    import triton.language as tl

# Bits of the device error word, one per kind of bad index value.
SLOT_RANGE = 1
SLOT_DUPLICATE = 2
CU_SEQLENS = 4
WINDOW_LENGTH = 8
ACCEPTED = 16
CURSORS = 32
SLOT_NOT_LIVE = 64

MESSAGES = {
    SLOT_RANGE: "a slot index outside [-1, num_slots)",
    SLOT_DUPLICATE: "a live slot on two rows of one batch",
    CU_SEQLENS: "cu_seqlens not starting at 0, decreasing, or not ending at the token count",
    WINDOW_LENGTH: "a window of no tokens or of more than the kernel's bound",
    ACCEPTED: "accepted outside [1, window length] on a live row (clamped)",
    CURSORS: "ring cursors outside the ring (negative, or write_pos + window > ring length)",
    SLOT_NOT_LIVE: "a slot that is not allocated in the pool",
}


class DeviceCheckError(RuntimeError):
    """Index values that a device-side guard found bad since the last host check.

    The offending rows ran as padding rows (or their counts were clamped), so no memory
    outside the buffers was touched; their results are not the requests'. The message
    names every kind of error seen.
    """


def describe(bits: int) -> str:
    """The error word ``bits`` in words."""
    names = [msg for bit, msg in MESSAGES.items() if bits & bit]
    return "device-side index checks found " + "; ".join(names or [f"error bits {bits:#x}"])


# ---------------------------------------------------------------------------- error word
class _ErrorWord:
    """One device's persistent error word and, on CUDA, a pinned host mirror that is
    refreshed without synchronising after each eager device-side check."""

    def __init__(self, device: torch.device):
        # a normal tensor even when the first user runs under inference mode (an engine
        # built inside one): an inference tensor could not be cleared outside it
        with torch.inference_mode(False):
            self.word = torch.zeros(1, dtype=torch.int32, device=device)
            self.mirror = torch.zeros(1, dtype=torch.int32, pin_memory=True) if device.type == "cuda" else None
        self.event = None

    def raise_bits(self, bits: torch.Tensor) -> None:
        self.word.bitwise_or_(bits)
        self.written()

    def written(self) -> None:
        """After a write to :attr:`word` on the device: refresh the host mirror (eagerly;
        a captured graph's writes are read at the next waiting check)."""
        if self.mirror is not None and not torch.cuda.is_current_stream_capturing():
            self.mirror.copy_(self.word, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self, wait: bool) -> int:
        if self.mirror is None:
            return int(self.word.item())
        if wait:
            return int(self.word.item())
        if self.event is not None and self.event.query():
            return int(self.mirror.item())
        return 0

    def clear(self) -> None:
        self.word.zero_()
        if self.mirror is not None:
            self.mirror.zero_()
        self.event = None


_WORDS: dict[torch.device, _ErrorWord] = {}


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def error_word(device) -> torch.Tensor:
    """The persistent ``[1]`` int32 error word of ``device`` (created on first use:
    create it before a CUDA graph capture, as :class:`~replayssm.state.StatePool`
    does, so that it is not allocated inside the graph)."""
    return _word(device).word


def _word(device) -> _ErrorWord:
    device = _device(device)
    word = _WORDS.get(device)
    if word is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the index guards' error word of {device} must exist before a CUDA graph capture: call "
                "replayssm.ops.guards.error_word(device) first (a StatePool or an eager warm-up call does)"
            )
        word = _WORDS[device] = _ErrorWord(device)
    return word


def check_errors(device=None, *, wait: bool = True) -> None:
    """Raise :class:`DeviceCheckError` if device-side guards flagged bad values since the
    last check (and clear the flag).

    Args:
        device: the device to look at (``None``: every device with an error word).
        wait: read the word on the device (a synchronisation). ``False`` looks only at
            what the host already has: CPU words, and a CUDA word's mirror once its copy
            has landed; nothing is read while a graph is being captured.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    words = [_word(device)] if device is not None else list(_WORDS.values())
    for word in words:
        bits = word.read(wait)
        if bits:
            word.clear()
            raise DeviceCheckError(describe(bits))


def clear_errors(device=None) -> None:
    """Forget what device-side guards flagged (``None``: on every device), without
    raising: after an error was handled, or between tests."""
    for word in [_word(device)] if device is not None else list(_WORDS.values()):
        word.clear()


# ---------------------------------------------------------------------------- modes
_FORCED = [False]


@contextlib.contextmanager
def device_checks():
    """Run every guard as inside graph capture (on the device, no host reads), on any
    device: the capture path, testable on the CPU."""
    _FORCED.append(True)
    try:
        yield
    finally:
        _FORCED.pop()


def on_device(x: torch.Tensor) -> bool:
    """Whether checks of ``x`` must stay on the device: inside CUDA graph capture (or
    under :func:`device_checks`)."""
    return _FORCED[-1] or (x.is_cuda and torch.cuda.is_current_stream_capturing())


# ---------------------------------------------------------------------------- host copies
class _Known:
    # values: the host copy (None for tensors checked on the device: ``checked`` then
    # holds what they were checked for: (paired offsets' serial, num_slots, tokens, max_len)).
    __slots__ = ("ref", "version", "values", "trusted", "serial", "memo", "checked")


_KNOWN: dict[int, _Known] = {}
_SERIAL = itertools.count()
_MAINTAINED: dict[int, weakref.ref] = {}


def _version(x: torch.Tensor) -> int | None:
    # inference tensors keep no version counter (asked first: reading ``_version`` of
    # one raises, and a raised error costs more than the rest of a guard's look-up)
    return None if x.is_inference() else x._version


def _remember(x: torch.Tensor, values: tuple[int, ...] | None, trusted: bool,
              checked: tuple | None = None) -> _Known:
    """Enter ``x`` with its host copy ``values`` (a tuple of Python ints: the callers
    convert) or ``None`` (checked on the device)."""
    key = id(x)

    def forget(ref, key=key):
        if key in _KNOWN and _KNOWN[key].ref is ref:
            del _KNOWN[key]

    entry = _Known()
    entry.ref, entry.version = weakref.ref(x, forget), _version(x)
    entry.values = values
    entry.trusted, entry.serial, entry.memo, entry.checked = trusted, next(_SERIAL), {}, checked
    _KNOWN[key] = entry
    return entry


def record_host_values(x: torch.Tensor, values: Sequence[int]) -> None:
    """Declare ``values`` the contents of the index tensor ``x``, for every later guard.

    For tensors the library builds from host lists (a batch's slots and offsets): they
    are then never read back, in eager mode or in graph capture. The writer promises to
    record again after every change of ``x`` (e.g. :meth:`Batch.set_slots
    <replayssm.state.Batch.set_slots>`); a change through PyTorch (which bumps the
    version counter) without a new record only makes the guard read ``x`` again.
    """
    _remember(x, tuple(host_ints(values).tolist()), trusted=True)


def _lookup(x: torch.Tensor, *, trusted: bool) -> _Known | None:
    entry = _KNOWN.get(id(x))
    if entry is None or entry.ref() is not x or (trusted and not entry.trusted):
        return None
    if entry.version is not None and _version(x) != entry.version:
        return None
    return entry


def _host_values(x: torch.Tensor) -> _Known:
    """The host copy of ``x``: recorded, remembered from an earlier read of the same
    version, or read now (one synchronisation, which also looks at the error word)."""
    entry = _lookup(x, trusted=False)
    if entry is not None and entry.values is not None:
        return entry
    values = tuple(x.tolist())
    if x.is_cuda:
        check_errors(x.device)  # the device was just synchronised: reading the word is cheap
    entry = _remember(x, values, trusted=False)
    if entry.version is None:
        del _KNOWN[id(x)]  # no version counter: a later call cannot tell it unchanged
    return entry


def _memo(entry: _Known, key: tuple, compute):
    if key not in entry.memo:
        entry.memo[key] = compute()
    return entry.memo[key]


def mark_maintained(*tensors: torch.Tensor) -> None:
    """Declare cursor tensors kept valid by the library's own kernels (a pool's
    ``write_pos`` / ``cache_base``: reset to 0 and advanced by clamped counts), so the
    chunked verify does not read them back to check them."""
    for x in tensors:
        key = id(x)

        def forget(ref, key=key):
            if _MAINTAINED.get(key) is ref:
                del _MAINTAINED[key]

        _MAINTAINED[key] = weakref.ref(x, forget)


def _maintained(x: torch.Tensor) -> bool:
    ref = _MAINTAINED.get(id(x))
    return ref is not None and ref() is x


# ---------------------------------------------------------------------------- guards
def check_indices(slots: torch.Tensor, cu_seqlens: torch.Tensor, *, num_slots: int, num_tokens: int,
                  max_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Guard a window launcher's ``slots [B]`` and ``cu_seqlens [B + 1]`` (metadata
    already checked): windows of ``1..max_len`` tokens within ``num_tokens``, live slots
    unique and below ``num_slots``. Returns the tensors to launch with: the same ones
    after a host check, rewritten ones on the device (see the module notes)."""
    return _window(slots, cu_seqlens, num_slots, num_tokens, max_len, None)


def check_slots(slots: torch.Tensor, *, num_slots: int) -> torch.Tensor:
    """Guard the ``slots [B]`` of a commit-side launcher (fold, snapshot and conv
    commits, cursors): each in ``[-1, num_slots)``. Returns the tensor to launch with."""
    if on_device(slots):
        entry = _lookup(slots, trusted=True)
        if entry is not None and entry.values is None:
            if entry.checked[1] == num_slots:
                return slots
            entry = None
        if entry is None:
            s = slots.long()
            bad = (s < -1) | (s >= num_slots)
            _word(slots.device).raise_bits(_bit(bad.any(), SLOT_RANGE))
            return torch.where(bad, torch.full_like(s, -1), s).to(slots.dtype)
    else:
        entry = _host_values(slots)
    error = _memo(entry, ("slots", num_slots), lambda: slots_error(list(entry.values), num_slots, unique=False))
    if error:
        raise ValueError(error)
    return slots


def check_window(slots: torch.Tensor, cu_seqlens: torch.Tensor, write_pos: torch.Tensor, cache_base: torch.Tensor,
                 *, num_slots: int, num_tokens: int, max_len: int, ring_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`check_indices` plus the ring cursors of ``circular``'s verify: for every
    live row, ``write_pos >= 0``, ``cache_base >= 0`` and ``write_pos + length <=
    ring_len`` (the reference's fit check). Cursors the library maintains
    (:func:`mark_maintained`) are trusted; others are read on the host (they change at
    every commit, so once per call) or checked on the device."""
    trusted = _maintained(write_pos) and _maintained(cache_base)
    cursors = None if trusted else (write_pos, cache_base, ring_len)
    return _window(slots, cu_seqlens, num_slots, num_tokens, max_len, cursors)


def check_window_call(q, checkpoint, ring, slots, cu_seqlens, write_pos, cache_base, max_len):
    """:func:`check_window` on the arguments of ``gdn_chunked_window_triton`` as they
    come; arguments whose metadata is off are passed through unchanged for the op's own
    checks to name."""
    tensors = (q, checkpoint, slots, cu_seqlens, write_pos, cache_base, getattr(ring, "k", None))
    if not all(isinstance(x, torch.Tensor) for x in tensors) or q.dim() != 3 or checkpoint.dim() != 4:
        return slots, cu_seqlens
    if slots.dim() != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() != slots.numel() + 1 or ring.k.dim() != 4:
        return slots, cu_seqlens
    if slots.dtype.is_floating_point or cu_seqlens.dtype.is_floating_point:
        return slots, cu_seqlens
    ring_len = ring.k.shape[1]
    bound = max_len if isinstance(max_len, int) and not isinstance(max_len, bool) and max_len >= 1 else ring_len
    return check_window(slots, cu_seqlens, write_pos, cache_base, num_slots=checkpoint.shape[0],
                        num_tokens=q.shape[0], max_len=bound, ring_len=ring_len)


def _window(slots, cu_seqlens, num_slots, num_tokens, max_len, cursors):
    if on_device(slots):
        es, ec = _lookup(slots, trusted=True), _lookup(cu_seqlens, trusted=True)
        if es is not None and ec is not None and es.values is None and cursors is None:
            serial, ns, n, bound = es.checked
            if (serial, ns, n) == (ec.serial, num_slots, num_tokens) and (max_len is None or bound <= max_len):
                return slots, cu_seqlens  # checked on the device for this launch already
        if es is None or ec is None or es.values is None or ec.values is None or cursors is not None:
            return sanitize_window(slots, cu_seqlens, num_slots=num_slots, num_tokens=num_tokens, max_len=max_len,
                                   cursors=cursors)
    else:
        es, ec = _host_values(slots), _host_values(cu_seqlens)
    key = ("window", ec.serial, num_slots, num_tokens, max_len)
    error = _memo(es, key, lambda: varlen_error(list(ec.values), list(es.values), num_tokens, num_slots, max_len))
    if error:
        raise ValueError(error)
    if cursors is not None:
        error = _cursor_error(es.values, ec.values, *cursors)
        if error:
            raise ValueError(error)
    return slots, cu_seqlens


def _cursor_error(sl, cu, write_pos, cache_base, ring_len) -> str | None:
    wp_all, base_all = write_pos.tolist(), cache_base.tolist()
    for i, s in enumerate(sl):
        if s < 0:
            continue
        wp, base = wp_all[s], base_all[s]
        if wp < 0 or base < 0:
            return f"cursors of slot {s} must be >= 0, got write_pos {wp}, cache_base {base}"
        if wp + cu[i + 1] - cu[i] > ring_len:
            return (f"window {i} (slot {s}) does not fit: write_pos {wp} + {cu[i + 1] - cu[i]} tokens "
                    f"> ring length {ring_len}")
    return None


# ---------------------------------------------------------------------------- on the device
def _bit(flag: torch.Tensor, bit: int) -> torch.Tensor:
    return flag.to(torch.int32) * bit


def duplicate_rows(s: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: live rows whose slot a live row before them already has."""
    rows = torch.arange(s.shape[0], device=s.device)
    key = torch.where(live, s, -1 - rows)  # non-live rows get distinct negative keys
    order = torch.argsort(key, stable=True)
    ordered = key[order]
    repeat = torch.zeros_like(live)
    repeat[1:] = ordered[1:] == ordered[:-1]
    dup = torch.zeros_like(live)
    dup[order] = repeat
    return dup & live


def sanitize_window(slots: torch.Tensor, cu_seqlens: torch.Tensor, *, num_slots: int, num_tokens: int,
                    max_len: int | None, live_mask: torch.Tensor | None = None,
                    cursors: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Safe copies of a batch's ``slots`` and ``cu_seqlens``, by tensor ops only (no host
    reads: capturable), with the error word raised for what was wrong.

    A row becomes padding (slot ``-1``) if its slot is out of range, repeated, not in
    ``live_mask`` (``[num_slots]`` bool, optional), its window has no tokens or more than
    ``max_len``, or (``cursors = (write_pos, cache_base, ring_len)``) its window does not
    fit its ring; every row does if ``cu_seqlens`` is malformed. The returned offsets
    are clamped into ``[0, num_tokens]`` and non-decreasing, so even padding rows (which
    zero their outputs) stay inside the token range.
    """
    s, c = slots.long(), cu_seqlens.long()
    length = c[1:] - c[:-1]
    cu_bad = (c[0] != 0) | (c[-1] != num_tokens) | (length < 0).any()
    slot_bad = (s < -1) | (s >= num_slots)
    live = (s >= 0) & ~slot_bad
    bad = slot_bad | cu_bad
    bits = _bit(slot_bad.any(), SLOT_RANGE) + _bit(cu_bad, CU_SEQLENS)
    if max_len is not None:
        long_or_empty = (length < 1) | (length > max_len)
        bad = bad | long_or_empty
        bits = bits + _bit(long_or_empty.any(), WINDOW_LENGTH)
    dup = duplicate_rows(s, live)
    bad = bad | dup
    bits = bits + _bit(dup.any(), SLOT_DUPLICATE)
    at = s.clamp(0, max(num_slots - 1, 0))
    if live_mask is not None:
        dead = live & ~live_mask[at]
        bad = bad | dead
        bits = bits + _bit(dead.any(), SLOT_NOT_LIVE)
    if cursors is not None:
        write_pos, cache_base, ring_len = cursors
        wp, base = write_pos[at].long(), cache_base[at].long()
        off = live & ((wp < 0) | (base < 0) | (wp + length > ring_len))
        bad = bad | off
        bits = bits + _bit(off.any(), CURSORS)
    _word(slots.device).raise_bits(bits)
    safe_slots = torch.where(bad, torch.full_like(s, -1), s).to(slots.dtype)
    safe_cu = torch.cummax(c.clamp(0, num_tokens), 0).values.to(cu_seqlens.dtype)
    # Later launches of the same capture take these as they are.
    offsets = _remember(safe_cu, None, trusted=True, checked=(None, num_slots, num_tokens, max_len))
    bound = max_len if max_len is not None else num_tokens
    _remember(safe_slots, None, trusted=True, checked=(offsets.serial, num_slots, num_tokens, bound))
    return safe_slots, safe_cu


def clamp_accepted(slots: torch.Tensor, accepted: torch.Tensor, lengths: torch.Tensor, *,
                   backend: str = "auto") -> torch.Tensor:
    """``accepted`` as int32 with every live row's count clamped into ``[1, length]``, on
    the device (no synchronisation); the error word is raised if any was outside.

    Args:
        slots: ``[B]`` the batch's slots (``-1``: padding, ignored).
        accepted: ``[B]`` integer counts (any stride).
        lengths: ``[B]`` the window lengths, on the same device.
        backend: ``"triton"`` (one launch: CUDA or the Triton interpreter), ``"torch"``
            (about a dozen small tensor ops, a kernel each on a GPU) or ``"auto"``
            (Triton on CUDA). The same counts and error bits.
    """
    if backend == "auto":
        backend = "triton" if accepted.device.type == "cuda" and triton is not None else "torch"
    if backend == "triton":
        return _clamp_accepted_triton(slots, accepted, lengths)
    if backend != "torch":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    n = accepted.to(torch.int32)
    live = slots >= 0
    bad = live & ((n < 1) | (n > lengths))
    _word(accepted.device).raise_bits(_bit(bad.any(), ACCEPTED))
    return torch.where(live, torch.minimum(torch.clamp(n, min=1), lengths.to(torch.int32)), n)


#: Rows a program of the Triton :func:`clamp_accepted` checks.
_CLAMP_BLOCK = 1024


def _clamp_accepted_triton(slots: torch.Tensor, accepted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    if triton is None or (accepted.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton clamp_accepted needs CUDA tensors or the Triton interpreter")
    b = accepted.shape[0]
    if slots.shape != (b,) or lengths.shape != (b,):
        raise ValueError(f"slots, accepted and lengths must be [B] alike, got {list(slots.shape)}, "
                         f"{list(accepted.shape)} and {list(lengths.shape)}")
    word = _word(accepted.device)
    out = torch.empty(b, dtype=torch.int32, device=accepted.device)
    if b:
        block = min(_CLAMP_BLOCK, triton.next_power_of_2(b))
        _clamp_accepted_kernel[(triton.cdiv(b, block),)](
            slots, accepted, lengths, out, word.word, b, slots.stride(0), accepted.stride(0), lengths.stride(0),
            BIT=ACCEPTED, BLOCK=block, num_warps=1 if block <= 128 else 4,
        )
        word.written()
    return out


if triton is not None:

    @triton.jit
    def _clamp_accepted_kernel(slot_ptr, acc_ptr, len_ptr, out_ptr, word_ptr, n_rows, stride_s, stride_a, stride_l,
                               BIT: tl.constexpr, BLOCK: tl.constexpr):
        """Rows ``[program_id BLOCK, +BLOCK)`` of :func:`clamp_accepted`: each count, live
        rows' clamped into ``[1, length]``; ``BIT`` ORed into the error word where one
        was outside."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < n_rows
        slot = tl.load(slot_ptr + rows * stride_s, mask=ok, other=-1)
        n = tl.load(acc_ptr + rows * stride_a, mask=ok, other=1).to(tl.int32)
        length = tl.load(len_ptr + rows * stride_l, mask=ok, other=1).to(tl.int32)
        live = slot >= 0
        bad = live & ((n < 1) | (n > length))
        tl.store(out_ptr + rows, tl.where(live, tl.minimum(tl.maximum(n, 1), length), n), mask=ok)
        if tl.sum(bad.to(tl.int32), 0) > 0:
            tl.atomic_or(word_ptr, tl.full((), BIT, tl.int32))


def host_ints(values: Iterable[int]) -> np.ndarray:
    """``values`` (any iterable of integers: ints, numpy or one-element tensors, a
    range, a generator) as a 1-D int64 array, in one pass: each converted as ``int()``
    would (``TypeError`` / ``ValueError`` / ``OverflowError`` as ``int()`` raises them).
    Always a new array (a numpy array given is copied: the result may back a tensor)."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iub":
        return values.astype(np.int64)
    return np.fromiter(values, np.int64)


def _host_tensor(host: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The int64 array ``host`` as a CPU tensor of ``dtype`` (``ValueError`` if a value
    does not fit it)."""
    x = torch.from_numpy(host)
    if dtype != torch.int64:
        x = x.to(dtype)
        if not torch.equal(x.long(), torch.from_numpy(host)):
            raise ValueError(f"index values outside the range of {dtype}")
    return x


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device(values: Iterable[int], device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host ``values`` (see :func:`host_ints`) as a tensor on ``device``. A CUDA copy goes
    through pinned memory and does not wait: a copy from pageable memory drains the
    stream first (a synchronisation), which a prompt pass paid once per index tensor."""
    return _upload(_host_tensor(host_ints(values), dtype), torch.device(device))


def copy_to_device(dst: torch.Tensor, values: Iterable[int]) -> tuple[int, ...]:
    """Write host ``values`` (see :func:`host_ints`; as many as ``dst`` holds) into the
    device tensor ``dst`` without a synchronisation (see :func:`to_device`), and record
    them as its contents for the guards. Returns that record, the values as a tuple of
    Python ints. ``ValueError`` (``dst`` untouched) for a wrong count."""
    host = host_ints(values)
    if host.size != dst.numel():
        raise ValueError(f"need {dst.numel()} values for a tensor of shape {tuple(dst.shape)}, got {host.size}")
    src = _host_tensor(host, dst.dtype).view(dst.shape)
    dst.copy_(src.pin_memory() if dst.device.type == "cuda" else src, non_blocking=dst.device.type == "cuda")
    values = tuple(host.tolist())
    _remember(dst, values, trusted=True)
    return values


def host_index(values: Iterable[int], device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """An index tensor built from host ``values``, with its host copy recorded (so guards
    never read it back)."""
    host = host_ints(values)
    x = _upload(_host_tensor(host, dtype), torch.device(device))
    _remember(x, tuple(host.tolist()), trusted=True)
    return x
