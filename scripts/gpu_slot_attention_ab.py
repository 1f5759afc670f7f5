"""The Triton slot attention alone at Qwen3.5's attention shapes (16 query heads on 2 key
heads of 256, bf16, gated, contexts 64-191): the committed warps rule
(:func:`~replayssm.engine.attention.attention_warps`) against 8 warps, µs a call from
graph replays (10 calls a graph), and whether the two give the same bits; with
``--key-splits``, the committed warps with each row's keys split into parts of those
many keys (``slot_attention``'s ``key_split``), and their largest difference from the
unsplit outputs.

    PYTHONPATH=src python3 scripts/gpu_slot_attention_ab.py [--batches 256,64] [--windows 4,1] [--key-splits 64,128]
"""

from __future__ import annotations

import argparse

import torch

from replayssm.engine import attention
from replayssm.ops.triton_common import arrival_counters, triton

HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 16, 2, 256, 256


def time_us(call, reps: int) -> float:
    """µs a call of ``call``, replayed from a graph of 10 calls after one warm replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps // 10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * (reps // 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,64")
    ap.add_argument("--windows", default="4,1")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--key-splits", default="", help="comma-separated key_split values to time beside (powers of two >= 64)")
    a = ap.parse_args()
    rule = attention.attention_warps
    g = torch.Generator(device="cuda").manual_seed(0)
    try:
        for b in map(int, a.batches.split(",")):
            for t in map(int, a.windows.split(",")):
                kc = torch.randn(b, KV_HEADS, CAPACITY, HEAD_DIM, device="cuda", generator=g).bfloat16()
                vc = torch.randn_like(kc)
                q = torch.randn(b, t, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
                gate = torch.randn(b * t, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
                slots = torch.randperm(b, device="cuda", generator=g).to(torch.int32)
                starts = torch.randint(64, 192, (b,), device="cuda", generator=g)

                def call():
                    return attention.slot_attention(q, kc, vc, slots, starts, HEAD_DIM**-0.5, gate=gate)

                block_m = max(16, triton.next_power_of_2(HEADS // KV_HEADS * t))  # the launcher's rows
                outs = []
                for name, warps in (("rule", rule), ("8 warps", lambda m, d, size: 8), ("rule again", rule)):
                    attention.attention_warps = warps
                    outs.append(call())
                    print(f"B {b} T {t} {name:10s} warps {warps(block_m, HEAD_DIM, q.element_size())}: "
                          f"{time_us(call, a.reps):8.2f} us", flush=True)
                print(f"B {b} T {t} same bits: {torch.equal(outs[0], outs[1])}")
                arrivals = arrival_counters("cuda")
                for split in (int(c) for c in a.key_splits.split(",") if c):
                    def split_call(split=split):
                        return attention.slot_attention(q, kc, vc, slots, starts, HEAD_DIM**-0.5, gate=gate,
                                                        key_split=split, arrivals=arrivals)

                    diff = (split_call().float() - outs[0].float()).abs().max().item()
                    print(f"B {b} T {t} key split {split:4d}: {time_us(split_call, a.reps):8.2f} us, "
                          f"largest difference from unsplit {diff:.2e}", flush=True)
    finally:
        attention.attention_warps = rule


if __name__ == "__main__":
    main()
