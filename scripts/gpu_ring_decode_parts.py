#!/usr/bin/env python3
"""Where ring decoding's state step goes: its rows that only take their token, its
flush rows, and the two together, each against the one-read floor, on a CUDA GPU.

    PYTHONPATH=src python3 scripts/gpu_ring_decode_parts.py --batches 64,256 --state-dtype float32 \
        [--tune ring_decode.max_registers=200]

For each batch it builds ``bench kernels``' ``plain_ring`` step (``RingDecodeStep``: the
requests spread over the cursor cycle by speculative steps, then plain ones), then
captures every layer's :meth:`~replayssm.strategies.Strategy.decode` (no commit: the
cursors stay, so every replay is the same step) and replays it with the pool's
``is_flush`` flags three ways, which the kernels read on the device:

* ``as is``: the flags of the phase the requests are at (one step of the cycle);
* ``token rows``: every flag cleared: each row reads its checkpoint once and adds its
  history (``write_pos`` records) to the two products: the step without its flushes;
* ``flush rows``: every flag set where a row has records: each row folds its
  ``write_pos`` records into its checkpoint (the exact replay) and writes it.

A step of the natural cycle (``bench kernels``' ``plain_ring`` row, printed beside when
the batch is timed there) is about ``(1 - f) token + f flush``, with ``f`` the flush
rows' share and their records ``cycle`` instead of the mean ``write_pos`` printed here.
``as is`` is one phase of that cycle, so a change that moves the flush rows (their own
kernel, another stream) can read better here than over the cycle: judge it by ``bench
kernels`` (BENCHMARKS.md, "Ring decoding's token rows streamed, and in two kernels").
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from replayssm.bench import common
from replayssm.bench.kernels import RingDecodeStep, _generator
from replayssm.cli import parse
from replayssm.cli.bench_kernels import resolve_config
from replayssm.ops import tuning


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--state-dtype", default="float32")
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--tune", action="append", default=[], metavar="FAMILY.PARAM=VALUE",
                    help="a shape-table override, as bench kernels --tune (repeatable)")
    args = ap.parse_args()
    tune = [arg for item in args.tune for arg in ("--tune", item)]
    cfg = resolve_config(parse(["bench", "kernels", "--layers", "6", "--window", "4", "--accept", "3",
                                "--ring-len", "16", "--state-dtype", args.state_dtype, "--batches", args.batches,
                                "--strategies", "none", "--baselines", "plain_ring", *tune]))
    with contextlib.ExitStack() as overrides:
        for family, param, value in cfg.tune:
            overrides.enter_context(tuning.override(family, **{param: value}))
        _parts(cfg, args.blocks)


def _parts(cfg, blocks: int) -> None:
    """Each batch's three replays (module docstring)."""
    copy_bw = common.copy_bandwidth(cfg.device)
    extra = "".join(f", {f}.{p}={v}" for f, p, v in cfg.tune)
    dtype = str(cfg.state_dtype).removeprefix("torch.")
    print(f"{torch.cuda.get_device_name()}; {dtype} states; copy bandwidth {copy_bw / 1e9:.0f} GB/s{extra}")
    for batch in cfg.batches:
        r = RingDecodeStep(cfg, "plain_ring", batch, _generator(cfg, "plain_ring", batch, 0))
        r.prepare()
        s, x, buf = r.pool.strategy, r.plain_inputs, r.pool.strategy.buf

        def decode():
            for layer in range(cfg.layers):
                r.outputs[layer] = s.decode(layer, x.q[layer], x.k[layer], x.v[layer], x.a[layer], x.b[layer],
                                            r.plain_batch)
            # End the step on the host alone (the protocol's bookkeeping; a commit would
            # move the cursors, an abort fold the flush rows' history again): the
            # warm-up calls before the capture then pass its checks.
            s._close_step()

        graph = common.capture_graph(decode)
        floor_us = cfg.step_shape(batch).state_bytes / copy_bw * 1e6
        flags = buf.is_flush.clone()
        wp = buf.write_pos[: batch].float()
        has = buf.write_pos > 0
        rows = {"as is": flags, "token rows": torch.zeros_like(flags), "flush rows": has.to(flags.dtype)}
        print(f"\nbatch {batch}: floor {floor_us:.1f} us a layer; mean write_pos {wp.mean():.2f}, "
              f"flush rows as is {int((flags[: batch] != 0).sum())} of {batch}")
        for name, value in rows.items():
            buf.is_flush.copy_(value)
            t = common.time_graphs([graph], steps_per_block=20, blocks=blocks)
            us = t.us_per_step / cfg.layers
            print(f"  {name:10s} {us:8.1f} us a layer  {us / floor_us:5.2f}x the floor")
        buf.is_flush.copy_(flags)
        del graph, r
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
