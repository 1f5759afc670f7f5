"""A static step's outputs after its acceptance, in one kernel.

After the forward and the acceptance of a chain window, a step writes what it emits: per
row the accepted count ``n + 1`` (``n`` drafts, then the target's token ``nxt``), the
emitted tokens (the ``n`` accepted drafts, ``nxt``, then ``-1``), the request's new KV
length, and both into the output buffer the driver reads. As torch ops that is about
ten small kernels a step (an add, an indexed write and a fill of the KV lengths, a
concatenation, two comparisons, two selections, two copies), five more for the greedy
acceptance itself (an equality, a cumulative product, a sum, a gather, a cast); at batch
1 a graphed step pays for each kernel's launch, not its work. :func:`emit_step` does all
of it in one launch, one program a row, from the target's argmax (greedy) or from
counts and tokens chosen elsewhere (rejection sampling, a benchmark drafter's forced
counts). Everything is integer: the kernel's results are the ops' exactly.
"""

from __future__ import annotations

import torch

from ..ops.triton_common import INTERPRETER, triton
from .sampling import accept_greedy_argmax

if triton is not None:
    import triton.language as tl


def emit_step_reference(ids, starts, slot_idx, kv_len, sink: int, out, *, argmax=None, n=None, nxt=None,
                        next_windows=None):
    """See :func:`emit_step` (the torch ops a step ran)."""
    t = ids.shape[1]
    if argmax is not None:
        n, nxt = accept_greedy_argmax(argmax, ids)
    if next_windows is not None:
        next_windows[slot_idx, 0] = nxt
    steps = torch.arange(t, device=ids.device)
    accepted = n + 1
    kv_len[slot_idx] = starts + accepted
    kv_len[sink:].zero_()  # padding rows always start at position 0
    shifted = torch.cat([ids[:, 1:], nxt[:, None]], 1)
    emitted = torch.where(steps[None] < n[:, None], shifted, torch.where(steps[None] == n[:, None], nxt[:, None], -1))
    out[:, 0] = accepted
    out[:, 1:] = emitted
    return out[:, 0], nxt, out[:, 1:]


def emit_step(ids: torch.Tensor, starts: torch.Tensor, slot_idx: torch.Tensor, kv_len: torch.Tensor, sink: int,
              out: torch.Tensor, *, argmax: torch.Tensor | None = None, n: torch.Tensor | None = None,
              nxt: torch.Tensor | None = None, next_windows: torch.Tensor | None = None, backend: str = "triton"):
    """A chain step's accepted counts, emitted tokens and KV lengths (graph-safe).

    Args:
        ids: ``[B, T]`` int64, each row's window (its last token, then ``T - 1`` drafts).
        starts: ``[B]`` int64, each row's committed length before the step.
        slot_idx: ``[B]`` int64 KV-cache slot per row (``sink`` for padding rows).
        kv_len: ``[S + 1]`` int64 device lengths of the cache, written in place: each
            live row's slot gets ``starts + n + 1``, the sink 0.
        sink: the cache's padding slot, its last (``S``).
        out: ``[B, 1 + T]`` int64, written: column 0 the accepted count, then the
            emitted tokens.
        argmax: ``[B, T]`` int64, the target's token at each window position: greedy
            acceptance (``n`` the leading drafts it agrees with, ``nxt`` its token after
            them). Or, without it:
        n, nxt: ``[B]`` int64, accepted drafts and the next token, chosen elsewhere.
        next_windows: ``None``, or the slots' next windows ``[S + 1, T']`` int64 (rows at
            any stride, the last axis contiguous): each row's next token goes to column 0
            of its slot's row, where the next step's window starts.
        backend: ``"triton"`` (one launch; CUDA or the Triton interpreter) or
            ``"reference"`` (the torch ops).

    Returns:
        ``(accepted [B], nxt [B], emitted [B, T])`` int64: ``accepted`` and ``emitted``
        are views of ``out`` (its columns 0 and ``1:``).
    """
    if (argmax is None) == (n is None or nxt is None) or (argmax is not None and (n is not None or nxt is not None)):
        raise ValueError("give argmax (greedy acceptance) or both n and nxt")
    b, t = ids.shape if ids.dim() == 2 else (None, None)
    named = dict(ids=(ids, [b, t]), starts=(starts, [b]), slot_idx=(slot_idx, [b]), out=(out, [b, 1 + (t or 0)]))
    named.update({"argmax": (argmax, [b, t])} if argmax is not None else {"n": (n, [b]), "nxt": (nxt, [b])})
    for name, (x, shape) in named.items():
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if b is None or list(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape if b is not None else '[B, T]'}, got {list(x.shape)}")
        if x.device != ids.device:
            raise ValueError(f"{name} is on {x.device}, ids on {ids.device}")
    if not isinstance(kv_len, torch.Tensor) or kv_len.dtype != torch.int64 or kv_len.dim() != 1:
        raise TypeError("kv_len must be a 1-d int64 tensor")
    if kv_len.device != ids.device or sink != kv_len.shape[0] - 1:
        raise ValueError(f"kv_len must be on {ids.device} with the sink {sink} its last entry, got "
                         f"{list(kv_len.shape)} on {kv_len.device}")
    if next_windows is not None and (
            not isinstance(next_windows, torch.Tensor) or next_windows.dtype != torch.int64 or next_windows.dim() != 2
            or next_windows.shape[0] != kv_len.shape[0] or next_windows.shape[1] < 1
            or next_windows.device != ids.device or (next_windows.stride(1) != 1 and next_windows.shape[1] > 1)):
        raise ValueError(f"next_windows must be an int64 [{kv_len.shape[0]}, T'] tensor on {ids.device}, its last "
                         f"axis contiguous, got {getattr(next_windows, 'dtype', type(next_windows).__name__)} "
                         f"{list(getattr(next_windows, 'shape', []))}")
    if backend == "reference":
        return emit_step_reference(ids, starts, slot_idx, kv_len, sink, out, argmax=argmax, n=n, nxt=nxt,
                                   next_windows=next_windows)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if triton is None or (ids.device.type != "cuda" and not INTERPRETER):
        raise RuntimeError("the Triton emit_step needs CUDA tensors or the Triton interpreter")
    if not all(x.is_contiguous() for x in (ids, out, *(a for a in (argmax, n, nxt) if a is not None))):
        raise ValueError("ids, out, argmax, n and nxt must be contiguous")
    greedy = argmax is not None
    nxt_out = torch.empty(b, dtype=torch.int64, device=ids.device) if greedy else nxt
    if b > 0:
        _emit_kernel[(b,)](
            ids, argmax if greedy else ids, n if not greedy else starts, nxt_out, starts, slot_idx, kv_len, out, sink,
            kv_len.shape[0], next_windows if next_windows is not None else out,
            next_windows.stride(0) if next_windows is not None else 0, T=t, BT=triton.next_power_of_2(t),
            GREEDY=greedy, WINDOWS=next_windows is not None, num_warps=1,
        )
    return out[:, 0], nxt_out, out[:, 1:]


