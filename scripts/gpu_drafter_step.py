"""The forced drafter's work in one static step, alone: its accepted counts, the step
counters' increment and the next drafts written into the windows, as
:class:`~replayssm.engine.graph_step.StaticStep` runs them, µs a step from graph replays
(10 steps a graph), at each batch; and the counts and drafts of the last replay, so that
two trees (``PYTHONPATH``) can be compared for bits as well as time.

    PYTHONPATH=src python3 scripts/gpu_drafter_step.py [--batches 256,64] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from replayssm.engine.device_drafters import ForcedDrafter

K, VOCAB = 3, 151936


def time_us(call, reps: int) -> float:
    """µs a call of ``call``, replayed from a graph of 10 calls after one warm replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps // 10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * (reps // 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,64")
    ap.add_argument("--reps", type=int, default=500)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev, rows = torch.device("cuda"), []
    for b in map(int, a.batches.split(",")):
        d = ForcedDrafter(0.8, VOCAB, seed=7)
        d.bind(b, K, 256, dev)
        for slot in range(b):
            d.start(slot, [1, 2], 1000 + slot)
        slot_idx = torch.arange(b, device=dev)
        windows = torch.zeros(b + 1, K + 1, dtype=torch.int64, device=dev)
        emitted = torch.zeros(b, K + 1, dtype=torch.int64, device=dev)
        out = {}

        def step():
            n = d.forced_accepts(slot_idx)
            d.observe(slot_idx, emitted, n + 1)
            windows[slot_idx, 1:] = d.propose(slot_idx)
            out["n"] = n

        step()  # eager once: the kernels compiled before the capture (both trees take this step)
        us = time_us(step, a.reps)
        digest = hashlib.sha1(torch.cat([out["n"][:, None], windows[:b]], 1).cpu().numpy().tobytes()).hexdigest()[:16]
        row = dict(batch=b, us_per_step=us, mean_accepted=float(out["n"].float().mean()), bits=digest)
        rows.append(row)
        print(f"batch {b:4d}: {us:7.2f} us a step; mean accepted {row['mean_accepted']:.3f}; counts and drafts {digest}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(card=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
