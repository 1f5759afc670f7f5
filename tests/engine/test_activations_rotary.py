"""The static step's fused MLP activation, output gate and in-place rotary embedding,
against transformers' ops: ``silu_mul`` (one kernel for ``silu(gate) * up``),
``sigmoid_mul`` (one for ``o * sigmoid(gate)``) and ``rotate_`` (queries and keys
rotated in place from ``rope_rows``, by torch's ops or one kernel)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from replayssm.engine.activations import dense_silu_mlp, sigmoid_mul, silu_mul
from replayssm.engine.random_model import build_tiny_model
from replayssm.engine.rotary import rope_rows, rotate_, rotate_into_cache_


@pytest.mark.parametrize("shape", [(37, 96), (5, 3, 2049)])
def test_silu_mul_is_the_modules_two_ops(rng, shape):
    g, u = 4 * torch.randn(shape, generator=rng), torch.randn(shape, generator=rng)
    got = silu_mul(g, u)
    want = torch.nn.functional.silu(g) * u
    assert got.shape == want.shape and got.abs().max() > 0.5
    # fp32 on the CPU: the interpreter's exp against torch's (each within an ulp or two)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_silu_mul_reads_the_halves_of_one_output_in_place(rng):
    """gate and up as the two column halves of one [N, 2D] matmul output (row stride
    2D), and a transposed pair (copied): the values of the contiguous call."""
    gu = 4 * torch.randn(37, 2 * 2100, generator=rng)
    g, u = gu[:, :2100], gu[:, 2100:]
    assert not g.is_contiguous()
    assert torch.equal(silu_mul(g, u), silu_mul(g.contiguous(), u.contiguous()))
    t = gu[:, :74].T  # [74, 37], its last axis strided
    assert torch.equal(silu_mul(t, t), silu_mul(t.contiguous(), t.contiguous()))
    empty = gu[:, :0]
    assert silu_mul(empty, empty).shape == (37, 0)


def test_silu_mul_rounds_bf16_at_both_ops(rng):
    """bf16: the activation rounded before the product, as the module's two ops round
    (the interpreter rounds to nearest even by hand, as the GPU does)."""
    g = (4 * torch.randn(4096, generator=rng)).bfloat16()
    u = torch.randn(4096, generator=rng).bfloat16()
    got = silu_mul(g, u).float()
    want = (torch.nn.functional.silu(g) * u).float()
    one_rounding = (torch.nn.functional.silu(g.float()) * u.float()).bfloat16().float()
    # the module's bits, up to a one-ulp flip where the CPU's exp and numpy's differ at a tie
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-3)
    assert ((got - want).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.99
    assert not torch.equal(want, one_rounding)  # the two roundings are distinguishable on these inputs


@pytest.mark.parametrize("op,names", [(silu_mul, "gate and up"), (sigmoid_mul, "x and gate")])
def test_elementwise_kernels_refuse_mismatched_inputs(rng, op, names):
    g = torch.randn(4, 2, 8, generator=rng)
    with pytest.raises(ValueError, match=f"{names} must be alike"):
        op(g, g[..., :4])
    with pytest.raises(ValueError, match=f"{names} must be alike"):
        op(g, g.double())
    with pytest.raises(TypeError, match=f"{names} must be tensors"):
        op(g, g.tolist())
    with pytest.raises(ValueError, match="backend"):
        op(g, g, backend="cuda")
    with pytest.raises(TypeError, match="must be one of"):
        op(g.double(), g.double())


def test_dense_silu_mlp_tells_the_dense_mlp_from_a_moe_block():
    dense = build_tiny_model("qwen3_5", seed=0).model.layers[0].mlp
    moe = build_tiny_model("qwen3_next", seed=0).model.layers[0].mlp
    assert dense_silu_mlp(dense) and not dense_silu_mlp(moe)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary,t_rope", [(16, 3), (64, 1)])
def test_rotate_in_place_is_transformers_rotary_bit_for_bit(rng, dtype, rotary, t_rope, backend):
    """Partial (16 of 64 channels) and full rotary; one rope row per token or one per
    request, broadcast over its tokens; torch's four ops and the one-launch kernel
    (under the interpreter, which rounds bf16 to nearest even by hand, as the GPU
    does)."""
    b, t, heads, d = 2, 3, 5, 64
    qk = torch.randn(b, t, heads, d, generator=rng).to(dtype)
    angle = 50 * torch.rand(b, t_rope, rotary // 2, generator=rng)
    emb = torch.cat([angle, angle], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want, _ = hf.apply_rotary_pos_emb(qk, qk, cos.expand(b, t, rotary), sin.expand(b, t, rotary), unsqueeze_dim=2)
    got = qk.clone()
    rotate_(got, rope_rows(cos.reshape(-1, rotary), sin.reshape(-1, rotary)).view(b, t_rope, 2, rotary),
            backend=backend)
    assert torch.equal(got, want)
    assert torch.equal(got[..., rotary:], qk[..., rotary:]) and not torch.equal(got, qk)


def test_rotary_shapes_are_checked(rng):
    cos = torch.randn(6, 8, generator=rng)
    with pytest.raises(ValueError, match="R even"):
        rope_rows(cos[:, :7], cos[:, :7])
    with pytest.raises(ValueError, match="qk must be"):
        rotate_(torch.randn(2, 3, 4, 6, generator=rng), rope_rows(cos, cos).view(2, 3, 2, 8))

    rope = rope_rows(cos, cos).view(2, 3, 2, 8)
    qk = torch.randn(2, 3, 4, 8, generator=rng)
    with pytest.raises(ValueError, match="a row per token or per request"):
        rotate_(qk, rope[:1])
    with pytest.raises(ValueError, match="backend"):
        rotate_(qk, rope, backend="cuda")
    with pytest.raises(TypeError, match="share one of"):
        rotate_(qk, rope.bfloat16(), backend="triton")
    with pytest.raises(ValueError, match="heads contiguous"):
        rotate_(qk.transpose(1, 2).contiguous().transpose(1, 2), rope, backend="triton")


def test_sigmoid_mul_is_the_two_ops(rng):
    """fp32 on the CPU: the interpreter's exp against torch's (an ulp or two); the gate
    read in place as the strided half of a wider output."""
    wide = 6 * torch.randn(37, 5, 2 * 48, generator=rng)
    gate, o = wide[..., 48:], torch.randn(37, 5, 48, generator=rng)
    assert not gate.is_contiguous()
    got, want = sigmoid_mul(o, gate), o * torch.sigmoid(gate)
    assert got.shape == want.shape and got.is_contiguous() and want.abs().max() > 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    assert torch.equal(got, sigmoid_mul(o, gate.contiguous()))


def test_sigmoid_mul_rounds_bf16_as_torch_does(rng):
    """bf16: torch's sigmoid computes ``1 / (1 + exp(-x))`` in fp32 and rounds once, then
    the product rounds; the kernel's values against torch's two bf16 ops on the CPU (an
    ulp at a tie apart where the CPU's exp and numpy's differ), and distinguishable from
    a sigmoid that rounds exp, the sum and the quotient each.
    tests/gpu/test_fused_layer_gpu.py holds it against torch's CUDA kernels."""
    g = (4 * torch.randn(64, 2, 64, generator=rng)).bfloat16()
    o = torch.randn(64, 2, 64, generator=rng).bfloat16()
    got = sigmoid_mul(o, g).float()
    want = (o * torch.sigmoid(g)).float()
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-3)
    assert ((got - want).abs() <= ulp).all() and (got == want).float().mean() > 0.99
    bf = torch.bfloat16
    e = torch.exp(-g.float()).to(bf).float()
    three_roundings = (o.float() * (1.0 / (1.0 + e).to(bf).float()).to(bf).float()).to(bf).float()
    assert (got != three_roundings).float().mean() > 0.01


