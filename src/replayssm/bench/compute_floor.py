"""The compute floor of a prompt prefill: its matmul FLOPs at a matmul rate measured on
the device in the same run.

A prefill of prompts of lengths ``L_1 .. L_B`` on a hybrid model multiplies, per token,
every projection of every layer (the GDN and attention projections, the MLP or the
routed experts), and per request the causal attention of each full-attention layer
and the GDN state products; the LM head runs on each request's last token only. The
count here (:func:`prefill_flops`) is read off the model's modules, so it follows any
checkpoint's shapes:

* ``linear``: ``2 x`` the weights of every ``nn.Linear`` of the decoder layers per
  token; a sparse MoE block counts its router, its shared expert and ``top_k`` routed
  experts per token;
* ``attention``: ``QK^T`` and ``PV`` over the causal triangle, ``2 x 2 x heads x
  head_dim x L (L + 1) / 2`` per full-attention layer and request;
* ``gdn``: the delta rule's state products (``S k``, the rank-one update, ``S q``),
  ``6 K V`` per token and value head of each GDN layer; the chunked form does the same
  work in other groupings;
* ``lm_head``: ``2 x vocab x hidden`` per request.

The floor is ``total / rate`` with ``rate`` from :func:`measure_matmul_rate`: a large
``torch.mm`` in the model's dtype on a GPU (bf16 there: the rate the card reaches on
dense matmuls, near its peak), an fp32 one on the CPU. Elementwise work (norms, gates,
the conv, activations) and memory traffic are left out, so no prefill can beat it.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch


def _linear_weights(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def _mlp_weights_per_token(mlp: torch.nn.Module) -> int:
    """Weights one token multiplies in an MLP or sparse MoE block."""
    experts = getattr(mlp, "experts", None)
    if experts is None:
        return _linear_weights(mlp)
    router = mlp.gate
    top_k = getattr(router, "top_k", None) or getattr(mlp, "top_k")
    per_expert = sum(p[0].numel() for p in experts.parameters() if p.dim() == 3)
    return _linear_weights(mlp) + router.weight.numel() + top_k * per_expert


def prefill_flops(model, prompt_lengths: Sequence[int]) -> dict[str, float]:
    """Matmul FLOPs of prefilling prompts of ``prompt_lengths`` tokens on ``model`` (a
    Qwen3.5 / Qwen3-Next ``*ForCausalLM``), by kind (see the module docstring), with
    ``total``."""
    from ..engine.adapter import _text_model

    lengths = [int(n) for n in prompt_lengths]
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"prompt_lengths must be positive ints, got {list(prompt_lengths)}")
    text = _text_model(model)
    tokens = sum(lengths)
    pairs = sum(n * (n + 1) // 2 for n in lengths)  # causal (query, key) pairs per attention head
    linear = attention = gdn = 0
    for layer in text.layers:
        linear += 2 * tokens * _mlp_weights_per_token(layer.mlp)
        if hasattr(layer, "linear_attn"):
            m = layer.linear_attn
            linear += 2 * tokens * _linear_weights(m)
            gdn += 6 * tokens * m.num_v_heads * m.head_k_dim * m.head_v_dim
        else:
            a = layer.self_attn
            linear += 2 * tokens * _linear_weights(a)
            attention += 2 * 2 * a.config.num_attention_heads * a.head_dim * pairs
    head = model.get_output_embeddings()
    lm_head = 2 * len(lengths) * head.weight.numel()
    out = {"linear": float(linear), "attention": float(attention), "gdn": float(gdn), "lm_head": float(lm_head)}
    out["total"] = sum(out.values())
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_rate(device: str | torch.device, dtype: torch.dtype, *, n: int | None = None,
                        repeats: int | None = None) -> dict:
    """The matmul rate of ``device``: ``torch.mm`` of two ``n x n`` matrices, timed
    ``repeats`` times in three rounds, the best round kept. On CUDA in ``dtype`` (the
    model's; default ``n = 8192``), on the CPU in fp32 (``n = 512``: the CPU's bf16
    matmuls are no guide to anything).

    Returns ``{"dtype", "n", "flops_per_s", "seconds"}`` (``seconds``: one product).
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    if not cuda:
        dtype = torch.float32
    n = n or (8192 if cuda else 512)
    repeats = repeats or (10 if cuda else 2)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    c = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=c)  # warm-up: the library picks its kernel
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b, out=c)
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return {"dtype": str(dtype).replace("torch.", ""), "n": n, "flops_per_s": 2 * n**3 / best, "seconds": best}
