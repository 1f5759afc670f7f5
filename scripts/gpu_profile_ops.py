"""Time each GDN op of a step alone, on a CUDA GPU, under controlled conditions.

Where ``replayssm bench kernels`` times whole strategy steps, this separates their parts
(a verify kernel, a commit kernel, the chunked window with an empty or full history,
with and without flush rows, ring decoding's token and flush rows) so that a slow step can be traced to its kernel. Each op
is captured in a CUDA graph of ``--reps`` calls and the graph replayed; the time per
call is printed next to the one-read floor ``Sb / copy bandwidth``.

    PYTHONPATH=src python3 scripts/gpu_profile_ops.py --batches 64,256 [--variants ...]

Variants are given as ``NAME=FAMILY.PARAM:VALUE,...`` and override rows of the kernels'
shape table (``replayssm/ops/tuning.py``, e.g. ``closed_form.k_chunk:32``,
``exact_write.block_v:32``) for the calls. Every op is timed under every variant.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import contextlib

from replayssm.bench import common

try:
    from replayssm.cli.args import int_list, output_path, positive_int
except ImportError:  # an older tree, for a before-and-after run
    from replayssm.bench.args import int_list, output_path, positive_int

from replayssm.ops import chunked, gdn_fold, gdn_recurrence, recurrent, tuning
from replayssm.ops.records import RawRecords


def timed(fn, reps: int) -> float:
    """Microseconds per call of ``fn``, from a graph of ``reps`` calls."""
    graph = common.capture_graph(lambda: [fn() for _ in range(reps)], warmup_steps=1)
    t = common.time_graphs([graph], steps_per_block=1, blocks=5, warmup_blocks=1)
    return t.us_per_step / reps


def make(batch, hv=32, h=16, kd=128, vd=128, T=4, L=32, seed=0, state_dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    n = batch * T
    r = lambda *s, dt=bf, sc=1.0: (torch.randn(*s, generator=g, device=dev) * sc).to(dt)  # noqa: E731
    x = dict(q=r(n, h, kd), k=r(n, h, kd), v=r(n, hv, vd), a=r(n, hv), b=r(n, hv, sc=2.0),
             A_log=r(hv, dt=torch.float32, sc=0.5), dt_bias=r(hv, dt=torch.float32, sc=0.5))
    ckpt = r(batch, hv, vd, kd, dt=state_dtype, sc=0.1)
    ring = RawRecords(r(batch, L, h, kd), r(batch, L, hv, vd), -torch.rand(batch, L, hv, generator=g, device=dev) * 0.1,
                      torch.rand(batch, L, hv, generator=g, device=dev))
    ring_u = r(batch, L, hv, vd, dt=torch.float32, sc=0.1)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    cu = torch.arange(0, n + 1, T, dtype=torch.int32, device=dev)
    return x, ckpt, ring, ring_u, slots, cu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int_list, default=(64, 256), help="requests per op call, comma-separated (default 64,256)")
    p.add_argument("--reps", type=positive_int, default=10, help="calls captured per CUDA graph (default 10)")
    p.add_argument("--variants", nargs="*", default=[],
                   help="tuning variants, each NAME=FAMILY.PARAM:VALUE,... (space-separated; default: none)")
    p.add_argument("--only", default="", help="time only the ops whose name contains one of these comma-separated texts (default: all)")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32", help="checkpoint dtype (default float32)")
    p.add_argument("--window", type=positive_int, default=4,
                   help="draft window T (default 4): T - 1 tokens accepted a commit, a ring of 4 T records (at least 16)")
    p.add_argument("--json", type=output_path(".json"), default=None, help="write every timed row here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    bw = common.copy_bandwidth("cuda")
    rows = []

    def report(name, batch, us, sb):
        floor = sb / bw * 1e6
        rows.append(dict(op=name, batch=batch, us=us, floor_us=floor, ratio=us / floor))
        print(f"{name:48s} b={batch:4d} {us:9.2f} us  floor {floor:8.2f}  x{us / floor:6.2f}", flush=True)

    T = args.window
    L, n_acc = max(16, 4 * T), T - 1
    modules = {"chunked": chunked, "recurrent": recurrent}
    variants = [("default", {})]
    for spec in args.variants:
        name, _, sets = spec.partition("=")
        variants.append((name, {kv.split(":")[0]: kv.split(":")[1] for kv in sets.split(",") if kv}))
    saved = {f"{m}.{k}": getattr(mod, k) for m, mod in modules.items() for k in dir(mod)
             if k.startswith("_") and not k.startswith("__") and k[1:].isupper()}

    def apply(env):
        """Module globals of ``env`` set, its table overrides entered on the returned stack."""
        for key, value in saved.items():
            m, k = key.split(".")
            setattr(modules[m], k, value)
        stack = contextlib.ExitStack()
        for key, value in env.items():
            m, k = key.split(".")
            if key in saved:
                old = saved[key]
                setattr(modules[m], k, value != "0" if isinstance(old, bool) else type(old)(value))
            else:
                stack.enter_context(tuning.override(m, **{k: int(value)}))
        return stack

    def attempt(name, batch, fn, sb):
        if args.only and not any(part in name for part in args.only.split(",")):
            return
        try:
            report(name, batch, timed(fn, args.reps), sb)
        except Exception as e:  # report and go on: a variant may not compile
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)

    for batch in args.batches:
        x, ckpt, ring, ring_u, slots, cu = make(batch, T=T, L=L, state_dtype=getattr(torch, args.state_dtype))
        sb = ckpt.numel() * ckpt.element_size()
        one = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda")
        xs1 = {k: (v[::T].contiguous() if v.shape[0] == batch * T else v) for k, v in x.items()}
        args1 = [xs1[k] for k in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]
        argsT = [x[k] for k in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]
        rec4 = RawRecords(*(t[:, :T].contiguous() for t in ring))
        start = torch.zeros(batch, dtype=torch.int32, device="cuda")
        count = torch.full((batch,), n_acc, dtype=torch.int32, device="cuda")
        wp = torch.zeros(batch, dtype=torch.int32, device="cuda")
        base = torch.zeros_like(wp)
        fl = torch.zeros_like(wp)
        for vname, env in variants:
            with apply(env):
                attempt(f"[{vname}] plain decode (1 token, update_state)", batch, lambda: gdn_recurrence(
                    *args1, ckpt, slots, one, update_state=True, max_len=1), sb)
                attempt(f"[{vname}] fold verify T={T} (+raw records)", batch, lambda: gdn_recurrence(
                    *argsT, ckpt, slots, cu, records=rec4, max_len=T), sb)
                attempt(f"[{vname}] fold commit, count={n_acc}", batch, lambda: gdn_fold(
                    ckpt[None], *(t[None] for t in rec4), slots, start, count), sb)
                if batch <= 64:
                    snaps = torch.empty(batch, T, *ckpt.shape[1:], device="cuda", dtype=ckpt.dtype)
                    attempt(f"[{vname}] snapshot verify T={T} ({T} snapshot writes)", batch, lambda: gdn_recurrence(
                        *argsT, ckpt, slots, cu, snapshots=snaps, max_len=T), sb)
                    del snaps
                # circular's verify at the peer table's cursors (T - 1 tokens a commit: at T=4,
                # L=16 write_pos cycles 3, 6, 9 and the rows at 9 flush), each method.
                phase = torch.arange(batch, device="cuda") % 3
                a1, a2, a3 = n_acc, 2 * n_acc, 3 * n_acc
                for label, w, f in (("empty history", 0, 0), (f"history {a2}", a2, 0), (f"flush {a3} (every row)", a3, 1),
                                    (f"flush {a1} (every row, the replay method's case)", a1, 1),
                                    (f"mixed: 1/3 flush {a3}, rest history {a1} or {a2}", None, None)):
                    if w is None:
                        fl.copy_((phase == 2).int())
                        wp.copy_((n_acc * (phase + 1)).int())
                    else:
                        wp.fill_(w)
                        fl.fill_(f)
                    for method in ("closed_form", "replay"):
                        attempt(f"[{vname}] chunked {method} {label}", batch, lambda: chunked.gdn_chunked_window_triton(
                            *argsT, ckpt, ring, ring_u, slots, cu, wp, base, fl, max_len=T, method=method), sb)
                # The closed form's kernels alone, at the last (mixed) cursors (the outputs kernel
                # includes the flush rows' fold unless closed_form.fuse_flush is 0).
                if not hasattr(chunked, "launch_coefficients"):
                    continue  # an older tree (a before-and-after run): its parts differ
                q, k, v, a, b, A_log, dt_bias = argsT
                attempt(f"[{vname}] closed_form part: flush, mixed", batch,
                        lambda: chunked.launch_flush(ckpt, ring, slots, wp, base, fl), sb)
                attempt(f"[{vname}] closed_form part: coefficients, mixed", batch,
                        lambda: chunked.launch_coefficients(q, k, a, b, A_log, dt_bias, ckpt, ring, slots, cu, wp, base,
                                                            fl, T), sb)
                coef = chunked.launch_coefficients(q, k, a, b, A_log, dt_bias, ckpt, ring, slots, cu, wp, base, fl, T)
                o = torch.empty_like(v)
                attempt(f"[{vname}] closed_form part: outputs, mixed", batch,
                        lambda: chunked.launch_window_outputs(q, k, v, ckpt, ring, ring_u, slots, cu, wp, base, fl, coef,
                                                              o, T), sb)
                # Plain decoding through the ring (one token a request) at the bench's cursors
                # (a flush every 9 tokens): the token rows alone, flush rows alone, and mixed,
                # which says how much of a plain ring step its flush rows cost.
                from replayssm.ops.ring_decode import gdn_ring_decode_triton
                step = torch.arange(batch, device="cuda") % 9
                for label, w, f in (("history 8, no flush", 8, 0), ("flush 9 (every row)", 9, 1),
                                    ("mixed: 1/9 flush 9, rest history 1-8", None, None)):
                    if w is None:
                        wp.copy_((step + 1).int())
                        fl.copy_((step == 8).int())
                    else:
                        wp.fill_(w)
                        fl.fill_(f)
                    attempt(f"[{vname}] ring decode {label}", batch, lambda: gdn_ring_decode_triton(
                        *args1, ckpt, ring, ring_u, slots, one, wp, base, fl), sb)
        apply({})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(copy_bandwidth=bw, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
