"""``replayssm drift``: the options of :mod:`replayssm.bench.drift` (a
:class:`~replayssm.bench.drift.DriftConfig`, which checks itself), and its report."""

from __future__ import annotations

import argparse

import torch

from ..bench.drift.config import (ACT_DTYPES, DEFAULT_DECAY_RANGE, DEFAULT_KEY_CORRELATION, DEFAULT_MODEL, INPUTS,
                                  SHAPES, STATE_DTYPES, DriftConfig)
from ..ops.dispatch import BACKENDS
from ..strategies import STRATEGY_NAMES
from . import common
from .args import device_name, name_list, nonneg_int, output_path, positive_float, positive_int


def _decay_range(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two numbers), got {text!r}") from None
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DriftConfig()
    g = parser.add_argument_group("the run")
    g.add_argument("--tokens", type=positive_int, default=d.tokens, help=f"committed tokens per request (default {d.tokens})")
    g.add_argument("--requests", type=positive_int, default=d.requests, help=f"requests driven together (default {d.requests})")
    g.add_argument("--window", type=positive_int, default=d.window, help=f"T, the largest verify window (default {d.window})")
    g.add_argument("--ring-len", type=positive_int, default=d.ring_len, help=f"L for circular and the control (default {d.ring_len})")
    g.add_argument("--every", type=positive_int, default=None, help="sample the errors every N committed tokens (default tokens/128)")
    g.add_argument("--act-dtype", choices=sorted(ACT_DTYPES), default=d.act_dtype, help="activations and raw records (default bf16)")
    g.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default=d.state_dtype, help="checkpoints (default fp32)")
    g.add_argument("--device", type=device_name, default=None, help="cpu, cuda or cuda:N (default cuda when available, else cpu)")
    g.add_argument("--backend", choices=BACKENDS, default=d.backend, help="ops backend (default auto: Triton on CUDA)")
    g.add_argument("--strategies", type=name_list(STRATEGY_NAMES, allow_none=True), default=STRATEGY_NAMES, help="comma-separated (default snapshot,fold,circular)")
    g.add_argument("--no-control", action="store_true", help="skip the open-loop control")
    g.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the window lengths and acceptance, and of random inputs (default 0)")
    i = parser.add_argument_group("the layer's inputs")
    i.add_argument("--inputs", choices=INPUTS, default=d.inputs,
                   help="model: a trained model's GDN layer over held-out standard-library text; random: synthetic "
                        f"inputs (default {d.inputs})")
    i.add_argument("--model", default=None,
                   help=f"model inputs: the checkpoint (default {DEFAULT_MODEL}, the shipped model)")
    i.add_argument("--layer", type=nonneg_int, default=None,
                   help="model inputs: which GDN layer, counted among the GDN layers from 0 (default the last)")
    i.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="random inputs: GDN layer shape (default qwen3.5 = H16 HV32 K128 V128 on CUDA, "
                        "tiny = H2 HV4 K16 V16 on the CPU)")
    i.add_argument("--decay-range", type=_decay_range, default=None,
                   help="random inputs: MIN,MAX mean per-token decay -g of the heads, spread log-uniformly "
                        f"(default {','.join(f'{x:g}' for x in DEFAULT_DECAY_RANGE)})")
    i.add_argument("--key-correlation", type=float, default=None,
                   help=f"random inputs: correlation of consecutive keys (default {DEFAULT_KEY_CORRELATION})")
    j = parser.add_argument_group("judging")
    j.add_argument("--growth-factor", type=positive_float, default=d.growth_factor,
                   help=f"late/early error ratio that counts as growth (default {d.growth_factor})")
    j.add_argument("--min-slope", type=float, default=d.min_slope,
                   help=f"log-log slope that counts as growth (default {d.min_slope})")
    j.add_argument("--excess-factor", type=positive_float, default=d.excess_factor,
                   help=f"error over the fp32 recurrence's that counts as leaving it (default {d.excess_factor})")
    o = parser.add_argument_group("output")
    o.add_argument("--json", type=output_path(".json"), default=None, help="write the full result (every sample) here")
    o.add_argument("--plot", type=output_path(".png"), default=None, help="write a PNG of the errors over tokens here")
    o.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args) -> DriftConfig:
    device = args.device if args.device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
    every = args.every if args.every is not None else max(1, args.tokens // 128)
    return DriftConfig(
        tokens=args.tokens, requests=args.requests, window=args.window, ring_len=args.ring_len, every=every,
        inputs=args.inputs, model=args.model, layer=args.layer, shape=args.shape, act_dtype=args.act_dtype,
        state_dtype=args.state_dtype, device=device, backend=args.backend,
        strategies=tuple(args.strategies), control=not args.no_control,
        decay_range=None if args.decay_range is None else tuple(args.decay_range),
        key_correlation=args.key_correlation, growth_factor=args.growth_factor, min_slope=args.min_slope,
        excess_factor=args.excess_factor, seed=args.seed,
    )


def check_args(args) -> None:
    """Validate the whole configuration (``ValueError``) before the run."""
    cfg = config_from_args(args)
    cfg.check()
    common.check_triton_window("--window", cfg.window, backend=cfg.backend, device=cfg.device,
                               strategies=tuple(cfg.strategies) + (("circular",) if cfg.control else ()))


def main(args) -> int:
    from ..bench.drift import print_report, run_drift

    cfg = config_from_args(args)
    result = run_drift(cfg, progress=not args.quiet)
    print_report(result)
    common.write_outputs(result, args.json, args.plot, "plot_drift")
    return result["exit_code"]
