"""Command line: ``replayssm run|generate|bench|drift|info``.

Each command lives in its own module, which provides ``add_arguments(parser)`` and
``main(args) -> int``; this file only wires them up, importing a module when its
command runs so that ``replayssm info`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, help); ``bench`` has sub-commands of its own.
COMMANDS = {
    "run": ("replayssm.engine.main_job", "the main job on the embedded default model (what `make run` calls)"),
    "demo": ("replayssm.demo", "every strategy through a long lifecycle against the float64 oracle"),
    "generate": ("replayssm.engine.generate", "speculative generation with a local Hugging Face checkpoint"),
    "drift": ("replayssm.bench.drift", "long teacher-forced runs of every strategy against a float64 oracle"),
    "info": ("replayssm.info", "versions, devices and backends"),
}
BENCH = {
    "kernels": ("replayssm.bench.kernels", "time one captured step per strategy against the one-read floor"),
    "memory": ("replayssm.bench.memory", "bytes per request and max concurrent requests per strategy"),
    "e2e": ("replayssm.bench.e2e", "end-to-end tokens per second, plain decoding vs each strategy"),
}


def _add(sub, name: str, module: str, help: str):
    p = sub.add_parser(name, help=help, description=help)
    p.set_defaults(_module=module)
    try:
        importlib.import_module(module).add_arguments(p)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        p.set_defaults(_missing=True)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replayssm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help) in COMMANDS.items():
        _add(sub, name, module, help)
    bench = sub.add_parser("bench", help="benchmarks (kernels, memory, e2e)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help) in BENCH.items():
        _add(bench_sub, name, module, help)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"replayssm: this build has no {args._module}", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
