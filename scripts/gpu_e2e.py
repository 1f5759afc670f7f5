#!/usr/bin/env python3
"""End-to-end tokens per second on a GPU: plain decoding vs each strategy, batch 1 and 64.

    python scripts/gpu_e2e.py                    # the defaults below, table on stdout
    python scripts/gpu_e2e.py --json out.json    # also the raw numbers

The model is a random-weight Qwen3.5-architecture model built in process with realistic
GDN shapes (H=16, HV=32, K=V=128; hidden 2048, 8 layers = 6 GDN + 2 full attention,
dense MLP, byte vocabulary), in bf16 with fp32 GDN states. Its token embedding is drawn
large (std 1.0) so greedy decoding falls into loops and n-gram drafting (k=3) hits;
the accept length is printed next to every number. Each configuration is generated once
untimed (Triton compiles then), then timed; generation is greedy and ignores
end-of-sequence, so every mode emits exactly the same number of tokens.

Columns: tok/s = generated tokens / (prompt prefill + decoding) wall time; decode tok/s
excludes the prefill; accept = mean tokens emitted per request-step; state/req = GDN
state pool bytes per request (checkpoint + conv + the strategy's buffers, all layers);
agree = tokens equal to plain decoding at the same position (all requests), which the
exact strategies should keep at 100% unless a bf16 near-tie flips between differently
shaped GEMMs (the fixed-shape exactness test is tests/gpu/test_engine_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from replayssm.engine.adapter import HybridEngine  # noqa: E402
from replayssm.engine.drafters import NgramDrafter  # noqa: E402
from replayssm.engine.generator import SpeculativeGenerator  # noqa: E402
from replayssm.engine.tiny import build_tiny_model  # noqa: E402

MID_SIZE = dict(
    hidden_size=2048, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, initializer_range=0.02,
)
MODES = ("plain", "snapshot", "fold", "circular")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--num-draft", type=int, default=3)
    p.add_argument("--layers", type=int, default=8, help="decoder layers (every 4th is full attention)")
    p.add_argument("--family", choices=("qwen3_5", "qwen3_next"), default="qwen3_5")
    p.add_argument("--embed-std", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", help="write the rows to this file")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; pass --device cpu for a (slow) smoke run", file=sys.stderr)
        return 2
    overrides = dict(MID_SIZE, num_hidden_layers=args.layers)
    if args.family == "qwen3_next":
        overrides.update(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512,
                         shared_expert_intermediate_size=512)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_tiny_model(args.family, seed=args.seed, dtype=dtype, device=device, embed_std=args.embed_std,
                             **overrides)
    cfg = model.config
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    print(f"# {gpu}; torch {torch.__version__}, triton {triton_version}; {args.family} random weights, "
          f"{cfg.num_hidden_layers} layers ({cfg.layer_types.count('linear_attention')} GDN), "
          f"hidden {cfg.hidden_size}, "
          f"GDN H={cfg.linear_num_key_heads} HV={cfg.linear_num_value_heads} K={cfg.linear_key_head_dim} "
          f"V={cfg.linear_value_head_dim}, {dtype} activations, fp32 states; n-gram drafts k={args.num_draft}; "
          f"prompt {args.prompt_len} tokens, {args.max_new_tokens} new tokens per request, greedy")
    rows = []
    g = torch.Generator().manual_seed(args.seed)
    for batch in args.batches:
        prompts = [torch.randint(0, 256, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
        max_len = args.prompt_len + args.max_new_tokens + args.num_draft + 2
        plain_tokens = None
        for mode in args.modes:
            spec = mode != "plain"
            eng = HybridEngine(model, strategy=mode if spec else "fold", num_slots=batch,
                               window=args.num_draft + 1 if spec else 1, max_len=max_len)

            def generate(n):
                gen = SpeculativeGenerator(eng, NgramDrafter() if spec else None, num_draft=args.num_draft)
                return gen.generate(prompts, n)

            generate(min(16, args.max_new_tokens))  # compile + warm up
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            t0 = time.perf_counter()
            res = generate(args.max_new_tokens)
            wall = time.perf_counter() - t0
            if mode == "plain":
                plain_tokens = res.tokens
            agree = None
            if plain_tokens is not None:
                same = sum(a == b for x, y in zip(res.tokens, plain_tokens) for a, b in zip(x, y))
                agree = same / sum(len(y) for y in plain_tokens)
            row = dict(
                batch=batch, mode=mode, tokens=res.num_generated, steps=res.steps, wall_s=wall,
                tok_s=res.tokens_per_second, decode_tok_s=res.decode_tokens_per_second,
                accept=res.mean_accept_length, acceptance_rate=res.acceptance_rate,
                state_bytes_per_request=eng.pool.nbytes_per_slot()["total"], agree=agree,
                prefill=eng.prefill_kernel,
            )
            rows.append(row)
            print(f"  batch {batch:>3} {mode:<9} {row['tok_s']:>9.1f} tok/s  accept {row['accept']:.2f}", flush=True)
            del eng
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print("\n| batch | mode | tok/s | decode tok/s | speed-up | accept | steps | state/req (MiB) | agree |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    base = {r["batch"]: r["tok_s"] for r in rows if r["mode"] == "plain"}
    for r in rows:
        up = r["tok_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
        agree = "-" if r["agree"] is None or r["mode"] == "plain" else f"{100 * r['agree']:.1f}%"
        print(f"| {r['batch']} | {r['mode']} | {r['tok_s']:.1f} | {r['decode_tok_s']:.1f} | {up:.2f}x | "
              f"{r['accept']:.2f} | {r['steps']} | {r['state_bytes_per_request'] / 2**20:.1f} | {agree} |")
    print(f"\nprompt prefill of the GDN layers: {rows[0]['prefill'] if rows else '-'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": gpu, "args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
