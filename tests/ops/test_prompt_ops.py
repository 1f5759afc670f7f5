"""The two small ops of a chunked prompt pass: ``prompt_gates`` (every token's gates in
one launch, zero past the pass's real tokens) and ``write_checkpoints`` (final states
into their slots' checkpoints by device slots). The Triton kernels against the
references, the references against the formulas written out here in float64, the
masks and skipped rows, and bad arguments refused before anything is written."""

import pytest
import torch

from replayssm.ops.checkpoints import write_checkpoints_reference, write_checkpoints_triton
from replayssm.ops.prompt_gates import prompt_gates_reference, prompt_gates_triton


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.initial_seed() % 2**31)


def _gate_inputs(n: int, hv: int, g: torch.Generator, token_stride: int | None = None):
    """Raw gates as a projection's column slices (token stride wider than HV) and
    parameters in the models' ranges, some ``a + dt_bias`` past softplus' threshold."""
    width = token_stride or hv
    a = (torch.randn(n, width, generator=g) * 8)[:, :hv]
    b = (torch.randn(n, width, generator=g) * 3)[:, :hv]
    A_log = torch.rand(hv, generator=g) * 3 - 1
    dt_bias = torch.randn(hv, generator=g)
    return a, b, A_log, dt_bias


def _gates_float64(a, b, A_log, dt_bias, real):
    # a + dt_bias in fp32 as the ops add it: softplus far below zero is as sensitive
    # to that sum's rounding as exp is, which would blur the comparison of the rest
    x = (a.float() + dt_bias.float()).double()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))
    g = -torch.exp(A_log.double()) * softplus
    beta = 1 / (1 + torch.exp(-b.double()))
    keep = (torch.arange(a.shape[0]) < (a.shape[0] if real is None else int(real[0])))[:, None]
    return torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0)


@pytest.mark.parametrize("n,hv,stride", [(1, 1, None), (37, 4, 12), (300, 6, None), (513, 32, 48)])
@pytest.mark.parametrize("real_at", [None, 0.0, 0.4, 1.0])
def test_prompt_gates_match_the_formulas(n, hv, stride, real_at):
    g = _gen()
    a, b, A_log, dt_bias = _gate_inputs(n, hv, g, stride)
    real = None if real_at is None else torch.tensor([int(real_at * n)], dtype=torch.int32)
    g64, beta64 = _gates_float64(a, b, A_log, dt_bias, real)
    for fn in (prompt_gates_reference, prompt_gates_triton):
        gate, beta = fn(a, b, A_log, dt_bias, real)
        assert gate.dtype == beta.dtype == torch.float32 and gate.shape == beta.shape == (n, hv)
        # fp32 against float64: within 8 fp32 ulps (1e-6) of each value's own scale; the
        # Triton form (exp, log and a division per value) measures up to ~3.5 ulps
        assert ((gate.double() - g64).abs() <= 1e-6 * g64.abs() + 1e-30).all(), fn.__name__
        assert ((beta.double() - beta64).abs() <= 1e-6 * beta64.abs() + 1e-30).all(), fn.__name__
        if real is not None:  # masked rows are exactly zero, the others are not
            m = int(real[0])
            assert torch.equal(gate[m:], torch.zeros_like(gate[m:])) and torch.equal(beta[m:], torch.zeros_like(beta[m:]))
            assert (beta[:m] > 0).all()


def test_prompt_gates_beta_in_16_bits_rounds_to_nearest():
    """beta stored in bf16 (the chunked kernel takes it in v's dtype) is the fp32 beta
    rounded to nearest even: the reference's bits, or one bf16 ulp where the fp32
    values sit at a rounding boundary a few fp32 ulps apart."""
    g = _gen()
    a, b, A_log, dt_bias = _gate_inputs(700, 8, g)
    real = torch.tensor([650])
    ref = prompt_gates_reference(a, b, A_log, dt_bias, real, beta_dtype=torch.bfloat16)[1]
    got = prompt_gates_triton(a, b, A_log, dt_bias, real, beta_dtype=torch.bfloat16)[1]
    assert got.dtype == torch.bfloat16
    diff = (got.float() - ref.float()).abs()
    assert (diff <= 2**-8 * ref.float().abs()).all()
    assert (diff == 0).float().mean() > 0.99


