"""Pools over buffers the caller owns (``StatePool(..., buffers=...)``, ``buffer_specs``).

Each strategy run on handed-in tensors laid out as an engine might (layer and slot
strides, SGLang's transposed rings) gives bit for bit what it gives on the pool's own
buffers, working on the given tensors in place; tensors that do not fit the spec are
refused with the reason, before anything is allocated or written.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.state import BufferSpec, GDNShape, StatePool, buffer_specs

SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=8, head_v_dim=4)
LAYERS, SLOTS, WINDOW, RING = 2, 4, 3, 8


def strided(spec, how: str):
    """A tensor of ``spec``'s full shape whose storage is laid out ``how``."""
    full = spec.full_shape(LAYERS, SLOTS)
    if how == "layer-strided":  # slot-packed, with a gap between layers
        return torch.zeros(full[0], full[1] + 3, *full[2:], dtype=spec.dtype)[:, : full[1]]
    if how == "slot-major":  # [slots, layers, ...] storage seen as [layers, slots, ...]
        return torch.zeros(full[1], full[0], *full[2:], dtype=spec.dtype).transpose(0, 1)
    if how == "heads-before-positions":  # SGLang's ring [layers, slots, heads, R, ...] transposed
        lead, (r, heads), rest = full[:2], full[2:4], full[4:]
        return torch.zeros(*lead, heads, r, *rest, dtype=spec.dtype).transpose(2, 3)
    raise ValueError(how)


# per strategy: how each of its buffers is laid out (within what its spec allows)
LAYOUTS = {
    "snapshot": dict(checkpoints="slot-major", conv_state="slot-major", conv_window="slot-major",
                     snapshots="layer-strided"),
    "fold": dict(checkpoints="slot-major", conv_state="slot-major", ring_k="heads-before-positions",
                 ring_v="heads-before-positions", ring_g="heads-before-positions", ring_beta="heads-before-positions"),
    "circular": dict(checkpoints="layer-strided", conv_state="slot-major", ring_k="layer-strided",
                     ring_v="layer-strided", ring_u="layer-strided", ring_g="layer-strided"),
}


def rand_inputs(steps: int, rows: int):
    """Layer parameters and, per step, window lengths, accepted counts and each layer's
    pre-conv channels and gates."""
    hv, c, w = SHAPE.num_value_heads, SHAPE.conv_dim, SHAPE.conv_kernel
    params = [dict(A_log=torch.rand(hv) * -2, dt_bias=torch.randn(hv) * 0.5, conv_weight=torch.randn(c, w) * 0.5)
              for _ in range(LAYERS)]
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, WINDOW + 1, (rows,)).tolist()
        accepted = [int(torch.randint(1, n + 1, ())) for n in lengths]
        n = sum(lengths)
        out.append((lengths, accepted, [(torch.randn(n, c), torch.randn(n, hv), torch.randn(n, hv))
                                        for _ in range(LAYERS)]))
    return out, params


def run(pool, steps, params):
    for layer, p in enumerate(params):
        pool.set_layer_params(layer, **p)
    slots = [pool.alloc(), pool.alloc(), pool.alloc()]
    outs = []
    for lengths, accepted, inputs in steps:
        batch = pool.batch([slots[0], -1, slots[2]], lengths)
        for layer, (x, a, b) in enumerate(inputs):
            y = pool.strategy.conv_verify(layer, x, batch)
            hk = SHAPE.num_heads * SHAPE.head_k_dim
            q, k, v = y[:, :hk], y[:, hk:2 * hk], y[:, 2 * hk:]
            n = y.shape[0]
            outs.append(pool.strategy.verify(layer, q.reshape(n, 2, 8), k.reshape(n, 2, 8), v.reshape(n, 4, 4), a, b,
                                             batch))
        pool.strategy.commit(batch, accepted)
        outs += [pool.strategy.committed_state(layer, slots) for layer in range(LAYERS)]
    return outs


@pytest.mark.parametrize("strategy", list(LAYOUTS))
def test_strategies_on_caller_buffers_match_pool_buffers(strategy):
    specs = buffer_specs(SHAPE, strategy=strategy, window=WINDOW, ring_len=RING)
    given = {name: strided(specs[name], how) for name, how in LAYOUTS[strategy].items()}
    assert all(not x.is_contiguous() for x in given.values())
    steps, params = rand_inputs(steps=4, rows=3)
    own = StatePool(SHAPE, LAYERS, SLOTS, strategy=strategy, window=WINDOW, ring_len=RING, backend="reference")
    theirs = StatePool(SHAPE, LAYERS, SLOTS, strategy=strategy, window=WINDOW, ring_len=RING, backend="reference",
                       buffers=given)
    assert theirs.caller_buffers == set(given) and all(theirs.buffers[n] is x for n, x in given.items())
    for got, want in zip(run(theirs, steps, params), run(own, steps, params)):
        assert torch.equal(got, want)
    assert given["checkpoints"].abs().sum() > 0, "the pool must work in the caller's tensor"


