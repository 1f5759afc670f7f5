"""Two pieces of the graphed step's glue timed alone, each variant beside the others in
one run, on Qwen3.5 shapes (bench e2e's ``qwen3.5-shapes``):

* the window attention (``engine/attention.py``) of a verify step (``T`` = 4 queries a
  row) and of plain decoding (``T`` = 1): 16 query heads on 2 key heads of 256, a slot's
  keys ``--context`` long, at each ``attention.KV_STAGES``; its outputs against the
  reference backend's;
* the conv commit (``ops/conv.py``): 6 GDN layers' conv states (8192 channels, 3
  entries) advanced by 3 accepted inputs, at each channel block ``conv.CONV_BLOCK``
  (which the verify shares) and conv state layout (``--layouts``); its states bit for
  bit the reference's.

Each op runs from a CUDA graph of 10 calls (``triton.testing.do_bench``, median), on
inputs that rotate among 4 sets so that repeats do not time the L2. Bytes are the
fewest each op must move (keys and values read once; the commit's buffered inputs read
and its states written), against a device-to-device copy timed in the same run.

    PYTHONPATH=src python3 scripts/gpu_glue_ab.py [--batches 64,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from replayssm.engine import attention
from replayssm.ops import conv

HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256
LAYERS, CHANNELS, TAPS = 6, 8192, 4


def copy_bandwidth() -> float:
    x = torch.randn(1 << 28, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=100, return_mode="median")
    return 2 * x.numel() * 4 / (ms * 1e-3)


def graphed_us(fn, sets: int) -> float:
    """Median µs of one call of ``fn(i)``, from a CUDA graph of 10 calls over ``sets``
    input sets."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(sets):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(10):
            fn(i % sets)
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, warmup=20, rep=200, return_mode="median") * 1e3 / 10


def attention_rows(batch: int, t: int, context: int, stages: list[int], bw: float) -> list[dict]:
    sets, rows = 4, []
    slots = batch + 1
    kc = [torch.randn(slots, KV_HEADS, context + 8, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    vc = [torch.randn_like(k) for k in kc]
    q = [torch.randn(batch, t, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    slot = torch.randperm(slots, device="cuda")[:batch].to(torch.int32)
    starts = torch.randint(context // 2, context - t + 1, (batch,), device="cuda", dtype=torch.int32)
    scale = HEAD_DIM ** -0.5
    ref = attention.slot_attention(q[0], kc[0], vc[0], slot, starts, scale, backend="reference").float()
    seen = (starts.long() + t).sum().item()  # keys the rows see, each read once per key head
    nbytes = 2 * seen * KV_HEADS * HEAD_DIM * 2 + 2 * q[0].numel() * 2
    default = attention.KV_STAGES
    for st in stages:
        attention.KV_STAGES = st
        out = attention.slot_attention(q[0], kc[0], vc[0], slot, starts, scale, backend="triton").float()
        err = ((out - ref).norm() / ref.norm()).item()
        us = graphed_us(lambda i: attention.slot_attention(q[i], kc[i], vc[i], slot, starts, scale,
                                                           backend="triton"), sets)
        rows.append(dict(op="attention", batch=batch, T=t, context=context, kv_stages=st, us=us,
                         floor_us=nbytes / bw * 1e6, rel_err=err))
    attention.KV_STAGES = default
    return rows


def commit_rows(batch: int, blocks: list[int], bw: float, layouts: list[str], window: int = 4,
                accepted: int = 3) -> list[dict]:
    """The conv commit at each channel block and conv state layout: ``per-channel``
    (``[C, W - 1]`` packed) or ``per-entry`` (the same values stored ``[W - 1, C]``, the
    pool's own layout)."""
    return [row for layout in layouts for row in commit_layout_rows(batch, blocks, bw, layout, window, accepted)]


def commit_layout_rows(batch: int, blocks: list[int], bw: float, layout: str, window: int,
                       accepted: int) -> list[dict]:
    if layout not in ("per-channel", "per-entry"):
        raise ValueError(f"unknown conv state layout {layout!r}")
    sets, rows = 4, []
    slots = batch + 1
    state = [torch.randn(LAYERS, slots, CHANNELS, TAPS - 1, device="cuda", dtype=torch.bfloat16)
             for _ in range(sets)]
    if layout == "per-entry":
        state = [s.mT.contiguous().mT for s in state]
    buf = [torch.randn(LAYERS, slots, window, CHANNELS, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    idx = torch.randperm(slots, device="cuda")[:batch].to(torch.int32)
    acc = torch.full((batch,), accepted, device="cuda", dtype=torch.int32)
    want = state[0].clone()
    conv.causal_conv_commit(want, buf[0], idx, acc, backend="reference")
    moved = min(accepted, TAPS - 1)  # entries taken from the buffer; the rest shift within the state
    nbytes = LAYERS * batch * CHANNELS * 2 * (moved + (TAPS - 1) + (TAPS - 1 - moved))
    default = conv.CONV_BLOCK
    for bc in blocks:
        conv.CONV_BLOCK = bc
        got = state[0].clone()
        conv.causal_conv_commit(got, buf[0], idx, acc, backend="triton")
        work = [s.clone() for s in state]
        us = graphed_us(lambda i: conv.causal_conv_commit(work[i], buf[i], idx, acc, backend="triton"), sets)
        rows.append(dict(op="conv_commit", batch=batch, block=bc, layout=layout, us=us, floor_us=nbytes / bw * 1e6,
                         bit_equal=bool(torch.equal(got, want))))
    conv.CONV_BLOCK = default
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--blocks", default="256,1024,2048")
    ap.add_argument("--layouts", default="per-entry,per-channel",
                    help="conv state layouts for the commit: per-entry ([W - 1, C] in memory, the pool's) and/or "
                         "per-channel ([C, W - 1])")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for b in map(int, a.batches.split(",")):
        for t in (4, 1):
            rows += attention_rows(b, t, a.context, [int(x) for x in a.stages.split(",")], bw)
        rows += commit_rows(b, [int(x) for x in a.blocks.split(",")], bw, a.layouts.split(","))
    print(f"copy {bw / 1e12:.2f} TB/s")
    for r in rows:
        what = (f"T={r['T']} stages={r['kv_stages']} rel_err={r['rel_err']:.1e}" if r["op"] == "attention"
                else f"{r['layout']} block={r['block']} bits={'equal' if r['bit_equal'] else 'DIFFER'}")
        print(f"{r['op']:<12} B={r['batch']:>3} {what:<46} {r['us']:8.2f} us  floor {r['floor_us']:7.2f}  "
              f"x{r['us'] / r['floor_us']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"copy_Bps": bw, "rows": rows}, f, indent=1)
    bad = [r for r in rows if r.get("bit_equal") is False or r.get("rel_err", 0) > 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
