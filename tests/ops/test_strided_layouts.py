"""Triton kernels on engines' strided layouts: the same results as on packed buffers.

vLLM stores a conv state as ``[slots, W - 1, C]`` and passes it transposed; engines
that interleave layers or pages give states and snapshots a slot stride larger than a
state. The kernels take those strides (the arithmetic is the packed path's: outputs
bit for bit, copies exact); what they cannot take is refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
from layer_inputs import args, rand_layer

pytest.importorskip("triton")

from replayssm.ops import causal_conv_commit, causal_conv_verify, gdn_recurrence, snapshot_commit  # noqa: E402
from replayssm.ops import triton_common  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_common.INTERPRETER:
    pytest.skip("CPU run without TRITON_INTERPRET=1 at import time", allow_module_level=True)

NS, T = 4, 3


def padded_slots(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into storage with two unused slots after each one (slot stride 3x)."""
    big = torch.full((x.shape[0], 3, *x.shape[1:]), float("nan"), dtype=x.dtype, device=x.device)
    big[:, 0] = x
    return big[:, 0]


def test_conv_on_a_transposed_state_and_a_strided_window_buffer():
    c, w = 24, 4
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32, device=DEVICE)
    x = torch.randn(6, c, device=DEVICE)
    weight, bias = torch.randn(c, w, device=DEVICE), torch.randn(c, device=DEVICE)
    state = torch.randn(NS, c, w - 1, device=DEVICE)
    vllm = state.transpose(1, 2).contiguous().transpose(1, 2)  # [slots, W - 1, C] storage
    wbuf_phys = torch.zeros(NS, c, T + 5, device=DEVICE)  # a window buffer inside a wider per-slot row
    wbuf = wbuf_phys[..., 2:2 + T].transpose(1, 2)
    packed_state, packed_wbuf = state.clone(), torch.zeros(NS, T, c, device=DEVICE)
    y = causal_conv_verify(x, vllm, weight, bias, slots, cu, window_buf=wbuf, backend="triton")
    y_ref = causal_conv_verify(x, packed_state, weight, bias, slots, cu, window_buf=packed_wbuf, backend="triton")
    assert torch.equal(y, y_ref)
    assert torch.equal(wbuf[[2, 0]], packed_wbuf[[2, 0]])
    accepted = torch.tensor([2, 1, 1], dtype=torch.int32, device=DEVICE)
    causal_conv_commit(vllm[None], wbuf[None], slots, accepted, backend="triton")
    causal_conv_commit(packed_state[None], packed_wbuf[None], slots, accepted, backend="triton")
    assert torch.equal(vllm, packed_state) and not torch.equal(vllm, state)


def test_recurrence_and_snapshot_commit_with_a_slot_stride():
    h, hv, kd, vd = 1, 2, 16, 8
    slots = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    x = rand_layer(5, h, hv, kd, vd, device=DEVICE)
    state = torch.randn(NS, hv, vd, kd, device=DEVICE)
    snaps = torch.randn(NS, T, hv, vd, kd, device=DEVICE)
    st_s, sn_s = padded_slots(state), padded_slots(snaps)
    st_p, sn_p = state.clone(), snaps.clone()
    o_s = gdn_recurrence(*args(x), st_s, slots, cu, snapshots=sn_s, backend="triton")
    o_p = gdn_recurrence(*args(x), st_p, slots, cu, snapshots=sn_p, backend="triton")
    assert torch.equal(o_s, o_p) and torch.equal(sn_s, sn_p)
    accepted = torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)
    snapshot_commit(st_s[None], sn_s[None], slots, accepted, backend="triton")
    snapshot_commit(st_p[None], sn_p[None], slots, accepted, backend="triton")
    assert torch.equal(st_s, st_p) and torch.equal(st_s[1], sn_p[1, 2])
    with pytest.raises(ValueError, match="state must be packed over its last 3 axes"):
        unpacked = state.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, [K, V] storage
        gdn_recurrence(*args(x), unpacked, slots, cu, max_len=T, backend="triton")
