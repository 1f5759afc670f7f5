"""Depthwise causal convolution (kernel W, SiLU) with verify / commit semantics.

GDN layers convolve the concatenated ``q|k|v`` channels before the recurrence. Per
channel ``c`` and token ``t`` of a window, with ``x_{-W+1} .. x_{-1}`` taken from the
request's conv state (the last ``W - 1`` committed inputs):

    y_t = silu(bias_c + sum_{j=0}^{W-1} w[c, j] * x_{t - W + 1 + j})

Verify (:func:`causal_conv_verify`) never advances the state; it keeps the window's
inputs in a per-slot buffer. Commit (:func:`causal_conv_commit`) shifts the first ``n``
buffered inputs into the state, which leaves it exactly as if the ``n`` accepted tokens
had been decoded one by one. Plain decoding and prefill pass ``update_state=True``.
"""

from __future__ import annotations

import torch

from . import _checks
from .dispatch import pick, register
from .records import check_varlen


def check_conv_args(x, conv_state, weight, bias):
    _checks.tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    n, c = x.shape
    _checks.tensor("weight", weight, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    w = weight.shape[1]
    _checks.shape("weight", weight, [c, w])
    if w < 2:
        raise ValueError(f"conv kernel width must be at least 2, got {w}")
    if bias is not None:
        _checks.tensor("bias", bias, ndim=1, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("bias", bias, [c])
    _checks.tensor("conv_state", conv_state, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("conv_state", conv_state, [None, c, w - 1])
    _checks.same_device(x, conv_state=conv_state, weight=weight, bias=bias)
    return n, c, w


@register("conv_verify", "reference")
def causal_conv_verify_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    window_buf: torch.Tensor | None = None,
    update_state: bool = False,
) -> torch.Tensor:
    """Causal depthwise conv + SiLU over a packed batch of windows.

    Args:
        x: ``[N, C]`` pre-conv channels (``C = 2 H K + HV V`` for GDN).
        conv_state: ``[num_slots, C, W - 1]`` last committed inputs, oldest first.
        weight: ``[C, W]`` depthwise taps; bias: ``[C]`` or ``None``.
        slots: ``[B]`` slot per window, ``-1`` for padding (zero output, no writes).
        cu_seqlens: ``[B + 1]`` token offsets.
        window_buf: optional ``[num_slots, T, C]``; window ``i``'s inputs are kept in
            ``window_buf[slots[i], :len]`` for :func:`causal_conv_commit`.
        update_state: advance ``conv_state`` over the whole window (decode / prefill).

    Returns:
        ``y``: ``[N, C]`` in the dtype of ``x``. Computed in float32 (float64 for
        float64 inputs).
    """
    n, c, w = check_conv_args(x, conv_state, weight, bias)
    ns = conv_state.shape[0]
    max_len = None
    if window_buf is not None:
        _checks.tensor("window_buf", window_buf, ndim=3, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("window_buf", window_buf, [ns, None, c])
        max_len = window_buf.shape[1]
    cu, sl = check_varlen(cu_seqlens, slots, n, ns, max_len)
    dtype = _checks.compute_dtype(x, weight)
    wt = weight.to(dtype)
    y = torch.zeros_like(x)
    for i, s in enumerate(sl):
        bos, eos = cu[i], cu[i + 1]
        if s < 0 or eos == bos:
            continue
        xs = torch.cat([conv_state[s].to(dtype).T, x[bos:eos].to(dtype)], 0)  # [W-1+m, C]
        acc = torch.zeros(eos - bos, c, dtype=dtype, device=x.device)
        if bias is not None:
            acc = acc + bias.to(dtype)
        for j in range(w):
            acc = acc + wt[:, j] * xs[j : j + eos - bos]
        y[bos:eos] = torch.nn.functional.silu(acc).to(y.dtype)
        if window_buf is not None:
            window_buf[s, : eos - bos] = x[bos:eos]
        if update_state:
            conv_state[s] = torch.cat([conv_state[s].T, x[bos:eos].to(conv_state.dtype)], 0)[-(w - 1) :].T
    return y


@register("conv_commit", "reference")
def causal_conv_commit_reference(
    conv_state: torch.Tensor, window_buf: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor
) -> None:
    """Shift the first ``accepted[i]`` buffered inputs into the conv state, in place.

    Args:
        conv_state: ``[layers, num_slots, C, W - 1]`` (all layers at once).
        window_buf: ``[layers, num_slots, T, C]`` inputs kept by verify.
        slots: ``[B]`` slot per row, ``-1`` ignored.
        accepted: ``[B]``, ``1 <= n <= T`` for live rows (validated by the caller).
    """
    _checks.tensor("conv_state", conv_state, ndim=4, dtypes=_checks.FLOAT_DTYPES)
    nl, ns, c, w1 = conv_state.shape
    _checks.tensor("window_buf", window_buf, ndim=4, dtypes=_checks.FLOAT_DTYPES)
    _checks.shape("window_buf", window_buf, [nl, ns, None, c])
    _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.tensor("accepted", accepted, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.shape("accepted", accepted, [slots.shape[0]])
    _checks.same_device(conv_state, window_buf=window_buf, slots=slots, accepted=accepted)
    for s, n in zip(slots.tolist(), accepted.tolist()):
        if s < 0:
            continue
        hist = torch.cat([conv_state[:, s].transpose(1, 2), window_buf[:, s, :n].to(conv_state.dtype)], 1)
        conv_state[:, s] = hist[:, -w1:].transpose(1, 2)


def causal_conv_verify(*args, backend: str = "auto", **kwargs) -> torch.Tensor:
    """Dispatching front of :func:`causal_conv_verify_reference` (same arguments)."""
    return pick("conv_verify", backend, args[0] if args else kwargs["x"])(*args, **kwargs)


def causal_conv_commit(*args, backend: str = "auto", **kwargs) -> None:
    """Dispatching front of :func:`causal_conv_commit_reference` (same arguments)."""
    return pick("conv_commit", backend, args[0] if args else kwargs["conv_state"])(*args, **kwargs)
