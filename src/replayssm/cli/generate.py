"""``replayssm generate``: speculative generation with a local Hugging Face checkpoint.

    replayssm generate --model DIR --prompt "..." --draft ngram|mtp|model|none \\
        --strategy snapshot|fold|circular [--draft-model DIR] [--temperature T --top-p P]

Streams the text of a single prompt as it is accepted (several prompts are printed when
they finish) and ends with the mean accept length, tokens per second and the memory of
the GDN state pool and the KV cache.
"""

from __future__ import annotations

import argparse
import sys

from ..engine.factory import DRAFT_CHOICES
from ..llm import STATE_DTYPES
from ..strategies import STRATEGY_NAMES
from . import common
from .args import branching, chain_from, device_name, nonneg_float, nonneg_int, num_draft, positive_int, probability, utf8_text

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded",
                        help="local checkpoint directory (config, safetensors, tokenizer), or 'embedded': the "
                             "checkpoint shipped in the package, trained by replayssm train (default)")
    parser.add_argument("--prompt", action="append", required=True, type=utf8_text,
                        help="prompt text; repeat for a batch of requests")
    parser.add_argument("--draft", choices=DRAFT_CHOICES, default="ngram",
                        help="drafter: n-gram prompt lookup, the checkpoint's MTP head, a draft model, "
                             "or none (plain decoding)")
    parser.add_argument("--draft-model", help="draft model directory (with --draft model), or 'embedded-draft': "
                             "the draft model shipped beside the embedded one")
    parser.add_argument("--strategy", choices=STRATEGY_NAMES, default="fold",
                        help="GDN verify/rollback strategy (default fold)")
    parser.add_argument("--num-draft", type=num_draft, default=3,
                        help="draft tokens per step k, at most 15 (window = k + 1; default 3)")
    parser.add_argument("--tree", type=branching, default=None, metavar="BRANCHING",
                        help="verify draft trees of this shape instead of chains (children per depth, e.g. 3,2,1; "
                             "--draft ngram, mtp or model; replaces --num-draft)")
    parser.add_argument("--chain-from", type=chain_from, default=None, metavar="B",
                        help="with --tree: batches of at least B prompts (by bucket) verify the tree's best chain, its "
                             "spine, instead of the whole tree; 'measured': the bucket measured for this model, "
                             "drafter and tree")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens to generate per prompt (default 256)")
    parser.add_argument("--temperature", type=nonneg_float, default=0.0, help="softmax temperature; 0 = greedy (default)")
    parser.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass in (0, 1]; 1 keeps every token (default)")
    parser.add_argument("--top-k", type=nonneg_int, default=0, help="keep the k most likely tokens; 0 keeps all (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="model dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    parser.add_argument("--state-dtype", choices=STATE_DTYPES, default="float32",
                        help="dtype of the GDN checkpoints: float32 (default) or bfloat16 (half the state memory; "
                             "tokens can differ from float32 states)")
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens whatever comes")
    parser.add_argument("--compare-plain", action="store_true",
                        help="also decode plainly and report the speed-up and (greedy) token agreement")
    parser.add_argument("--no-stream", action="store_true", help="print outputs only when they finish")


def check_args(args) -> None:
    """Check what needs several options or a look at the checkpoint, before anything
    is loaded; raises ``ValueError`` naming the option. ``embedded`` model names become
    the package's checkpoint directory here, and the prompts become token ids
    (``args.prompt_ids``), checked against the model's length limit and the device's
    memory."""
    args.model = common.check_model("--model", args.model)
    if args.draft == "model":
        if not args.draft_model:
            raise ValueError("--draft model needs --draft-model DIR")
        args.draft_model = common.check_model("--draft-model", args.draft_model)
        common.check_same_tokenizer("--draft-model", args.draft_model, args.model)
    elif args.draft_model:
        raise ValueError(f"--draft-model is only used with --draft model, not --draft {args.draft}")
    if args.draft == "mtp":
        common.check_mtp("--draft mtp", args.model)
    if args.chain_from is not None and args.tree is None:
        raise ValueError("--chain-from chooses between a draft tree and its spine: it needs --tree")
    if args.tree is not None:
        from ..engine.factory import MAX_WINDOW
        from ..engine.trees import StaticTree

        if args.draft not in ("ngram", "mtp", "model"):
            raise ValueError(f"--tree needs --draft ngram, mtp or model, not --draft {args.draft}")
        nodes = StaticTree.from_branching(args.tree).num_nodes
        if nodes > MAX_WINDOW:
            raise ValueError(f"--tree {','.join(map(str, args.tree))} has {nodes} nodes; a window holds at most "
                             f"{MAX_WINDOW}")
        args.num_draft = nodes - 1  # the window: the tree's nodes
        if args.chain_from == "measured":
            from ..engine.loading import shipped_model_name
            from ..engine.trees import measured_chain_from

            args.chain_from = measured_chain_from(shipped_model_name(args.model), args.draft, args.tree)
    from ..engine.loading import load_tokenizer

    args.prompt_ids = encode_prompts(load_tokenizer(args.model), args.prompt, chat=args.chat)
    for i, ids in enumerate(args.prompt_ids):
        if not ids:
            raise ValueError(f"--prompt {args.prompt[i]!r} encodes to no tokens")
    args.max_len = common.check_lengths(args.model, args.prompt_ids, args.max_new_tokens, num_draft=args.num_draft,
                                        dtype=args.dtype, device=args.device)


def encode_prompts(tokenizer, texts: list[str], *, chat: bool = False) -> list[list[int]]:
    """Token ids of each text (wrapped in the tokenizer's chat template with ``chat``)."""
    if not chat:
        return [tokenizer.encode(p, add_special_tokens=False) for p in texts]
    out = []
    for p in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids))
    return out


