"""The prompt pass's causal attention alone on the GPU, per SDPA backend: ``B`` prompts
of ``T`` tokens (the padded ``[B + 1, T]`` layout a prompt pass builds), Qwen3.5's 16
query heads and 2 key/value heads of 256, bf16; time and TFLOP/s of the causal products
(``4 heads d T (T + 1) / 2`` a row), and each backend's largest distance from the flash
backend's output.

    PYTHONPATH=src python3 scripts/gpu_prompt_attention_ab.py --case 16x2048

Backends: ``flash`` with grouped keys (the engine's choice today), ``cudnn`` and
``efficient`` with grouped keys where SDPA takes them, else with the keys and values
repeated per query head (the repeat is timed with the call); with ``--flex``, also
``flex_attention`` compiled with a causal block mask. A backend that refuses the inputs
is reported, not replaced. ``--engine``: instead, the engine's own prompt attention
(``kv_cache._fresh_attention``: its backend choice, the padded layout gathered from the
packed tokens and the outputs gathered back) on the pass's packed rows, ``B`` prompts
and a padding request of 256 tokens; with ``PYTHONPATH`` at another tree, that tree's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from replayssm.bench.common import time_cuda


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="16x2048", help="BATCHxPROMPT_LEN")
    ap.add_argument("--flex", action="store_true", help="also time flex_attention (compiled; slow to start)")
    ap.add_argument("--engine", action="store_true", help="time the engine's prompt attention instead")
    args = ap.parse_args()
    b, t = (int(v) for v in args.case.split("x"))
    rows, heads, kv_heads, d = b + 1, 16, 2, 256
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    if args.engine:
        engine_attention(b, t, heads, kv_heads, d, g)
        return
    q = torch.randn(rows, heads, t, d, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(rows, kv_heads, t, d, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(rows, kv_heads, t, d, device=dev, generator=g, dtype=torch.bfloat16)
    flops = 4 * heads * d * t * (t + 1) / 2 * b  # the real prompts' rows; the padding row rides along
    print(f"prompt attention {b} x {t} (+1 padding row), {heads} heads / {kv_heads} kv of {d}, bf16: "
          f"{flops / 1e12:.3f} TFLOP; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    ref = None
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in (True, False):
            def call():
                kk, vv = (k, v) if gqa else (k.repeat_interleave(heads // kv_heads, 1),
                                             v.repeat_interleave(heads // kv_heads, 1))
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
            try:
                out = call()
            except RuntimeError as e:
                print(f"  {name:9s} gqa={gqa!s:5s}: refused ({str(e).splitlines()[0][:100]})")
                continue
            if ref is None:
                ref = out.float()
            diff = (out.float() - ref).abs().max().item()
            dt = time_cuda(call)
            print(f"  {name:9s} gqa={gqa!s:5s}: {1e3 * dt:.3f} ms, {flops / dt / 1e12:.0f} TFLOP/s, "
                  f"max |out - flash| {diff:.2e}")
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b_, h_, i, j: i >= j, None, None, t, t, device=dev)
        flex = torch.compile(flex_attention)
        try:
            out = flex(q, k, v, block_mask=mask, enable_gqa=True)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            print(f"  flex: refused ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            return
        dt = time_cuda(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True))
        print(f"  flex      gqa=True : {1e3 * dt:.3f} ms, {flops / dt / 1e12:.0f} TFLOP/s, "
              f"max |out - flash| {(out.float() - ref).abs().max().item():.2e}")


def engine_attention(b: int, t: int, heads: int, kv_heads: int, d: int, g: torch.Generator) -> None:
    from replayssm.engine import kv_cache

    lengths = [t] * b + [256]
    n = sum(lengths)
    q = torch.randn(n, heads, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(n, kv_heads, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).cuda()
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1].cuda()
    col = torch.arange(n, device="cuda") - starts[row]
    layout = kv_cache.PromptLayout(len(lengths), t, torch.stack([row, col, col, row]))
    flops = 4 * heads * d * t * (t + 1) / 2 * b
    dt = time_cuda(lambda: kv_cache._fresh_attention(layout, q, k, v, d**-0.5))
    print(f"engine prompt attention {b} x {t} + 256 padding, {heads} / {kv_heads} heads of {d}, bf16: "
          f"{1e3 * dt:.3f} ms, {flops / dt / 1e12:.0f} TFLOP/s of the prompts' causal products")


if __name__ == "__main__":
    main()
