"""``replayssm bench memory``: the byte accounting must be the pool's own, the model
configs the published ones, and the request counts what the budget allows."""

import json
import random

import pytest
import torch

from replayssm import cli
from replayssm.bench import memory
from replayssm.state import GDNShape, StatePool
from replayssm.strategies import STRATEGY_NAMES

STRATEGIES = STRATEGY_NAMES


@pytest.fixture(autouse=True)
def _seed_random(_seed):
    random.seed(torch.initial_seed())


def random_shape():
    h = random.choice([1, 2, 3])
    return GDNShape(
        num_heads=h, num_value_heads=h * random.choice([1, 2, 4]), head_k_dim=random.choice([8, 16, 24]),
        head_v_dim=random.choice([8, 16, 32]), conv_kernel=random.choice([2, 3, 4]),
    )


@pytest.mark.parametrize("conv_ring", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_accounting_equals_a_real_pool(strategy, state_dtype, conv_ring):
    shape = random_shape()
    window = random.randint(1, 4)
    ring_len = 2 ** random.randint((2 * window - 1).bit_length(), 5)
    layers, slots = random.randint(1, 4), random.randint(1, 5)
    pool = StatePool(shape, layers, slots, strategy=strategy, window=window, ring_len=ring_len,
                     state_dtype=state_dtype, act_dtype=torch.bfloat16, conv_ring=conv_ring)
    b = memory.gdn_bytes(shape, strategy, window=window, ring_len=ring_len, state_dtype=state_dtype, act_dtype=torch.bfloat16,
                         conv_ring=conv_ring)
    real = pool.nbytes()
    assert real["total"] == slots * (layers * b["per_layer_total"] + b["per_request_total"])
    for name, n in real.items():
        if name == "total":
            continue
        assert n == slots * (layers * b["per_layer"].get(name, 0) + b["per_request"].get(name, 0)), name
    # DESIGN.md section 4: the snapshot scratch is T * HV * V * K state elements per layer
    if strategy == "snapshot":
        elem = torch.empty((), dtype=state_dtype).element_size()
        assert b["per_layer"]["snapshots"] == window * shape.state_numel * elem
    conv = {"conv_pos": 4} if conv_ring else {}  # one int32 position a request, whatever the layers
    if strategy == "circular":
        assert b["per_request"] == {"write_pos": 4, "cache_base": 4, "is_flush": 4, "first_cycle": 4, **conv}
    else:
        assert b["per_request"] == conv


def test_plain_is_checkpoint_and_conv_state():
    shape = random_shape()
    pool = StatePool(shape, 1, 1, strategy="fold", window=2, act_dtype=torch.bfloat16)
    per = pool.nbytes_per_slot()
    b = memory.gdn_bytes(shape, "plain", window=2, ring_len=4, state_dtype=torch.float32, act_dtype=torch.bfloat16)
    assert b["per_layer"] == {"checkpoints": per["checkpoints"], "conv_state": per["conv_state"]}
    assert b["per_request_total"] == 0
    assert per["checkpoints"] == shape.state_numel * 4
    assert per["conv_state"] == shape.conv_dim * (shape.conv_kernel - 1) * 2


def next_power_of_two(n):
    r = 1
    while r < n:
        r *= 2
    return r


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_conv_ring_is_c_by_r_a_layer_and_one_position_a_request(strategy):
    """The engine's layout (DESIGN.md section 3, "Conv ring"): ``conv_state [C, R]``,
    ``R`` the least power of two >= ``T + W - 1``, no window buffer, and ``conv_pos``
    once per request, 4 bytes. The classic layout: ``[C, W - 1]`` and ``[T, C]``."""
    shape = random_shape()
    window = random.randint(1, 8)
    ring_len = next_power_of_two(2 * window)
    elem = 2  # bf16 activations
    c, w = shape.conv_dim, shape.conv_kernel
    kw = dict(window=window, ring_len=ring_len, state_dtype=torch.float32, act_dtype=torch.bfloat16)
    ring = memory.gdn_bytes(shape, strategy, conv_ring=True, **kw)
    classic = memory.gdn_bytes(shape, strategy, conv_ring=False, **kw)
    r = next_power_of_two(window + w - 1)
    assert ring["per_layer"]["conv_state"] == c * r * elem
    assert "conv_window" not in ring["per_layer"] and "conv_pos" not in ring["per_layer"]
    assert ring["per_request"]["conv_pos"] == 4
    assert classic["per_layer"]["conv_state"] == c * (w - 1) * elem
    assert classic["per_layer"]["conv_window"] == window * c * elem
    assert "conv_pos" not in classic["per_request"]
    # the conv buffers are all that differ
    others = {k: v for k, v in ring["per_layer"].items() if k != "conv_state"}
    assert others == {k: v for k, v in classic["per_layer"].items() if k not in ("conv_state", "conv_window")}
    assert ring["per_layer_total"] - classic["per_layer_total"] == c * (r - (w - 1) - window) * elem
    assert ring["per_request_total"] - classic["per_request_total"] == 4


def test_plain_is_the_classic_conv_state_in_both_layouts():
    shape = random_shape()
    kw = dict(window=random.randint(1, 8), ring_len=16, state_dtype=torch.float32, act_dtype=torch.bfloat16)
    ring = memory.gdn_bytes(shape, "plain", conv_ring=True, **kw)
    assert ring == memory.gdn_bytes(shape, "plain", conv_ring=False, **kw)
    assert ring["per_layer"] == {"checkpoints": shape.state_numel * 4,
                                 "conv_state": shape.conv_dim * (shape.conv_kernel - 1) * 2}
    assert ring["per_request"] == {}


def test_table_counts_the_conv_layout_it_says():
    """Qwen3.5-35B-A3B at TP1, T = 4: C = 2 * 16 * 128 + 32 * 128 = 8192 channels, a ring
    of 8 entries against 3 + 4 in each of 30 layers, bf16, and one int32 position."""
    base = dict(models=("qwen3.5-35b-a3b",), contexts=(4096,), window=4, ring_len=16, tp=1, budget_gib=50.0)
    tables = {ring: memory.memory_table(memory.MemoryConfig(conv_ring=ring, **base), memory.MODELS) for ring in (True, False)}
    rows = {ring: {r["strategy"]: r for r in t["rows"]} for ring, t in tables.items()}
    assert tables[True]["config"]["conv_ring"] is True and tables[False]["config"]["conv_ring"] is False
    assert tables[True]["models"]["qwen3.5-35b-a3b"]["conv_entries"] == 8
    assert tables[False]["models"]["qwen3.5-35b-a3b"]["conv_entries"] == 7
    for s in STRATEGIES:
        assert rows[True][s]["conv_layout"] == "ring" and rows[False][s]["conv_layout"] == "classic"
        assert rows[True][s]["gdn_bytes_per_request"] - rows[False][s]["gdn_bytes_per_request"] == 30 * 8192 * 2 + 4
        assert rows[True][s]["gdn_buffers_per_layer"]["conv_state"] == 8192 * 8 * 2
        assert rows[False][s]["gdn_buffers_per_layer"]["conv_state"] + rows[False][s]["gdn_buffers_per_layer"]["conv_window"] \
            == 8192 * (3 + 4) * 2
        # the ring of records is the strategy's; the conv ring's position is not in it
        assert rows[True][s]["ring_bytes_per_request"] == rows[False][s]["ring_bytes_per_request"]
    assert rows[True]["plain"] == {**rows[False]["plain"], "conv_layout": "classic"}
    assert rows[True]["plain"]["gdn_bytes_per_request"] == 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)


