"""Run each state kernel of a circular / fold / decode / ring decode step a few times at one shape, for
Nsight Compute (``ncu -k regex:...``) to read its counters: register use, occupancy,
memory throughput, issue activity and stall reasons.

    PYTHONPATH=src ncu --clock-control none --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats python3 scripts/gpu_ncu_kernels.py --batch 256
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_profile_ops import make  # noqa: E402

from replayssm.ops import chunked, gdn_fold, gdn_recurrence, ring_decode  # noqa: E402
from replayssm.ops.records import RawRecords  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--calls", type=int, default=2, help="calls of each op (the first compiles)")
    args = p.parse_args()
    T, L, B = 4, 16, args.batch
    x, ckpt, ring, ring_u, slots, cu = make(B, T=T, L=L, state_dtype=getattr(torch, args.state_dtype))
    q, k, v, a, b, A_log, dt_bias = (x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias"))
    phase = torch.arange(B, device="cuda") % 3
    fl = (phase == 2).int()
    wp = (3 * (phase + 1)).int()
    base = torch.zeros_like(wp)
    one = torch.arange(0, B + 1, dtype=torch.int32, device="cuda")
    xs1 = [t[::T].contiguous() for t in (q, k, v, a, b)]
    rec4 = RawRecords(*(t[:, :T].contiguous() for t in ring))
    start = torch.zeros(B, dtype=torch.int32, device="cuda")
    count = torch.full((B,), 3, dtype=torch.int32, device="cuda")
    o = torch.empty_like(v)
    # Plain decoding through the ring at its steady state (a flush every 9 tokens): a
    # ninth of the rows flush 9 records, the others hold 0..8.
    ph9 = torch.arange(B, device="cuda") % 9
    wp9, fl9 = (ph9 + 1).int(), (ph9 == 8).int()
    o1 = torch.empty_like(xs1[2])
    for _ in range(args.calls):
        ring_decode.launch_ring_decode(*xs1, A_log, dt_bias, ckpt, ring, ring_u, slots, one, wp9, base, fl9, o1)
        chunked.launch_flush(ckpt, ring, slots, wp, base, fl)
        coef = chunked.launch_coefficients(q, k, a, b, A_log, dt_bias, ckpt, ring, slots, cu, wp, base, fl, T)
        chunked.launch_window_outputs(q, k, v, ckpt, ring, ring_u, slots, cu, wp, base, fl, coef, o, T)
        gdn_fold(ckpt[None], *(t[None] for t in rec4), slots, start, count)  # fold's commit
        gdn_recurrence(*xs1, A_log, dt_bias, ckpt, slots, one, update_state=True, max_len=1)  # plain decode
        gdn_recurrence(q, k, v, a, b, A_log, dt_bias, ckpt, slots, cu, records=rec4, max_len=T)  # fold's verify
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
