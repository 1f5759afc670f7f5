"""A graphed decode step, part by part, against each part's own bound.

A step of ``N = rows x window`` tokens through a hybrid GDN model splits into parts
whose kernels the profiler names (:func:`step_part`), each with a bound from its bytes
at the card's copy rate or its FLOPs at its matmul rate, both measured in the same run:

* ``matmul``: every ``nn.Linear`` of the decoder layers and the LM head on the ``N``
  rows: ``2 N W`` FLOPs for ``W`` weights, at the matmul rate, or the weights' bytes
  read once at the copy rate, whichever is longer (a sparse MoE block counts the
  weights one token multiplies, :func:`~replayssm.bench.compute_floor.prefill_flops`'
  rule, so its bytes are a lower bound);
* ``gdn_state``: the state kernels of every GDN layer (verify, commit, flush, cursors):
  the bytes of :func:`~replayssm.bench.common.step_bytes` (DESIGN.md section 4) for the
  step's kind, without the conv;
* ``conv``: the causal conv of every GDN layer: its inputs read and outputs written,
  the conv state read and rewritten (a verify writes its window buffer, and the commit
  reads the accepted tokens back; on the engine's conv ring the commit moves a position
  and moves no bytes);
* ``attention``: every full-attention layer's window attention: each row's cached keys
  and values read at its context length, the window's written, queries (with their
  output gate) read and outputs written;
* ``norms``: the RMS norms, fused residual adds included: their inputs read and outputs
  written (two per decoder layer over ``hidden``, the GDN output norm with its gate over
  ``HV x V``, an attention layer's query and key norms);
* ``other``: every other kernel (embedding and rotary rows, activations, acceptance, the
  drafter): listed, no bound.

The bounds assume each part moves its bytes once at the full copy rate, or its FLOPs at
the full matmul rate, and nothing overlaps: the sum of the bounds is what the step
would take if every part ran at its own bound back to back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .common import StepShape, step_bytes
from .compute_floor import _linear_weights, _mlp_weights_per_token

#: the parts of a step, in the order they are reported
STEP_PARTS = ("matmul", "gdn_state", "conv", "attention", "norms", "other")

#: Triton kernels of this package by part (their function names, as the profiler shows
#: them); tests/bench/test_step_bounds.py checks that each is defined in the package
PART_KERNELS = {
    "gdn_state": (
        "_recurrence_kernel", "_window_outputs_kernel", "_coefficients_kernel", "_replay_window_kernel",
        "_tree_replay_kernel", "_fold_kernel", "_snapshot_commit_kernel", "_write_checkpoints_kernel",
        "_ring_decode_kernel", "_ring_flush_kernel", "_advance_cursors_kernel", "_reset_cursors_kernel",
        "_clamp_accepted_kernel",
        "_tree_recurrence_kernel", "_tree_path_kernel", "_compact_path_kernel",
    ),
    "conv": ("_conv_verify_kernel", "_conv_commit_kernel", "_conv_ring_commit_kernel", "_conv_verify_tree_kernel"),
    "attention": ("_slot_attention_kernel",),
    "norms": ("_rms_norm_kernel",),
}
#: substrings of the vendor libraries' matrix-product kernels (cuBLAS, cuBLASLt, CUTLASS)
MATMUL_MARKS = ("gemm", "nvjet", "cutlass", "xmma", "splitkreduce", "cublas")

_BY_NAME = {name: part for part, names in PART_KERNELS.items() for name in names}


def step_part(kernel: str) -> str:
    """The part of :data:`STEP_PARTS` a kernel belongs to, by the name the profiler
    gives it: a Triton kernel of this package by its function name, a vendor matrix
    product by :data:`MATMUL_MARKS`, anything else ``"other"``."""
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a str, got {type(kernel).__name__}")
    name = kernel.split("(")[0].strip()
    if name in _BY_NAME:
        return _BY_NAME[name]
    low = kernel.lower()
    return "matmul" if any(m in low for m in MATMUL_MARKS) else "other"


@dataclass(frozen=True)
class PartBound:
    """One part's bound: ``bytes`` moved, ``flops`` done, and ``us``, the longer of the
    bytes at the copy rate and the FLOPs at the matmul rate; ``by`` says which."""

    bytes: float
    flops: float
    us: float
    by: str


def _bound(nbytes: float, flops: float, copy_bw: float, matmul_rate: float) -> PartBound:
    t_bytes, t_flops = nbytes / copy_bw * 1e6, flops / matmul_rate * 1e6
    return PartBound(float(nbytes), float(flops), max(t_bytes, t_flops), "flops" if t_flops > t_bytes else "bytes")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _number(name: str, value, *, zero: bool = False) -> None:
    """A real number above zero (or at least zero, with ``zero``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero else value > 0):
        raise ValueError(f"{name} must be a {'non-negative' if zero else 'positive'} number, got {value!r}")


def step_kind(engine, window: int) -> str:
    """The :func:`~replayssm.bench.common.step_bytes` kind of a step of ``window``
    tokens a request on ``engine``: ``plain_decode`` or ``plain_ring`` for one token
    (through the recurrence or circular's ring), else the engine's strategy."""
    if window == 1:
        return "plain_ring" if engine.plain_via_ring else "plain_decode"
    return engine.strategy_name