def published_config(layers, value_heads, attn_heads):
    """The fields of a Qwen3.5 MoE config.json that the memory model reads."""
    return {
        "model_type": "qwen3_5_moe",
        "text_config": {
            "num_hidden_layers": layers,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
            "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": value_heads,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "num_attention_heads": attn_heads, "num_key_value_heads": 2, "head_dim": 256,
        },
    }


@pytest.mark.parametrize("key,layers,value_heads,attn_heads", [
    ("qwen3.5-35b-a3b", 40, 32, 16), ("qwen3.5-122b-a10b", 48, 64, 32),
])
def test_builtin_models_match_their_configs(key, layers, value_heads, attn_heads):
    spec = memory.spec_from_hf_config(published_config(layers, value_heads, attn_heads), "x")
    builtin = memory.MODELS[key]
    for field in ("gdn_layers", "attention_layers", "num_heads", "num_value_heads", "head_k_dim", "head_v_dim",
                  "conv_kernel", "kv_heads", "attn_head_dim"):
        assert getattr(spec, field) == getattr(builtin, field), field
    assert spec.gdn_layers + spec.attention_layers == layers
    # without layer_types, the interval decides
    cfg = published_config(layers, value_heads, attn_heads)
    del cfg["text_config"]["layer_types"]
    assert memory.spec_from_hf_config(cfg, "x").attention_layers == layers // 4


