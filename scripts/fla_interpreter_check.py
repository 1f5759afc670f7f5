#!/usr/bin/env python3
"""fla-core's chunked kernel itself, on the CPU, inside the engine's static prompt passes.

    python scripts/fla_interpreter_check.py --wheel fla_core-0.6.0-py3-none-any.whl einops-0.8.2-py3-none-any.whl
    python scripts/fla_interpreter_check.py --wheel ... --lengths 130,5,70 64,64,1 --json out.json

The CPU tests run the prompt passes of several requests through a stand-in for
fla-core's kernel. This script runs fla-core's own Triton kernels under the Triton
interpreter (fp32) instead, on a tiny model: each prompt pass of fresh requests at a
static shape (the packed tokens with the fixed-length chunk list whose spare entries
name an empty sequence) against the eager pass (fla-core's varlen call, its chunk list
derived by itself), the committed GDN states and the last tokens' logits.

fla-core (and what it imports that this environment lacks: einops) is unpacked from
``--wheel`` into a temporary directory, with two changes
that the interpreter needs and that change no arithmetic: every autotuner keeps its
first config (the interpreter cannot time configs), and one loop index cast in the
state kernel is written as ``tl.full`` (the interpreter's loop indices are Python
ints). Prints a line per case; exits 0 when every state agrees bit for bit and every
logit to 1e-5 of the logits' scale.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import zipfile

#: the interpreter's loop indices are Python ints, which have no ``.to``
_LOOP_CAST = ("i_t_int64 = i_t.to(tl.int64)", "i_t_int64 = tl.full([], i_t, tl.int64)")


def _unpack(wheels: list[str], into: str) -> None:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(into)
    path = pathlib.Path(into, "fla", "ops", "common", "chunk_delta_h.py")
    if not path.is_file():
        raise SystemExit("fla_interpreter_check.py: error: no --wheel holds fla-core")
    src = path.read_text()
    if _LOOP_CAST[0] not in src:
        raise SystemExit(f"fla_interpreter_check.py: error: {path.name} has no {_LOOP_CAST[0]!r}: another fla-core")
    path.write_text(src.replace(*_LOOP_CAST))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fla_interpreter_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", nargs="+", required=True, help="fla-core's wheel (0.6 or newer), einops' wheel")
    parser.add_argument("--lengths", nargs="+", default=["130,5,70", "64,64,1", "200,3"],
                        help="prompt lengths of each pass (default 130,5,70 64,64,1 200,3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    missing = [w for w in args.wheel if not os.path.isfile(w)]
    if missing:
        print(f"fla_interpreter_check.py: error: --wheel {missing[0]!r} is not a file", file=sys.stderr)
        return 2
    try:
        cases = [[int(n) for n in s.split(",")] for s in args.lengths]
    except ValueError:
        print(f"fla_interpreter_check.py: error: --lengths wants comma-separated ints, got {args.lengths}",
              file=sys.stderr)
        return 2
    if any(len(c) < 2 or min(c) < 1 for c in cases):
        print("fla_interpreter_check.py: error: each pass needs 2 or more prompts of >= 1 token", file=sys.stderr)
        return 2

    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    tmp = tempfile.mkdtemp(prefix="fla-")
    _unpack(args.wheel, tmp)
    sys.path.insert(0, tmp)
    import torch
    import triton.runtime.autotuner as autotuner

    torch.set_num_threads(args.threads)
    init = autotuner.Autotuner.__init__

    def first_config(self, fn, arg_names, configs, *rest, **kw):
        init(self, fn, arg_names, configs[:1], *rest, **kw)

    autotuner.Autotuner.__init__ = first_config
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from replayssm.engine.adapter import HybridEngine
    from replayssm.engine.random_model import build_tiny_model

    model = build_tiny_model("qwen3_5", seed=args.seed)
    common = dict(strategy="fold", num_slots=8, window=2, max_len=max(map(max, cases)) + 8, prefill="chunk",
                  chunk_kernel=chunk_gated_delta_rule)
    eager = HybridEngine(model, prompt_graphs=False, **common)
    static = HybridEngine(model, prompt_graphs=True, **common)
    gen = torch.Generator().manual_seed(args.seed)
    rows, ok = [], True
    for lengths in cases:
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
        outs = []
        for eng in (eager, static):
            slots = [eng.alloc() for _ in prompts]
            with torch.inference_mode():
                out = eng.extend(slots, prompts, prompt=True)
            states = torch.stack([eng.strategy.committed_state(j, slots) for j in range(len(eng.mixers))])
            outs.append((out.logits, states))
            eng.free_many(slots)
        (le, se), (ls, ss) = outs
        logit_err = ((ls - le).abs().max() / le.abs().max()).item()
        same_states = torch.equal(ss, se)
        good = same_states and logit_err <= 1e-5 and bool(torch.isfinite(ls).all())
        ok &= good
        rows.append(dict(lengths=lengths, states_bit_for_bit=same_states, logits_max_rel_err=logit_err, ok=good))
        print(f"{lengths}: states {'bit for bit' if same_states else 'DIFFER'}, logits within "
              f"{logit_err:.2e} of their scale: {'ok' if good else 'FAIL'}")
    print(f"static passes {static.prompt_passes}, eager {eager.prompt_passes}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(cases=rows, static_passes=static.prompt_passes, wheels=[os.path.basename(w) for w in args.wheel]), fh,
                      indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