def test_sigmoid_mul_wants_heads_of_contiguous_rows(rng):
    o = torch.randn(4, 2, 8, generator=rng)
    with pytest.raises(ValueError, match="alike \\[N, heads, D\\]"):
        sigmoid_mul(o.reshape(8, 8), o.reshape(8, 8))
    with pytest.raises(ValueError, match="last axes"):
        sigmoid_mul(o.transpose(1, 2).contiguous().transpose(1, 2)[..., :2, :], o[..., :2, :])


def _cache_case(rng, b=3, t=2, heads=4, kv_heads=2, d=32, r=8, slots=5, cap=12, t_rope=None):
    """Queries and keys ``qk``, rotary rows, values as a strided view of a wider
    projection, two caches of random contents, each row's slot and its tokens' positions."""
    qk = torch.randn(b, t, heads + kv_heads, d, generator=rng)
    rope = torch.randn(b, t if t_rope is None else t_rope, 2, r, generator=rng)
    wide = torch.randn(b * t, 3 * kv_heads * d, generator=rng)
    v = wide[:, kv_heads * d : 2 * kv_heads * d].view(b, t, kv_heads, d)
    caches = torch.randn(2, slots, kv_heads, cap, d, generator=rng)
    rows = torch.randperm(slots, generator=rng)[:b]
    at = torch.stack([torch.randperm(cap, generator=rng)[:t] for _ in range(b)])
    return qk, rope, v, caches, rows, at


