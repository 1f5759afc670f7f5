"""``replayssm bench memory``: bytes per request per strategy, and how many requests fit.

For each model and strategy: the GDN state bytes one request occupies per layer (the
:class:`~replayssm.state.StatePool`'s own accounting, taken from a pool on the ``meta``
device, so nothing is allocated and the numbers cannot disagree with a real pool), the
same over all GDN layers, the KV cache of the full-attention layers at the given
context length, and the number of concurrent requests that fit in a memory budget.

``plain`` is decoding without speculation: checkpoint and the classic conv state
``[C, W - 1]`` only, whatever the conv layout (a step of one token keeps no window). The
strategies add what DESIGN.md section 4 says: ``snapshot`` a ``[T, HV, V, K]`` scratch,
``fold`` a ``T``-record raw ring, ``circular`` an ``L``-record ring plus the records'
float32 ``u``; every speculative pool also keeps the window's conv inputs. Each row
also gives the ring's share (``ring/request``: the records of every GDN layer and the
cursors), which is also what plain decoding through ``circular``'s ring (DESIGN.md
section 9) costs a request beside its checkpoints.

Conv layout (``MemoryConfig.conv_ring``, ``--conv-layout``). By default the speculative
pools are counted as the engine keeps them (``HybridEngine(conv_ring=True)``, DESIGN.md
section 3, "Conv ring"): a request's ``W - 1`` committed conv inputs and its window's
``T`` are one ring per layer, ``conv_state [C, R]`` with ``R`` the least power of two
of at least ``T + W - 1`` (:func:`~replayssm.state.pool.conv_ring_len`), plus one int32
``conv_pos`` per request, shared by the layers (a ``per_request`` buffer, like the
cursors; not part of ``ring/request``, which counts the records' ring). The classic
layout (``conv_ring=False``) keeps ``conv_state [C, W - 1]`` and a ``conv_window [T, C]``
beside it. The ring costs the rounding up to a power of two: at ``T = 4``, ``W = 4`` it
is 8 entries a channel and layer against 3 + 4 (one more, 2 bytes a channel in bf16),
plus 4 bytes a request; at ``T = 16`` (a 16-node tree) 32 against 3 + 16.

The budget is ``--budget-gib`` if given, else ``--mem-fraction`` of ``--gpu-gib`` minus
the weights' share of one GPU (weights / TP). Not counted: activations, CUDA graphs,
the allocator's slack, the draft model's own state, and the KV of the ``T`` draft
positions (a few tokens). With tensor parallelism the GDN heads and the KV heads are
split across GPUs (KV heads are replicated when TP exceeds their number); all figures
are per GPU.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import torch

from ..state import GDNShape, StatePool
from ..state.pool import conv_ring_len
from ..strategies import STRATEGY_NAMES

PLAIN = "plain"
#: the buffers of a strategy's ring of records (and its cursors), DESIGN.md section 8
RING_BUFFERS = ("ring_k", "ring_v", "ring_g", "ring_beta", "ring_u", "write_pos", "cache_base", "is_flush", "first_cycle")
#: ``--conv-layout`` -> ``MemoryConfig.conv_ring``: the engine's conv ring, or state + window
CONV_LAYOUTS = {"ring": True, "classic": False}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
GIB = 2**30
MIB = 2**20

#: memory of one H200 as torch reports it (``total_memory``), in GiB
H200_GIB = 139.7


@dataclass(frozen=True)
class ModelSpec:
    """What the memory of a hybrid GDN / attention model depends on.

    Attributes:
        name: display name.
        gdn_layers: number of Gated DeltaNet (linear attention) layers.
        attention_layers: number of full-attention layers (they keep a KV cache).
        num_heads, num_value_heads, head_k_dim, head_v_dim, conv_kernel: the GDN layer
            (``linear_num_key_heads``, ``linear_num_value_heads``,
            ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``).
        kv_heads, attn_head_dim: the full-attention layers' KV heads and head size.
        weight_bytes: size of the weights in memory (``None``: unknown).
        source: where the numbers come from.
        default_tp: tensor-parallel degree used unless ``--tp`` is given: the smallest
            power of two at which the weights leave room for requests on an H200.
    """

    name: str
    gdn_layers: int
    attention_layers: int
    num_heads: int
    num_value_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    kv_heads: int
    attn_head_dim: int
    weight_bytes: int | None
    source: str
    default_tp: int = 1


# Values from the public Hugging Face configs of the Qwen3.5 MoE checkpoints
# (model_type qwen3_5_moe, text part). Both use full_attention_interval 4: every fourth
# layer is full attention, the rest are Gated DeltaNet.
# - Qwen/Qwen3.5-35B-A3B: num_hidden_layers 40 (30 GDN + 10 attention),
#   linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128,
#   linear_value_head_dim 128, linear_conv_kernel_dim 4; num_attention_heads 16,
#   num_key_value_heads 2, head_dim 256. The model card lists the same layout
#   ("10 x (3 x (Gated DeltaNet -> MoE) -> 1 x (Gated Attention -> MoE))").
#   The BF16 checkpoint is about 72 GB (vision encoder and MTP head included).
# - Qwen/Qwen3.5-122B-A10B: num_hidden_layers 48 (36 GDN + 12 attention),
#   linear_num_key_heads 16, linear_num_value_heads 64, head dims 128, conv kernel 4;
#   num_attention_heads 32, num_key_value_heads 2, head_dim 256; 122.1B parameters,
#   BF16 checkpoint about 250 GB.
MODELS = {
    "qwen3.5-35b-a3b": ModelSpec(
        name="Qwen3.5-35B-A3B", gdn_layers=30, attention_layers=10, num_heads=16, num_value_heads=32,
        head_k_dim=128, head_v_dim=128, conv_kernel=4, kv_heads=2, attn_head_dim=256,
        weight_bytes=72 * 10**9, source="Qwen/Qwen3.5-35B-A3B config.json; weights: BF16 checkpoint size (about 72 GB)",
    ),
    "qwen3.5-122b-a10b": ModelSpec(
        name="Qwen3.5-122B-A10B", gdn_layers=36, attention_layers=12, num_heads=16, num_value_heads=64,
        head_k_dim=128, head_v_dim=128, conv_kernel=4, kv_heads=2, attn_head_dim=256,
        weight_bytes=250 * 10**9, source="Qwen/Qwen3.5-122B-A10B config.json; weights: BF16 checkpoint size (about 250 GB)",
        # 233 GiB of weights: TP2 leaves ~9 GiB per H200 for requests, TP4 ~67 GiB
        default_tp=4,
    ),
}


def spec_from_hf_config(config: dict, name: str, *, weight_bytes: int | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` of a Qwen3.5 / Qwen3-Next
    style model (the text part is taken from ``text_config`` when present).

    Layer kinds come from ``layer_types`` if present, else from
    ``full_attention_interval`` (every ``n``-th layer is full attention).

    Raises:
        ValueError: a required field is missing or malformed (named in the message).
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    def need(key):
        value = text.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config field {key!r} must be a positive int, got {value!r}")
        return value

    layers = need("num_hidden_layers")
    types = text.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ValueError(f"config field 'layer_types' must list {layers} layer types")
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown:
            raise ValueError(f"config field 'layer_types' has unknown kinds {unknown}")
        attention = sum(t == "full_attention" for t in types)
    else:
        interval = need("full_attention_interval")
        attention = layers // interval
    head_dim = text.get("head_dim") or (need("hidden_size") // need("num_attention_heads"))
    return ModelSpec(
        name=name, gdn_layers=layers - attention, attention_layers=attention,
        num_heads=need("linear_num_key_heads"), num_value_heads=need("linear_num_value_heads"),
        head_k_dim=need("linear_key_head_dim"), head_v_dim=need("linear_value_head_dim"),
        conv_kernel=text.get("linear_conv_kernel_dim", 4), kv_heads=need("num_key_value_heads"),
        attn_head_dim=int(head_dim), weight_bytes=weight_bytes, source="config.json",
    )


# ---------------------------------------------------------------------- accounting
def gdn_bytes(shape: GDNShape, strategy: str, *, window: int, ring_len: int, state_dtype, act_dtype,
              conv_ring: bool = False) -> dict:
    """Per-request bytes of ``strategy`` from the pool's own accounting, no allocation.

    Returns ``{"per_layer": {buffer: bytes, ...}, "per_request": {buffer: bytes, ...},
    "per_layer_total": int, "per_request_total": int}``: ``per_layer`` buffers are
    repeated in every GDN layer, ``per_request`` ones (the cursors, and ``conv_pos``
    with ``conv_ring``) exist once per request. ``strategy`` may be ``"plain"``
    (checkpoint ``[HV, V, K]`` and conv state ``[C, W - 1]`` only).

    ``conv_ring`` is :class:`~replayssm.state.StatePool`'s (and its default): ``True``
    counts ``conv_state [C, R]`` and ``conv_pos`` instead of ``conv_state [C, W - 1]``
    and ``conv_window [T, C]``. ``plain`` ignores it: without speculation the classic
    ``W - 1`` state is all a request needs.
    """
    if not isinstance(conv_ring, bool):
        raise TypeError(f"conv_ring must be a bool, got {type(conv_ring).__name__}")
    name = "snapshot" if strategy == PLAIN else strategy
    kw = dict(strategy=name, window=window, ring_len=ring_len, state_dtype=state_dtype, act_dtype=act_dtype, device="meta",
              conv_ring=conv_ring and strategy != PLAIN)
    # A one- and a two-layer pool of one slot: the difference is what one layer costs,
    # the rest what a request costs whatever the number of layers.
    one = StatePool(shape, 1, 1, **kw).nbytes_per_slot()
    two = StatePool(shape, 2, 1, **kw).nbytes_per_slot()
    per_layer, per_request = {}, {}
    for buf in one:
        if buf == "total":
            continue
        layer_part = two[buf] - one[buf]
        if layer_part:
            per_layer[buf] = layer_part
        if one[buf] - layer_part:
            per_request[buf] = one[buf] - layer_part
    if strategy == PLAIN:
        per_layer = {k: per_layer[k] for k in ("checkpoints", "conv_state")}
        per_request = {}
    return {
        "per_layer": per_layer,
        "per_request": per_request,
        "per_layer_total": sum(per_layer.values()),
        "per_request_total": sum(per_request.values()),
    }


def ring_bytes(b: dict, gdn_layers: int) -> int:
    """Bytes of the ring of records one request holds over ``gdn_layers`` layers, cursors
    included, from a :func:`gdn_bytes` result (0 for a strategy without a ring)."""
    per_layer = sum(b["per_layer"].get(n, 0) for n in RING_BUFFERS)
    return gdn_layers * per_layer + sum(b["per_request"].get(n, 0) for n in RING_BUFFERS)


def kv_bytes_per_token(model: ModelSpec, *, tp: int, kv_dtype) -> int:
    """KV cache bytes per token of one request, per GPU: K and V of every
    full-attention layer, ``ceil(kv_heads / tp)`` heads each (replicated past TP = heads)."""
    heads = math.ceil(model.kv_heads / tp)
    return model.attention_layers * 2 * heads * model.attn_head_dim * torch.empty((), dtype=kv_dtype).element_size()


@dataclass
class MemoryConfig:
    """What ``replayssm bench memory`` counts (one field per option, :meth:`check`
    validates them); ``conv_ring`` is ``--conv-layout`` (``True``: ring)."""

    models: tuple[str, ...] = tuple(MODELS)
    strategies: tuple[str, ...] = (PLAIN,) + STRATEGY_NAMES
    window: int = 4
    ring_len: int = 16
    contexts: tuple[int, ...] = (4096, 32768)
    state_dtype: str = "fp32"
    act_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    tp: int | None = None  # None: each model's default_tp
    gpu_gib: float = H200_GIB
    mem_fraction: float = 0.9
    budget_gib: float | None = None
    weights_gib: float | None = None  # override of the models' weight size
    # the speculative pools' conv layout: the engine's ring (its default) or the classic
    # state + window; plain is always counted with the classic W - 1 state
    conv_ring: bool = True

    def check(self) -> None:
        if not isinstance(self.conv_ring, bool):
            raise ValueError(f"conv_ring must be a bool, got {self.conv_ring!r}")
        for name in ("window", "ring_len", "tp"):
            v = getattr(self, name)
            if name == "tp" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not self.contexts or any(not isinstance(c, int) or c < 0 for c in self.contexts):
            raise ValueError(f"contexts must be non-negative ints, got {list(self.contexts)}")
        for name in ("state_dtype", "act_dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {sorted(DTYPES)}, got {getattr(self, name)!r}")
        if self.state_dtype not in ("fp32", "bf16"):
            raise ValueError(f"state_dtype must be fp32 or bf16, got {self.state_dtype!r}")
        if self.act_dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"act_dtype must be bf16, fp16 or fp32, got {self.act_dtype!r}")
        bad = [s for s in self.strategies if s not in (PLAIN,) + STRATEGY_NAMES]
        if bad or not self.strategies:
            raise ValueError(f"strategies must be names from {(PLAIN,) + STRATEGY_NAMES}, got {list(self.strategies)}")
        if not self.models:
            raise ValueError("models must name at least one model")
        if not self.gpu_gib > 0:
            raise ValueError(f"gpu_gib must be positive, got {self.gpu_gib}")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.budget_gib is not None and not self.budget_gib > 0:
            raise ValueError(f"budget_gib must be positive, got {self.budget_gib}")
        if self.weights_gib is not None and not self.weights_gib >= 0:
            raise ValueError(f"weights_gib must be non-negative, got {self.weights_gib}")


def conv_layout(conv_ring: bool) -> str:
    """The ``--conv-layout`` name of ``conv_ring``: ``"ring"`` or ``"classic"``."""
    return next(name for name, ring in CONV_LAYOUTS.items() if ring == conv_ring)


def budget_bytes(cfg: MemoryConfig, model: ModelSpec, tp: int) -> tuple[int, int | None, str]:
    """``(budget, weight bytes per GPU, how the budget was made)`` for one model at
    tensor-parallel degree ``tp``."""
    if cfg.weights_gib is not None:
        weights = int(cfg.weights_gib * GIB)
    else:
        weights = model.weight_bytes
    per_gpu = None if weights is None else weights // tp
    if cfg.budget_gib is not None:
        return int(cfg.budget_gib * GIB), per_gpu, f"--budget-gib {cfg.budget_gib}"
    if per_gpu is None:
        raise ValueError(f"{model.name}: weight size unknown; give --weights-gib or --budget-gib")
    budget = int(cfg.gpu_gib * GIB * cfg.mem_fraction) - per_gpu
    how = f"{cfg.mem_fraction:g} x {cfg.gpu_gib:g} GiB - {per_gpu / GIB:.1f} GiB weights/GPU"
    return budget, per_gpu, how


def memory_table(cfg: MemoryConfig, specs: dict[str, ModelSpec]) -> dict:
    """All rows of the memory benchmark (see the module doc); JSON-ready."""
    cfg.check()
    rows, models = [], {}
    for key in cfg.models:
        model = specs[key]
        tp = cfg.tp or model.default_tp
        for name, heads in (("linear_num_key_heads", model.num_heads), ("linear_num_value_heads", model.num_value_heads)):
            if heads % tp:
                raise ValueError(f"{model.name}: {name} = {heads} is not divisible by tp = {tp}")
        shape = GDNShape(
            num_heads=model.num_heads // tp, num_value_heads=model.num_value_heads // tp,
            head_k_dim=model.head_k_dim, head_v_dim=model.head_v_dim, conv_kernel=model.conv_kernel,
        )
        budget, weights, how = budget_bytes(cfg, model, tp)
        kv_tok = kv_bytes_per_token(model, tp=tp, kv_dtype=DTYPES[cfg.kv_dtype])
        # conv entries a channel and layer of a speculative request: the ring's R, or W - 1 + T
        conv_entries = (conv_ring_len(cfg.window, shape.conv_kernel) if cfg.conv_ring
                        else shape.conv_kernel - 1 + cfg.window)
        models[key] = {**asdict(model), "tp": tp, "budget_bytes": budget, "budget": how, "weight_bytes_per_gpu": weights,
                       "kv_bytes_per_token": kv_tok, "gdn_shape_per_gpu": asdict(shape), "conv_dim_per_gpu": shape.conv_dim,
                       "conv_entries": conv_entries}
        per_strategy = {
            s: gdn_bytes(shape, s, window=cfg.window, ring_len=cfg.ring_len, state_dtype=DTYPES[cfg.state_dtype],
                         act_dtype=DTYPES[cfg.act_dtype], conv_ring=cfg.conv_ring)
            for s in cfg.strategies
        }
        for ctx in cfg.contexts:
            snapshot_max = None
            for s in cfg.strategies:
                b = per_strategy[s]
                gdn = b["per_layer_total"] * model.gdn_layers + b["per_request_total"]
                total = gdn + kv_tok * ctx
                max_req = max(0, budget // total)
                row = {
                    "model": model.name, "model_key": key, "tp": tp, "context": ctx, "strategy": s,
                    "conv_layout": conv_layout(cfg.conv_ring and s != PLAIN),
                    "gdn_bytes_per_layer": b["per_layer_total"], "gdn_buffers_per_layer": b["per_layer"],
                    "gdn_bytes_per_request_fixed": b["per_request_total"],
                    "gdn_bytes_per_request": gdn, "kv_bytes_per_request": kv_tok * ctx,
                    "ring_bytes_per_request": ring_bytes(b, model.gdn_layers),
                    "bytes_per_request": total, "budget_bytes": budget, "max_requests": int(max_req),
                }
                if s == "snapshot":
                    snapshot_max = max_req
                rows.append(row)
            for row in rows:
                if row["model_key"] == key and row["context"] == ctx:
                    row["vs_snapshot"] = (row["max_requests"] / snapshot_max) if snapshot_max else None
    return {
        "tool": "replayssm bench memory",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(cfg), "models": list(cfg.models), "strategies": list(cfg.strategies), "contexts": list(cfg.contexts)},
        "models": models,
        "rows": rows,
    }


def _gib(n) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.2f} MiB" if abs(n) >= MIB else f"{n / 1024:.1f} KiB"


def print_table(result: dict, file=None) -> None:
    """Print a :func:`memory_table` result: the settings and the conv layout counted,
    then per model its shapes, budget and one line per strategy and context."""
    file = file or sys.stdout
    cfg = result["config"]
    conv_ring = cfg["conv_ring"]
    print(
        f"replayssm bench memory: T={cfg['window']}, L={cfg['ring_len']}, {cfg['state_dtype']} state, "
        f"{cfg['act_dtype']} activations, {cfg['kv_dtype']} KV, {'conv ring' if conv_ring else 'classic conv'} "
        f"(figures per GPU)",
        file=file,
    )
    if conv_ring:
        print("conv ring (--conv-layout ring, the engine's): the speculative strategies keep each layer's conv inputs as "
              "one ring [C, R], R the least power of two >= T + W - 1, and a 4-byte position per request (in GDN/request, "
              "not ring/request); plain keeps [C, W - 1]", file=file)
    else:
        print("classic conv (--conv-layout classic; the engine's is ring): the speculative strategies keep each layer's "
              "conv state [C, W - 1] and the window's inputs [T, C]; plain keeps [C, W - 1]", file=file)
    print("ring/request: the ring of records and its cursors over every GDN layer (part of GDN/request); plain "
          "decoding through circular's ring (bench e2e --plain-ring) holds circular's", file=file)
    for key, m in result["models"].items():
        sh = m["gdn_shape_per_gpu"]
        entries = f"R={m['conv_entries']}" if conv_ring else f"({sh['conv_kernel'] - 1} + {cfg['window']})"
        print(
            f"\n{m['name']} at TP{m['tp']}: {m['gdn_layers']} GDN layers (H={sh['num_heads']} HV={sh['num_value_heads']} "
            f"K={sh['head_k_dim']} V={sh['head_v_dim']} per GPU, conv C={m['conv_dim_per_gpu']} x {entries}), "
            f"{m['attention_layers']} attention layers "
            f"({_gib(m['kv_bytes_per_token'])}/token of KV); budget {_gib(m['budget_bytes'])} ({m['budget']})",
            file=file,
        )
        print(
            f"  {'strategy':<9} {'context':>8} {'GDN/layer':>11} {'GDN/request':>12} {'ring/request':>13} "
            f"{'KV/request':>11} {'total/request':>14} {'max requests':>13} {'vs snapshot':>12}",
            file=file,
        )
        for r in (r for r in result["rows"] if r["model_key"] == key):
            vs = "-" if r.get("vs_snapshot") is None else f"{r['vs_snapshot']:.2f}x"
            ring = _gib(r["ring_bytes_per_request"]) if r["ring_bytes_per_request"] else "-"
            print(
                f"  {r['strategy']:<9} {r['context']:>8} {_gib(r['gdn_bytes_per_layer']):>11} "
                f"{_gib(r['gdn_bytes_per_request']):>12} {ring:>13} {_gib(r['kv_bytes_per_request']):>11} "
                f"{_gib(r['bytes_per_request']):>14} {r['max_requests']:>13} {vs:>12}",
                file=file,
            )
        if m["budget_bytes"] <= 0:
            print("  the weights alone exceed the budget: raise --tp or give --budget-gib", file=file)
