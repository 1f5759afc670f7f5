"""The static step's fused layer pieces on the GPU: ``silu_mul`` computes the bits of
transformers' ``silu(gate) * up`` (CUDA's ``expf``, an IEEE division, both roundings),
and the in-place rotary those of ``apply_rotary_pos_emb``, in bf16.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_fused_layer_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.activations import silu_mul
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


def test_rotate_in_place_is_transformers_rotary_on_cuda():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    g = torch.Generator(device="cuda").manual_seed(torch.initial_seed())
    b, t, heads, d, r = 64, 4, 18, 256, 64
    qk = torch.randn(b, t, heads, d, device="cuda", generator=g).bfloat16()
    angle = 100 * torch.rand(b * t, r // 2, device="cuda", generator=g)
    cos, sin = torch.cat([angle, angle], -1).cos().bfloat16(), torch.cat([angle, angle], -1).sin().bfloat16()
    want, _ = hf.apply_rotary_pos_emb(qk, qk, cos.view(b, t, r), sin.view(b, t, r), unsqueeze_dim=2)
    got = qk.clone()
    rotate_(got, rope_rows(cos, sin).view(b, t, 2, r))
    assert torch.equal(got, want)
