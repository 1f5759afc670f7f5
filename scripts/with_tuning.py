"""Run a ``replayssm`` command with rows of the kernels' shape table overridden.

``bench kernels`` takes ``--tune``; every other command (``bench e2e``, ``drift``, ...)
runs under the table as it stands. This runs any of them under overrides, so that a
table entry can be measured end to end before it becomes the default:

    PYTHONPATH=src python3 scripts/with_tuning.py closed_form.early_tile=1 -- bench e2e --random qwen3.5-shapes ...
"""

from __future__ import annotations

import contextlib
import sys

from replayssm.cli import main
from replayssm.cli.bench_kernels import _tune_item
from replayssm.ops import tuning


def run(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: with_tuning.py FAMILY.PARAM=INT ... -- COMMAND ARGS...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    with contextlib.ExitStack() as stack:
        for item in argv[:cut]:
            try:
                family, param, value = _tune_item(item)  # bench kernels' --tune, checked against the table
            except ValueError as e:
                print(f"with_tuning.py: error: {e}", file=sys.stderr)
                return 2
            stack.enter_context(tuning.override(family, **{param: value}))
            print(f"shape table override: {family}.{param} = {value}", flush=True)
        return main(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