if triton is not None:

    @triton.jit
    def _emit_kernel(ids_ptr, am_ptr, n_ptr, nxt_ptr, starts_ptr, slot_ptr, kv_ptr, out_ptr, sink, n_kv, win_ptr,
                     stride_w, T: tl.constexpr, BT: tl.constexpr, GREEDY: tl.constexpr, WINDOWS: tl.constexpr):
        """Row ``program_id``: its acceptance (``GREEDY``: from the target's argmax, its
        next token stored at ``nxt_ptr``; else both read), its count and emitted tokens
        into ``out``, its KV length, and with ``WINDOWS`` its next token into column 0 of
        its slot's next window."""
        b = tl.program_id(0).to(tl.int64)
        t = tl.arange(0, BT)
        in_window = t < T
        has_draft = t + 1 < T
        draft = tl.load(ids_ptr + b * T + t + 1, mask=has_draft, other=-1)  # the draft after position t
        if GREEDY:
            am = tl.load(am_ptr + b * T + t, mask=in_window, other=0)
            # the first position whose draft the target does not take, or T - 1 (every draft taken)
            stop = (has_draft & (draft != am)) | (t == T - 1)
            n = tl.min(tl.where(stop, t, BT), 0).to(tl.int64)
            nxt = tl.sum(tl.where(t == n, am, 0), 0)
            tl.store(nxt_ptr + b, nxt)
        else:
            n = tl.load(n_ptr + b)
            nxt = tl.load(nxt_ptr + b)
        emitted = tl.where(t < n, draft, tl.where(t == n, nxt, -1))
        tl.store(out_ptr + b * (T + 1) + 1 + t, emitted, mask=in_window)
        tl.store(out_ptr + b * (T + 1), n + 1)
        slot = tl.load(slot_ptr + b)
        start = tl.load(starts_ptr + b)
        # a live row's slot takes its new length; the sink stays 0 (a padding row writes 0
        # there, as the first row does: the same value)
        tl.store(kv_ptr + slot, tl.where(slot >= sink, 0, start + n + 1), mask=(slot >= 0) & (slot < n_kv))
        if WINDOWS:
            tl.store(win_ptr + slot * stride_w, nxt, mask=(slot >= 0) & (slot < n_kv))
        tl.store(kv_ptr + sink, 0, mask=b == 0)
