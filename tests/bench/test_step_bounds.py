"""A decode step's parts against their bounds (``replayssm.bench.step_bounds``): which
part a profiled kernel belongs to, each part's bytes and FLOPs counted from the model's
shapes by hand here, the sums by part, and the one-line errors."""

import random
import re
from pathlib import Path

import pytest
import torch

from replayssm.bench import step_bounds as sb
from replayssm.bench.e2e import E2EConfig, load_model
from replayssm.engine.adapter import HybridEngine

SRC = Path(sb.__file__).resolve().parents[1]
#: the files whose Triton kernels are a decode step's GDN state kernels, and its conv
STATE_FILES = ("recurrent", "chunked", "fold", "snapshot", "checkpoints", "ring_decode", "cursors", "tree_ops", "guards")


def _kernels_in(path: Path) -> set[str]:
    return set(re.findall(r"^\s*def (_\w+_kernel)\(", path.read_text(), flags=re.M))


def test_every_listed_kernel_is_defined_and_every_state_kernel_is_listed():
    defined = set().union(*(_kernels_in(p) for p in SRC.rglob("*.py")))
    listed = [n for names in sb.PART_KERNELS.values() for n in names]
    assert len(listed) == len(set(listed))
    assert sorted(set(listed) - defined) == []  # a renamed kernel would fall into "other" unseen
    state = set().union(*(_kernels_in(SRC / "ops" / f"{f}.py") for f in STATE_FILES))
    assert state and sorted(state - set(sb.PART_KERNELS["gdn_state"])) == []
    assert _kernels_in(SRC / "ops" / "conv.py") == set(sb.PART_KERNELS["conv"])


