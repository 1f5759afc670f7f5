"""Run a Hugging Face Qwen3.5 / Qwen3-Next model with the state pool.

:class:`HybridEngine` wraps a loaded ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` /
``Qwen3NextForCausalLM`` and reuses its modules (embedding, projections, norms, MLP or
MoE, rotary embedding, LM head). Only the parts that hold state are replaced:

* GDN layers: ``in_proj`` -> :meth:`Strategy.conv_verify` (causal conv over ``q|k|v``)
  -> split into ``q, k, v`` and raw gates ``a, b`` -> :meth:`Strategy.verify` -> gated
  RMSNorm -> ``out_proj``. Prompts and plain decoding go through ``conv_prefill`` /
  ``prefill`` (the exact recurrence), or, for prompts on CUDA, through a chunked kernel
  (fla-core's ``chunk_gated_delta_rule``) when one is available.
* Full-attention layers: the module's ``q/k/v/o`` projections, ``q/k`` norms, rotary
  embedding and output gate, with our own :class:`KVCache` that rolls back by length.

Transformers' own kernel routing (fla, causal-conv1d) is never used: the engine never
calls the HF GDN or attention ``forward``.

Token layout: a step covers ``B`` requests, request ``i`` with a window of ``l_i``
tokens; tokens are packed ``[N = sum l_i]`` in request order, the layout of
:class:`replayssm.state.Batch`.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..ops.guards import to_device
from ..ops.triton_common import arrival_counters, chained_launches
from ..state import Batch, GDNShape, StatePool, strategy_class
from .attention import slot_attention, tree_attention
from .kv_cache import KVCache, PromptLayout, WindowLayout, cached_attention
from .activations import dense_silu_mlp, sigmoid_mul, silu_mul
from .argmax import argmax_rows
from .step_inputs import gather_step_inputs
from .fused_linear import fuse_linears, fused_weight
from .norms import add_rms_norm, norm_eps, norm_kind, rms_norm, rms_norm_pair
from .rotary import rope_at, rope_rows, rotate_, rotate_into_cache_

log = logging.getLogger("replayssm.engine")

PREFILL_MODES = ("auto", "recurrence", "chunk")


@dataclass
class StepOutput:
    """What one forward returns.

    Attributes:
        logits: ``[M, vocab]`` float32 logits, ``M = N`` (every window token) or ``B``
            (each request's last token), see ``all_logits`` of the call.
        hidden: ``[N, hidden]`` final-norm hidden states of every window token, in the
            model dtype (the MTP head reads them).
        lengths: window length per request.
        offsets: ``[B + 1]`` host offsets of the windows in the packed tokens.
        prompt_head: the engine's prompt head (:meth:`HybridEngine.set_prompt_head`) that
            ran inside this pass over every token of it (a static prompt pass), else
            ``None``.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    lengths: list[int]
    offsets: list[int]
    prompt_head: object = None

    def window_logits(self, i: int) -> torch.Tensor:
        """Logits of request ``i``'s window positions (needs ``all_logits``)."""
        return self.logits[self.offsets[i] : self.offsets[i + 1]]


def _text_model(hf_model):
    base = getattr(hf_model, "model", None)
    if base is None:
        raise TypeError(f"{type(hf_model).__name__} has no .model; expected a *ForCausalLM of Qwen3.5 / Qwen3-Next")
    return getattr(base, "language_model", base)


def _family(gdn_module) -> str:
    if hasattr(gdn_module, "in_proj_qkvz") and hasattr(gdn_module, "in_proj_ba"):
        return "qwen3_next"
    if all(hasattr(gdn_module, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")):
        return "qwen3_5"
    raise TypeError(f"unrecognised GDN module {type(gdn_module).__name__}: no in_proj_qkvz/ba nor in_proj_qkv/z/a/b")


#: Rotary embedding types whose frequencies depend on the sequence length (transformers'
#: ``rope_type``): a table of rows built once would not match them.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")

#: how to get the chunked prompt kernel (the package's optional GPU extra)
CHUNK_KERNEL_INSTALL = "pip install 'replayssm[gpu]' (fla-core >= 0.6)"


def load_chunk_kernel() -> Callable | None:
    """fla-core's ``chunk_gated_delta_rule`` if importable and recent enough (0.6 on:
    grouped value heads and ``state_v_first``, the pool's ``[V, K]`` state layout),
    else ``None``.

    Static prompt passes of several requests hand its Triton kernels their chunk list
    (``chunk_indices``, :meth:`Strategy.chunk_prefill_static`). A backend that fla-core
    dispatches to ahead of them (FlashQLA, where that package is installed) takes the
    offsets alone and derives its chunks itself, on the host: with it installed, set
    ``FLA_FLASH_QLA=0`` for graphed prompt passes."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule if takes(chunk_gated_delta_rule, "state_v_first") else None


class _GDNMixer:
    """Projections of one HF GDN module into our op inputs, and back."""

    def __init__(self, module):
        self.module = module
        self.family = _family(module)
        self.H = module.num_k_heads
        self.HV = module.num_v_heads
        self.K = module.head_k_dim
        self.V = module.head_v_dim
        # Qwen3.5's q|k|v, a and b projections in one matmul: their weights laid out as one
        # tensor (the module's weights views of it). z keeps its own: as a column slice
        # of a wider output the gated norm would copy it.
        self.fused = (module.in_proj_qkv, module.in_proj_a, module.in_proj_b) if self.family == "qwen3_5" else ()
        fuse_linears(self.fused)
        self.fused_sizes = [p.out_features for p in self.fused]

    def project(self, x: torch.Tensor):
        """``x [N, hidden]`` -> ``mixed_qkv [N, C]`` (q|k|v, pre-conv), ``z [N, HV, V]``,
        raw gates ``a, b [N, HV]`` (row-strided views of one output where the
        projections are fused)."""
        m, n = self.module, x.shape[0]
        if self.family == "qwen3_5":
            w = fused_weight(self.fused)
            z = m.in_proj_z(x).view(n, self.HV, self.V)
            if w is not None:
                mixed, a, b = torch.nn.functional.linear(x, w).split(self.fused_sizes, dim=-1)
                return mixed, z, a, b
            mixed = m.in_proj_qkv(x)
            return mixed, z, m.in_proj_a(x), m.in_proj_b(x)
        # Qwen3-Next interleaves q, k, v, z (and b, a) per key head; the module's own
        # reordering yields q, k [1, N, H, K], v, z [1, N, HV, V], b, a [1, N, HV].
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x)[None], m.in_proj_ba(x)[None])
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z[0].reshape(n, self.HV, self.V), a[0].reshape(n, self.HV), b[0].reshape(n, self.HV)

    @property
    def parts(self) -> tuple[int, int, int]:
        """The channel counts of ``q|k|v`` in the conv's input."""
        return self.H * self.K, self.H * self.K, self.HV * self.V

    def split(self, mixed):
        """Post-conv channels ``[N, C]`` (or their three parts, a planar conv output) ->
        ``q, k [N, H, K]``, ``v [N, HV, V]``."""
        q, k, v = torch.split(mixed, self.parts, dim=-1) if isinstance(mixed, torch.Tensor) else mixed
        n = q.shape[0]
        return q.reshape(n, self.H, self.K), k.reshape(n, self.H, self.K), v.reshape(n, self.HV, self.V)

    def finish(self, o: torch.Tensor, z: torch.Tensor, norm=None) -> torch.Tensor:
        """Gated RMSNorm per value head, then ``out_proj``: ``[N, HV, V] -> [N, hidden]``.
        ``norm(module, x, gate)`` replaces the norm module's call (fused kernels)."""
        n = o.shape[0]
        if norm is None:
            y = self.module.norm(o.reshape(-1, self.V), z.reshape(-1, self.V))
        else:
            y = norm(self.module.norm, o.reshape(-1, self.V), z.reshape(-1, self.V))
        return self.module.out_proj(y.reshape(n, self.HV * self.V))


def attention_forward(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                      layout: WindowLayout | PromptLayout, norm=None) -> torch.Tensor:
    """The HF full-attention module's computation with our cache.

    Reproduces ``Qwen3_5Attention.forward`` / ``Qwen3NextAttention.forward`` (query and
    output gate from ``q_proj``, per-head ``q/k`` RMSNorm, partial rotary embedding,
    ``sigmoid(gate)`` on the output) except for the cache handling.

    Args:
        x: ``[R, hidden]`` normed hidden states; the first ``N`` rows are the window
            tokens, any further rows padding (projected, then ignored).
        cos, sin: ``[N, rotary_dim]``.
        norm: ``norm(module, x)`` for the ``q/k`` norms (default: the modules).

    Returns:
        ``[R, hidden]`` (padding rows zero before ``o_proj``).
    """
    rows, n = x.shape[0], cos.shape[0]
    q, k, v, gate = _attention_inputs(attn, x, cos, sin, norm)
    o = cached_attention(cache, layer, layout, q, k, v[:n], attn.scaling)
    o = _pad_rows(o.reshape(n, -1), rows) * torch.sigmoid(gate)
    return attn.o_proj(o)


def attention_projections(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A full-attention module's projections of ``x [N, hidden]``: ``q, gate [N, heads,
    D]`` (interleaved per head in ``q_proj``'s output), ``k, v [N, kv_heads, D]``.

    Where the weights of ``q_proj``, ``k_proj`` and ``v_proj`` are laid out as one
    tensor (:func:`fuse_linears`), one matmul computes all four, each a strided view of
    its output ``[N, W]``, ``W = 2 heads D + 2 kv_heads D``: ``q, gate`` at strides ``(W,
    2D, 1)``, ``k, v`` at ``(W, D, 1)`` (the norms read them in place); else the three
    modules.
    """
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    w = fused_weight(projections)
    if w is None:
        return split_projections(attn, *(p(x) for p in projections))
    return split_projections(attn, torch.nn.functional.linear(x, w))


def split_projections(attn, *outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention_projections`' views ``q, gate, k, v`` of the projections'
    outputs: the three modules' ``[N, *]``, or the fused matmul's ``[N, W]`` (strided
    views of it, no copy)."""
    if len(outputs) == 1:
        sizes = [p.out_features for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        outputs = outputs[0].split(sizes, dim=-1)
    qg, k, v = outputs
    n, d = qg.shape[0], attn.head_dim
    q, gate = qg.view(n, -1, 2 * d).chunk(2, dim=-1)
    return q, gate, k.view(n, -1, d), v.view(n, -1, d)


def _attention_inputs(attn, x, cos, sin, norm=None):
    """Rotated ``q [N, heads, D]``, ``k [N, kv_heads, D]`` of the first ``N = len(cos)``
    rows, ``v [R, kv_heads, D]`` and the output gate ``[R, heads * D]``. ``norm(module,
    x)`` applies the ``q/k`` norms (default: the modules themselves)."""
    norm = norm or (lambda module, t: module(t))
    rows, n = x.shape[0], cos.shape[0]
    q, gate, k, v = attention_projections(attn, x)
    gate = gate.reshape(rows, -1)
    q = norm(attn.q_norm, q)
    k = norm(attn.k_norm, k)
    rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb")
    q, k = rope(q[None, :n], k[None, :n], cos[None], sin[None], unsqueeze_dim=2)
    return q[0], k[0], v, gate


def rotated_qk(attn, q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor, norm, *, fused: bool = False,
               cache: tuple | None = None) -> torch.Tensor:
    """A full-attention module's normed and rotated queries and keys, in one buffer.

    Args:
        q: ``[B * T, heads, D]``, k: ``[B * T, kv_heads, D]`` projections, row-major
            over ``(b, t)`` (:func:`attention_projections`: strided views, read in place).
        rope: ``[B, T or 1, 2, R]`` rotary rows (:func:`~replayssm.engine.rotary.rope_rows`).
        norm: ``norm(module, x, out=buffer)``, the ``q/k`` norms written into slices of
            the result (:meth:`HybridEngine.static_norm`; default: the modules).
        fused: the engine's fused kernels (CUDA or the interpreter): both norms in one
            launch where both are offset norms (:func:`~replayssm.engine.norms.rms_norm_pair`,
            the bits of ``norm``'s two), and the rotation in one
            (:func:`~replayssm.engine.rotary.rotate_`'s Triton form); else ``norm`` twice
            and torch's ops.
        cache: ``None``, or ``(k_cache, v_cache, slots, at, v)``: also write the rotated
            keys and the values ``v [B, T, kv_heads, D]`` into one layer's cache
            ``[slots, kv_heads, L, D]``, token ``(b, t)`` at slot ``slots[b]`` and
            position ``at[b, t]``; with ``fused`` in the rotation's launch
            (:func:`~replayssm.engine.rotary.rotate_into_cache_`), else two indexed
            writes after it (the same bits).

    Returns:
        ``qk [B, T, heads + kv_heads, D]``: queries, then keys (the norms write there and
        the rotation runs once, in place, for both). The arithmetic of
        :func:`_attention_inputs`, bit for bit.
    """
    norm = norm or (lambda module, y, out: out.copy_(module(y)))
    (n, heads, d), b = q.shape, rope.shape[0]
    qk = torch.empty((b, n // b, heads + k.shape[1], d), dtype=q.dtype, device=q.device)
    q_out, k_out = qk.view(n, -1, d)[:, :heads], qk.view(n, -1, d)[:, heads:]
    if fused and norm_kind(attn.q_norm) == norm_kind(attn.k_norm) == "offset":
        rms_norm_pair(q, attn.q_norm.weight, norm_eps(attn.q_norm), q_out, k, attn.k_norm.weight,
                      norm_eps(attn.k_norm), k_out)
    else:
        norm(attn.q_norm, q, out=q_out)
        norm(attn.k_norm, k, out=k_out)
    if cache is None:
        rotate_(qk, rope, backend="triton" if fused else "torch")
        return qk
    k_cache, v_cache, slots, at, v = cache
    if fused:
        rotate_into_cache_(qk, rope, v, k_cache, v_cache, slots, at)
        return qk
    rotate_(qk, rope, backend="torch")
    where = (slots[:, None].expand(b, n // b), slice(None), at)
    k_cache[where] = qk[:, :, heads:].to(k_cache.dtype)
    v_cache[where] = v.to(v_cache.dtype)  # a strided view of the projections
    return qk


def gated_output(o: torch.Tensor, gate: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
    """A full-attention layer's gated output ``o * sigmoid(gate)`` for ``o, gate [N,
    heads, D]`` (``gate`` a strided view of the query projection), as ``[N, heads * D]``:
    one launch where ``fused`` (:func:`~replayssm.engine.activations.sigmoid_mul`, the
    same bits on CUDA), else torch's two ops."""
    y = sigmoid_mul(o, gate) if fused else o * torch.sigmoid(gate)
    return y.view(o.shape[0], -1)


def static_attention_forward(attn, x: torch.Tensor | None, rope: torch.Tensor, cache: KVCache,
                             layer: int, slot_idx: torch.Tensor, positions: torch.Tensor,
                             backend: str = "auto", norm=None, tree=None, fused: bool = False,
                             projections: tuple | None = None, output_projection: bool = True,
                             key_split: int = 0, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attention_forward` for a static-shape step of ``B`` rows of ``T`` tokens.

    Args:
        x: ``[B * T, hidden]`` normed hidden states, row-major over ``(b, t)`` (``None``
            with ``projections``).
        projections: ``None``, or ``(q, gate, k, v)`` as :func:`attention_projections`
            gives them, computed by the caller (with its norm, say); ``x`` is then unused.
        output_projection: ``False``: return the gated attention output ``[B * T,
            heads * D]`` before ``o_proj`` (for a caller that runs it with the residual add).
        rope: ``[B, T, 2, rotary_dim]`` rotary rows of the tokens
            (:func:`~replayssm.engine.rotary.rope_rows`).
        norm, fused: as :func:`rotated_qk`'s (``fused`` also for the output gate,
            :func:`gated_output`).
        slot_idx: ``[B]`` cache slot per row (the cache's sink for padding rows).
        positions: ``[B, T]`` absolute position of every token (``starts[:, None] + t``).
        tree: ``None`` (a causal window), or ``(starts [B], nodes [T], visible [T, W],
            visible_bits [T])`` for ``T`` nodes of a draft-tree window
            (:mod:`replayssm.engine.trees`): token ``t`` is node ``nodes[t]``, written at
            cache position ``starts + nodes[t]`` and seeing the prefix and the window
            entries ``visible[t]`` (:func:`tree_attention`; ``visible_bits`` its rows as
            bit sets, built once per tree); ``positions`` are then only the rotary ones
            (``start + depth``, already in ``cos`` / ``sin``).
        key_split, arrivals: a causal window's attention with its keys split into parts
            of ``key_split`` merged in its launch (:func:`slot_attention`; not for trees).

    Writes the window's keys and values at their positions (the lengths are not
    changed) and attends over each row's slot with :func:`slot_attention`; no value is
    read on the host, so the call can be captured in a CUDA graph.
    """
    if key_split and tree is not None:  # before the cache writes: a refused call changes nothing
        raise ValueError("key_split is for causal windows, not trees")
    b, t = positions.shape
    q, gate, k, v = attention_projections(attn, x) if projections is None else projections
    heads, d = gate.shape[1], attn.head_dim
    at = positions if tree is None else tree[0][:, None] + tree[1][None]
    qk = rotated_qk(attn, q, k, rope, norm, fused=fused,
                    cache=(cache.k[layer], cache.v[layer], slot_idx, at, v.view(b, t, -1, d)))
    # Fused, the output gate is the attention kernel's epilogue (the bits of sigmoid_mul after it).
    inside = gate if fused else None
    if tree is None:
        o = slot_attention(qk[:, :, :heads], cache.k[layer], cache.v[layer], slot_idx, positions[:, 0],
                           attn.scaling, backend=backend, gate=inside, key_split=key_split, arrivals=arrivals)
    else:
        o = tree_attention(qk[:, :, :heads], cache.k[layer], cache.v[layer], slot_idx, tree[0], tree[2],
                           attn.scaling, backend=backend, gate=inside, visible_bits=tree[3])
    o = o.view(b * t, heads * d) if fused else gated_output(o.reshape(b * t, heads, d), gate)
    return attn.o_proj(o) if output_projection else o


def prompt_attention_forward(attn, x: torch.Tensor, rope: torch.Tensor, cache: KVCache, layer: int,
                             layout: PromptLayout, norm=None, fused: bool = False) -> torch.Tensor:
    """:func:`attention_forward` of a static prompt pass (:mod:`replayssm.engine.prompt_graph`)
    with the queries and keys normed into one buffer and rotated in place
    (:func:`rotated_qk`: one kernel where ``fused``, else four, where transformers'
    rotary takes about twelve and two concatenations per layer; the same bits).

    Args:
        x: ``[N, hidden]`` normed hidden states of the pass's packed tokens.
        rope: ``[1, N, 2, rotary_dim]`` rotary rows of the tokens
            (:func:`~replayssm.engine.rotary.rope_rows`).
        layout: the pass's :class:`PromptLayout`.
        norm, fused: as :func:`rotated_qk`'s (``fused`` also for the output gate,
            :func:`gated_output`).

    Returns:
        ``[N, hidden]``.
    """
    n, d = x.shape[0], attn.head_dim
    q, gate, k, v = attention_projections(attn, x)
    qk = rotated_qk(attn, q, k, rope, norm, fused=fused)[0]  # [N, heads + kv_heads, D]
    heads = gate.shape[1]
    o = cached_attention(cache, layer, layout, qk[:, :heads], qk[:, heads:], v, attn.scaling)
    return attn.o_proj(gated_output(o.reshape(n, heads, d), gate, fused=fused))


def _resolve_plain_via_ring(plain_via_ring, strategy, window: int, ring_len) -> bool:
    """``HybridEngine``'s ``plain_via_ring`` for ``strategy`` (a registered name) and its
    pool: ``None`` means when the strategy can decode through a ring that holds more
    than ``2 T`` records. With ``L = 2 T`` every plain step would flush (the flag keeps
    room for two windows, DESIGN.md section 9): the recurrence then moves less."""
    ring = bool(getattr(strategy_class(strategy), "ring_decode", False))
    if plain_via_ring is None:
        return ring and isinstance(ring_len, int) and ring_len > 2 * window
    if not isinstance(plain_via_ring, bool):
        raise TypeError(f"plain_via_ring must be a bool or None, got {type(plain_via_ring).__name__}")
    if plain_via_ring and not ring:
        raise ValueError(f"plain_via_ring=True needs a strategy with a ring to decode through (circular), "
                         f"got {strategy!r}")
    return plain_via_ring


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [N, ...]`` with zero rows appended up to ``rows``."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


def mlp_forward(mlp, x: torch.Tensor, *, token_by_token: int = 0) -> torch.Tensor:
    """Dense MLP or sparse MoE block on ``[N, hidden]`` (MoE blocks expect ``[B, S, H]``
    and some versions return ``(out, router_logits)``).

    ``token_by_token = n`` runs a MoE block on each of the first ``n`` rows alone (the
    other rows get zeros): an expert's matmul then always has one row, whatever the
    routing of the step's other tokens (fixed shapes).
    """
    if token_by_token and hasattr(mlp, "experts"):
        out = torch.zeros_like(x)
        for i in range(token_by_token):
            out[i : i + 1] = mlp_forward(mlp, x[i : i + 1])
        return out
    y = mlp(x[None])
    if isinstance(y, tuple):
        y = y[0]
    return y.reshape(x.shape)


def moe_kernel_for(block, device: torch.device, dtype: torch.dtype) -> str:
    """How :func:`static_moe_forward` runs ``block``'s experts: ``"grouped_mm"``
    (``torch._grouped_mm``, one grouped GEMM per projection; CUDA, 16-bit weights, when
    a probe call succeeds) or ``"gather"`` (each token's expert weights gathered and
    multiplied alone; any device, memory ``tokens x top_k x expert size``)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16,) or not hasattr(torch, "_grouped_mm"):
        return "gather"
    experts = block.experts
    try:
        x = torch.zeros(16, experts.gate_up_proj.shape[-1], device=device, dtype=dtype)
        offs = torch.full((experts.gate_up_proj.shape[0],), 16, dtype=torch.int32, device=device)
        torch._grouped_mm(x, experts.gate_up_proj.transpose(1, 2), offs=offs)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        log.info("torch._grouped_mm unavailable for the MoE experts (%s); gathering expert weights per token", e)
        return "gather"
    return "grouped_mm"


def static_moe_forward(block, x: torch.Tensor, kernel: str = "gather") -> torch.Tensor:
    """A transformers-5 sparse MoE block (router ``gate``, fused ``experts``, optional
    gated ``shared_expert``) on ``[N, hidden]`` without a host synchronisation: the HF
    experts loop over the experts a step hits, which the host must read first.

    Each token's result depends on that token alone (its experts' products are summed in
    ``top_k`` order), so plain and speculative steps agree on shared tokens.
    """
    n, hidden = x.shape
    _, weights, idx = block.gate(x)  # [N, k] routing weights and expert ids
    experts = block.experts
    k = idx.shape[1]
    flat = idx.reshape(-1)
    if kernel == "grouped_mm":
        order = torch.argsort(flat, stable=True)
        xs = x[order // k]
        counts = torch.zeros(experts.gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(xs, experts.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        ys = torch._grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2), offs=offs)
        y = torch.empty_like(ys)
        y[order] = ys
    else:
        xs = x.repeat_interleave(k, dim=0)[:, None]  # [N k, 1, hidden]
        gate, up = torch.bmm(xs, experts.gate_up_proj[flat].transpose(1, 2)).chunk(2, dim=-1)
        y = torch.bmm(experts.act_fn(gate) * up, experts.down_proj[flat].transpose(1, 2))[:, 0]
    out = (y.view(n, k, hidden) * weights.to(y.dtype)[..., None]).sum(1)
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * shared(x)
    return out


def is_moe(mlp) -> bool:
    return hasattr(mlp, "experts")


def takes(kernel: Callable, parameter: str) -> bool:
    """Whether ``kernel``'s signature names ``parameter`` (for fla-core's releases:
    ``cu_seqlens_cpu``, the host copy of the offsets, so that the kernel derives its
    chunk indices without reading the device; ``state_v_first``, from 0.6)."""
    import inspect

    try:
        return parameter in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


class _PromptKernel:
    """The chunked kernel as one prompt pass calls it, layer after layer (the strategy's
    ``chunk_prefill`` calls it with fla-core's signature).

    * Every layer gets the same ``cu_seqlens`` tensor (of the values the strategy
      passes): fla-core derives chunk indices from it with a host read and caches them
      by tensor identity, so that read happens once per pass instead of once per
      layer; a kernel that takes ``cu_seqlens_cpu`` gets the host copy and reads
      nothing.
    * Requests that hold committed tokens (a prompt prefilled in chunks) start from
      their committed state: the kernel's ``initial_state`` ``[B, HV, V, K]``, the
      layer's committed states; fresh requests start from zero, which their committed
      state is.
    """

    def __init__(self, kernel: Callable, strategy, batch: Batch, starts: Sequence[int]):
        self.kernel = kernel
        self.strategy = strategy
        self.slots = list(batch.host_slots)
        self.history = any(starts)
        self.cu_seqlens = batch.cu_seqlens.long()
        self.extra = {}
        if takes(kernel, "cu_seqlens_cpu"):
            self.extra["cu_seqlens_cpu"] = torch.tensor(list(itertools.accumulate(batch.lengths, initial=0)))

    def layer(self, j: int) -> Callable:
        def call(q, k, v, g, beta, *, initial_state=None, cu_seqlens=None, **kwargs):
            if self.history:
                initial_state = self.strategy.committed_state(j, self.slots)
            return self.kernel(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=self.cu_seqlens,
                               **kwargs, **self.extra)

        return call


def token_ids(w, what: str, vocab_size: int) -> np.ndarray:
    """The token ids ``w`` as a 1-D int64 array, checked (``ValueError`` naming ``what``):
    non-empty, every id in ``[0, vocab_size)``. ``w`` is a sequence of integers (Python's
    or NumPy's; not bools), or a 1-D integer NumPy array or CPU tensor, whose dtype
    stands for every element. A list of plain ints, and an array, are checked in one
    pass at C speed; anything else id by id."""
    if isinstance(w, torch.Tensor):
        if w.device.type != "cpu":
            raise ValueError(f"{what} is a tensor on {w.device}: token ids come from the host")
        w = w.numpy()
    if isinstance(w, np.ndarray):
        if w.ndim != 1 or w.dtype.kind not in "iu":
            raise ValueError(f"{what} must be a 1-D array of integer token ids, got {w.ndim}-D {w.dtype}")
        ids = w.astype(np.int64)  # a copy: later changes to the caller's array do not reach the pass
    else:
        w = w if isinstance(w, list) else list(w)
        # plain ints, their types checked at C speed (a long prompt's loop took milliseconds);
        # else the token-by-token check below finds the culprit
        ids = _packed_ints(w) if set(map(type, w)) == {int} else None
        if ids is None:  # other integers (NumPy's, int subclasses), one by one; never bools
            for t in w:
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
                    raise ValueError(f"{what} holds {t!r}, not a token id in [0, {vocab_size})")
            ids = np.array([int(t) for t in w], dtype=np.int64)
    if ids.size == 0:
        raise ValueError(f"{what} is empty")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise ValueError(f"{what} holds {bad}, not a token id in [0, {vocab_size})")
    return ids


def _packed_ints(w: list) -> np.ndarray | None:
    """The plain ints ``w`` as an int64 array, or ``None`` where one is past int64 (out
    of any vocabulary: the caller's token-by-token check names it)."""
    try:
        return np.fromiter(w, np.int64, len(w))
    except OverflowError:
        return None


class HybridEngine:
    """A Qwen3.5 / Qwen3-Next model whose GDN state lives in a :class:`StatePool`.

    Args:
        hf_model: a loaded ``*ForCausalLM`` (its parameters are used, not copied). The
            projections that share an input (a Qwen3.5 GDN layer's ``q|k|v``, ``a``,
            ``b``; a full-attention layer's ``q_proj``, ``k_proj``, ``v_proj``; a dense
            MLP's ``gate`` and ``up``) get their weights laid out as one tensor each,
            the modules' weights becoming views of it (same values and memory;
            :mod:`~replayssm.engine.fused_linear`), so each group is one matmul.
        strategy: ``"snapshot"``, ``"fold"`` or ``"circular"`` (DESIGN.md section 3).
        num_slots: concurrent requests.
        window: largest verify window ``T`` (draft tokens + 1).
        max_len: most tokens per request (prompt + generated + one window).
        ring_len: circular ring length ``L``; default the smallest power of two
            ``>= 4 T``: at ``L = 2T`` every commit would raise the flush flag, so every
            verify would fold (DESIGN.md section 3), and plain steps would not take the
            ring.
        state_dtype: dtype of GDN checkpoints (float32 unless you know better).
        backend: op backend (``"auto"``: Triton on CUDA, the reference on the CPU).
        prefill: ``"recurrence"`` (the exact recurrence), ``"chunk"`` (a chunked
            kernel; needs ``chunk_kernel`` or fla-core, the ``gpu`` extra) or ``"auto"``
            (chunk on CUDA in bf16/fp16 when fla-core imports, else the recurrence). The
            choice is logged (a warning when a CUDA engine in 16 bits finds no fla-core)
            and kept in :attr:`prefill_kernel`.
        chunk_kernel: a callable with fla-core's ``chunk_gated_delta_rule`` signature.
        fixed_shape: ``(rows, window)`` to run every step of at most ``rows`` tokens
            and windows of at most ``window`` tokens with fixed shapes: token-wise
            layers (projections, norms, MLP, LM head) on ``rows`` rows (zero padding),
            attention on ``window`` queries against ``max_len`` keys per request, MoE
            blocks one token at a time. A
            token's result then does not depend on how many tokens share its step,
            which GPU matmuls otherwise do not guarantee; two engines with the same
            ``fixed_shape`` (say plain decoding and speculative decoding) compute
            bit-identical logits for the same tokens. Costs speed; for exactness tests.
        plain_via_ring: plain decoding steps (:meth:`extend` of one token per request,
            not a prompt; :meth:`forward_static` with ``verify=False``) go through the
            strategy's ring (:meth:`Strategy.decode`: the state is read once a step and
            written at a flush, DESIGN.md section 9) instead of the recurrence. Default
            (``None``): whenever the strategy has one (``circular``) longer than
            ``2 * window`` records, as the default ring is (with ``ring_len = 2 *
            window`` every plain step would flush). ``True`` with a strategy without a ring raises;
            ``False`` keeps the recurrence. Steps
            through the recurrence (prompts, windows of several tokens) first fold a
            request's ring history into its checkpoint (:meth:`Strategy.fold_history`).
        prompt_graphs: prompt passes of fresh requests run as static shapes, each
            captured once in a CUDA graph (:mod:`replayssm.engine.prompt_graph`): the
            host's launches, not the GPU, set an eager prompt pass's time up to a few
            thousand tokens. GDN layers go through the chunked kernel when the engine
            has one (one request as one sequence, several as sequences of the packed
            tokens with a fixed-length chunk list; shapes up to 16 prompts of 2048
            tokens), else through the exact
            recurrence. Default
            (``None``): on a CUDA engine without ``fixed_shape``. ``True`` on the CPU
            runs the same static body eagerly. Which passes took it: :attr:`prompt_passes`;
            passes asking for every token's logits, and any pass while
            :attr:`gdn_inputs_hook` is set, run eagerly.
        prompt_graph_tokens: the largest token capacity of a prompt shape whose GDN
            layers run the recurrence (a power of two; the
            :class:`~replayssm.engine.prompt_graph.PromptGraphs`'
            ``max_tokens``); longer passes without a chunked kernel run eagerly.
        conv_ring: keep each request's conv inputs as one ring (``StatePool(...,
            conv_ring=True)``): a commit moves the request's position instead of copying
            the accepted inputs into its conv state (one launch and ~6 rows of every
            GDN layer's channels a request, read or written, fewer a step).

    A step is either :meth:`extend` (prompt prefill or plain decoding: the state
    advances over every token) or :meth:`verify` followed by :meth:`commit`.
    """

    #: Each GDN layer's conv and state kernel (verify, ring decode, a prompt's or a
    #: plain step's recurrence) in a static step, and the step's commit, launch as a chain
    #: (:func:`~replayssm.ops.triton_common.chained_launches`, on GPUs that allow it):
    #: the verify's programs load their state tiles while the conv runs. ``False``: in
    #: stream order, for comparison. The numbers are the same either way.
    chain_state_kernels = True
    #: Keys a part of a static step's window attention (the fused kernels): ``0`` walks
    #: each row's keys in one program; ``C`` splits them at fixed positions into parts
    #: merged in the launch (:func:`~replayssm.engine.attention.slot_attention`). Either
    #: way a token's bits do not depend on its window position or batch, so plain and
    #: speculative steps agree; the two settings differ from each other to rounding.
    attention_key_split = 0

    def __init__(self, hf_model, *, strategy: str = "fold", num_slots: int = 1, window: int = 4,
                 max_len: int = 4096, ring_len: int | None = None, state_dtype: torch.dtype = torch.float32,
                 backend: str = "auto", prefill: str = "auto", chunk_kernel: Callable | None = None,
                 fixed_shape: tuple[int, int] | None = None, plain_via_ring: bool | None = None,
                 prompt_graphs: bool | None = None, prompt_graph_tokens: int = 512, conv_ring: bool = True):
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if fixed_shape is not None:
            if (not isinstance(fixed_shape, (tuple, list)) or len(fixed_shape) != 2
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in fixed_shape)):
                raise ValueError(f"fixed_shape must be (rows, window) of positive ints, got {fixed_shape!r}")
            fixed_shape = (int(fixed_shape[0]), int(fixed_shape[1]))
        self.fixed_shape = fixed_shape
        text = _text_model(hf_model)
        lm_head = getattr(hf_model, "lm_head", None)
        if lm_head is None:
            raise TypeError(f"{type(hf_model).__name__} has no lm_head")
        self.hf_model = hf_model
        self.config = text.config
        self.embed = text.embed_tokens
        self.layers = list(text.layers)
        self.norm = text.norm
        self.rotary = text.rotary_emb
        self.lm_head = lm_head
        self.vocab_size = lm_head.out_features
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device

        self.kinds: list[str] = []  # "gdn" or "attn" per decoder layer
        self.index: list[int] = []  # index among layers of the same kind
        self.mixers: list[_GDNMixer] = []
        attn_modules = []
        for i, layer in enumerate(self.layers):
            if hasattr(layer, "linear_attn"):
                self.kinds.append("gdn")
                self.index.append(len(self.mixers))
                self.mixers.append(_GDNMixer(layer.linear_attn))
            elif hasattr(layer, "self_attn"):
                self.kinds.append("attn")
                self.index.append(len(attn_modules))
                attn = layer.self_attn
                attn_modules.append(attn)
                fuse_linears((attn.q_proj, attn.k_proj, attn.v_proj))  # one matmul (attention_projections)
            else:
                raise TypeError(f"decoder layer {i} has neither linear_attn nor self_attn")
            if dense_silu_mlp(getattr(layer, "mlp", None)):  # gate and up in one matmul (static_mlp)
                fuse_linears((layer.mlp.gate_proj, layer.mlp.up_proj))
        if not self.mixers:
            raise TypeError("the model has no GDN (linear_attention) layers")
        self.family = self.mixers[0].family
        m0 = self.mixers[0]
        self.shape = GDNShape(m0.H, m0.HV, m0.K, m0.V, conv_kernel=m0.module.conv_kernel_size)
        if ring_len is None:
            ring_len = 1 << max(1, (4 * window - 1).bit_length())
        self.plain_via_ring = _resolve_plain_via_ring(plain_via_ring, strategy, window, ring_len)
        self.strategy_name = strategy
        self.window = window
        self.pool = StatePool(
            self.shape, len(self.mixers), num_slots, strategy=strategy, window=window, ring_len=ring_len,
            state_dtype=state_dtype, act_dtype=self.dtype, device=self.device, backend=backend, conv_ring=conv_ring,
        )
        for j, mixer in enumerate(self.mixers):
            mod = mixer.module
            self.pool.set_layer_params(
                j, A_log=mod.A_log.detach(), dt_bias=mod.dt_bias.detach(), conv_weight=mod.conv1d.weight.detach(),
                conv_bias=None if mod.conv1d.bias is None else mod.conv1d.bias.detach(),
            )
        a0 = attn_modules[0] if attn_modules else None
        self.kv = KVCache(
            len(attn_modules), num_slots,
            a0.k_proj.out_features // a0.head_dim if a0 is not None else 1,
            a0.head_dim if a0 is not None else 1, max_len, dtype=self.dtype, device=self.device,
        )
        self.max_len = max_len
        self.backend = backend
        # Steps run the norms, and the MLP's activation with its product, as one kernel
        # each on CUDA (a quarter of a batch-1 step was the modules' small kernels); the
        # CPU keeps the modules.
        self.fused_norms = backend == "triton" or (self.device.type == "cuda" and backend != "reference")
        #: Arrival counters of the fused kernels split into parts
        #: (:func:`~replayssm.ops.triton_common.arrival_counters`): a split argmax's
        #: last part, or a split attention's, merges the parts in its own launch. A
        #: step's split kernels (the target's argmax, the MTP head's attention and
        #: argmaxes) run one after another on its stream, so they share one buffer.
        self.arrivals = arrival_counters(self.device) if self.fused_norms else None
        # every cache position's rotary rows, gathered by the static steps (None: the
        # embedding's frequencies follow the sequence length; the steps evaluate it)
        self._rope = None
        if getattr(self.rotary, "rope_type", "default") not in LENGTH_DEPENDENT_ROPE:
            self._rope = self.rope_table(max_len + window)
        self._pending: tuple | None = None
        #: Optional ``hook(j, q, k, v, a, b)`` called with GDN layer ``j``'s inputs of
        #: every eager step (:meth:`extend`, :meth:`verify`; not :meth:`forward_static`)
        #: just before the strategy gets them: ``q, k [N, H, K]`` and ``v [N, HV, V]``
        #: after the causal conv and its activation, raw gates ``a, b [N, HV]``, the
        #: step's tokens packed in request order. For instruments (``replayssm drift``
        #: records one layer's inputs over real text); the tensors are the engine's
        #: own, under inference mode, so a hook copies what it keeps.
        self.gdn_inputs_hook: Callable | None = None
        moe = next((layer.mlp for layer in self.layers if is_moe(layer.mlp)), None)
        self.moe_kernel = None if moe is None else moe_kernel_for(moe, self.device, self.dtype)
        if self.moe_kernel is not None:
            log.info("MoE experts of static steps: %s", self.moe_kernel)

        self.chunk_kernel = None
        if prefill == "chunk":
            self.chunk_kernel = chunk_kernel or load_chunk_kernel()
            if self.chunk_kernel is None:
                raise ValueError("prefill='chunk' needs fla-core >= 0.6 (fla.ops.gated_delta_rule) or a chunk_kernel: "
                                 + CHUNK_KERNEL_INSTALL)
            self.prefill_kernel = "chunk"
        elif prefill == "auto" and self.device.type == "cuda":
            if self.dtype not in (torch.bfloat16, torch.float16):
                self.prefill_kernel = f"recurrence (chunked kernels need bf16/fp16, the model is {self.dtype})"
            else:
                self.chunk_kernel = chunk_kernel or load_chunk_kernel()
                self.prefill_kernel = ("chunk (fla-core)" if self.chunk_kernel
                                       else f"recurrence (fla-core >= 0.6 not importable: {CHUNK_KERNEL_INSTALL})")
        else:
            self.prefill_kernel = "recurrence"
        # A CUDA engine that could run prompts through the chunked kernel but cannot
        # find it says so: the token-serial recurrence is many times slower on long prompts.
        missing = self.device.type == "cuda" and prefill == "auto" and self.chunk_kernel is None
        (log.warning if missing and self.dtype != torch.float32 else log.info)(
            "prompt prefill of GDN layers: %s", self.prefill_kernel)
        if prompt_graphs is None:
            prompt_graphs = self.device.type == "cuda" and fixed_shape is None
        if not isinstance(prompt_graphs, bool):
            raise TypeError(f"prompt_graphs must be a bool or None, got {type(prompt_graphs).__name__}")
        if prompt_graphs and fixed_shape is not None:
            raise ValueError("prompt_graphs and fixed_shape exclude each other (fixed_shape pads every step its own way)")
        self.prompt_graphs = None
        if prompt_graphs:
            from .prompt_graph import PromptGraphs  # it builds on this module

            self.prompt_graphs = PromptGraphs(self, max_tokens=prompt_graph_tokens)
        #: prompt passes so far by path: ``"static"`` (a prompt shape) or ``"eager"``
        self.prompt_passes = {"static": 0, "eager": 0}

    # ------------------------------------------------------------------ slots
    @property
    def strategy(self):
        return self.pool.strategy

    def alloc(self) -> int:
        """A fresh request slot (zero state, empty KV)."""
        return self.alloc_many(1)[0]

    def alloc_many(self, n: int) -> list[int]:
        """``n`` fresh request slots, as ``n`` calls of :meth:`alloc` would give them,
        with one device write per buffer for all of them (``PoolExhausted`` if fewer are
        free; none is taken then)."""
        slots = self.pool.alloc_many(n)
        self.kv.reset_many(slots)
        return slots

    def free(self, slot: int) -> None:
        """Release a request's slot (the pool's checks first; its KV length is reset)."""
        self.free_many((slot,))

    def free_many(self, slots: Sequence[int]) -> None:
        """Release several slots at once: the pool's checks of every slot first (a
        failed call frees none), then one device write each for the pool's liveness
        and the KV lengths, instead of one per slot."""
        slots = list(slots)
        self.pool.free_many(slots)
        self.kv.reset_many(slots)

    def length(self, slot: int) -> int:
        """Committed tokens of ``slot`` (the position of its next token)."""
        return self.kv.lengths[slot]

    def state_nbytes(self) -> dict[str, int]:
        """Bytes of the GDN state pool (per buffer, ``total``) and of the KV cache."""
        out = dict(self.pool.nbytes())
        out["kv_cache"] = self.kv.nbytes()
        return out

    @property
    def ring_decoding(self) -> bool:
        """Whether plain decoding steps run through the strategy's ring now
        (``plain_via_ring`` and a strategy with ``ring_decode``)."""
        return self.plain_via_ring and self.strategy.ring_decode

    def set_prompt_head(self, head) -> None:
        """Run ``head`` at the end of every static prompt pass (``None``: nothing).

        ``head(layout, ids, hidden, kv_rows, kv_lengths)`` is graph-safe work on the
        pass's tokens that a drafter would otherwise do eagerly after it (the MTP
        head's keys and values of the prompt,
        :attr:`~replayssm.engine.device_drafters.DeviceMTPDrafter.prompt_head`):
        ``layout`` the pass's :class:`~replayssm.engine.kv_cache.PromptLayout`, ``ids
        [N]`` its token ids, ``hidden [N, hidden]`` its final hidden states, ``kv_rows``
        / ``kv_lengths [B]`` each request's slot and prompt length. The pass's
        :class:`StepOutput` names the head that ran (``prompt_head``). Prompt shapes
        are captured per head (those of the last few heads kept:
        :meth:`~replayssm.engine.prompt_graph.PromptGraphs.set_head`), so switching
        between heads captures each shape once per head; passes that run eagerly run no
        head."""
        if self.prompt_graphs is not None:
            self.prompt_graphs.set_head(head)

    # ------------------------------------------------------------------ steps
    def extend(self, slots: Sequence[int], windows: Sequence[Sequence[int]], *, all_logits: bool = False,
               prompt: bool = False) -> StepOutput:
        """Advance every request over its tokens: prompt prefill or plain decoding.

        A plain decoding step (not ``prompt``, one token per request) goes through the
        strategy's ring when :attr:`ring_decoding`; anything else through the
        recurrence, from checkpoints into which any ring history was folded first.

        Args:
            slots: live slot per request.
            windows: token ids per request (any length >= 1): lists of ints, or 1-D
                integer arrays or CPU tensors (:func:`token_ids`).
            all_logits: logits of every token (default: each request's last token).
            prompt: prompt tokens: the chunked prefill kernel may run them (see
                ``prefill``). A request may hold committed tokens already (a prompt
                prefilled in chunks): the kernel then starts from its committed state.
        """
        if not prompt and self.ring_decoding and all(len(w) == 1 for w in windows):
            return self._ring_step(slots, windows, all_logits)
        static = prompt and not all_logits and self.prompt_graphs is not None and self.gdn_inputs_hook is None
        slots, windows = self._check_step(slots, windows)
        if static:
            lengths = [len(w) for w in windows]
            slots, _ = self.pool.check_rows(slots, lengths, prefill=True)
            if self.prompt_graphs.fits(slots, windows):
                self.kv.check_room(slots, lengths)
                out = self.prompt_graphs.run(slots, windows, ids=np.concatenate(windows))
                self.prompt_passes["static"] += 1
                return out
        out = self._forward(slots, windows, verify=False, all_logits=all_logits, chunked=prompt, checked=True)
        if prompt:
            self.prompt_passes["eager"] += 1
        return out

    def _ring_step(self, slots, windows, all_logits: bool) -> StepOutput:
        """A plain decoding step through the ring: every GDN layer decodes (a window of
        one token from checkpoint + ring), then one commit keeps each request's token;
        a forward that fails halfway aborts the step, leaving every state as it was."""
        before = self._pending  # a verified step left pending makes _forward refuse: keep it
        try:
            out = self._forward(slots, windows, verify=True, all_logits=all_logits, chunked=False, ring=True)
        except BaseException:
            if self._pending is not None and self._pending is not before:  # this step opened: drop it
                self.strategy.abort(self._pending[0])
                self._pending = before
            raise
        batch, slots, lengths = self._pending
        self._pending = None
        self.strategy.commit(batch)
        self.kv.advance(slots, lengths)
        return out

    def verify(self, slots: Sequence[int], windows: Sequence[Sequence[int]]) -> StepOutput:
        """Logits of every window token; nothing committed until :meth:`commit`.

        Windows hold ``1 .. window`` tokens: the last accepted token then the drafts.
        """
        return self._forward(slots, windows, verify=True, all_logits=True, chunked=False)

    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the first ``accepted[i]`` tokens of each verified window (GDN state, conv
        state and KV lengths), discard the rest."""
        if self._pending is None:
            raise RuntimeError("commit without a verify")
        batch, slots, lengths = self._pending
        accepted = [int(a) for a in accepted]
        if len(accepted) != len(slots):
            raise ValueError(f"accepted has {len(accepted)} entries for {len(slots)} requests")
        for i, (a, n) in enumerate(zip(accepted, lengths)):
            if not 1 <= a <= n:
                raise ValueError(f"accepted[{i}] = {a} must be in [1, {n}]")
        self.strategy.commit(batch, torch.tensor(accepted, dtype=torch.int32, device=self.device))
        self.kv.advance(slots, accepted)
        self._pending = None

    # ------------------------------------------------------------------ draft-model support
    def save_state(self, slots: Sequence[int]):
        """Copy the committed state of ``slots`` (GDN state through the strategy, KV
        lengths), to undo scratch decoding with :meth:`restore_state`."""
        if self._pending is not None:
            raise RuntimeError("save_state between verify and commit")
        return list(slots), self.strategy.save_states(list(slots)), [self.kv.lengths[s] for s in slots]

    def restore_state(self, saved) -> None:
        slots, states, lengths = saved
        self.strategy.restore_states(states)
        self.kv.truncate(slots, lengths)

    # ------------------------------------------------------------------ forward
    def _check_step(self, slots, windows):
        """``(slots, windows)`` after the step's checks (no pending step, a window per slot,
        token ids in range, :func:`token_ids`): the slots as a list, each window as a
        1-D int64 array (a pass packs them with one ``np.concatenate``)."""
        if self._pending is not None:
            raise RuntimeError("a verified step is pending: commit it first")
        slots = list(slots)
        if len(windows) != len(slots) or not slots:
            raise ValueError(f"need one window per slot and at least one request; got {len(windows)} windows "
                             f"for {len(slots)} slots")
        # each window's ids packed and checked once; the pass takes them as these arrays
        return slots, [token_ids(w, f"windows[{i}]", self.vocab_size) for i, w in enumerate(windows)]

    @torch.inference_mode()
    def _forward(self, slots, windows, *, verify: bool, all_logits: bool, chunked: bool,
                 ring: bool = False, checked: bool = False) -> StepOutput:
        """One eager forward. ``verify``: the GDN layers verify (the step stays open for
        :meth:`commit`); with ``ring`` they decode through the ring instead (one token
        per request, the step open for :meth:`_ring_step`'s commit); ``checked``: the
        caller ran :meth:`_check_step` already."""
        if not checked:
            slots, windows = self._check_step(slots, windows)
        lengths = [len(w) for w in windows]
        batch = self.pool.batch(slots, lengths, prefill=not verify)  # validates slots and lengths
        self.kv.check_room(slots, lengths)
        starts = [self.kv.lengths[s] for s in slots]
        if ring:  # from here a failed forward leaves an open step for _ring_step to abort
            self._pending = (batch, slots, lengths)
        elif not verify:  # the recurrence starts from the checkpoint: fold any ring history into it
            self.strategy.fold_history(batch.live_slots)
        prompt_kernel = None
        if chunked and self.chunk_kernel is not None:
            prompt_kernel = _PromptKernel(self.chunk_kernel, self.strategy, batch, starts)
        n = sum(lengths)
        rows, t_max, l_max = n, None, None
        fixed = self.fixed_shape
        if fixed is not None and n <= fixed[0] and max(lengths) <= fixed[1]:
            rows, t_max, l_max = fixed[0], fixed[1], self.max_len
        layout = WindowLayout(slots, starts, lengths, self.device, t_max=t_max, l_max=l_max)
        ids = to_device(np.concatenate(windows), self.device)  # the checked windows: int64 arrays

        h = _pad_rows(self.embed(ids), rows)  # [rows, hidden]; rows > N only with fixed_shape
        cos, sin = self.rotary_cos_sin(h[:n], layout.positions)
        strat, norm = self.strategy, self.static_norm
        for layer, kind, j in zip(self.layers, self.kinds, self.index):
            residual = h
            x = norm(layer.input_layernorm, h)
            if kind == "gdn":
                mixer = self.mixers[j]
                mixed, z, a, b = mixer.project(x)
                mixed, a, b = mixed[:n], a[:n], b[:n]
                if verify:
                    mixed = strat.conv_verify(j, mixed, batch)
                else:  # the chunked kernel wants q, k, v contiguous: the conv stores them so
                    mixed = strat.conv_prefill(j, mixed, batch, parts=mixer.parts if prompt_kernel is not None else None)
                q, k, v = mixer.split(mixed)
                if self.gdn_inputs_hook is not None:
                    self.gdn_inputs_hook(j, q, k, v, a, b)
                if ring:
                    o = strat.decode(j, q, k, v, a, b, batch)
                elif verify:
                    o = strat.verify(j, q, k, v, a, b, batch)
                elif prompt_kernel is not None:
                    o = strat.chunk_prefill(j, q, k, v, a, b, batch, prompt_kernel.layer(j))
                else:
                    o = strat.prefill(j, q, k, v, a, b, batch)
                x = mixer.finish(_pad_rows(o, rows), z, norm)
            else:
                x = attention_forward(layer.self_attn, x, cos, sin, self.kv, j, layout, norm)
            h = residual + x
            residual = h
            x = norm(layer.post_attention_layernorm, h)
            if chunked and t_max is None and self.moe_kernel == "grouped_mm" and is_moe(layer.mlp):
                # the HF block loops over the experts a pass hits, which the host reads
                # first (a synchronisation per layer); the grouped GEMM reads nothing
                h = residual + static_moe_forward(layer.mlp, x, self.moe_kernel)
            else:
                h = residual + mlp_forward(layer.mlp, x, token_by_token=n if t_max is not None else 0)
        h = norm(self.norm, h)

        offsets = [0]
        for m in lengths:
            offsets.append(offsets[-1] + m)
        if all_logits or t_max is not None:
            logits = self.lm_head(h).float()[:n]
            if not all_logits:
                logits = logits[[o - 1 for o in offsets[1:]]]
        else:
            last = to_device([o - 1 for o in offsets[1:]], self.device)
            logits = self.lm_head(h[last]).float()
        if verify:
            self._pending = (batch, slots, lengths)
        else:
            self.kv.advance(slots, lengths)
        return StepOutput(logits=logits, hidden=h[:n], lengths=lengths, offsets=offsets)

    # ------------------------------------------------------------------ static steps
    def static_batch(self, rows: int, window: int) -> Batch:
        """A :class:`Batch` of ``rows`` windows of ``window`` tokens for
        :meth:`forward_static`, every row padding (slot -1) until the caller writes
        live slots into its ``slots`` tensor; one per captured step shape."""
        return Batch.build([-1] * rows, [window] * rows, self.device)

    def forward_static(self, ids: torch.Tensor, positions: torch.Tensor, slot_idx: torch.Tensor | None, batch: Batch,
                       *, verify: bool, ring: bool = False, tree=None, prompt: PromptLayout | None = None,
                       last: torch.Tensor | None = None, chunk_kernel: Callable | None = None,
                       chunks: tuple[torch.Tensor, torch.Tensor] | None = None,
                       embedded: tuple[torch.Tensor, torch.Tensor | None] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """One static-shape forward of ``B`` rows of ``T`` tokens, CUDA-graph safe.

        Args:
            ids: ``[B, T]`` int64 tokens.
            positions: ``[B, T]`` int64 absolute positions (``starts[:, None] + t``).
            slot_idx: ``[B]`` int64 KV-cache slot per row (``kv.sink`` for padding).
            batch: from :meth:`static_batch` with the rows' pool slots (-1 padding).
            verify: ``True``: the GDN layers verify (commit follows, through the
                strategy); ``False``: plain decoding, the state advances over every
                token (``T`` is then 1 in practice).
            ring: with ``verify=False`` and ``T = 1``: plain decoding through the
                strategy's ring (:meth:`Strategy.decode`; the caller then commits with
                ``strategy.commit(batch)``), see :attr:`ring_decoding`.
            tree: with ``verify``: ``None`` (a chain window), or ``(static_tree,
                draft_trees, starts)`` for a draft-tree window of ``T = N`` nodes
                (:class:`~replayssm.engine.trees.StaticTree`, the same
                :class:`~replayssm.ops.trees.DraftTrees` object in every layer, ``[B]``
                committed lengths): GDN layers run :meth:`Strategy.conv_verify_tree` and
                :meth:`Strategy.verify_tree`, attention layers the ancestor mask (node
                ``i`` written at ``starts + i``); ``positions`` are then ``starts +
                depth`` (rotary); the caller commits with ``strategy.commit_tree``.
            prompt: with ``verify=False``, a prompt pass of fresh requests packed into
                ``ids [1, N]`` (``batch`` its requests' offsets, a padding request last):
                attention layers attend through this layout (:func:`cached_attention`
                of fresh requests) instead of ``slot_idx`` (unused, may be ``None``).
            last: ``[R]`` int64 rows of ``hidden`` whose logits are returned (the
                requests' last prompt tokens); default every row.
            chunk_kernel: with ``prompt``: GDN layers through this chunked kernel
                (:meth:`Strategy.chunk_prefill_static`) instead of the recurrence; one
                request's tokens as one sequence, or, with ``chunks``, several
                requests' as sequences of the packed tokens.
            chunks: with ``chunk_kernel`` and a prompt of ``B`` requests (a padding
                request last): ``(cu_seqlens [B + 3], chunk_indices [M, 2])``, the
                kernel's offsets and fixed-length chunk list on the device
                (:meth:`Strategy.chunk_prefill_static`'s ``chunks``).
            embedded: ``(h [B * T, hidden], rope [B, T, 2, R] or None)``, the tokens'
                embedding rows and rotary rows already gathered
                (:meth:`static_step_inputs`); default: gathered here from ``ids`` and
                ``positions``.

        Returns:
            ``(logits [B * T, vocab], hidden [B * T, hidden])`` (logits ``[R, vocab]``
            with ``last``), both in the model's dtype: the LM head's output as it is
            (greedy tokens take its argmax, which its fp32 widening would not change;
            sampling widens it, :func:`~replayssm.engine.sampling.warp_probs`), so a
            step moves no fp32 copy of ``B T x vocab`` logits (at a Qwen3.5 vocabulary
            and 256 window rows, half a gigabyte a step with the fp32 argmax). Nothing is read on the host; the KV
            cache gets the window's keys and values, its lengths are left to the caller.
        """
        b, t = ids.shape
        h, rope = embedded if embedded is not None else (self.static_embed(ids.reshape(-1)), None)
        if rope is None:
            rope = self.static_rope(h, positions)
        strat = self.strategy
        norm = self.static_norm
        window = None
        if tree is not None:
            shape, trees, starts = tree
            nodes = torch.arange(shape.num_nodes, device=ids.device)
            window = (starts, nodes, shape.ancestors, shape.ancestor_bits)
        # Each residual add runs in the kernel of the norm after it (the next layer's
        # input norm, or the final norm), so a layer's loop starts from its normed input.
        x = norm(self.layers[0].input_layernorm, h)
        for i, (layer, kind, j) in enumerate(zip(self.layers, self.kinds, self.index)):
            if kind == "gdn":
                mixer = self.mixers[j]
                mixed, z, a, bb = mixer.project(x)
                with chained_launches(self.device, self.chain_state_kernels):
                    if tree is not None:
                        q, k, v = mixer.split(strat.conv_verify_tree(j, mixed, batch, trees))
                        o = strat.verify_tree(j, q, k, v, a, bb, batch, trees)
                    elif verify or ring:
                        q, k, v = mixer.split(strat.conv_verify(j, mixed, batch))
                        o = (strat.verify if verify else strat.decode)(j, q, k, v, a, bb, batch)
                    else:
                        parts = mixer.parts if chunk_kernel is not None else None
                        q, k, v = mixer.split(strat.conv_prefill(j, mixed, batch, parts=parts))
                        if chunk_kernel is not None:
                            o = strat.chunk_prefill_static(j, q, k, v, a, bb, batch, chunk_kernel, chunks=chunks)
                        else:
                            o = strat.prefill(j, q, k, v, a, bb, batch)
                x = mixer.finish(o, z, norm)
            elif prompt is not None:
                x = prompt_attention_forward(layer.self_attn, x, rope, self.kv, j, prompt, norm,
                                             fused=self.fused_norms)
            else:
                split = self.attention_key_split if window is None and self.fused_norms else 0
                x = static_attention_forward(layer.self_attn, x, rope, self.kv, j, slot_idx, positions,
                                             backend=self.backend, norm=norm, tree=window, fused=self.fused_norms,
                                             key_split=split, arrivals=self.arrivals if split else None)
            h, x = self.static_add_norm(layer.post_attention_layernorm, h, x)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = self.static_add_norm(after, h, self.static_mlp(layer.mlp, x))
        return self.lm_head(x if last is None else x[last]), x

    def static_norm(self, module, x: torch.Tensor, gate: torch.Tensor | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """A norm module (a gated one takes ``gate``) as a static step runs it: one fused kernel on CUDA (see
        :mod:`replayssm.engine.norms`), the module itself elsewhere. ``out``: where to write the result (shaped
        like ``x``, e.g. a slice of a wider buffer; the fused kernel writes there itself)."""
        kind = norm_kind(module)
        if kind is None or not self.fused_norms:
            y = module(x) if gate is None else module(x, gate)
            return y if out is None else out.copy_(y)
        return rms_norm(x, module.weight, norm_eps(module), kind, gate, out=out)

    def static_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens ``logits.argmax(-1)`` (int64 ``logits.shape[:-1]``) as a static
        step takes them: one launch where the kernels are fused
        (:func:`~replayssm.engine.argmax.argmax_rows`; torch's reduction spends 4-15 µs
        on a few rows, and a split row is merged by its last part:
        :attr:`arrivals`), torch's ``argmax`` elsewhere. The same indices either
        way."""
        if not self.fused_norms:
            return argmax_rows(logits, backend="reference")
        return argmax_rows(logits, arrivals=self.arrivals)

    def static_add_norm(self, module, h: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + update, norm(h + update))`` for ``h, update [N, hidden]``: a residual add
        and the norm after it, one fused kernel where the norms are fused (the sum
        rounded to the dtype, as torch's add rounds it)."""
        if norm_kind(module) == "offset" and self.fused_norms:
            return add_rms_norm(h, update, module.weight, norm_eps(module))
        h = h + update
        return h, self.static_norm(module, h)

    def static_mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """A layer's MLP on ``x [N, hidden]`` as a static step runs it: a MoE block
        without host syncs (:func:`static_moe_forward`); a dense SiLU MLP with its
        activation and product in one kernel where the kernels are fused
        (:func:`~replayssm.engine.activations.silu_mul`), ``gate`` and ``up`` in one
        matmul where their weights are laid out as one (:func:`fuse_linears`); else the
        module."""
        if is_moe(mlp):
            return static_moe_forward(mlp, x, self.moe_kernel)
        if self.fused_norms and dense_silu_mlp(mlp):
            w = fused_weight((mlp.gate_proj, mlp.up_proj))
            if w is None:
                return mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
            gate_up, i = torch.nn.functional.linear(x, w), mlp.gate_proj.out_features
            return mlp.down_proj(silu_mul(gate_up[..., :i], gate_up[..., i:]))
        return mlp(x)

    def rotary_cos_sin(self, h: torch.Tensor, positions: torch.Tensor):
        """``(cos, sin) [N, rotary_dim]`` of the model's rotary embedding at ``positions [N]``."""
        # Qwen3.5's rotary embedding is multimodal (3 position grids); text tokens use
        # the same position on every grid, which both the 5.17 and the newer signature
        # accept as [3, 1, N].
        pos = positions[None]
        if hasattr(self.rotary, "mrope_section"):
            pos = pos[None].expand(3, 1, -1)
        cos, sin = self.rotary(h[None], pos)
        return cos.reshape(h.shape[0], -1), sin.reshape(h.shape[0], -1)

    def rope_table(self, capacity: int, device=None) -> torch.Tensor:
        """``[capacity, 2, R]`` rotary rows (:func:`~replayssm.engine.rotary.rope_rows`) of
        positions ``0 .. capacity - 1`` in the model dtype, on ``device`` (default the
        engine's): a step gathers its rows (one kernel) instead of evaluating the rotary
        embedding (about ten small kernels). The embedding is elementwise per position,
        so a row equals what a call at that position alone returns, bit for bit; the
        engine's own table (``max_len + window`` rows) serves any shorter one on its
        device. Raises ``ValueError`` for an embedding whose frequencies depend on the
        sequence length (:data:`LENGTH_DEPENDENT_ROPE`)."""
        rope_type = getattr(self.rotary, "rope_type", "default")
        if rope_type in LENGTH_DEPENDENT_ROPE:
            raise ValueError(f"a rotary table needs a rotary embedding that does not change with the sequence "
                             f"length; this model's is {rope_type!r}")
        device = self.device if device is None else torch.device(device)
        own = getattr(self, "_rope", None)
        if own is not None and own.shape[0] >= capacity and own.device == device:
            return own[:capacity]
        x = torch.empty((capacity, 1), dtype=self.dtype, device=device)
        return rope_rows(*self.rotary_cos_sin(x, torch.arange(capacity, device=device))).contiguous()

    def static_step_inputs(self, windows: torch.Tensor, slot_idx: torch.Tensor, steps: torch.Tensor) -> tuple:
        """A step's inputs from its rows' slots ``slot_idx [B]`` and the slots' next
        windows ``windows [S + 1, T]`` (``steps [T]``: each token's offset from its row's
        committed length, ``arange(T)`` for a chain, a draft tree's depths): ``(ids [B, T], starts [B], positions [B,
        T], embedded)``, the rows' windows, committed lengths and token positions, and
        ``embedded`` for :meth:`forward_static` (their embedding and rotary rows). One
        kernel where the kernels are fused and the embedding is a plain table
        (:attr:`plain_embedding`; :func:`~replayssm.engine.step_inputs.gather_step_inputs`;
        five as torch ops), else the torch ops (``embedded`` then ``None``: the forward
        gathers them). The same values either way."""
        if self.fused_norms and self.plain_embedding:
            ids, starts, positions, h, rope = gather_step_inputs(windows, self.kv.device_lengths, slot_idx,
                                                                 self.embed.weight, self._rope, steps)
            return ids, starts, positions, (h, rope)
        ids = windows[slot_idx]
        starts = self.kv.device_lengths[slot_idx]
        return ids, starts, starts[:, None] + steps, None

    @property
    def plain_embedding(self) -> bool:
        """Whether the embedding is a plain table lookup (an ``nn.Embedding`` without
        ``max_norm``, which would renormalise the rows it reads), so that kernels may read
        its rows from the table directly."""
        return type(self.embed) is torch.nn.Embedding and self.embed.max_norm is None

    def static_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows of ``ids [N]`` (``[N, hidden]``) for a static step: a
        plain embedding's table indexed directly (:attr:`plain_embedding`), one gather
        parallel over every element (the module's ``index_select`` loops over the ids in
        a few blocks: 7.5 µs for 16 ids on an H100, against about 1.5), the module
        otherwise. The same rows."""
        if self.plain_embedding:
            return self.embed.weight[ids]
        return self.embed(ids)

    def static_rope(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[B, T, 2, R]`` rotary rows at ``positions [B, T]`` (cache positions, below
        ``max_len + window``) for a static step: gathered from the engine's table, or
        evaluated on ``h [B * T, hidden]``'s dtype where the embedding has no table."""
        if self._rope is None:
            return rope_rows(*self.rotary_cos_sin(h, positions.reshape(-1))).view(*positions.shape, 2, -1)
        return rope_at(self._rope, positions)
