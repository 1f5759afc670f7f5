"""The fold strategy on SGLang 0.5.23's own GDN state tensors (its MambaPool layout).

The buffers are built as SGLang's memory pool builds them, and handed to the pool as
they are (views, never copies):

    ssm_states (temporal)      [layers, slots, HV, V, K]      -> checkpoints
    conv state                 [layers, slots, C, W - 1]      -> conv_state
    replayssm_rawk             [layers, slots, H, T, K]       -> ring_k    (.transpose(2, 3))
    replayssm_rawv             [layers, slots, HV, T, V]      -> ring_v    (.transpose(2, 3))
    replayssm_g / _beta        [layers, slots, HV, T] fp32    -> ring_g / ring_beta (.transpose(2, 3))
    intermediate conv window   [layers, slots, C, T + W - 2]  -> conv_window ([..., W - 2:].transpose(2, 3))

and, in the ``envelope`` variant, with the checkpoints and conv states as strided views
into one shared per-slot buffer (SGLang's page-granularity envelope: the slot pitch
spans every layer). Several verify -> accept -> commit steps on the Triton kernels (the
interpreter without a GPU) are checked against a float64 reference run of plain
decoding on the accepted tokens (outputs and committed states to fp32 rounding; conv
states exactly), the committed states bit for bit against the fp32 recurrence of the
same kernels on a packed copy, and the records against the inputs in SGLang's layout,
where SGLang's own fold kernel reads them (its keys raw in the model's 16-bit dtype,
which the pool takes as such; in these fp32 runs normalised, as a pool keeps fp32 ring
keys: ``ops.records.keys_normalized``). Untouched slots stay bit-identical.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from replayssm.ops import causal_conv_verify_reference, gdn_recurrence, gdn_recurrence_reference  # noqa: E402
from replayssm.ops.records import stored_keys  # noqa: E402
from replayssm.ops import triton_common  # noqa: E402
from replayssm.state import GDNShape, StatePool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_common.INTERPRETER:
    pytest.skip("CPU run without TRITON_INTERPRET=1 at import time", allow_module_level=True)

NL, SLOTS, T, STEPS = 2, 5, 3, 2
SHAPE = GDNShape(num_heads=2, num_value_heads=2, head_k_dim=16, head_v_dim=8)
ROWS = [3, -1, 1]  # SGLang's mamba cache indices of the step's requests (-1: padding)
# fp32 kernels against float64 over a few steps of O(1) values: ~1e-6 (the compiled
# kernels' exp/log are a few ulp off); a wrong slot, head, position or stride is off by O(0.1).
TOL = dict(rtol=1e-4, atol=1e-4)


def sglang_tensors(layout: str):
    """The GDN entries of SGLang's MambaPool (spec verify, fold-every-commit records)."""
    s, c, w = SHAPE, SHAPE.conv_dim, SHAPE.conv_kernel
    hv, v, k, h = s.num_value_heads, s.head_v_dim, s.head_k_dim, s.num_heads
    if layout == "envelope":
        conv_n, ssm_n = c * (w - 1), hv * v * k
        raw = torch.randn(SLOTS, NL, conv_n + ssm_n, device=DEVICE)  # [slots][layers][conv | temporal]
        conv = raw[:, :, :conv_n].unflatten(2, (c, w - 1)).transpose(0, 1)
        temporal = raw[:, :, conv_n:].unflatten(2, (hv, v, k)).transpose(0, 1)
    else:
        conv = torch.randn(NL, SLOTS, c, w - 1, device=DEVICE)
        temporal = torch.randn(NL, SLOTS, hv, v, k, device=DEVICE)
    temporal.mul_(0.5)
    return dict(
        temporal=temporal,
        conv=conv,
        conv_window_phys=torch.zeros(NL, SLOTS, c, T + w - 2, device=DEVICE),
        rawv=torch.zeros(NL, SLOTS, hv, T, v, device=DEVICE),
        rawk=torch.zeros(NL, SLOTS, h, T, k, device=DEVICE),
        g=torch.zeros(NL, SLOTS, hv, T, device=DEVICE),
        beta=torch.zeros(NL, SLOTS, hv, T, device=DEVICE),
    )


def as_pool_buffers(sg):
    w = SHAPE.conv_kernel
    return {
        "checkpoints": sg["temporal"], "conv_state": sg["conv"],
        "conv_window": sg["conv_window_phys"][..., w - 2:].transpose(2, 3),
        "ring_k": sg["rawk"].transpose(2, 3), "ring_v": sg["rawv"].transpose(2, 3),
        "ring_g": sg["g"].transpose(2, 3), "ring_beta": sg["beta"].transpose(2, 3),
    }


def split(y, n):
    s = SHAPE
    hk = s.num_heads * s.head_k_dim
    return (y[:, :hk].view(n, s.num_heads, s.head_k_dim), y[:, hk:2 * hk].view(n, s.num_heads, s.head_k_dim),
            y[:, 2 * hk:].view(n, s.num_value_heads, s.head_v_dim))


