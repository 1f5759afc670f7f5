"""Issue 19's targets against the JSON of `scripts/gpu_prefill_bench.sh`: one line per
target, measured value, bound, PASS or MISS; exit status 1 when one is missed.

    python3 scripts/prefill_targets.py benchmarks/results          # the files of TAG=h200
    python3 scripts/prefill_targets.py benchmarks/results --tag h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [r for r in json.loads(path.read_text())["rows"] if not r.get("error")]


def _row(rows, mode, batch):
    return next((r for r in rows if r["mode"] == mode and r["batch"] == batch), None)


def _best(rows, batch, key):
    """The speculative row of ``batch`` with the largest ``key``."""
    spec = [r for r in rows if r["batch"] == batch and r.get("drafter") and r.get(key) is not None]
    return max(spec, key=lambda r: r[key], default=None)


def targets(results: Path, tag: str) -> list[tuple[str, float | None, str, bool | None]]:
    """``(target, measured, bound, met)``; ``measured`` and ``met`` are ``None`` where
    the run left no row."""
    out = []

    def add(name, value, bound_text, ok):
        out.append((name, value, bound_text, None if value is None else ok(value)))

    short, long_ = _rows(results / f"e2e_prefill64_{tag}.json"), _rows(results / f"e2e_prefill2048_{tag}.json")
    r = _row(short, "plain", 1)
    add("prefill 64 tokens, batch 1 (ms)", r and r["prefill_ms"], "<= 2.0", lambda v: v <= 2.0)
    for batch, bound in ((1, 2.5), (16, 1.5)):
        r = _row(long_, "plain", batch)
        add(f"prefill {batch} x 2048 tokens (x floor)", r and r["prefill_vs_floor"], f"<= {bound}",
            lambda v, b=bound: v <= b)
    decode = _rows(results / f"e2e_decode_{tag}.json")
    for batch, bound in ((1, 0.8), (64, 1.4)):
        r = _row(decode, "plain", batch)
        add(f"plain decode step p50, batch {batch} (ms)", r and r["step_ms_p50"], f"<= {bound}",
            lambda v, b=bound: v <= b)
    mtp = _rows(results / f"e2e_mtp_{tag}.json")
    plain, best = _row(mtp, "plain", 1), _best(mtp, 1, "speedup_vs_plain")
    ratio = best["step_ms_p50"] / plain["step_ms_p50"] if plain and best else None
    add("MTP: speculative step / plain step, batch 1", ratio, "<= 1.4", lambda v: v <= 1.4)
    for batch, bound in ((1, 1.7), (16, 1.5), (64, 1.5)):
        best = _best(mtp, batch, "speedup_vs_plain")
        add(f"MTP: best strategy / plain decode tok/s, batch {batch}", best and best["speedup_vs_plain"],
            f">= {bound}", lambda v, b=bound: v >= b)
    best = _best(mtp, 1, "speedup_vs_plain_with_prefill")
    add("MTP: best / plain counting prefill, 512 + 256 tokens, batch 1",
        best and best["speedup_vs_plain_with_prefill"], ">= 1.5", lambda v: v >= 1.5)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="the folder of the JSON files")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()
    rc = 0
    for name, value, bound, met in targets(args.results, args.tag):
        shown = "no row" if value is None else f"{value:.3f}"
        verdict = "-" if met is None else ("PASS" if met else "MISS")
        print(f"{name:<62} {shown:>8}  {bound:<7} {verdict}")
        rc |= met is False
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
