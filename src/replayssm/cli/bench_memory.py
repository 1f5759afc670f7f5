"""``replayssm bench memory``: the options of :mod:`replayssm.bench.memory`, and its table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..bench.memory import (
    CONV_LAYOUTS, DTYPES, GIB, H200_GIB, MODELS, PLAIN, MemoryConfig, ModelSpec, conv_layout, memory_table, print_table,
    spec_from_hf_config,
)
from ..strategies import STRATEGY_NAMES
from . import common
from .args import int_list, name_list, nonneg_float, output_path, positive_float, positive_int
from .bench_kernels import branching


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MemoryConfig()
    parser.add_argument("--models", type=name_list(tuple(MODELS)), default=d.models,
                        help=f"built-in model configs, comma-separated (default {','.join(MODELS)})")
    parser.add_argument("--config", type=Path, action="append", default=[],
                        help="a Hugging Face config.json of another GDN hybrid model (repeatable); replaces --models")
    parser.add_argument("--strategies", type=name_list((PLAIN,) + STRATEGY_NAMES), default=d.strategies,
                        help="comma-separated (default plain,snapshot,fold,circular)")
    parser.add_argument("--window", type=positive_int, default=d.window, help=f"T: draft tokens + bonus (default {d.window})")
    parser.add_argument("--ring-len", type=positive_int, default=d.ring_len, help=f"L for circular (default {d.ring_len})")
    parser.add_argument("--tree", type=branching, default=None, metavar="B1,B2,...",
                        help="size the pools for draft trees of this branching per depth (e.g. 3,2,1: 16 nodes): "
                             "--window becomes the node count and --ring-len at least twice it; snapshot then keeps "
                             "a state per node, fold and circular a record per node")
    parser.add_argument("--conv-layout", choices=tuple(CONV_LAYOUTS), default=conv_layout(d.conv_ring),
                        help="how the speculative strategies keep the conv inputs: ring, the engine's (one ring [C, R] a "
                             "layer, R the least power of two >= T + W - 1, and a 4-byte position a request), or classic "
                             "(state [C, W - 1] and window [T, C] a layer); plain always keeps [C, W - 1] (default "
                             f"{conv_layout(d.conv_ring)})")
    parser.add_argument("--context", type=int_list, default=d.contexts,
                        help="tokens of KV cache per request, comma-separated (default 4096,32768)")
    parser.add_argument("--state-dtype", choices=("fp32", "bf16"), default=d.state_dtype, help="checkpoints (default fp32)")
    parser.add_argument("--act-dtype", choices=("bf16", "fp16", "fp32"), default=d.act_dtype, help="conv state and records (default bf16)")
    parser.add_argument("--kv-dtype", choices=sorted(DTYPES), default=d.kv_dtype, help="KV cache (default bf16)")
    parser.add_argument("--tp", type=positive_int, default=None,
                        help="tensor-parallel degree for every model (default: 1 for 35B-A3B, 4 for 122B-A10B); figures are per GPU")
    parser.add_argument("--gpu-gib", type=positive_float, default=None,
                        help=f"memory of one GPU (default: the CUDA device's, else {H200_GIB} = an H200)")
    parser.add_argument("--mem-fraction", type=positive_float, default=d.mem_fraction,
                        help=f"share of GPU memory for weights + request state (default {d.mem_fraction})")
    parser.add_argument("--budget-gib", type=positive_float, default=None,
                        help="memory for request state per GPU; overrides --gpu-gib/--mem-fraction and the weights")
    parser.add_argument("--weights-gib", type=nonneg_float, default=None, help="weights in memory (all GPUs together), overriding the model's")
    parser.add_argument("--json", type=output_path(".json"), default=None, help="write the rows here")
    parser.add_argument("--plot", type=output_path(".png"), default=None, help="write a PNG bar chart of the max requests here")


def config_from_args(args) -> tuple[MemoryConfig, dict[str, ModelSpec]]:
    gpu = args.gpu_gib
    if gpu is None:
        gpu = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else H200_GIB
    specs = dict(MODELS)
    models = tuple(args.models)
    if args.config:
        models = ()
        for path in args.config:
            try:
                raw = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"--config {path}: cannot read a JSON config ({e})") from None
            key = str(path)
            specs[key] = spec_from_hf_config(raw, Path(path).parent.name or key)
            models += (key,)
    window, ring_len = args.window, args.ring_len
    if getattr(args, "tree", None):
        from ..ops.trees import DraftTrees

        window = DraftTrees.from_branching(args.tree).max_nodes  # a tree step's window: its nodes
        ring_len = max(ring_len, 1 << (2 * window - 1).bit_length())
    cfg = MemoryConfig(
        models=models, strategies=tuple(args.strategies), window=window, ring_len=ring_len,
        contexts=tuple(args.context), state_dtype=args.state_dtype, act_dtype=args.act_dtype, kv_dtype=args.kv_dtype,
        tp=args.tp, gpu_gib=gpu, mem_fraction=args.mem_fraction, budget_gib=args.budget_gib, weights_gib=args.weights_gib,
        conv_ring=CONV_LAYOUTS[args.conv_layout],
    )
    return cfg, specs


def check_args(args) -> None:
    """Build the whole table once (it is cheap: a few pools on the ``meta`` device), so
    that every error, e.g. heads not divisible by ``--tp``, is a usage error."""
    memory_table(*config_from_args(args))


def main(args) -> int:
    cfg, specs = config_from_args(args)
    result = memory_table(cfg, specs)
    print_table(result)
    common.write_outputs(result, args.json, args.plot, "plot_memory")
    return 0
