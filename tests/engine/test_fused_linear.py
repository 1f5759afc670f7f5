"""Projections fused into one matmul: the layout, what it keeps and when it stops."""

import pytest
import torch

from replayssm.engine.fused_linear import fuse_linears, fused_weight


def _linears(*outs, inp=24, dtype=torch.float32, bias=False, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Linear(inp, o, bias=bias, dtype=dtype) for o in outs]


def test_fused_layout_keeps_every_module_and_computes_their_outputs():
    mods = _linears(40, 3, 5)
    before = [m.weight.detach().clone() for m in mods]
    x = torch.randn(7, 24, dtype=torch.float64).float()
    expected = [m(x) for m in mods]
    assert fused_weight(mods) is None  # three separate tensors
    assert fuse_linears(mods)
    w = fused_weight(mods)
    assert w.shape == (48, 24) and w.data_ptr() == mods[0].weight.data_ptr()
    for m, b in zip(mods, before):
        assert torch.equal(m.weight, b) and isinstance(m.weight, torch.nn.Parameter)
        assert m.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    for got, ref, m in zip(torch.nn.functional.linear(x, w).split([40, 3, 5], -1), expected, mods):
        # one matmul against three: the same dot products, summed in whatever order the BLAS picks
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert torch.equal(m(x), ref)  # the module computes what it did
    # fusing again moves nothing; an in-place change of one module is the fused tensor's
    assert fuse_linears(mods) and fused_weight(mods).data_ptr() == w.data_ptr()
    with torch.no_grad():
        mods[1].weight.mul_(2)
    assert torch.equal(w[40:43], mods[1].weight)


def test_a_replaced_weight_ends_the_fused_layout():
    mods = _linears(8, 8)
    assert fuse_linears(mods)
    mods[1].weight = torch.nn.Parameter(torch.randn(8, 24))
    assert fused_weight(mods) is None
    assert fused_weight(list(reversed(mods))) is None


@pytest.mark.parametrize("case", ["bias", "dtype", "inputs"])
def test_modules_that_cannot_share_one_matmul_are_left_alone(case):
    if case == "bias":
        mods = _linears(8, 4, bias=True)
    elif case == "dtype":
        mods = _linears(8) + _linears(4, dtype=torch.float64)
    else:
        mods = _linears(8) + _linears(4, inp=16)
    ptrs = [m.weight.data_ptr() for m in mods]
    assert not fuse_linears(mods)
    assert fused_weight(mods) is None and [m.weight.data_ptr() for m in mods] == ptrs


def test_the_engine_projects_a_gdn_layer_in_two_matmuls_and_an_mlp_in_one():
    """Qwen3.5's q|k|v, a, b in one matmul (z apart) and each dense MLP's gate and up in
    one, with the modules' outputs (fp32: the same dot products); a second engine on the
    same model moves nothing."""
    from replayssm.engine.adapter import HybridEngine
    from replayssm.engine.random_model import build_tiny_model
    from replayssm.testing.op_count import count_ops

    model = build_tiny_model("qwen3_5", seed=4)
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=64, backend="triton")
    ptrs = [m.fused[0].weight.data_ptr() for m in eng.mixers]
    HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=64)
    assert [m.fused[0].weight.data_ptr() for m in eng.mixers] == ptrs
    mixer, gen = eng.mixers[0], torch.Generator().manual_seed(5)
    x = torch.randn(6, model.config.hidden_size, generator=gen)
    with torch.inference_mode(), count_ops() as ops:
        got = mixer.project(x)
    assert sum(n for name, n in ops.counts.items() if name in ("aten.mm", "aten.addmm", "aten.linear")) == 2, ops.counts
    m = mixer.module
    with torch.inference_mode():
        want = (m.in_proj_qkv(x), m.in_proj_z(x).view(6, mixer.HV, mixer.V), m.in_proj_a(x), m.in_proj_b(x))
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g - w).abs().max() <= 1e-5 * w.abs().max()
    mlp = next(layer.mlp for layer in eng.layers)
    assert fused_weight((mlp.gate_proj, mlp.up_proj)) is not None
    with torch.inference_mode(), count_ops() as ops:
        y = eng.static_mlp(mlp, x)
    assert sum(n for name, n in ops.counts.items() if name in ("aten.mm", "aten.addmm", "aten.linear")) == 2, ops.counts
    with torch.inference_mode():
        ref = mlp(x)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
