#!/usr/bin/env python3
"""Check the rows of ``replayssm bench kernels --json`` against performance targets.

    python scripts/check_kernel_targets.py benchmarks/results/kernels_h200.json
    python scripts/check_kernel_targets.py RESULT.json --targets benchmarks/kernel_targets.json

Prints one ``[PASS]``/``[FAIL]`` line per target and batch, and exits 1 if any target
fails, 2 on bad input. The targets (issue 3's, by default) live in
``benchmarks/kernel_targets.json``, not in the library: they are one project's goals
for one GPU, not properties of the kernels. A smoke run (no CUDA, no floor) has no
floor targets to check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_TARGETS = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel_targets.json"


def evaluate(rows: list[dict], targets: dict) -> list[dict]:
    """One entry per (target, batch) that the rows allow to check: ``batch``,
    ``target`` (text), ``value``, ``limit``, ``unit``, ``passed`` (``value <= limit``)."""
    out = []
    by = {(r["strategy"], r["batch"]): r for r in rows}

    def add(batch, target, value, limit, unit):
        out.append({"batch": batch, "target": target, "value": value, "limit": limit, "unit": unit,
                    "passed": value <= limit})

    ratio_rules = sorted(targets.get("best_strategy_floor_ratio", []), key=lambda t: -t["min_batch"])
    for batch in sorted({r["batch"] for r in rows}):
        strat = [r for r in rows if r["kind"] == "strategy" and r["batch"] == batch]
        if not strat:
            continue
        best = min(strat, key=lambda r: r["us_per_layer_step"])
        rule = next((t for t in ratio_rules if batch >= t["min_batch"]), None)
        if rule is not None and best["floor_ratio"] is not None:
            add(batch, f"best strategy ({best['strategy']}) / one-read floor", best["floor_ratio"], rule["limit"], "x")
        for t in targets.get("best_strategy_no_slower_than", []):
            ref = by.get((t["reference"], batch))
            if ref is not None and batch in t["batches"]:
                add(batch, f"best strategy ({best['strategy']}) vs {t['reference']}", best["us_per_layer_step"],
                    ref["us_per_layer_step"], "us")
        every = targets.get("every_strategy_no_slower_than")
        ref = by.get((every, batch)) if every else None
        if ref is not None:
            for r in strat:
                if r["strategy"] != every:
                    add(batch, f"{r['strategy']} vs {every}", r["us_per_layer_step"], ref["us_per_layer_step"], "us")
        for t in targets.get("no_slower_than", []):
            step, ref = by.get((t["step"], batch)), by.get((t["reference"], batch))
            if step is not None and ref is not None:
                note = f" ({t['note']})" if t.get("note") else ""
                add(batch, f"{t['step']} vs {t['reference']}{note}", step["us_per_layer_step"], ref["us_per_layer_step"], "us")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_kernel_targets.py", description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="JSON written by replayssm bench kernels --json")
    parser.add_argument("--targets", type=Path, default=DEFAULT_TARGETS,
                        help="targets file (default benchmarks/kernel_targets.json)")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.result.read_text())
        targets = json.loads(args.targets.read_text())
        rows = data["rows"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        print(f"check_kernel_targets.py: error: {e}", file=sys.stderr)
        return 2
    if data.get("smoke"):
        print("smoke run (no CUDA): no targets to check")
        return 0
    results = evaluate(rows, targets)
    print(f"targets from {args.targets}:")
    for t in results:
        print(f"  [{'PASS' if t['passed'] else 'FAIL'}] batch {t['batch']:>4}: {t['target']}: "
              f"{t['value']:.3f} {t['unit']} (limit {t['limit']:.3f})")
    failed = sum(not t["passed"] for t in results)
    print(f"{len(results) - failed} of {len(results)} targets met")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
