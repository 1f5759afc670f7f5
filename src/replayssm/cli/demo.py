"""``replayssm demo``: every strategy through a long verify -> accept -> commit lifecycle.

Random layer inputs, random window lengths and acceptance, padding rows; after every
step the committed state and the accepted outputs are compared with the float64 oracle
and the float32 reference recurrence. Prints one line per strategy and the scratch
memory each strategy needs per request. Runs on the reference ops (any machine).
"""

from __future__ import annotations

import sys
import time

import torch

from .args import positive_int
from ..progress import ProgressBar
from ..testing.lifecycle import Lifecycle
from ..state import GDNShape, StatePool
from ..strategies import STRATEGIES

SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=16)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=positive_int, default=300, help="steps per strategy (default 300)")
    parser.add_argument("--layers", type=positive_int, default=2, help="GDN layers per pool (default 2)")
    parser.add_argument("--requests", type=positive_int, default=3,
                        help="live requests per step, plus one padding row (default 3)")
    parser.add_argument("--window", type=positive_int, default=4, help="T: draft tokens + bonus (default 4)")
    parser.add_argument("--ring-len", type=positive_int, default=16,
                        help="L for circular: a power of two >= 2T (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")


def check_args(args) -> None:
    """Let every strategy's pool validate window and ring length (on the ``meta``
    device, so nothing is allocated); ``ValueError`` names the option."""
    for name in STRATEGIES:
        try:
            StatePool(SHAPE, args.layers, args.requests, strategy=name, window=args.window, ring_len=args.ring_len,
                      device="meta")
        except ValueError as e:
            raise ValueError(f"--window {args.window} / --ring-len {args.ring_len} ({name}): {e}") from None


def _mib(n: int) -> str:
    return f"{n / 2**20:8.3f} MiB"


def main(args) -> int:
    shape = SHAPE
    print(
        f"replayssm demo: {args.steps} verify/accept/commit steps per strategy on random inputs "
        f"(reference ops, CPU, float32; {args.layers} GDN layers, {args.requests} requests + 1 padding row, "
        f"H={shape.num_heads} HV={shape.num_value_heads} K={shape.head_k_dim} V={shape.head_v_dim}, "
        f"window {args.window}, ring {args.ring_len})"
    )
    print("checked after every step against a float64 oracle and the float32 reference recurrence\n")
    print(f"{'strategy':<10} {'max state err':>14} {'max out err':>12} {'state == ref':>13} {'flushes':>8} {'time':>7}")
    ok = True
    for name in STRATEGIES:
        pool = StatePool(shape, args.layers, args.requests, strategy=name, window=args.window, ring_len=args.ring_len)
        lc = Lifecycle(pool, num_requests=args.requests, generator=torch.Generator().manual_seed(args.seed))
        t0 = time.perf_counter()
        reports = []
        # A bar only on a terminal: the demo's output is its table, and logs need no bar.
        with ProgressBar(args.steps, f"  {name}", unit="step", enabled=sys.stderr.isatty()) as bar:
            for _ in range(args.steps):
                reports.append(lc.step())
                bar.update(1)
        exact = all(r.state_bitexact and r.conv_bitexact for r in reports)
        ok &= exact
        print(
            f"{name:<10} {max(r.state_err for r in reports):14.2e} {max(r.out_err for r in reports):12.2e} "
            f"{'bit-exact' if exact else 'DIFFERS':>13} {sum(r.flushed for r in reports):8d} "
            f"{time.perf_counter() - t0:6.1f}s"
        )
    qwen = GDNShape(num_heads=16, num_value_heads=32, head_k_dim=128, head_v_dim=128)
    print("\nscratch per request and GDN layer at Qwen3.5-35B-A3B shapes (HV=32, K=V=128, fp32 state, bf16 activations):")
    for name in STRATEGIES:
        pool = StatePool(qwen, 1, 1, strategy=name, window=4, ring_len=16, act_dtype=torch.bfloat16, device="meta")
        state = pool.nbytes_per_slot()["checkpoints"]
        print(f"  {name:<10} {_mib(pool.scratch_nbytes_per_slot())}  (checkpoint itself: {_mib(state)})")
    print("\nresult:", "all strategies commit exactly the reference state" if ok else "MISMATCH")
    return 0 if ok else 1
