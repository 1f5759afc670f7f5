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


def _matmuls(ops) -> int:
    return sum(n for name, n in ops.counts.items() if name in ("aten.mm", "aten.addmm", "aten.linear"))


def _split_attention_projections(attns) -> None:
    """End the fused layout of ``q_proj | k_proj | v_proj`` (``k_proj``'s weight its own
    tensor again, same values): the attention then runs its three modules."""
    for attn in attns:
        attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())
        assert fused_weight((attn.q_proj, attn.k_proj, attn.v_proj)) is None


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_the_engine_projects_a_full_attention_layer_in_one_matmul(family, rng):
    """Every full-attention layer's q_proj, k_proj and v_proj become one tensor (the
    modules' weights views of it, their outputs the same bits): q, gate, k, v are
    strided views of one matmul's output ``[N, W]``, the modules' values bit for bit
    (fp32 on the CPU: each output column is the same dot product, summed in the same
    order by the BLAS whether its weight rows stand alone or among others); the static
    attention layer runs 2 matmuls (q|k|v, o), 9 kernels in all, and copies nothing."""
    from replayssm.engine.adapter import HybridEngine, attention_projections, static_attention_forward
    from replayssm.engine.random_model import build_tiny_model
    from replayssm.engine.rotary import rope_rows
    from replayssm.testing.op_count import count_ops

    model = build_tiny_model(family, seed=int(torch.randint(0, 1000, (1,), generator=rng)))
    attns = [layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")]
    x = torch.randn(6, model.config.hidden_size, generator=rng)
    with torch.inference_mode():
        before = [[p(x) for p in (a.q_proj, a.k_proj, a.v_proj)] for a in attns]
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=3, max_len=32, backend="triton")
    attn, (ref_qg, ref_k, ref_v) = attns[0], before[0]
    d = attn.head_dim
    heads, kv_heads = attn.q_proj.out_features // (2 * d), attn.k_proj.out_features // d
    width = 2 * (heads + kv_heads) * d
    for a, outs in zip(attns, before):
        projections = (a.q_proj, a.k_proj, a.v_proj)
        w = fused_weight(projections)
        assert w is not None and w.shape == (width, x.shape[1])
        with torch.inference_mode():
            for p, ref in zip(projections, outs):
                assert isinstance(p.weight, torch.nn.Parameter)
                assert p.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
                assert torch.equal(p(x), ref)  # the module computes what it did
    with torch.inference_mode(), count_ops() as ops:
        q, gate, k, v = attention_projections(attn, x)
    assert _matmuls(ops) == 1 and ops.total == 1, ops.counts
    base = q.untyped_storage().data_ptr()
    for got, strides, want in ((q, (width, 2 * d, 1), ref_qg.view(6, heads, 2 * d)[..., :d]),
                               (gate, (width, 2 * d, 1), ref_qg.view(6, heads, 2 * d)[..., d:]),
                               (k, (width, d, 1), ref_k.view(6, kv_heads, d)),
                               (v, (width, d, 1), ref_v.view(6, kv_heads, d))):
        assert got.untyped_storage().data_ptr() == base and got.stride() == strides
        assert torch.equal(got, want)
    # the static step's attention layer: one matmul in, one out, the norms reading in place
    b, t = 2, 3
    positions = torch.tensor([[4, 5, 6], [9, 10, 11]])
    rope = rope_rows(*eng.rotary_cos_sin(x, positions.reshape(-1))).view(b, t, 2, -1)
    with torch.inference_mode(), count_ops() as ops:
        static_attention_forward(attn, x, rope, eng.kv, 0, torch.tensor([0, 1]), positions, backend="triton",
                                 norm=eng.static_norm, fused=eng.fused_norms)
    assert _matmuls(ops) == 2, ops.counts
    # and 9 kernels in all: the 2 matmuls, 2 norms, the rotary, 2 cache writes, the attention, the gate
    assert ops.total <= 9 and ops.counts["triton._rotate_kernel"] == 1, ops.counts
    assert not set(ops.counts) & {"aten.copy_", "aten.clone", "aten.cat"}, ops.counts


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_attention_projections_give_the_unfused_engines_bits(family, backend, rng):
    """Two engines on copies of one model, the second with its attention projections
    unfused (three modules): a prompt pass (eager) and a static verify step give the same
    logits, hidden states and KV caches, bit for bit (fp32, CPU). Prompts of 3 and 6
    tokens: the Triton GDN layers take a prompt token by token under the interpreter,
    the same in both engines, so longer prompts add time and no check."""
    from replayssm.engine.adapter import HybridEngine
    from replayssm.engine.random_model import build_tiny_model

    seed = int(torch.randint(0, 1000, (1,), generator=rng))
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (3, 6)]
    windows = torch.randint(0, 256, (2, 4), generator=rng)
    runs = []
    for fused in (True, False):
        eng = HybridEngine(build_tiny_model(family, seed=seed), strategy="fold", num_slots=3, window=4, max_len=64,
                           backend=backend)
        attns = [layer.self_attn for kind, layer in zip(eng.kinds, eng.layers) if kind == "attn"]
        if not fused:
            _split_attention_projections(attns)
        slots = [eng.alloc() for _ in prompts]
        with torch.inference_mode():
            out = eng.extend(slots, prompts, prompt=True)
            batch = eng.static_batch(3, 4)
            batch.slots.copy_(torch.tensor(slots + [-1], dtype=batch.slots.dtype))
            slot_idx = torch.tensor(slots + [eng.kv.sink])
            starts = eng.kv.device_lengths[slot_idx]
            ids = torch.cat([windows, windows[:1] * 0])  # a padding row last
            logits, hidden = eng.forward_static(ids, starts[:, None] + torch.arange(4), slot_idx, batch, verify=True)
        runs.append((out.logits, out.hidden, logits, hidden, eng.kv.k.clone(), eng.kv.v.clone()))
    for i, (got, want) in enumerate(zip(*runs)):
        assert torch.equal(got, want), f"output {i} differs"
    assert runs[0][2].abs().max() > 0
