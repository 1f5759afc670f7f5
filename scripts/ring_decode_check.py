#!/usr/bin/env python3
"""Greedy plain decoding through circular's ring against the recurrence, over a long run.

    python scripts/ring_decode_check.py                      # the embedded model, 8192 tokens, fp32, CPU
    python scripts/ring_decode_check.py --tokens 2048 --json ring_decode.json

Both engines decode the same prompt greedily in lockstep on the same model (fp32): one
with its plain steps through the ring (``circular``, ring length ``--ring-len``, window
``--window``: a flush every ``L - 2T + 1`` tokens), one through the exact recurrence
(``fold``), see :func:`replayssm.testing.ring_decoding.compare_plain_decoding`. Prints
whether every token agrees, or the first difference with its logit margins, and the
largest logit difference before it. Exits 0 when every token agrees, 1 at a difference
(a greedy near-tie can flip: the ring's outputs equal the recurrence's to rounding).
About 10 minutes on one CPU core for 8192 tokens with the embedded model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

DEFAULT_PROMPT = 'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the command line and run."""\n'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ring_decode_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="checkpoint directory or 'embedded' (default)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens to generate (default 8192)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: the start of a Python file)")
    parser.add_argument("--window", type=int, default=4, help="T of the ring's pool (default 4)")
    parser.add_argument("--ring-len", type=int, default=16, help="L (default 16)")
    parser.add_argument("--device", default="cpu", help="default cpu")
    parser.add_argument("--backend", default="reference", help="op backend (default reference)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)

    from replayssm.engine.loading import load_model, load_tokenizer
    from replayssm.testing.ring_decoding import compare_plain_decoding

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32, device=args.device)
    prompt = load_tokenizer(args.model)(args.prompt)["input_ids"]
    t0 = time.perf_counter()

    def progress(n):
        if n % 512 == 0:
            print(f"  {n} tokens equal ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    try:
        result = compare_plain_decoding(model, prompt, args.tokens, window=args.window, ring_len=args.ring_len,
                                        backend=args.backend, on_step=progress)
    except ValueError as e:
        print(f"ring_decode_check.py: error: {e}", file=sys.stderr)
        return 2
    result.update(model=args.model, seconds=time.perf_counter() - t0, torch=torch.__version__)
    d = result["first_difference"]
    print(f"{args.model}, fp32, {args.device}/{args.backend}: {result['prompt_tokens']} prompt tokens, ring L="
          f"{args.ring_len} T={args.window}, {result['flushes']} flushes")
    if d is None:
        print(f"greedy ring decoding equals recurrent plain decoding over {result['tokens']} tokens")
    else:
        print(f"first difference at generated token {d['index']}: ring {d['ring_token']}, recurrence "
              f"{d['recurrence_token']}; the recurrence's top-2 logit margin {d['recurrence_margin']:.3e}, the "
              f"ring's {d['ring_margin']:.3e}")
    print(f"largest |logit difference| before it: {result['max_logit_error']:.3e} (logits up to "
          f"{result['logit_scale']:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
