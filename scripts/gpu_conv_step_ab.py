"""A decode or verify step's conv alone on the GPU: one launch per layer at a step's
shape (B windows of T tokens, Qwen3.5's q|k|v channels, bf16), timed per channel block
(``conv.CONV_BLOCK``, channels a program, read at each launch), against its bytes
(the windows' inputs and outputs, the conv state's entries read, and the entries
written: the advanced state when T = 1, the window buffer otherwise) at the card's copy
rate. 6 launches (a step's GDN layers) in a CUDA graph, replayed; the conv state
packed ``[C, W - 1]`` (``per-channel``) or stored ``[W - 1, C]`` (``per-entry``, the pool's).

    PYTHONPATH=src python3 scripts/gpu_conv_step_ab.py --batches 256,64 --windows 1,4 --blocks 256,1024 \
        [--layouts per-entry,per-channel]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from replayssm.bench.common import time_cuda
from replayssm.ops import conv
from replayssm.ops.conv import causal_conv_verify
from replayssm.ops.guards import host_index

LAYERS = 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="256,64")
    ap.add_argument("--windows", default="1,4")
    ap.add_argument("--blocks", default="256,1024", help="conv.CONV_BLOCK settings, comma-separated")
    ap.add_argument("--layouts", default="per-entry,per-channel",
                    help="conv state layouts: per-entry ([W - 1, C] in memory, the pool's) and/or per-channel")
    args = ap.parse_args()
    h, k, hv, v, w = 16, 128, 32, 128, 4
    c = 2 * h * k + hv * v
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.empty(1 << 28, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    rate = 2 * src.numel() * 2 / time_cuda(lambda: dst.copy_(src), warmup=5, repeats=20)
    weight = torch.randn(c, w, device=dev, generator=g).to(torch.bfloat16)
    bias = torch.randn(c, device=dev, generator=g).to(torch.bfloat16)
    for b in map(int, args.batches.split(",")):
        for t in map(int, args.windows.split(",")):
            n = b * t
            x = torch.randn(n, c, device=dev, generator=g).to(torch.bfloat16)
            packed = torch.randn(b, c, w - 1, device=dev, generator=g).to(torch.bfloat16)
            states = {"per-channel": packed, "per-entry": packed.mT.contiguous().mT}  # same values, [W - 1, C] stored
            buf = torch.zeros(b, t, c, device=dev, dtype=torch.bfloat16)
            # index tensors with their host copies recorded, as an engine's step holds them:
            # checked once on the host, not by device kernels at every launch
            slots = host_index(torch.randperm(b).tolist(), dev)
            cu = host_index(range(0, n + 1, t), dev)
            decode = t == 1
            written = (w - 1) if decode else t
            floor = LAYERS * (2 * n * c + b * c * (w - 1 + written)) * 2 / rate
            print(f"B {b} T {t}: bytes floor {1e6 * floor:.1f} us for {LAYERS} launches at {rate / 1e9:.0f} GB/s")
            for layout, block in itertools.product(args.layouts.split(","), map(int, args.blocks.split(","))):
                conv.CONV_BLOCK = block
                state = states[layout]

                def layers():
                    for _ in range(LAYERS):
                        if decode:
                            causal_conv_verify(x, state, weight, bias, slots, cu, update_state=True, max_len=1)
                        else:
                            causal_conv_verify(x, state, weight, bias, slots, cu, window_buf=buf)

                layers()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    layers()
                dt = time_cuda(graph.replay, warmup=3, repeats=20)
                print(f"  {layout}, {block} channels a program: {1e6 * dt:.1f} us, {dt / floor:.2f}x the floor")


if __name__ == "__main__":
    main()