def test_hf_config_errors_name_the_field():
    cfg = published_config(40, 32, 16)
    del cfg["text_config"]["linear_num_value_heads"]
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        memory.spec_from_hf_config(cfg, "x")
    cfg = published_config(40, 32, 16)
    cfg["text_config"]["layer_types"][0] = "mamba"
    with pytest.raises(ValueError, match="layer_types"):
        memory.spec_from_hf_config(cfg, "x")
    with pytest.raises(TypeError, match="config"):
        memory.spec_from_hf_config([], "x")


def test_kv_bytes_per_token_replicates_heads_past_tp():
    m = memory.MODELS["qwen3.5-35b-a3b"]
    bf16 = torch.bfloat16
    assert memory.kv_bytes_per_token(m, tp=1, kv_dtype=bf16) == 10 * 2 * 2 * 256 * 2
    assert memory.kv_bytes_per_token(m, tp=2, kv_dtype=bf16) == 10 * 2 * 1 * 256 * 2
    assert memory.kv_bytes_per_token(m, tp=8, kv_dtype=bf16) == 10 * 2 * 1 * 256 * 2  # replicated
    assert memory.kv_bytes_per_token(m, tp=1, kv_dtype=torch.float8_e4m3fn) == 10 * 2 * 2 * 256


def test_table_counts_what_fits():
    gpu = random.uniform(60, 200)
    frac = random.uniform(0.5, 0.95)
    ctx = random.randint(1, 65536)
    cfg = memory.MemoryConfig(contexts=(ctx,), gpu_gib=gpu, mem_fraction=frac, tp=None)
    result = memory.memory_table(cfg, memory.MODELS)
    assert len(result["rows"]) == len(memory.MODELS) * 4
    for key, m in result["models"].items():
        spec = memory.MODELS[key]
        assert m["tp"] == spec.default_tp
        assert m["budget_bytes"] == int(gpu * 2**30 * frac) - spec.weight_bytes // spec.default_tp
    for r in result["rows"]:
        spec = memory.MODELS[r["model_key"]]
        assert r["bytes_per_request"] == r["gdn_bytes_per_request"] + r["kv_bytes_per_request"]
        assert r["kv_bytes_per_request"] == ctx * memory.kv_bytes_per_token(spec, tp=r["tp"], kv_dtype=torch.bfloat16)
        assert r["gdn_bytes_per_request"] == spec.gdn_layers * r["gdn_bytes_per_layer"] + r["gdn_bytes_per_request_fixed"]
        n = r["max_requests"]
        if r["budget_bytes"] > 0:
            assert n * r["bytes_per_request"] <= r["budget_bytes"] < (n + 1) * r["bytes_per_request"]
        else:
            assert n == 0
    # the scratch ranks the strategies: snapshot needs the most, plain the least
    for key in memory.MODELS:
        per = {r["strategy"]: r["bytes_per_request"] for r in result["rows"] if r["model_key"] == key}
        assert per["plain"] < per["fold"] < per["circular"] < per["snapshot"]


def test_rows_report_the_ring_bytes_per_request():
    """``ring_bytes_per_request``: circular's L records (k normalised in fp32, v in bf16,
    fp32 g, beta and u) in every GDN layer plus four int32 cursors (the last the
    first-flush flag); fold's T records; none for plain and snapshot. Counted by hand from
    DESIGN.md section 8's table."""
    L, T = random.choice([8, 16, 32]), random.choice([2, 4])
    cfg = memory.MemoryConfig(models=("qwen3.5-35b-a3b",), contexts=(1024,), window=T, ring_len=L, tp=1)
    rows = {r["strategy"]: r for r in memory.memory_table(cfg, memory.MODELS)["rows"]}
    m = memory.MODELS["qwen3.5-35b-a3b"]
    h, hv, kd, vd = m.num_heads, m.num_value_heads, m.head_k_dim, m.head_v_dim
    raw = h * kd * 4 + hv * vd * 2 + 2 * hv * 4
    assert rows["circular"]["ring_bytes_per_request"] == m.gdn_layers * L * (raw + hv * vd * 4) + 4 * 4
    assert rows["fold"]["ring_bytes_per_request"] == m.gdn_layers * T * raw
    assert rows["plain"]["ring_bytes_per_request"] == rows["snapshot"]["ring_bytes_per_request"] == 0
    assert rows["circular"]["ring_bytes_per_request"] < rows["circular"]["gdn_bytes_per_request"]


