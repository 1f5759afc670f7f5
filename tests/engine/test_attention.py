"""The window attention's output gate in its launch (``slot_attention`` / ``tree_attention``
with ``gate=``): the bits of the attention followed by ``sigmoid_mul``, on both kernels'
masks, with the gate a strided view of a wider projection output."""

import pytest
import torch

from replayssm.engine.activations import sigmoid_mul
from replayssm.engine.attention import slot_attention, tree_attention


def _case(gen, b=2, t=3, heads=4, kv_heads=2, d=32, slots=5, cap=16, device="cpu", dtype=torch.float32):
    r = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
    q, kc, vc = r(b, t, heads, d), r(slots, kv_heads, cap, d), r(slots, kv_heads, cap, d)
    gate = r(b * t, 2 * heads * d).view(b * t, heads, 2 * d)[..., d:]  # q|gate halves: the gate's rows strided
    rows = torch.randperm(slots, generator=gen)[:b].to(device)
    starts = torch.randint(0, cap - t + 1, (b,), generator=gen).to(device)
    return q, kc, vc, gate, rows, starts


def _both(q, kc, vc, rows, starts, backend, gate=None):
    """Slot attention and tree attention over the causal window (its tril mask)."""
    vis = torch.tril(torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device))
    return (slot_attention(q, kc, vc, rows, starts, 0.3, backend=backend, gate=gate),
            tree_attention(q, kc, vc, rows, starts, vis, 0.3, backend=backend, gate=gate))


def test_gate_in_the_attention_is_the_attention_then_sigmoid_mul(rng):
    """Each kernel's gated outputs equal its ungated outputs passed through
    ``sigmoid_mul`` bit for bit; the reference backend gates with torch's two ops."""
    q, kc, vc, gate, rows, starts = _case(rng)
    plain = _both(q, kc, vc, rows, starts, "triton")
    gated = _both(q, kc, vc, rows, starts, "triton", gate)
    for o, g in zip(plain, gated):
        want = sigmoid_mul(o.reshape(gate.shape), gate).view(o.shape)
        assert torch.equal(g, want)
        assert not torch.equal(g, o)
    for o, g in zip(_both(q, kc, vc, rows, starts, "reference"), _both(q, kc, vc, rows, starts, "reference", gate)):
        assert torch.equal(g, (o.reshape(gate.shape) * torch.sigmoid(gate)).view(o.shape))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_gate_that_does_not_fit_is_refused(rng, backend):
    """A gate of another shape or dtype, or not contiguous along its last axis: a
    ValueError naming it, on either backend."""
    q, kc, vc, gate, rows, starts = _case(rng)
    for bad in (gate[:-1], gate.double(), gate.transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match="gate must be a torch.float32 tensor"):
            slot_attention(q, kc, vc, rows, starts, 0.3, backend=backend, gate=bad)


@pytest.mark.gpu
def test_gate_in_the_attention_on_cuda_in_bf16():
    """The compiled kernel in bf16 (heads of 64, the embedded model's): the bits of the
    attention followed by ``sigmoid_mul``, one token and a window of 4, chain and tree."""
    gen = torch.Generator().manual_seed(4)
    for t in (1, 4):
        q, kc, vc, gate, rows, starts = _case(gen, t=t, d=64, cap=64, device="cuda", dtype=torch.bfloat16)
        for o, g in zip(_both(q, kc, vc, rows, starts, "triton"), _both(q, kc, vc, rows, starts, "triton", gate)):
            assert torch.equal(g, sigmoid_mul(o.reshape(gate.shape), gate).view(o.shape))