def main(args) -> int:
    import torch

    from ..engine.adapter import HybridEngine
    from ..engine.factory import make_drafter
    from ..engine.generator import SpeculativeGenerator, StepGenerator
    from ..engine.loading import eos_token_ids, load_model, load_tokenizer
    from ..engine.sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    tokenizer = load_tokenizer(args.model)
    prompts = args.prompt_ids
    eos = [] if args.ignore_eos else eos_token_ids(args.model, tokenizer)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    batch = len(prompts)
    max_len = args.max_len
    plain = args.draft == "none"
    engine = HybridEngine(model, strategy=args.strategy, num_slots=batch, window=1 if plain else args.num_draft + 1,
                          max_len=max_len, state_dtype=getattr(torch, args.state_dtype))
    tree = None
    if args.tree is not None:
        from ..engine.trees import StaticTree

        tree = StaticTree.from_branching(args.tree, engine.device)
    drafter = make_drafter(args.draft, engine, model_dir=args.model, draft_model_dir=args.draft_model,
                           sampling=sampling, batch=batch, max_len=max_len, tree=tree)
    shape = f"k={args.num_draft}" if tree is None else f"tree {tree.describe()} ({tree.num_nodes} nodes)"
    print(f"model {args.model} ({engine.family}, {model.dtype}, {engine.pool.state_dtype} states, {engine.device}); "
          f"draft {args.draft}, strategy {args.strategy}, {shape}; prompt prefill: {engine.prefill_kernel}",
          file=sys.stderr)

    stream = batch == 1 and not args.no_stream
    shown = [""]
    produced: list[int] = []

    def on_tokens(i, toks):
        if not stream or not toks:
            return
        produced.extend(toks)
        text = tokenizer.decode(produced, skip_special_tokens=True)
        if text.startswith(shown[0]):
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    torch.manual_seed(args.seed)  # static steps sample from torch's generator of the device
    if args.draft == "model" and tree is None:  # the draft model decodes on the host between steps
        gen = SpeculativeGenerator(engine, drafter, num_draft=args.num_draft, sampling=sampling, eos_token_ids=eos,
                                   seed=args.seed)
    else:  # one static step per decode step, a CUDA graph replay on a GPU
        gen = StepGenerator(engine, drafter, num_draft=args.num_draft, sampling=sampling, eos_token_ids=eos, tree=tree,
                            chain_from=args.chain_from)
    result = gen.generate(prompts, args.max_new_tokens, on_tokens=on_tokens)
    if stream:
        print()
    else:
        for i, toks in enumerate(result.tokens):
            print(f"--- [{i}] {args.prompt[i]!r}")
            print(tokenizer.decode(toks, skip_special_tokens=True))
    print(f"generated {result.num_generated} tokens in {result.steps} steps "
          f"(prefill {result.prefill_s:.2f}s, decode {result.decode_s:.2f}s)")
    if not plain:
        print(f"accept length {result.mean_accept_length:.2f} tokens/step "
              f"(drafted {result.drafted}, accepted {result.accepted}, rate {result.acceptance_rate:.2f})")
    print(f"tokens/s {result.tokens_per_second:.1f} end to end, {result.decode_tokens_per_second:.1f} decoding")
    print(f"state memory: {common.describe_memory(engine)}")
    if args.compare_plain and not plain:
        base_engine = HybridEngine(model, strategy=args.strategy, num_slots=batch, window=1, max_len=max_len,
                                   state_dtype=engine.pool.state_dtype)
        base = StepGenerator(base_engine, None, sampling=sampling, eos_token_ids=eos)
        ref = base.generate(prompts, args.max_new_tokens)
        print(f"plain decoding: tokens/s {ref.tokens_per_second:.1f}; speed-up "
              f"{result.tokens_per_second / max(ref.tokens_per_second, 1e-9):.2f}x")
        if sampling.greedy:
            same = sum(a == b for x, y in zip(result.tokens, ref.tokens) for a, b in zip(x, y))
            total = sum(max(len(x), len(y)) for x, y in zip(result.tokens, ref.tokens))
            print(f"greedy agreement with plain decoding: {same}/{total} tokens"
                  + ("" if result.tokens == ref.tokens else "  (OUTPUTS DIFFER)"))
            if result.tokens != ref.tokens:
                return 1
    return 0
