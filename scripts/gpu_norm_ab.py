"""The fused RMS norms a row per program against a block of rows per program, in one run:
the graphed step of plain decoding and circular (forced drafter) at batch 64 and 256,
its time and its norm kernels' (scripts/gpu_profile_step.py).

    PYTHONPATH=src python3 scripts/gpu_norm_ab.py
"""

import sys
sys.path.insert(0, "scripts")
import gpu_profile_step as g
from replayssm.engine import norms
from replayssm.bench.e2e import E2EConfig, load_model
model, _, _ = load_model(E2EConfig(random_model="qwen3.5-shapes", device="cuda", dtype="bf16"))
for rows in (1, 16):
    norms.MAX_ROWS_PER_PROGRAM = rows
    for b in (64, 256):
        for mode in ("plain", "circular"):
            r = g.profile(model, mode, b, 3, 50, 40, "forced")
            nt = sum(t["us_per_step"] for t in r["top"] if "rms_norm" in t["kernel"])
            print(f"AB rows/program {rows:2d} {mode:9s} B={b:3d}: step {r['gpu_ms']:.3f} ms, norms {nt:.1f} us")
