"""``replayssm generate``: speculative generation with a local Hugging Face checkpoint.

    replayssm generate --model DIR --prompt "..." --draft ngram|mtp|model|none \\
        --strategy snapshot|fold|circular [--draft-model DIR] [--temperature T --top-p P]

Streams the text of a single prompt as it is accepted (several prompts are printed when
they finish) and ends with the mean accept length, tokens per second and the memory of
the GDN state pool and the KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..bench.args import device_name, nonneg_float, nonneg_int, positive_int, probability
from ..strategies import STRATEGY_NAMES

DRAFT_CHOICES = ("ngram", "mtp", "model", "none")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded",
                        help="local checkpoint directory (config, safetensors, tokenizer), or 'embedded': the "
                             "checkpoint shipped in the package, trained by replayssm train (default)")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text; repeat for a batch of requests")
    parser.add_argument("--draft", choices=DRAFT_CHOICES, default="ngram",
                        help="drafter: n-gram prompt lookup, the checkpoint's MTP head, a draft model, "
                             "or none (plain decoding)")
    parser.add_argument("--draft-model", help="draft model directory (with --draft model), or 'embedded-draft': "
                             "the draft model shipped beside the embedded one")
    parser.add_argument("--strategy", choices=STRATEGY_NAMES, default="fold",
                        help="GDN verify/rollback strategy (default fold)")
    parser.add_argument("--num-draft", type=positive_int, default=3, help="draft tokens per step (window = k + 1; default 3)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens to generate per prompt (default 256)")
    parser.add_argument("--temperature", type=nonneg_float, default=0.0, help="softmax temperature; 0 = greedy (default)")
    parser.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass in (0, 1]; 1 keeps every token (default)")
    parser.add_argument("--top-k", type=nonneg_int, default=0, help="keep the k most likely tokens; 0 keeps all (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="model dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens whatever comes")
    parser.add_argument("--compare-plain", action="store_true",
                        help="also decode plainly and report the speed-up and (greedy) token agreement")
    parser.add_argument("--no-stream", action="store_true", help="print outputs only when they finish")


def _has_mtp_weights(model_dir: str) -> bool:
    """Whether the checkpoint's safetensors hold ``mtp.*`` tensors (keys only: nothing
    is read into memory)."""
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            return any(k.startswith("mtp.") for k in json.load(fh).get("weight_map", {}))
    for name in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_dir, name), framework="pt") as fh:
            if any(k.startswith("mtp.") for k in fh.keys()):
                return True
    return False


def _check_model_dir(option: str, path: str) -> None:
    from .loading import SUPPORTED_MODEL_TYPES, model_type

    try:
        mtype = model_type(path)
    except ValueError as e:
        raise ValueError(f"{option}: {e}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{option}: cannot read {path}/config.json ({e})") from None
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{option}: {path!r} holds a {mtype!r} model; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def check_args(args) -> None:
    """Check what needs several options or a look at the checkpoint, before anything
    is loaded; raises ``ValueError`` naming the option. ``embedded`` model names become
    the package's checkpoint directory here."""
    from .loading import resolve_model_path

    for option in ("model", "draft_model"):
        value = getattr(args, option)
        if value is not None:
            try:
                setattr(args, option, resolve_model_path(value))
            except ValueError as e:
                raise ValueError(f"--{option.replace('_', '-')}: {e}") from None
    _check_model_dir("--model", args.model)
    if args.draft == "model":
        if not args.draft_model:
            raise ValueError("--draft model needs --draft-model DIR")
        _check_model_dir("--draft-model", args.draft_model)
        from .loading import load_tokenizer

        if load_tokenizer(args.draft_model).get_vocab() != load_tokenizer(args.model).get_vocab():
            raise ValueError(f"--draft-model {args.draft_model!r} does not share the target's tokenizer")
    elif args.draft_model:
        raise ValueError(f"--draft-model is only used with --draft model, not --draft {args.draft}")
    if args.draft == "mtp" and not _has_mtp_weights(args.model):
        raise ValueError(f"--draft mtp: {args.model!r} has no mtp.* weights (this checkpoint carries no MTP head)")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def describe_memory(engine) -> str:
    nb = engine.state_nbytes()
    pool = nb["total"]
    scratch = pool - nb["checkpoints"] - nb["conv_state"]
    return (f"GDN state pool {_mib(pool)} (checkpoints {_mib(nb['checkpoints'])}, conv {_mib(nb['conv_state'])}, "
            f"{engine.strategy_name} buffers {_mib(scratch)}) for {engine.pool.num_slots} slot(s); "
            f"KV cache {_mib(nb['kv_cache'])}")


