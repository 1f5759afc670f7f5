"""The forced drafter's work in one static step, alone: its accepted counts, the step
counters' increment and the next drafts written into the windows, as
:class:`~replayssm.engine.graph_step.StaticStep` runs them, µs a step from graph replays
(one step a graph, its launch included), at each batch; and the counts and drafts of
the last replay, so that two trees (``PYTHONPATH``) can be compared for bits as well
as time.

    PYTHONPATH=src python3 scripts/gpu_drafter_step.py [--batches 256,64] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from replayssm.bench.common import capture_graph, time_graphs
from replayssm.engine.device_drafters import ForcedDrafter
from replayssm.ops.guards import host_index

K, VOCAB = 3, 151936


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,64")
    ap.add_argument("--blocks", type=int, default=20, help="timed blocks of 50 replays; the median block (default 20)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev, rows = torch.device("cuda"), []
    for b in map(int, a.batches.split(",")):
        d = ForcedDrafter(0.8, VOCAB, seed=7)
        d.bind(b, K, 256, dev)
        for slot in range(b):
            d.start(slot, [1, 2], 1000 + slot)
        # rows whose host copy is known, as a step's are (StaticStep.set_rows): guards read nothing on the device
        slot_idx = host_index(range(b), dev, torch.int64)
        windows = torch.zeros(b + 1, K + 1, dtype=torch.int64, device=dev)
        emitted = torch.zeros(b, K + 1, dtype=torch.int64, device=dev)
        out = {}

        def step():
            n = d.forced_accepts(slot_idx)
            d.observe(slot_idx, emitted, n + 1)
            windows[slot_idx, 1:] = d.propose(slot_idx)
            out["n"] = n

        graph = capture_graph(step, warmup_steps=1)  # one eager step first: both trees take it
        us = time_graphs([graph], steps_per_block=50, blocks=a.blocks).us_per_step
        digest = hashlib.sha1(torch.cat([out["n"][:, None], windows[:b]], 1).cpu().numpy().tobytes()).hexdigest()[:16]
        row = dict(batch=b, us_per_step=us, mean_accepted=float(out["n"].float().mean()), bits=digest)
        rows.append(row)
        print(f"batch {b:4d}: {us:7.2f} us a step; mean accepted {row['mean_accepted']:.3f}; counts and drafts {digest}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(card=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