@pytest.mark.parametrize("name, part", [
    ("_window_outputs_kernel", "gdn_state"),
    ("_recurrence_kernel", "gdn_state"),
    ("_conv_verify_kernel", "conv"),
    ("_slot_attention_kernel", "attention"),
    ("_rms_norm_kernel", "norms"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_128x256_64x3_tn_align2>(cut", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, __nv_bfloat16, __nv_bfloat16, float, __nv_", "matmul"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native:", "other"),
    ("_silu_mul_kernel", "other"),
    ("_emit_kernel", "other"),
])
def test_kernels_fall_into_their_parts(name, part):
    assert sb.step_part(name) == part


@pytest.fixture(scope="module")
def tiny():
    model, _, _ = load_model(E2EConfig(random_model="tiny", device="cpu", dtype="bf16"))
    return model


def _engine(model, strategy, window, ring_len=None, plain_via_ring=None, conv_ring=True):
    return HybridEngine(model, strategy=strategy, num_slots=2, window=window, max_len=64, ring_len=ring_len,
                        plain_via_ring=plain_via_ring, conv_ring=conv_ring)


def test_bounds_of_a_plain_step_counted_by_hand(tiny):
    eng = _engine(tiny, "fold", 1)
    rows, ctx = random.randint(3, 40), random.uniform(10, 500)
    copy_bw, rate = random.uniform(1e12, 5e12), random.uniform(1e14, 1e15)
    b = sb.step_bounds(eng, rows=rows, window=1, accept=1, context=ctx, copy_bw=copy_bw, matmul_rate=rate)
    assert set(b) == set(sb.STEP_PARTS) - {"other"}
    cfg = eng.config
    h, hv, k, v = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    attn = cfg.num_hidden_layers - gdn
    assert gdn == len(eng.mixers) and attn > 0
    # every nn.Linear of the model, the LM head included, once a row
    weights = sum(m.weight.numel() for m in tiny.modules() if isinstance(m, torch.nn.Linear))
    assert b["matmul"].flops == 2 * rows * weights and b["matmul"].bytes == 2 * weights
    assert b["matmul"].us == pytest.approx(max(2 * rows * weights / rate, 2 * weights / copy_bw) * 1e6)
    # fp32 states read and written once, the layer's inputs and output in bf16
    state = 2 * rows * hv * k * v * 4 + rows * (2 * h * k + 2 * hv * v + 2 * hv) * 2
    assert b["gdn_state"].bytes == gdn * state and b["gdn_state"].by == "bytes"
    assert b["gdn_state"].us == pytest.approx(gdn * state / copy_bw * 1e6)
    c = 2 * h * k + hv * v
    assert b["conv"].bytes == gdn * rows * (2 + 2 * (cfg.linear_conv_kernel_dim - 1)) * c * 2
    kvh, hd, heads = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    assert b["attention"].bytes == pytest.approx(attn * rows * (2 * kvh * hd * (ctx + 1) + 3 * heads * hd) * 2)
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    norms = rows * (2 * hidden + 8 * layers * hidden + 3 * gdn * hv * v + 2 * attn * (heads + kvh) * hd) * 2
    assert b["norms"].bytes == norms


def test_a_window_multiplies_the_rows_and_the_ring_moves_less_than_fold(tiny):
    rows, t = random.randint(3, 40), 4
    kw = dict(rows=rows, window=t, accept=3, context=100.0, copy_bw=3e12, matmul_rate=1e12)  # a slow matmul
    fold = sb.step_bounds(_engine(tiny, "fold", t), **kw)
    circ = sb.step_bounds(_engine(tiny, "circular", t, ring_len=16), **kw)
    plain = sb.step_bounds(_engine(tiny, "fold", 1), **{**kw, "window": 1, "accept": 1})
    assert fold["matmul"].flops == t * plain["matmul"].flops and fold["matmul"].by == "flops"
    assert fold["norms"].bytes == t * plain["norms"].bytes
    cfg = tiny.config
    c = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    w = cfg.linear_conv_kernel_dim
    gdn = len(_engine(tiny, "fold", t).mixers)
    # x read and y written, the history read, the window stored; on the conv ring that is all
    assert fold["conv"].bytes == gdn * rows * (2 * t + (w - 1) + t) * c * 2
    # with a window buffer, the commit reads the 3 accepted inputs back and rewrites the history
    shifted = sb.step_bounds(_engine(tiny, "fold", t, conv_ring=False), **kw)
    assert shifted["conv"].bytes == gdn * rows * (2 * t + (w - 1) + t + 3 + (w - 1)) * c * 2
    # fold reads the state twice and writes it once; circular reads it once and flushes it now and then
    assert circ["gdn_state"].bytes < fold["gdn_state"].bytes
    sbytes = rows * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    assert gdn * 3 * sbytes < fold["gdn_state"].bytes < gdn * 4 * sbytes
    assert gdn * sbytes < circ["gdn_state"].bytes  # (the tiny heads' records weigh more than a real model's)


def test_a_plain_step_through_the_ring_is_counted_as_one(tiny):
    eng = _engine(tiny, "circular", 4, ring_len=16, plain_via_ring=True)
    assert sb.step_kind(eng, 1) == "plain_ring" and sb.step_kind(eng, 4) == "circular"
    assert sb.step_kind(_engine(tiny, "fold", 1), 1) == "plain_decode"
    kw = dict(rows=8, window=1, accept=1, context=50.0, copy_bw=3e12, matmul_rate=7e14)
    ring = sb.step_bounds(eng, **kw)
    plain = sb.step_bounds(_engine(tiny, "fold", 1), **kw)
    assert ring["gdn_state"].bytes < plain["gdn_state"].bytes  # one read, the flushes amortised
    # on the conv ring: the history read and the token stored, where plain decoding rewrites the history
    assert ring["conv"].bytes < plain["conv"].bytes
    shifted = sb.step_bounds(_engine(tiny, "circular", 4, ring_len=16, plain_via_ring=True, conv_ring=False), **kw)
    assert shifted["conv"].bytes > plain["conv"].bytes  # the window buffer and the commit's shift


def test_parts_are_summed_beside_their_bounds():
    us = [random.uniform(1, 100) for _ in range(6)]
    kernels = [("_window_outputs_kernel", us[0]), ("nvjet_sm90_x", us[1]), ("_coefficients_kernel", us[2]),
               ("_silu_mul_kernel", us[3]), ("_rms_norm_kernel", us[4]), ("_emit_kernel", us[5])]
    bounds = {"matmul": sb.PartBound(1.0, 2.0, 10.0, "flops"), "gdn_state": sb.PartBound(5.0, 0.0, 20.0, "bytes"),
              "norms": sb.PartBound(1.0, 0.0, 2.0, "bytes"), "conv": sb.PartBound(1.0, 0.0, 4.0, "bytes")}
    rows = {r["part"]: r for r in sb.parts_against_bounds(kernels, bounds)}
    assert list(rows) == ["matmul", "gdn_state", "conv", "norms", "other", "total"]  # no attention: neither
    assert rows["gdn_state"]["us"] == pytest.approx(us[0] + us[2])
    assert rows["gdn_state"]["ratio"] == pytest.approx((us[0] + us[2]) / 20.0)
    assert rows["conv"]["us"] == 0 and rows["conv"]["ratio"] == 0
    assert rows["other"]["us"] == pytest.approx(us[3] + us[5]) and rows["other"]["bound_us"] is None
    assert rows["total"]["us"] == pytest.approx(sum(us)) and rows["total"]["bound_us"] == pytest.approx(36.0)
    text = sb.format_parts(list(rows.values()))
    assert len(text.splitlines()) == 7 and "flops" in text


@pytest.mark.parametrize("override, word", [
    (dict(rows=0), "rows"), (dict(window=True), "window"), (dict(accept=5), "accept"), (dict(context=-1.0), "context"),
    (dict(copy_bw=0.0), "copy_bw"), (dict(matmul_rate="fast"), "matmul_rate"),
])
def test_bad_arguments_are_named(tiny, override, word):
    kw = dict(rows=4, window=4, accept=3, context=10.0, copy_bw=3e12, matmul_rate=7e14) | override
    with pytest.raises(ValueError, match=word):
        sb.step_bounds(_engine(tiny, "fold", 4), **kw)


def test_a_kernel_name_must_be_a_string():
    with pytest.raises(TypeError, match="kernel"):
        sb.step_part(3)
