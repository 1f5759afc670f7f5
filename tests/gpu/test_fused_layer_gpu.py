"""The static step's fused layer pieces on the GPU: ``silu_mul`` computes the bits of
transformers' ``silu(gate) * up`` (CUDA's ``expf``, an IEEE division, both roundings),
``sigmoid_mul`` those of ``o * sigmoid(gate)``, and the in-place rotary (torch's four
ops and the one-launch kernel) those of ``apply_rotary_pos_emb``, in bf16; and a
step's outputs after acceptance (``emit_step``) the torch ops'.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_fused_layer_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.activations import sigmoid_mul, silu_mul
from replayssm.engine.rotary import rope_rows, rotate_

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_mul_is_torch_bit_for_bit_on_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(torch.initial_seed())
    gate = (6 * torch.randn(1024, 3584, device="cuda", generator=g)).to(dtype)
    up = torch.randn(1024, 3584, device="cuda", generator=g).to(dtype)
    got, want = silu_mul(gate, up), torch.nn.functional.silu(gate) * up
    assert want.abs().max() > 1
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sigmoid_mul_is_torch_bit_for_bit_on_cuda(dtype):
    """The output gate as the attention layer reads it: a strided view of a wider
    projection output."""
    g = torch.Generator(device="cuda").manual_seed(torch.initial_seed())
    n, heads, d = 1024, 16, 256
    qg = (6 * torch.randn(n, heads, 2 * d, device="cuda", generator=g)).to(dtype)
    o = torch.randn(n, heads, d, device="cuda", generator=g).to(dtype)
    gate = qg[..., d:]
    got, want = sigmoid_mul(o, gate), o * torch.sigmoid(gate)
    assert not gate.is_contiguous() and want.abs().max() > 1
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} differ"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rotate_in_place_is_transformers_rotary_on_cuda(backend):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    g = torch.Generator(device="cuda").manual_seed(torch.initial_seed())
    b, t, heads, d, r = 64, 4, 18, 256, 64
    qk = torch.randn(b, t, heads, d, device="cuda", generator=g).bfloat16()
    angle = 100 * torch.rand(b * t, r // 2, device="cuda", generator=g)
    cos, sin = torch.cat([angle, angle], -1).cos().bfloat16(), torch.cat([angle, angle], -1).sin().bfloat16()
    want, _ = hf.apply_rotary_pos_emb(qk, qk, cos.view(b, t, r), sin.view(b, t, r), unsqueeze_dim=2)
    got = qk.clone()
    rotate_(got, rope_rows(cos, sin).view(b, t, 2, r), backend=backend)
    assert torch.equal(got, want)


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("b", [48, 1])
def test_slot_attention_on_cuda_matches_the_reference(t, stages, b, monkeypatch):
    """The Triton window attention at Qwen3.5's attention shapes (16 query heads on 2
    key heads of 256, bf16), its key pass pipelined or not, against the reference's
    SDPA over the same cache: rows whose keys end inside a key block, and a tree
    window's ancestor mask (T = 4), at batch 1 and 48. bf16 operands, fp32 softmax:
    within 1e-2 of the outputs' scale."""
    from replayssm.engine import attention

    monkeypatch.setattr(attention, "KV_STAGES", stages)
    g = torch.Generator(device="cuda").manual_seed(torch.initial_seed())
    heads, kvh, d, cap = 16, 2, 256, 300
    kc = torch.randn(b + 3, kvh, cap, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn(b + 3, kvh, cap, d, device="cuda", generator=g).bfloat16()
    q = torch.randn(b, t, heads, d, device="cuda", generator=g).bfloat16()
    slot = torch.randperm(b + 3, device="cuda", generator=g)[:b]
    starts = torch.randint(0, cap - t, (b,), device="cuda", generator=g)
    cases = [(attention.slot_attention, ())]
    if t == 4:
        visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool,
                               device="cuda")
        cases.append((attention.tree_attention, (visible,)))
    for fn, extra in cases:
        got = fn(q, kc, vc, slot, starts, *extra, d**-0.5, backend="triton").float()
        want = fn(q, kc, vc, slot, starts, *extra, d**-0.5, backend="reference").float()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-2, (fn.__name__, err)


@pytest.mark.parametrize("t", [1, 4])
def test_slot_attention_warps_change_no_bit(t, monkeypatch):
    """The Triton window attention on 4 warps and on 8 (the rule picks 4 for these
    tiles, :func:`attention_warps`), gated, at Qwen3.5's attention shapes, batch 64:
    the same bits, so the rule may pick either per tile without moving a greedy token."""
    from replayssm.engine import attention

    g = torch.Generator(device="cuda").manual_seed(torch.initial_seed())
    heads, kvh, d, cap, b = 16, 2, 256, 300, 64
    kc = torch.randn(b + 3, kvh, cap, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn(b + 3, kvh, cap, d, device="cuda", generator=g).bfloat16()
    q = torch.randn(b, t, heads, d, device="cuda", generator=g).bfloat16()
    gate = torch.randn(b * t, heads, d, device="cuda", generator=g).bfloat16()
    slot = torch.randperm(b + 3, device="cuda", generator=g)[:b]
    starts = torch.randint(0, cap - t, (b,), device="cuda", generator=g)
    assert attention.attention_warps(max(16, heads // kvh * t), d, q.element_size()) == 4
    runs = []
    for warps in (4, 8):
        monkeypatch.setattr(attention, "attention_warps", lambda block_m, d, itemsize, w=warps: w)
        runs.append(attention.slot_attention(q, kc, vc, slot, starts, d**-0.5, gate=gate, backend="triton"))
    assert runs[0].abs().max() > 0.1
    assert torch.equal(runs[0], runs[1]), f"{(runs[0] != runs[1]).sum().item()} of {runs[0].numel()} differ"


@pytest.mark.parametrize("t", [1, 4])
def test_emit_step_on_cuda_is_the_torch_ops(t):
    """The step's outputs after acceptance in one kernel, against the torch ops, on the
    card (integers: equal), greedy, at batch 64 with the last row padding."""
    from replayssm.engine.emit import emit_step

    g = torch.Generator(device="cuda").manual_seed(torch.initial_seed())
    b, slots = 64, 80
    ids = torch.randint(0, 50, (b, t), device="cuda", generator=g)
    argmax = torch.where(torch.rand(b, t, device="cuda", generator=g) < 0.7, torch.roll(ids, -1, 1), ids + 1)
    slot_idx = torch.cat([torch.randperm(slots, device="cuda", generator=g)[: b - 1],
                          torch.tensor([slots], device="cuda")])
    starts = torch.randint(0, 100, (b,), device="cuda", generator=g)
    kv_len = torch.randint(0, 100, (slots + 1,), device="cuda", generator=g)
    runs = []
    for backend in ("reference", "triton"):
        kv, out = kv_len.clone(), torch.zeros(b, 1 + t, dtype=torch.int64, device="cuda")
        runs.append((*emit_step(ids, starts, slot_idx, kv, slots, out, argmax=argmax, backend=backend), kv, out))
    for want, got in zip(*runs):
        assert torch.equal(got, want)