def _rotated_then_written(qk, rope, v, caches, rows, at):
    """What :func:`rotate_into_cache_` must leave: rotate_, then the two indexed writes."""
    qk, caches = qk.clone(), caches.clone()
    rotate_(qk, rope, backend="triton")
    heads = qk.shape[2] - caches.shape[2]
    where = (rows[:, None].expand(*at.shape), slice(None), at)
    caches[0][where] = qk[:, :, heads:]
    caches[1][where] = v
    return qk, caches


@pytest.mark.parametrize("t_rope", [None, 1], ids=["rope_per_token", "rope_per_request"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])  # the slots' and the positions' dtype
def test_rotate_into_cache_is_the_rotary_then_the_writes(rng, t_rope, slot_dtype):
    """One launch gives the bits of :func:`rotate_` followed by the attention step's two
    indexed writes: the queries and keys rotated in place, each token's rotated keys
    (the rotated channels and the ones the rotary leaves) and its values (read through a
    strided view) at its slot and position (read through strided views too), every
    other cache entry untouched."""
    qk, rope, v, caches, rows, at = _cache_case(rng, t_rope=t_rope)
    want_qk, want = _rotated_then_written(qk, rope, v, caches, rows, at)
    assert not torch.equal(want, caches) and not torch.equal(want_qk, qk)  # the case writes and rotates
    # slots and positions as strided views (columns of wider index buffers), as a step's may be
    rows = torch.stack([rows, -rows], 1).to(slot_dtype)[:, 0]
    at = torch.stack([at, -at], 2).to(slot_dtype)[..., 0]
    assert rows.stride(0) == 2 and at.stride(1) == 2
    rotate_into_cache_(qk, rope, v, caches[0], caches[1], rows, at)
    assert torch.equal(qk, want_qk)
    assert torch.equal(caches, want)


def test_rotate_into_cache_drops_tokens_outside_the_cache(rng):
    """A slot or position outside the cache (a sink row -1, a position at the capacity)
    writes nothing, on the device, while the other tokens are written and every token
    is still rotated."""
    qk, rope, v, caches, rows, at = _cache_case(rng, b=3, t=2, cap=12)
    rows[0] = -1
    at[1, 1] = 12
    want = caches.clone()
    want_qk = qk.clone()
    rotate_(want_qk, rope, backend="triton")
    heads = qk.shape[2] - caches.shape[2]
    for b, t in ((1, 0), (2, 0), (2, 1)):  # the tokens inside the cache
        want[0, rows[b], :, at[b, t]] = want_qk[b, t, heads:]
        want[1, rows[b], :, at[b, t]] = v[b, t]
    rotate_into_cache_(qk, rope, v, caches[0], caches[1], rows, at)
    assert torch.equal(qk, want_qk)
    assert torch.equal(caches, want)


def test_rotate_into_cache_refuses_what_it_cannot_write_and_touches_nothing(rng, refused):
    """Shapes, dtypes and index tensors that do not fit: a ValueError or TypeError
    naming the argument, before the queries, keys or caches change."""
    qk, rope, v, caches, rows, at = _cache_case(rng)
    bad = [
        (dict(v=v[:, :, :1]), ValueError, "v must be"),
        (dict(v=v.double()), TypeError, "v and the caches must be"),
        (dict(k_cache=caches[0][:, :, :, :16]), ValueError, "k_cache and v_cache must be alike"),
        (dict(k_cache=caches[0].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         "k_cache and v_cache must be alike"),
        (dict(at=at.float()), ValueError, "at an int"),
        (dict(slots=rows[:2]), ValueError, "slots must be"),
        (dict(rope=rope[..., :7]), ValueError, "R even"),
    ]
    args = dict(qk=qk, rope=rope, v=v, k_cache=caches[0], v_cache=caches[1], slots=rows, at=at)
    refused(rotate_into_cache_, args, bad, qk, caches)


@pytest.mark.gpu
def test_rotate_into_cache_on_cuda_in_bf16_is_the_rotary_then_the_writes():
    """The compiled kernel in bf16 at the embedded model's shapes (4 + 2 heads of 64, 16
    rotated channels), one token and a window of 4: the bits of the rotary followed by
    the indexed writes."""
    g = torch.Generator().manual_seed(3)
    for t in (1, 4):
        qk, rope, v, caches, rows, at = _cache_case(g, b=2, t=t, d=64, r=16, cap=32)
        qk, rope, v, caches = (x.to("cuda", torch.bfloat16) for x in (qk, rope, v, caches))
        rows, at = rows.cuda(), at.cuda()
        want_qk, want = _rotated_then_written(qk, rope, v, caches, rows, at)
        rotate_into_cache_(qk, rope, v, caches[0], caches[1], rows, at)
        assert torch.equal(qk, want_qk) and torch.equal(caches, want)