@pytest.mark.parametrize("fn", [prompt_gates_reference, prompt_gates_triton])
def test_prompt_gates_refuse_bad_arguments(fn):
    a, b, A_log, dt_bias = _gate_inputs(5, 4, _gen())
    with pytest.raises(ValueError, match="^b must have shape"):
        fn(a, b[:4], A_log, dt_bias)
    with pytest.raises(ValueError, match="^A_log must have shape"):
        fn(a, b, A_log[:3], dt_bias)
    with pytest.raises(TypeError, match="^real must have dtype"):
        fn(a, b, A_log, dt_bias, torch.tensor([2.0]))
    with pytest.raises(ValueError, match="^real must have shape"):
        fn(a, b, A_log, dt_bias, torch.tensor([2, 3]))
    with pytest.raises(TypeError, match="beta_dtype"):
        fn(a, b, A_log, dt_bias, beta_dtype=torch.int32)


def test_prompt_gates_triton_needs_head_contiguous_gates():
    a, b, A_log, dt_bias = _gate_inputs(6, 4, _gen())
    with pytest.raises(ValueError, match="contiguous along heads"):
        prompt_gates_triton(a.t().contiguous().t(), b, A_log, dt_bias)


def _pool_checkpoints(num_slots, hv, v, k, dtype, g):
    """One layer's checkpoints as a view of a two-layer buffer (a slot stride of the
    pool's layout), filled with values that must survive where no row writes."""
    big = torch.randn(2, num_slots, hv, v, k, generator=g).to(dtype)
    return big, big[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 4, 8), (2, 24, 40)])
def test_write_checkpoints_writes_live_rows_and_nothing_else(dtype, shape):
    g = _gen()
    num_slots = 6
    slots = torch.tensor([4, -1, 0, 2], dtype=torch.int32)
    states = torch.randn(4, *shape, generator=g) * 3
    expected = None
    for fn in (write_checkpoints_reference, write_checkpoints_triton):
        big, ck = _pool_checkpoints(num_slots, *shape, dtype, torch.Generator().manual_seed(5))
        before = big.clone()
        fn(ck, slots, states)
        if expected is None:
            expected = big.clone()
        assert torch.equal(big, expected), fn.__name__  # the Triton copy gives the reference's bits
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:  # a cast rounded to nearest even: torch's own cast
                assert torch.equal(ck[slot], states[row].to(dtype))
        untouched = [s for s in range(num_slots) if s not in slots.tolist()]
        assert torch.equal(big[0], before[0]) and torch.equal(big[1, untouched], before[1, untouched])


@pytest.mark.parametrize("fn", [write_checkpoints_reference, write_checkpoints_triton])
def test_write_checkpoints_refuse_bad_arguments_and_write_nothing(fn):
    g = _gen()
    big, ck = _pool_checkpoints(3, 2, 4, 8, torch.float32, g)
    before = big.clone()
    states = torch.randn(2, 2, 4, 8, generator=g)
    with pytest.raises(ValueError, match="^states must have shape"):
        fn(ck, torch.tensor([0, 1]), states[:, :, :2])
    with pytest.raises(TypeError, match="^slots must have dtype"):
        fn(ck, torch.tensor([0.0, 1.0]), states)
    with pytest.raises(ValueError, match="^states must have shape"):
        fn(ck, torch.tensor([0]), states)
    if fn is write_checkpoints_triton:
        with pytest.raises(ValueError, match="slot"):
            fn(ck, torch.tensor([0, 3]), states)
        with pytest.raises(ValueError, match="packed"):
            fn(ck, torch.tensor([0, 1]), states.transpose(-1, -2).contiguous().transpose(-1, -2))
    assert torch.equal(big, before)
