"""Errors name the argument at fault and change nothing; a float64 pool is exact.

The float64 bound: a float64 pool on float64 activations runs the same recurrence as
the float64 oracle, so after 60 steps its committed states and outputs must agree to
float64 rounding (1e-12 relative leaves four orders of magnitude of room). With float32
ring gates (as before) the replayed gates were rounded to fp32 and the error was ~1e-8.
"""

import pytest
import torch

from replayssm.testing.lifecycle import Lifecycle
from replayssm.ops.conv import causal_conv_verify_reference
from replayssm.state import GDNShape, StatePool

STRATEGIES = ["snapshot", "fold", "circular"]
SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=8)


def make(strategy, **kw):
    pool = StatePool(SHAPE, 2, 4, strategy=strategy, window=4, ring_len=8, **kw)
    return pool, Lifecycle(pool, num_requests=2, padding_rows=1, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_errors_name_the_argument_and_change_nothing(strategy):
    """Guards: a float64 q beside fp32 inputs and bf16 inputs into an fp32 pool were
    accepted and written; a v with the wrong HV was reported as 'a must have shape';
    a conv input with the wrong channel count blamed the registered weight."""
    pool, lc = make(strategy)
    for _ in range(3):
        lc.step()
    before = {n: b.clone() for n, b in pool.buffers.items()}
    batch = pool.batch(lc.slots, [2, 2])
    x = lc.make_inputs(4)
    st = pool.strategy

    def verify(**over):
        args = {n: x[n] for n in "qkvab"} | over
        return st.verify(0, args["q"], args["k"], args["v"], args["a"], args["b"], batch)

    with pytest.raises(TypeError, match=r"^q has dtype float64, the pool's act_dtype is float32"):
        verify(q=x["q"].double())
    with pytest.raises(TypeError, match=r"^v has dtype bfloat16"):
        verify(v=x["v"].bfloat16())
    with pytest.raises(TypeError, match=r"^b has dtype float16"):
        verify(b=x["b"].half())
    with pytest.raises(ValueError, match=r"^v must have shape \[4, 4, \*\]"):
        verify(v=torch.randn(4, 2, SHAPE.head_v_dim))
    with pytest.raises(ValueError, match=r"^v must have shape \[4, 4, 8\]"):
        verify(v=torch.randn(4, 4, 5))
    with pytest.raises(ValueError, match=r"^k must have shape"):
        verify(k=torch.randn(4, 2, 8))
    with pytest.raises(ValueError, match=r"^x \(mixed_qkv\) must have shape \[\*, 96\]"):
        st.conv_verify(0, torch.randn(4, 95), batch)
    with pytest.raises(TypeError, match=r"^x \(mixed_qkv\) has dtype bfloat16"):
        st.conv_verify(0, x["x"].bfloat16(), batch)
    with pytest.raises(ValueError, match=r"^x \(mixed_qkv\) must have shape"):
        st.conv_prefill(0, torch.randn(4, 95), pool.batch(lc.slots, [2, 2], prefill=True))
    assert not st.step_open
    for n, b in pool.buffers.items():
        assert torch.equal(b.nan_to_num(7.0), before[n].nan_to_num(7.0)), n


def test_conv_op_names_x_not_the_weight():
    c, w = 6, 4
    with pytest.raises(ValueError, match=r"^x must have shape \[\*, 6\]"):
        causal_conv_verify_reference(
            torch.randn(3, c + 1), torch.randn(2, c, w - 1), torch.randn(c, w), None,
            torch.tensor([0], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float64_pool_is_exact(strategy):
    pool, lc = make(strategy, state_dtype=torch.float64, act_dtype=torch.float64)
    if strategy != "snapshot":
        for name in ("ring_g", "ring_beta") + (("ring_u",) if strategy == "circular" else ()):
            assert pool.buffers[name].dtype == torch.float64, name
    flushed = 0
    for _ in range(60):
        r = lc.step()
        flushed += r.flushed
        assert r.state_err < 1e-12, f"step {r.step}: state error {r.state_err:.2e}"
        assert r.out_err < 1e-12, f"step {r.step}: output error {r.out_err:.2e}"
    if strategy == "circular":
        assert flushed > 10


def test_inputs_are_validated_once_per_step_but_every_bad_input_is_caught():
    """Later layers of a step skip the checks only when their inputs match the validated
    ones: a wrong dtype or shape on any layer still raises."""
    from replayssm.state import GDNShape, StatePool

    shape = GDNShape(2, 4, 8, 8)
    pool = StatePool(shape, 3, 2, strategy="fold", window=2)
    for layer in range(3):
        pool.set_layer_params(layer, A_log=-torch.rand(4), dt_bias=torch.randn(4),
                              conv_weight=torch.randn(shape.conv_dim, shape.conv_kernel))
    s = pool.alloc()
    batch = pool.batch([s], 2)

    def inputs(dtype=torch.float32, n=2):
        return (torch.randn(n, 2, 8, dtype=dtype), torch.randn(n, 2, 8, dtype=dtype), torch.randn(n, 4, 8, dtype=dtype),
                torch.randn(n, 4, dtype=dtype), torch.randn(n, 4, dtype=dtype))

    calls = []
    real = pool.strategy._check_inputs_now
    pool.strategy._check_inputs_now = lambda *a: (calls.append(a[0]), real(*a))[1]
    pool.strategy.verify(0, *inputs(), batch)
    pool.strategy.verify(1, *inputs(), batch)
    assert calls == [0]  # layer 1's inputs matched layer 0's: no second validation
    with pytest.raises(TypeError):
        pool.strategy.verify(2, *inputs(torch.float64), batch)
    with pytest.raises(ValueError):
        pool.strategy.verify(2, *inputs(n=3), batch)