def step_bounds(engine, *, rows: int, window: int, accept: int, context: float, copy_bw: float,
                matmul_rate: float) -> dict[str, PartBound]:
    """Each part's bound (:class:`PartBound`, see the module docstring) for one step of
    ``rows`` requests with ``window`` tokens each on ``engine`` (a
    :class:`~replayssm.engine.adapter.HybridEngine`).

    Args:
        rows: requests in the step (the bucket's rows).
        window: tokens a request verifies (1: a plain step).
        accept: tokens a request commits (bonus included, ``<= window``), for the
            state's byte model (a ring's flush rate).
        context: the mean cached tokens a request's attention reads.
        copy_bw: the card's copy rate, bytes per second (read and write counted).
        matmul_rate: the card's matmul rate in the model's dtype, FLOP per second.

    Returns:
        ``{part: PartBound}`` for every part of :data:`STEP_PARTS` but ``"other"``.
    """
    for name, value in (("rows", rows), ("window", window), ("accept", accept)):
        _positive_int(name, value)
    if accept > window:
        raise ValueError(f"accept must be at most window ({window}), got {accept}")
    _number("context", context, zero=True)
    _number("copy_bw", copy_bw)
    _number("matmul_rate", matmul_rate)
    tokens = rows * window
    e = torch.empty((), dtype=engine.dtype).element_size()
    hidden, gdn_layers = engine.config.hidden_size, len(engine.mixers)

    weights = engine.lm_head.weight.numel()
    for layer in engine.layers:
        weights += _mlp_weights_per_token(layer.mlp)
        weights += _linear_weights(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn)
    out = {"matmul": _bound(weights * e, 2 * tokens * weights, copy_bw, matmul_rate)}

    s, pool = engine.shape, engine.pool
    kind = step_kind(engine, window)
    conv_dim = 2 * s.num_heads * s.head_k_dim + s.num_value_heads * s.head_v_dim
    shape = StepShape(batch=rows, num_heads=s.num_heads, num_value_heads=s.num_value_heads, head_k_dim=s.head_k_dim,
                      head_v_dim=s.head_v_dim, window=window, accept=accept,
                      state_elem=torch.empty((), dtype=pool.state_dtype).element_size(), act_elem=e,
                      ring_len=pool.ring_len or 0, conv_dim=conv_dim, conv_kernel=s.conv_kernel)
    # the state kernels without the conv, which is a part of its own
    out["gdn_state"] = _bound(gdn_layers * step_bytes(kind, replace(shape, conv_dim=0)).total, 0, copy_bw, matmul_rate)
    if kind == "plain_decode":  # x read, y written, the state read and advanced in place
        conv = rows * (2 + 2 * (s.conv_kernel - 1)) * conv_dim * e
    else:  # a verify's window buffer and a commit (a plain step through the ring takes both)
        conv = shape.conv_bytes(ring=pool.conv_ring)
    out["conv"] = _bound(gdn_layers * conv, 0, copy_bw, matmul_rate)

    norms = 2 * tokens * hidden  # the first layer's input norm
    norms += len(engine.layers) * 2 * 4 * tokens * hidden  # two residual adds with their norms a layer
    norms += gdn_layers * 3 * tokens * s.num_value_heads * s.head_v_dim  # the GDN output, its gate, the result
    attention = 0
    for layer, layer_kind in zip(engine.layers, engine.kinds):
        if layer_kind != "attn":
            continue
        a = layer.self_attn
        heads, kv_heads, d = a.config.num_attention_heads, a.config.num_key_value_heads, a.head_dim
        # each row's cached keys and values read, the window's written; queries and their gate read, outputs written
        attention += rows * (2 * kv_heads * d * (context + window) + 3 * window * heads * d)
        norms += 2 * tokens * (heads + kv_heads) * d  # the query and key norms
    out["attention"] = _bound(attention * e, 0, copy_bw, matmul_rate)
    out["norms"] = _bound(norms * e, 0, copy_bw, matmul_rate)
    return out


def parts_against_bounds(kernels, bounds: dict[str, PartBound]) -> list[dict]:
    """The step's kernels (``(name, us per step)`` pairs) summed by part, beside the
    parts' ``bounds`` (:func:`step_bounds`).

    Returns one row per part of :data:`STEP_PARTS` with kernels or a bound, in that
    order: ``{"part", "us", "kernels", "bound_us", "ratio", "by"}`` (``bound_us``,
    ``ratio`` and ``by`` ``None`` for ``"other"``), then a ``"total"`` row (its bound the
    sum of the parts' bounds, over the parts that have one).
    """
    us = dict.fromkeys(STEP_PARTS, 0.0)
    names: dict[str, list[str]] = {p: [] for p in STEP_PARTS}
    for name, t in kernels:
        part = step_part(name)
        us[part] += float(t)
        names[part].append(name)
    rows = []
    for part in STEP_PARTS:
        b = bounds.get(part)
        if not names[part] and b is None:
            continue
        rows.append({"part": part, "us": us[part], "kernels": names[part],
                     "bound_us": None if b is None else b.us,
                     "ratio": None if b is None or b.us == 0 else us[part] / b.us, "by": None if b is None else b.by})
    bounded = sum(b.us for b in bounds.values())
    total = sum(us.values())
    rows.append({"part": "total", "us": total, "kernels": [], "bound_us": bounded,
                 "ratio": total / bounded if bounded else None, "by": None})
    return rows


def format_parts(rows: list[dict]) -> str:
    """:func:`parts_against_bounds`' rows as a text table."""
    lines = [f"   {'part':<10} {'us/step':>9} {'bound us':>9} {'ratio':>7}  bound by"]
    for r in rows:
        bound = "-" if r["bound_us"] is None else f"{r['bound_us']:9.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:6.2f}x"
        lines.append(f"   {r['part']:<10} {r['us']:9.1f} {bound:>9} {ratio:>7}  {r['by'] or ''}")
    return "\n".join(lines)
