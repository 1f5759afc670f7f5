"""Kernels round their 16-bit stores to nearest even, under the interpreter as on a GPU.

Guards issue 12: under the Triton interpreter an fp32 -> bf16 cast truncates (even with
``fp_downcast_rounding="rtne"``), while the compiled GPU kernels round to nearest even,
so CPU and GPU bf16 outputs and states differed. Every comparison here is against
torch's own fp32 -> bf16 / fp16 cast (round to nearest even), an independent
implementation, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from layer_inputs import args, rand_layer

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from replayssm.ops import gdn_recurrence, triton_common  # noqa: E402
from replayssm.ops.triton_common import to_rtne  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_common.INTERPRETER:
    pytest.skip("CPU run without TRITON_INTERPRET=1 at import time", allow_module_level=True)


@triton.jit
def _store_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, to_rtne(x, y_ptr.dtype.element_ty))


def hard_values(n: int) -> torch.Tensor:
    """fp32 values whose bf16 rounding is decided by the low 16 bits: random bits, exact
    ties with even and odd kept bits, values that round up into the next binade and past
    bf16's largest finite value, infinities, NaN, signed zeros and subnormals."""
    gen = torch.Generator().manual_seed(7)
    rand_bits = torch.randint(0, 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
    rand_bits = rand_bits[torch.isfinite(rand_bits.to(torch.int32).view(torch.float32))]
    special = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3FFFFFFF, 0x3FFF8000, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000, 0x00000001,
         0x00008000, 0x00018000, 0x80000000, 0x00000000, 0x3F80FFFF, 0x3F807FFF],
        dtype=torch.int64,
    )
    bits = torch.cat([rand_bits, special, special | 0x80000000]).to(torch.int32)
    x = bits.view(torch.float32)
    return torch.cat([x, torch.randn(64, generator=gen), torch.tensor([float("nan"), float("-inf")])])


# The hard values include fp32 values past float16's range, which must store as inf; the
# interpreter's numpy cast warns about them.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_cast_rounds_to_nearest_even(dtype):
    x = hard_values(1800)
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.randn(n - x.numel())]).to(DEVICE)
    y = torch.empty(n, dtype=dtype, device=DEVICE)
    _store_kernel[(1,)](x, y, N=n)
    want = x.to(dtype)
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].float(), want[~nan].float()), "store rounding differs from round-to-nearest-even"
    if dtype == torch.bfloat16:
        trunc = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
        assert not torch.equal(want[~nan].float(), trunc[~nan].float()), "inputs must include values truncation gets wrong"


def test_recurrence_bf16_outputs_are_the_fp32_outputs_rounded():
    """The recurrence kernel on bf16 activations computes in fp32 exactly what it computes
    on the same values given as fp32; its bf16 outputs must be those fp32 outputs rounded
    to nearest even (truncation gets about half of them wrong)."""
    n, h, hv, kd, vd = 6, 2, 4, 16, 16
    x = rand_layer(n, h, hv, kd, vd, torch.bfloat16, device=DEVICE)
    state = torch.randn(2, hv, vd, kd, device=DEVICE) * 0.3
    slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32, device=DEVICE)
    o16 = gdn_recurrence(*args(x), state.clone(), slots, cu, max_len=4, backend="triton")
    x32 = {k: (v.float() if v.dtype == torch.bfloat16 else v) for k, v in x.items()}
    o32 = gdn_recurrence(*args(x32), state.clone(), slots, cu, max_len=4, backend="triton")
    assert o16.dtype == torch.bfloat16
    assert torch.equal(o16.float(), o32.to(torch.bfloat16).float())
