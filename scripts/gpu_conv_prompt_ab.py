"""The prompt conv alone on the GPU: one launch at a prompt pass's shape (B prompts of P
tokens and a padding row, Qwen3.5's q|k|v channels in planes, bf16, the state advanced),
timed per tile setting of the prompt kernel, against its bytes (one read and one write
of every channel of every token) at the card's copy rate.

    PYTHONPATH=src python3 scripts/gpu_conv_prompt_ab.py --case 16x2048 --tiles default,256x32x16

``--tiles BCxBTxU,...`` sets ``conv.CONV_BLOCK`` (channels a program),
``CONV_TOKEN_BLOCK`` (a long window's tokens a program) and ``CONV_TOKEN_GROUP`` (the
tokens whose rows a program loads together), read at each launch; ``default`` runs the
module's values. Each setting: 5 warm-up launches, then the median of 20 CUDA-event
timings, each on a fresh copy of the state.
"""

from __future__ import annotations

import argparse

import torch

from replayssm.bench.common import time_cuda
from replayssm.ops import conv
from replayssm.ops.conv import causal_conv_verify


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="16x2048", help="BATCHxPROMPT_LEN")
    ap.add_argument("--tiles", default="default", help="BCxBTxU settings, comma-separated, or 'default'")
    args = ap.parse_args()
    b, p = (int(v) for v in args.case.split("x"))
    h, k, hv, v, w = 16, 128, 32, 128, 4
    c = 2 * h * k + hv * v
    pad = 256
    n = b * p + pad
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, c, device=dev, generator=g).to(torch.bfloat16)
    weight = torch.randn(c, w, device=dev, generator=g).to(torch.bfloat16)
    bias = torch.randn(c, device=dev, generator=g).to(torch.bfloat16)
    state0 = torch.randn(b + 1, c, w - 1, device=dev, generator=g).to(torch.bfloat16)
    slots = torch.tensor(list(range(b)) + [-1], dtype=torch.int32, device=dev)
    cu = torch.tensor([i * p for i in range(b + 1)] + [n], dtype=torch.int32, device=dev)
    parts = (h * k, h * k, hv * v)
    # The card's copy rate: a device-to-device copy of the same bytes.
    src = torch.empty(2 * n * c, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    rate = 2 * src.numel() * 2 / time_cuda(lambda: dst.copy_(src), warmup=5, repeats=20)
    floor = 2 * n * c * 2 / rate
    print(f"prompt conv {b} x {p} (+{pad} padding), C = {c}: bytes floor {1e3 * floor:.3f} ms "
          f"at {rate / 1e9:.0f} GB/s")
    for tile in args.tiles.split(","):
        if tile != "default":
            conv.CONV_BLOCK, conv.CONV_TOKEN_BLOCK, conv.CONV_TOKEN_GROUP = (int(t) for t in tile.split("x"))
        state = state0.clone()

        def once():
            state.copy_(state0)
            causal_conv_verify(x, state, weight, bias, slots, cu, update_state=True, max_len=p, parts=parts)

        dt = time_cuda(once, warmup=5, repeats=20)
        print(f"  {tile}: {1e3 * dt:.3f} ms, {dt / floor:.2f}x the floor")


if __name__ == "__main__":
    main()
