#!/usr/bin/env python3
"""Host time of a static prompt pass, without its device work.

    OMP_NUM_THREADS=1 python scripts/prompt_host_time.py --cases 16x2048,1x64

The pass's body (every layer, as a CUDA graph replays it) is replaced by a stub, so an
``extend(prompt=True)`` call's time is the host's own work before the graph would
replay: the step's checks of the slots and token ids, the shape's choice, the
metadata the host builds and its one upload, and the outputs' copies. The engine is a
small random Qwen3.5 on the CPU with the CPU stand-in of the chunked kernel, so the
shapes are those of several requests through the chunked kernel (a chunk list), as on
a GPU with fla-core. Prints the median of ``--repeats`` calls, fresh requests and
fresh prompts each (random ids as Python lists, or with ``--arrays`` as the int64 arrays
that the generators pass), after two warm-up calls; and the median time of a
generator's ``check_requests`` of such prompts as lists.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from replayssm.bench.common import time_prompt_pass
from replayssm.engine import prompt_graph
from replayssm.engine.adapter import HybridEngine
from replayssm.engine.generator import check_requests
from replayssm.engine.random_model import build_tiny_model
from replayssm.testing.chunk_kernel import chunk_kernel_on_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="16x2048,1x64", help="BATCHxPROMPT_LEN, comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--arrays", action="store_true", help="prompts as int64 arrays (as the generators pass them)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompt_graph.PromptGraph._body = lambda self: None  # the host's work alone
    model = build_tiny_model("qwen3_5", seed=0)
    g = torch.Generator().manual_seed(1)
    for case in args.cases.split(","):
        batch, length = (int(v) for v in case.split("x"))
        eng = HybridEngine(model, num_slots=batch, window=1, max_len=length + 64, prefill="chunk",
                           chunk_kernel=chunk_kernel_on_cpu)
        eng.prompt_graphs = prompt_graph.PromptGraphs(eng, graph=False)

        def once() -> float:
            return time_prompt_pass(eng, batch, length, g, arrays=args.arrays)

        with torch.inference_mode():
            once(), once()
            host = statistics.median(once() for _ in range(args.repeats))
        # a generator's checks of the same prompts as lists, before its clock starts
        prompts = torch.randint(0, 256, (batch, length), generator=g).tolist()
        checks = statistics.median(_seconds(lambda: check_requests(eng, prompts, 1)) for _ in range(args.repeats))
        print(f"{batch} x {length}, {'arrays' if args.arrays else 'lists'}: host {1e3 * host:.2f} ms a pass "
              f"(median of {args.repeats}; passes {eng.prompt_passes}); check_requests of lists "
              f"{1e3 * checks:.2f} ms")


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
