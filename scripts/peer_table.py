"""Print replayssm's `bench kernels` JSON beside the peer's (`bench_peer.py`) from one run.

    python3 scripts/peer_table.py CONFIG=OURS.json,PEER.json [CONFIG=OURS.json,PEER.json ...]

One row per (config, batch); for each state step (plain decode, snapshot, fold, circular
/ the peer's ring) the peer's multiple of the one-read floor, then ours, both over the
floor that ``bench kernels`` measured in the same run (one read of the batch's states at
the card's copy bandwidth). Ours is in bold where it is at or below the peer's.
"""

from __future__ import annotations

import json
import sys

#: (column, our strategy, the peer's key)
PAIRS = (("decode", "plain_decode", "decode"), ("snapshot", "snapshot", "snapshot"), ("fold", "fold", "fold"),
         ("ring / circular", "circular", "circular"))


def rows_of(ours_path: str, peer_path: str):
    with open(ours_path) as fh:
        ours = json.load(fh)["rows"]
    with open(peer_path) as fh:
        peer = {r["B"]: r for r in json.load(fh)["rows"]}
    by_batch: dict[int, dict] = {}
    for r in ours:
        by_batch.setdefault(r["batch"], {})[r["strategy"]] = r
    for batch, strategies in sorted(by_batch.items()):
        floor = next(iter(strategies.values()))["floor_us"]
        if batch not in peer or not floor:
            continue
        cells = []
        for _, mine, theirs in PAIRS:
            p = peer[batch][theirs] / floor
            o = strategies[mine]["floor_ratio"] if mine in strategies else None
            cells.append((p, o))
        yield batch, cells


def main(argv: list[str]) -> int:
    if not argv or any("=" not in a or "," not in a for a in argv):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    head = ["config", "B"] + [f"{w} {c}" for c, _, _ in PAIRS for w in ("peer", "ours")]
    print("| " + " | ".join(head) + " |")
    print("|---|---:|" + "---:|" * (len(head) - 2))
    for arg in argv:
        label, _, paths = arg.partition("=")
        ours_path, peer_path = paths.split(",")
        for batch, cells in rows_of(ours_path, peer_path):
            vals = []
            for p, o in cells:
                vals.append(f"{p:.2f}")
                vals.append("-" if o is None else (f"**{o:.2f}**" if o <= p else f"{o:.2f}"))
            print("| " + " | ".join([label, str(batch), *vals]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