def rows_of(cu, lengths, keep):
    """Token indices of the first ``keep[i]`` tokens of each window."""
    return torch.cat([torch.arange(cu[i], cu[i] + keep[i]) for i in range(len(lengths))]).to(DEVICE)


@pytest.mark.parametrize("layout", ["standard", "envelope"])
def test_fold_strategy_on_sglang_tensors(layout):
    sg = sglang_tensors(layout)
    buffers = as_pool_buffers(sg)
    assert not buffers["ring_k"].is_contiguous() and not buffers["conv_window"].is_contiguous()
    pool = StatePool(SHAPE, NL, SLOTS, strategy="fold", window=T, backend="triton", device=DEVICE, buffers=buffers)
    hv, c, w = SHAPE.num_value_heads, SHAPE.conv_dim, SHAPE.conv_kernel
    params = [dict(A_log=torch.empty(hv).uniform_(-2, -0.5), dt_bias=torch.randn(hv) * 0.5,
                   conv_weight=torch.randn(c, 1, w) * 0.5) for _ in range(NL)]  # HF's [C, 1, W] taps
    for layer, p in enumerate(params):
        pool.set_layer_params(layer, **p)
    live = [s for s in ROWS if s >= 0]
    for s in live:
        pool.alloc(s, keep_state=True)  # the engine's states, as SGLang's pool holds them
    untouched = [s for s in range(SLOTS) if s not in live]
    before = {name: sg[name][:, untouched].clone() for name in ("temporal", "conv")}
    ssm64, conv64 = sg["temporal"].double().clone(), sg["conv"].double().clone()
    plain = sg["temporal"].clone().contiguous()  # fp32 plain decoding with the same kernels
    slots = torch.tensor(ROWS, dtype=torch.int32, device=DEVICE)

    for step in range(STEPS):
        lengths = torch.randint(1, T + 1, (len(ROWS),)).tolist()
        accepted = [int(torch.randint(1, n + 1, ())) for n in lengths]
        n = sum(lengths)
        cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
        keep = rows_of(cu, lengths, accepted)
        cu_acc = torch.tensor([0] + torch.tensor(accepted).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        batch = pool.batch(ROWS, lengths)
        for layer, p in enumerate(params):
            x = torch.randn(n, c, device=DEVICE)
            a, b = torch.randn(n, hv, device=DEVICE), torch.randn(n, hv, device=DEVICE)
            y = pool.strategy.conv_verify(layer, x, batch)
            q, k, v = split(y, n)
            o = pool.strategy.verify(layer, q, k, v, a, b, batch)

            # float64 reference: the window's outputs, then plain decoding of the accepted tokens
            weight64 = p["conv_weight"][:, 0].double().to(DEVICE)
            gates64 = (p["A_log"].double().to(DEVICE), p["dt_bias"].double().to(DEVICE))
            y64 = causal_conv_verify_reference(x.double(), conv64[layer], weight64, None, slots, batch.cu_seqlens)
            o64 = gdn_recurrence_reference(*split(y64, n), a.double(), b.double(), *gates64, ssm64[layer], slots,
                                           batch.cu_seqlens)
            torch.testing.assert_close(o.double(), o64, **TOL, msg=f"outputs, step {step}, layer {layer}")
            y64_acc = causal_conv_verify_reference(x[keep].double(), conv64[layer], weight64, None, slots, cu_acc,
                                                   update_state=True)
            gdn_recurrence_reference(*split(y64_acc, len(keep)), a[keep].double(), b[keep].double(), *gates64,
                                     ssm64[layer], slots, cu_acc, update_state=True)
            gdn_recurrence(q[keep], k[keep], v[keep], a[keep], b[keep], pool.params["A_log"][layer],
                           pool.params["dt_bias"][layer], plain[layer], slots, cu_acc, max_len=T, update_state=True,
                           backend="triton")
            # the records sit where SGLang's fold kernel reads them: [layer, slot, head, t, :]
            for i, s in enumerate(ROWS):
                if s >= 0:
                    t = torch.arange(cu[i], cu[i + 1])
                    # fp32 keys are kept normalised (normalised by each side: a few ulp); a
                    # 16-bit ring (SGLang's bf16 models) keeps them raw (ops.records.keys_normalized)
                    torch.testing.assert_close(sg["rawk"][layer, s, :, : lengths[i]],
                                               stored_keys(k[t], sg["rawk"].dtype).transpose(0, 1), rtol=1e-6, atol=1e-7)
                    assert torch.equal(sg["rawv"][layer, s, :, : lengths[i]], v[t].transpose(0, 1))
        pool.strategy.commit(batch, accepted)

        for s in live:
            state = sg["temporal"][:, s]
            assert torch.equal(state, plain[:, s]), f"step {step}: fold and plain decoding differ (slot {s})"
            torch.testing.assert_close(state.double(), ssm64[:, s], **TOL, msg=f"committed state, step {step}")
            assert torch.equal(sg["conv"][:, s].double(), conv64[:, s]), f"conv state, step {step}"
        for name, x0 in before.items():
            assert torch.equal(sg[name][:, untouched], x0), f"{name} of an untouched slot changed"