def build_drafter(args, engine, batch: int, max_len: int):
    """The drafter the arguments ask for (``None`` for plain decoding), see :func:`make_drafter`."""
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    return make_drafter(args.draft, engine, model_dir=args.model, draft_model_dir=args.draft_model,
                        sampling=sampling, batch=batch, max_len=max_len)


def make_drafter(kind: str, engine, *, model_dir=None, draft_model_dir=None, sampling=None, batch: int = 1,
                 max_len: int = 0):
    """A drafter of ``kind`` (one of :data:`DRAFT_CHOICES`; ``"none"`` gives ``None``)
    for ``engine``: n-gram lookup and the MTP head of ``model_dir`` run on the device
    inside the static step (:class:`~replayssm.engine.generator.StepGenerator`); the
    draft model of ``draft_model_dir`` (same tokenizer as ``model_dir``) runs eagerly
    with its own engine of ``batch`` slots and ``max_len`` tokens
    (:class:`~replayssm.engine.generator.SpeculativeGenerator`)."""
    from .device_drafters import DeviceMTPDrafter, DeviceNgramDrafter
    from .drafters import ModelDrafter, load_mtp_head

    if kind not in DRAFT_CHOICES:
        raise ValueError(f"kind must be one of {DRAFT_CHOICES}, got {kind!r}")
    if kind == "none":
        return None
    if kind == "ngram":
        return DeviceNgramDrafter()
    if kind == "mtp":
        return DeviceMTPDrafter(engine, load_mtp_head(engine, model_dir), sampling=sampling)
    from .adapter import HybridEngine
    from .loading import load_model, load_tokenizer

    if not draft_model_dir:
        raise ValueError("a draft-model drafter needs draft_model_dir")
    target_vocab = load_tokenizer(model_dir).get_vocab()
    if load_tokenizer(draft_model_dir).get_vocab() != target_vocab:
        raise ValueError(f"{draft_model_dir!r} does not share the target's tokenizer")
    draft = load_model(draft_model_dir, dtype=engine.dtype, device=str(engine.device))
    draft_engine = HybridEngine(draft, strategy="fold", num_slots=batch, window=1, max_len=max_len)
    return ModelDrafter(draft_engine, engine.vocab_size)


def main(args) -> int:
    from .adapter import HybridEngine
    import torch

    from .generator import SpeculativeGenerator, StepGenerator
    from .loading import eos_token_ids, load_model, load_tokenizer
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    tokenizer = load_tokenizer(args.model)
    if args.chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=True) for p in args.prompt]
        prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    else:
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in args.prompt]
    if any(not p for p in prompts):
        print("replayssm generate: error: a prompt encodes to no tokens", file=sys.stderr)
        return 2
    eos = [] if args.ignore_eos else eos_token_ids(args.model, tokenizer)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    batch = len(prompts)
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + args.num_draft + 2
    plain = args.draft == "none"
    engine = HybridEngine(model, strategy=args.strategy, num_slots=batch, window=1 if plain else args.num_draft + 1,
                          max_len=max_len)
    drafter = build_drafter(args, engine, batch, max_len)
    print(f"model {args.model} ({engine.family}, {model.dtype}, {engine.device}); "
          f"draft {args.draft}, strategy {args.strategy}, k={args.num_draft}; prompt prefill: {engine.prefill_kernel}",
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
    if args.draft == "model":  # the draft model decodes on the host between steps
        gen = SpeculativeGenerator(engine, drafter, num_draft=args.num_draft, sampling=sampling, eos_token_ids=eos,
                                   seed=args.seed)
    else:  # one static step per decode step, a CUDA graph replay on a GPU
        gen = StepGenerator(engine, drafter, num_draft=args.num_draft, sampling=sampling, eos_token_ids=eos)
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
    print(f"state memory: {describe_memory(engine)}")
    if args.compare_plain and not plain:
        base_engine = HybridEngine(model, strategy=args.strategy, num_slots=batch, window=1, max_len=max_len)
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