def test_caller_buffers_that_do_not_fit_are_refused():
    specs = buffer_specs(SHAPE, strategy="circular", window=WINDOW, ring_len=RING)

    def pool(strategy="circular", **buffers):
        return StatePool(SHAPE, LAYERS, SLOTS, strategy=strategy, window=WINDOW, ring_len=RING, buffers=buffers)

    ckpt = torch.zeros(specs["checkpoints"].full_shape(LAYERS, SLOTS))
    with pytest.raises(ValueError, match=r"buffers\['checkpoints'\] must have shape \[2, 4, 4, 4, 8\]"):
        pool(checkpoints=ckpt[:, :3])
    with pytest.raises(TypeError, match=r"buffers\['checkpoints'\] must have dtype"):
        pool(checkpoints=ckpt.double())
    with pytest.raises(ValueError, match="stride 0 on axis 1"):
        pool(checkpoints=ckpt[:, :1].expand(ckpt.shape))
    with pytest.raises(ValueError, match="packed over its last 3 axes"):
        pool("fold", checkpoints=ckpt.transpose(3, 4).contiguous().transpose(3, 4))
    with pytest.raises(ValueError, match="circular's chunked verify kernels"):
        pool(ring_k=strided(specs["ring_k"], "heads-before-positions"))
    with pytest.raises(ValueError, match="circular's chunked verify kernels"):
        pool(checkpoints=strided(specs["checkpoints"], "slot-major"))
    with pytest.raises(ValueError, match="does not hold"):
        pool(snapshots=ckpt)
    pool(checkpoints=strided(specs["checkpoints"], "layer-strided"))  # a layer stride is free


def test_ring_keys_raw_in_the_activation_dtype_or_normalised_in_fp32():
    """A bf16 pool takes a caller's ring of keys in fp32 (normalised, as it allocates)
    or in bf16 (raw, SGLang's layout), and names both when given another dtype; an fp32
    pool takes fp32 only."""
    spec = buffer_specs(SHAPE, strategy="fold", window=WINDOW, act_dtype=torch.bfloat16)["ring_k"]
    assert (spec.dtype, spec.alt_dtype) == (torch.float32, torch.bfloat16)
    full = spec.full_shape(LAYERS, SLOTS)

    def pool(act_dtype, ring_k):
        return StatePool(SHAPE, LAYERS, SLOTS, strategy="fold", window=WINDOW, act_dtype=act_dtype,
                         buffers=dict(ring_k=ring_k))

    for dtype in (torch.float32, torch.bfloat16):
        assert pool(torch.bfloat16, torch.randn(full).to(dtype)).buffers["ring_k"].dtype == dtype
    with pytest.raises(TypeError, match=r"buffers\['ring_k'\] must have dtype torch.float32 or torch.bfloat16, "
                                        r"got torch.float16"):
        pool(torch.bfloat16, torch.randn(full).half())
    with pytest.raises(TypeError, match=r"must have dtype torch.float32, got torch.bfloat16"):
        pool(torch.float32, torch.randn(full).bfloat16())


def test_buffer_specs_list_every_buffer_with_its_layout():
    fold = buffer_specs(SHAPE, strategy="fold", window=WINDOW, state_dtype=torch.bfloat16, act_dtype=torch.bfloat16)
    assert list(fold) == ["checkpoints", "conv_state", "conv_window", "ring_k", "ring_v", "ring_g", "ring_beta"]
    assert fold["checkpoints"].full_shape(LAYERS, SLOTS) == (LAYERS, SLOTS, 4, 4, 8)
    assert fold["ring_k"].full_shape(LAYERS, SLOTS) == (LAYERS, SLOTS, WINDOW, 2, 8)
    # keys normalised in fp32 (ops.records.keys_normalized), values in the activations' dtype
    assert fold["ring_g"].dtype == fold["ring_k"].dtype == torch.float32 and fold["ring_v"].dtype == torch.bfloat16
    packed = [fold[name].packed for name in ("checkpoints", "conv_state", "ring_k", "ring_g")]
    assert packed == [3, 0, 1, 0]
    circ = buffer_specs(SHAPE, strategy="circular", window=WINDOW, ring_len=RING)
    assert circ["write_pos"].full_shape(LAYERS, SLOTS) == (SLOTS,) and circ["ring_k"].packed == 4
    pool = StatePool(SHAPE, LAYERS, SLOTS, strategy="fold", window=WINDOW)
    assert dict(pool.specs) == buffer_specs(SHAPE, strategy="fold", window=WINDOW)


def test_the_pools_own_conv_state_keeps_its_channels_contiguous():
    # The conv kernels read and write a channel block's W - 1 entries as rows; the pool
    # allocates its conv state [layers, slots, C, W - 1] over [layers, slots, W - 1, C].
    pool = StatePool(SHAPE, LAYERS, SLOTS, strategy="circular", window=WINDOW, ring_len=RING)
    c, w1 = SHAPE.conv_dim, SHAPE.conv_kernel - 1
    assert pool.specs["conv_state"].swap_last
    assert pool.conv_state.shape == (LAYERS, SLOTS, c, w1)
    assert pool.conv_state.stride() == (SLOTS * w1 * c, w1 * c, 1, c)
    assert pool.conv_state.eq(0).all()
    others = [name for name, spec in pool.specs.items() if not spec.swap_last]
    assert others and all(pool.buffers[name].is_contiguous() for name in others)
    with pytest.raises(ValueError, match="swap_last needs at least two axes and no packed ones"):
        BufferSpec((4, 3), torch.float32, packed=1, swap_last=True)


def test_alloc_keep_state_keeps_the_engines_state_and_empties_the_history():
    pool = StatePool(SHAPE, LAYERS, SLOTS, strategy="circular", window=WINDOW, ring_len=RING)
    ckpt, conv = pool.buffers["checkpoints"], pool.buffers["conv_state"]
    ckpt[:, 1].normal_()
    conv[:, 1].normal_()
    pool.buffers["write_pos"][1] = 5
    kept = ckpt[:, 1].clone(), conv[:, 1].clone()
    assert pool.alloc(1, keep_state=True) == 1
    assert torch.equal(ckpt[:, 1], kept[0]) and torch.equal(conv[:, 1], kept[1])
    assert pool.buffers["write_pos"][1] == 0 and pool.buffers["ring_k"][:, 1].isnan().all()
    assert pool.alloc(2) == 2 and (ckpt[:, 2] == 0).all()
