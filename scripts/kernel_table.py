"""Print `replayssm bench kernels` JSON files as one table in issue 11's layout.

    python3 scripts/kernel_table.py LABEL=FILE.json [LABEL=FILE.json ...]

One row per (file, batch); one column per strategy or reference step found in the
files, as a multiple of the one-read floor (``floor_ratio``), and µs per layer-step for
`circular` next to `snapshot` (issue 11's batch-1 target is a ratio of the two). A file
whose rows are all `circular` (a `--strategies circular` run, e.g. with `--tune`) adds
its column to the row of the same batch under its own label.
"""

from __future__ import annotations

import json
import sys

ORDER = ("plain_decode", "plain_ring", "snapshot_verify", "snapshot", "fold", "circular")


def main(argv: list[str]) -> int:
    if not argv or any("=" not in a for a in argv):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    table: dict[tuple[str, int], dict[str, float]] = {}
    columns: list[str] = []
    groups: list[str] = []
    for arg in argv:
        label, _, path = arg.partition("=")
        with open(path) as fh:
            data = json.load(fh)
        rows = data["rows"]
        only_circular = rows and all(r["strategy"] == "circular" for r in rows)
        group = groups[-1] if only_circular and groups else label
        if group not in groups:
            groups.append(group)
        for r in rows:
            col = f"circular[{label}]" if only_circular else r["strategy"]
            if col not in columns:
                columns.append(col)
            cell = table.setdefault((group, r["batch"]), {})
            cell[col] = r["floor_ratio"]
            cell[f"{col} us"] = r["us_per_layer_step"]
    columns.sort(key=lambda c: (ORDER.index(c.split("[")[0]) if c.split("[")[0] in ORDER else 99, c))
    head = ["config", "batch", *columns, "circular/snapshot (us)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * 2 + "---:|" * (len(head) - 2))
    for (group, batch), cell in table.items():
        ratio = ""
        if "circular us" in cell and "snapshot us" in cell:
            ratio = f"{cell['circular us'] / cell['snapshot us']:.2f}"
        vals = [f"{cell[c]:.2f}" if cell.get(c) is not None else "-" for c in columns]
        print("| " + " | ".join([group, str(batch), *vals, ratio]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
