"""SDPA's cuDNN attention in a CUDA graph, on the GPU: the prompt pass's causal attention of
16 prompts of 2048 tokens and their padding row (Qwen3.5's 16 query heads over 2
key/value heads of 256, bf16, grouped keys as they are), timed at its first eager call
(cuDNN builds the shape's execution plan), its second, a call with other queries of the
same strides, the capture, three replays, and whether a replay equals an eager call.

    PYTHONPATH=src python3 scripts/gpu_sdpa_graph_probe.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    dev = torch.device("cuda")
    b, t, h, kvh, d = 17, 2048, 16, 2, 256
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, t, n, d, device=dev, generator=g, dtype=torch.bfloat16).transpose(1, 2)
               for n in (h, kvh, kvh))
    q2 = torch.randn(q.shape, device=dev, generator=g, dtype=torch.bfloat16)

    def call(query=q):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(query, k, v, is_causal=True, enable_gqa=True)

    def timed(label, fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        print(f"{label}: {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
        return out

    timed("eager 1st", call)
    timed("eager 2nd", call)
    timed("eager, other q of the same strides", lambda: call(q2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(graph):
        out = call()
    print(f"capture: {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    for i in range(3):
        timed(f"replay {i}", graph.replay)
    ref = call()
    graph.replay()
    torch.cuda.synchronize()
    print("replay equals eager:", torch.equal(out, ref), flush=True)


if __name__ == "__main__":
    main()