def test_explicit_budget_and_tp():
    budget = random.uniform(1, 50)
    cfg = memory.MemoryConfig(models=("qwen3.5-35b-a3b",), contexts=(0,), budget_gib=budget, tp=2)
    result = memory.memory_table(cfg, memory.MODELS)
    m = result["models"]["qwen3.5-35b-a3b"]
    assert m["tp"] == 2 and m["gdn_shape_per_gpu"]["num_value_heads"] == 16
    for r in result["rows"]:
        assert r["budget_bytes"] == int(budget * 2**30)
        assert r["max_requests"] == int(budget * 2**30) // r["bytes_per_request"]
    with pytest.raises(ValueError, match="tp"):
        memory.memory_table(memory.MemoryConfig(tp=3), memory.MODELS)


@pytest.mark.parametrize("field,value", [
    ("window", 0), ("tp", 0), ("mem_fraction", 1.5), ("budget_gib", -1.0), ("state_dtype", "fp16"),
    ("act_dtype", "fp8"), ("contexts", ()), ("strategies", ("ring",)), ("conv_ring", "ring"), ("conv_ring", 1),
])
def test_config_errors_name_the_field(field, value):
    cfg = memory.MemoryConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        cfg.check()


def test_cli_writes_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "memory.json", tmp_path / "memory.png"
    ctx = random.randint(100, 9000)
    rc = cli.main(["bench", "memory", "--context", f"{ctx},{2 * ctx}", "--gpu-gib", "139.7", "--json", str(js), "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Qwen3.5-35B-A3B" in out and "Qwen3.5-122B-A10B" in out and "max requests" in out
    data = json.loads(js.read_text())
    assert data["tool"] == "replayssm bench memory"
    assert {(r["model_key"], r["context"], r["strategy"]) for r in data["rows"]} == {
        (m, c, s) for m in memory.MODELS for c in (ctx, 2 * ctx) for s in ("plain",) + STRATEGIES
    }
    assert all(r["max_requests"] > 0 for r in data["rows"])  # both models fit an H200 at their default TP
    assert data["config"]["conv_ring"] is True  # the engine's layout unless told
    assert "conv ring" in out.splitlines()[0] and "C=8192 x R=8" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reads_a_hf_config(tmp_path, capsys):
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(published_config(24, 32, 16)))
    js = tmp_path / "m.json"
    rc = cli.main(["bench", "memory", "--config", str(path), "--budget-gib", "10", "--strategies", "snapshot,circular",
                   "--context", "1024", "--json", str(js)])
    assert rc == 0
    rows = json.loads(js.read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["snapshot", "circular"]
    assert rows[0]["model"] == "my-model" and rows[0]["tp"] == 1
    assert rows[0]["gdn_bytes_per_request"] == 18 * rows[0]["gdn_bytes_per_layer"] + 4  # snapshot: conv_pos alone a request


def test_cli_rejects_bad_settings(capsys):
    assert cli.main(["bench", "memory", "--tp", "3"]) == 2
    assert "divisible" in capsys.readouterr().err
    assert cli.main(["bench", "memory", "--ring-len", "12"]) == 2
    assert "ring_len" in capsys.readouterr().err


def test_cli_conv_layout(tmp_path, capsys):
    js = tmp_path / "classic.json"
    argv = ["bench", "memory", "--models", "qwen3.5-35b-a3b", "--context", "1024", "--budget-gib", "20"]
    assert cli.main([*argv, "--conv-layout", "classic", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "classic conv" in out.splitlines()[0] and "C=8192 x (3 + 4)" in out
    classic = json.loads(js.read_text())
    assert classic["config"]["conv_ring"] is False
    assert cli.main([*argv, "--conv-layout", "ring", "--json", str(js)]) == 0
    capsys.readouterr()
    ring = json.loads(js.read_text())
    assert ring["config"]["conv_ring"] is True
    by = {r["strategy"]: r["gdn_bytes_per_request"] for r in classic["rows"]}
    for r in ring["rows"]:
        extra = 0 if r["strategy"] == "plain" else 30 * 8192 * 2 + 4
        assert r["gdn_bytes_per_request"] - by[r["strategy"]] == extra, r["strategy"]
    # a bad value: argparse's one line, status 2
    assert cli.main([*argv, "--conv-layout", "flat"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("replayssm bench memory: error: argument --conv-layout: invalid choice: 'flat'"), err
