"""Command line: replayssm run | generate | demo | drift | closed-loop | train | bench kernels|memory|e2e|acceptance | info.

Each command has its own module in this package (``replayssm.cli.run``,
``replayssm.cli.bench_kernels``, ...), which parses the command's options and prints
its results: ``add_arguments(parser)``, ``main(args) -> int`` and optionally
``check_args(args)``. The work itself is done by the library (``engine``, ``bench``,
``train``), which knows nothing of argparse. This file wires the modules up,
importing one when its command runs so that ``replayssm info`` stays instant.

Bad input is reported the same way by every command, before any work starts: one line
``replayssm CMD: error: ...`` on stderr and exit status 2. Argument types catch what
one option can say alone; ``check_args`` raises ``ValueError`` for what needs several
options (or a look at a file), and :func:`main` turns that into the same line.

CPU runs get a thread count from here (``--threads``), the one place that sets it.
"""

from __future__ import annotations

import argparse
import importlib
import os

from .args import positive_int

# command -> (module, help); ``bench`` has sub-commands of its own.
COMMANDS = {
    "run": ("replayssm.cli.run", "the main job on the embedded default model (what make run calls)"),
    "demo": ("replayssm.cli.demo", "every strategy through a long lifecycle against the float64 oracle"),
    "generate": ("replayssm.cli.generate", "speculative generation with a local Hugging Face checkpoint"),
    "drift": ("replayssm.cli.drift", "long teacher-forced runs of every strategy against a float64 oracle"),
    "closed-loop": ("replayssm.cli.closed_loop",
                    "greedy generation under every strategy against plain decoding: first divergence, state error"),
    "train": ("replayssm.cli.train", "train a small Qwen3.5-architecture model and its MTP head on the standard library"),
    "info": ("replayssm.cli.info", "versions, devices and backends"),
}
BENCH = {
    "kernels": ("replayssm.cli.bench_kernels", "time one captured step per strategy against the one-read floor"),
    "memory": ("replayssm.cli.bench_memory", "bytes per request and max concurrent requests per strategy"),
    "e2e": ("replayssm.cli.bench_e2e", "end-to-end tokens per second, plain decoding vs each strategy"),
    "acceptance": ("replayssm.cli.bench_acceptance", "accepted draft tokens per step of the trained model, per drafter and window"),
}

#: Default CPU threads per command (``None``: leave torch's default). The compute
#: commands run tiny models or the reference ops on tiny shapes on the CPU, whose ops
#: are far too small to gain from intra-op threads; on a busy machine the thread
#: hand-offs cost more than the work (``replayssm generate`` on a 2-core machine shared
#: with other jobs: 9.7 tok/s with torch's default, 950 tok/s with one thread).
#: ``train`` runs matrix products big enough to use every core: ``None`` leaves torch's
#: default unless ``--threads`` says otherwise.
CPU_THREADS = {"run": 1, "demo": 1, "generate": 1, "drift": 1, "closed-loop": 1, "kernels": 1, "e2e": 1, "acceptance": 1,
               "train": None}


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE``, on
    stderr with exit status 2 (argparse's own adds the usage lines above it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def _add(sub, name: str, module: str, help: str):
    p = sub.add_parser(name, help=help, description=help)
    p.set_defaults(_module=module, _name=name)
    try:
        importlib.import_module(module).add_arguments(p)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        p.set_defaults(_missing=True)
        return p
    if name in CPU_THREADS:
        default = CPU_THREADS[name]
        why = ("torch's default" if default is None
               else f"{default}: this command's CPU work is ops too small to gain from more")
        p.add_argument("--threads", type=positive_int, default=None,
                       help=f"CPU threads for torch on CPU runs (default {why})")
    return p


def build_parser() -> Parser:
    parser = Parser(prog="replayssm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    parsers = {}
    for name, (module, help) in COMMANDS.items():
        parsers[name] = _add(sub, name, module, help)
    bench = sub.add_parser("bench", help="benchmarks (kernels, memory, e2e)", description="benchmarks (kernels, memory, e2e)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=Parser)
    for name, (module, help) in BENCH.items():
        parsers[f"bench {name}"] = _add(bench_sub, name, module, help)
    parser.set_defaults(_parsers=parsers)
    return parser


def _on_cpu(args) -> bool:
    """Whether the command will compute on the CPU (its ``--device``, else where
    ``auto`` would go)."""
    device = getattr(args, "device", None)
    if device in (None, "auto"):
        import torch

        return not torch.cuda.is_available()
    return str(device).split(":")[0] == "cpu"


def set_cpu_threads(args) -> int | None:
    """Set torch's intra-op threads for the command of ``args``: ``--threads`` when
    given, else the command's default on CPU runs. Returns the count set (or ``None``)."""
    name = getattr(args, "_name", None)
    threads = getattr(args, "threads", None)
    if threads is None and CPU_THREADS.get(name) is not None and _on_cpu(args):
        threads = min(CPU_THREADS[name], os.cpu_count() or 1)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return threads


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check ``argv`` (exits with status 2 and one line on bad input)."""
    args, extra = build_parser().parse_known_args(argv)
    cmd = f"{args.command} {args.bench}" if args.command == "bench" else args.command
    sub = args._parsers[cmd]
    if extra:  # reported by the command's parser, so that the line names the command
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "_missing", False):
        sub.error(f"this build has no {args._module}")
    check = getattr(importlib.import_module(args._module), "check_args", None)
    if check is not None:
        try:
            check(args)
        except ValueError as e:
            sub.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command of ``argv``; returns its exit status (2 for bad input, after the
    one-line error; 0 after ``--help``)."""
    try:
        args = parse(argv)
    except SystemExit as e:  # argparse's way out: --help, or a usage error already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    set_cpu_threads(args)
    return int(importlib.import_module(args._module).main(args) or 0)

