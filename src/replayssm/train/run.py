"""The training run: data, tokenizer, model, loop, evaluation, checkpoint, log, plot."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import corpus as C
from . import data as D
from .model import build_model, count_parameters, gdn_kernel_path, losses, mtp_checkpoint_state


@dataclass
class TrainConfig:
    """What ``replayssm train`` was asked for (see its ``--help`` for each field)."""

    out: str
    size: str = "default"
    vocab: int = 4096
    tokenizer: str | None = None  # a checkpoint directory whose tokenizer to reuse
    minutes: float = 10.0
    steps: int | None = None
    seq_len: int = 512
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.5
    seed: int = 0
    device: str = "auto"
    heldout_percent: float = C.HELDOUT_PERCENT
    eval_every: int = 100
    eval_windows: int = 64
    max_files: int | None = None
    source: str | None = None  # a directory of .py files instead of the standard library
    save_dtype: str = "bfloat16"
    quiet: bool = False


SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then cosine decay to a tenth of
    ``cfg.lr`` over ``progress`` (the larger of the step and time fractions of the
    budget, so a time-limited run still ends at the low learning rate)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = min(1.0, max(0.0, progress))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def sample_windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` random windows of ``length`` tokens from ``stream`` (int64 ``[count,
    length]``); files follow each other with ``<|endoftext|>`` between them, so a window
    may span two files, as in packed pretraining."""
    if stream.numel() <= length:
        raise ValueError(f"the token stream ({stream.numel()} tokens) is shorter than a window ({length} + 1)")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()


@torch.no_grad()
def evaluate(model, head, windows: torch.Tensor, batch: int, device: torch.device, autocast) -> tuple[float, float]:
    """Mean next-token and MTP loss (nats per token) over ``windows``."""
    model.eval(), head.eval()
    tot_main = tot_mtp = 0.0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch].to(device)
        with autocast():
            main, mtp = losses(model, head, w)
        tot_main += main.item() * w.shape[0]
        tot_mtp += mtp.item() * w.shape[0]
    model.train(), head.train()
    n = windows.shape[0]
    return tot_main / n, tot_mtp / n


def _param_groups(modules, weight_decay: float):
    """AdamW groups: decay on matrices, none on norms, biases and gate scalars."""
    seen, decay, no_decay = set(), [], []
    for m in modules:
        for name, p in m.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def prepare_data(cfg: TrainConfig, log=print):
    """Corpus, tokenizer (trained, or reused from ``cfg.tokenizer``) and the two token
    streams. Returns ``(corpus, tokenizer, train_ids, heldout_ids, info)``."""
    t0 = time.perf_counter()
    corpus = C.load_corpus(cfg.source, heldout_percent=cfg.heldout_percent, max_files=cfg.max_files)
    s = corpus.summary()
    log(f"text: {s['train']['files']} training files ({s['train']['bytes'] / 1e6:.1f} MB), "
        f"{s['heldout']['files']} held out ({s['heldout']['bytes'] / 1e6:.1f} MB), "
        f"{s['skipped_not_utf8']} skipped (not UTF-8), from {corpus.root}")
    if not corpus.heldout:
        raise ValueError("no file is held out; raise --heldout-percent or --max-files")
    if cfg.tokenizer:
        from ..engine.loading import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer)
        origin = f"reused from {cfg.tokenizer}"
    else:
        tokenizer = D.train_tokenizer([f.text for f in corpus.train], cfg.vocab)
        origin = f"byte-level BPE trained on the training files, {cfg.vocab} tokens"
    train_ids = C.encode_files(tokenizer, corpus.train)
    heldout_ids = C.encode_files(tokenizer, corpus.heldout)
    bpt = D.bytes_per_token(tokenizer, corpus.heldout)
    log(f"tokenizer: {origin}; {len(tokenizer)} tokens, {bpt:.2f} bytes/token on held-out text; "
        f"{train_ids.numel():,} training tokens, {heldout_ids.numel():,} held out "
        f"({time.perf_counter() - t0:.1f}s)")
    if cfg.source is None:
        # The log may ship with the checkpoint: name the library, not this machine's path.
        s["root"] = f"standard library of Python {sys.version.split()[0]}"
    info = dict(corpus=s, tokenizer=origin, vocab_size=len(tokenizer), heldout_bytes_per_token=bpt,
                train_tokens=train_ids.numel(), heldout_tokens=heldout_ids.numel(), data_s=time.perf_counter() - t0)
    return corpus, tokenizer, train_ids, heldout_ids, info


def run_training(cfg: TrainConfig, log=print) -> dict:
    """Train, save the checkpoint into ``cfg.out`` and return the log (also written as
    ``cfg.out/train_log.json``, with the plot ``cfg.out/loss.png``)."""
    from ..progress import ProgressBar, write_json
    from ..engine.loading import resolve_device

    device = resolve_device(cfg.device)
    kernel = gdn_kernel_path(device)
    log(f"device {device}; GDN layers in training: {kernel}")
    corpus, tokenizer, train_ids, heldout_ids, info = prepare_data(cfg, log)
    eos = tokenizer.convert_tokens_to_ids(C.EOS_TOKEN)
    model, head = build_model(cfg.size, len(tokenizer), eos, seed=cfg.seed)
    model.to(device), head.to(device)
    n_params = count_parameters(model) + count_parameters(head)
    log(f"model: size {cfg.size}, {count_parameters(model):,} parameters + MTP head {count_parameters(head):,}")

    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def autocast():
        # bf16 activations with fp32 master weights on CUDA; plain fp32 on the CPU.
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    opt = torch.optim.AdamW(_param_groups([model, head], cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=cuda)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    evals_windows = C.heldout_windows(heldout_ids, cfg.eval_windows, cfg.seq_len + 1)
    budget_s = cfg.minutes * 60
    steps_cap = cfg.steps
    history, evals = [], []
    tokens = 0
    t_start = time.perf_counter()
    # The bar counts steps when --steps is given, else seconds of the time budget.
    bar = ProgressBar(steps_cap if steps_cap else max(1, int(math.ceil(budget_s))), "train",
                      unit="step" if steps_cap else "s", enabled=not cfg.quiet)

    # A small model sees the library many times over on a GPU: keep the weights of the
    # best held-out evaluation (a copy on the device, a few tens of MB) and save those
    # if later steps only overfit.
    best: dict = {}

    def do_eval(step):
        main, mtp = evaluate(model, head, evals_windows, cfg.batch, device, autocast)
        bpb = main / math.log(2) / info["heldout_bytes_per_token"]
        evals.append(dict(step=step, tokens=tokens, heldout_loss=main, heldout_mtp_loss=mtp, heldout_bits_per_byte=bpb,
                          wall_s=time.perf_counter() - t_start))
        bar.write(f"step {step}: held-out loss {main:.3f} (MTP {mtp:.3f}), {bpb:.3f} bits/byte")
        if not best or main < best["eval"]["heldout_loss"]:
            best.update(eval=evals[-1], model={k: v.detach().clone() for k, v in model.state_dict().items()},
                        head={k: v.detach().clone() for k, v in head.state_dict().items()})

    step = 0
    train_s = 0.0  # time in training steps only (evaluations excluded), for tokens/s
    try:
        do_eval(0)
        while True:
            elapsed = time.perf_counter() - t_start
            if (steps_cap and step >= steps_cap) or elapsed >= budget_s:  # whichever runs out first
                break
            progress = max(step / steps_cap if steps_cap else 0.0, elapsed / budget_s)
            lr = lr_at(cfg, step, progress)
            for g in opt.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            w = sample_windows(train_ids, cfg.batch, cfg.seq_len + 1, gen).to(device, non_blocking=True)
            with autocast():
                main, mtp = losses(model, head, w)
                loss = main + cfg.mtp_weight * mtp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_([*model.parameters(), *head.parameters()], 1.0)
            opt.step()
            main_v, mtp_v = main.item(), mtp.item()  # one sync per step; the log needs the values anyway
            if not math.isfinite(main_v):
                raise FloatingPointError(f"training loss is {main_v} at step {step}; lower --lr")
            dt = time.perf_counter() - t0
            train_s += dt
            step += 1
            tokens += cfg.batch * cfg.seq_len
            history.append(dict(step=step, tokens=tokens, loss=main_v, mtp_loss=mtp_v, lr=lr, grad_norm=gnorm.item()))
            bar.set_postfix(f"loss {main_v:.3f} mtp {mtp_v:.3f} {tokens / max(train_s, 1e-9):,.0f} tok/s")
            bar.set(step if steps_cap else int(time.perf_counter() - t_start))
            if step % cfg.eval_every == 0:
                do_eval(step)
    except KeyboardInterrupt:  # keep what was trained: evaluate and save as at the end
        bar.write(f"interrupted at step {step}: saving the model as it is")
    try:
        if not evals or evals[-1]["step"] != step:
            do_eval(step)
    finally:
        bar.close()
    wall = time.perf_counter() - t_start
    saved = evals[-1]
    if best["eval"] is not saved:
        model.load_state_dict(best["model"])
        head.load_state_dict(best["head"])
        saved = best["eval"]
        log(f"held-out loss was lowest at step {saved['step']} ({saved['heldout_loss']:.3f} against "
            f"{evals[-1]['heldout_loss']:.3f} at the end): saving the weights of step {saved['step']}")
    best.clear()

    out = Path(cfg.out)
    ckpt_bytes = save_checkpoint(out, model, head, tokenizer, SAVE_DTYPES[cfg.save_dtype])
    result = dict(
        config=asdict(cfg), device=str(device), device_name=torch.cuda.get_device_name(device) if cuda else
        platform.processor() or platform.machine(), torch=torch.__version__, python=sys.version.split()[0],
        threads=torch.get_num_threads(), gdn_kernel=kernel, data=info, parameters=n_params,
        steps=step, tokens=tokens, epochs=tokens / max(1, info["train_tokens"]), wall_s=wall, train_s=train_s,
        tokens_per_s=tokens / max(train_s, 1e-9), losses=history, evals=evals,
        final_heldout_loss=evals[-1]["heldout_loss"], final_heldout_mtp_loss=evals[-1]["heldout_mtp_loss"],
        final_heldout_bits_per_byte=evals[-1]["heldout_bits_per_byte"], saved_step=saved["step"],
        saved_heldout_loss=saved["heldout_loss"], saved_heldout_mtp_loss=saved["heldout_mtp_loss"],
        saved_heldout_bits_per_byte=saved["heldout_bits_per_byte"], checkpoint_bytes=ckpt_bytes,
    )
    write_json(out / "train_log.json", result)
    log(f"{step} steps, {tokens:,} tokens ({result['epochs']:.2f} epochs) in {wall:.0f}s "
        f"({result['tokens_per_s']:,.0f} tokens/s in training steps); held-out loss {result['final_heldout_loss']:.3f}, "
        f"MTP {result['final_heldout_mtp_loss']:.3f}, {result['final_heldout_bits_per_byte']:.3f} bits/byte")
    log(f"wrote {out}, the weights of step {saved['step']} ({ckpt_bytes['total'] / 1e6:.2f} MB: weights {ckpt_bytes['safetensors'] / 1e6:.2f} MB, "
        f"tokenizer {ckpt_bytes['tokenizer'] / 1e6:.2f} MB) and {out / 'train_log.json'}")
    try:
        plot_losses(result, out / "loss.png")
        log(f"wrote {out / 'loss.png'}")
    except ImportError:
        log("no loss plot: matplotlib is not installed (pip install 'replayssm[plot]')")
    return result


def save_checkpoint(out: Path, model, head, tokenizer, dtype: torch.dtype) -> dict:
    """Write an HF checkpoint directory: ``config.json``, ``model.safetensors`` (model
    plus ``mtp.*`` head tensors, in ``dtype``), tokenizer files and
    ``generation_config.json``. Returns its file sizes in bytes."""
    import copy

    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    cpu_model = copy.deepcopy(model).to("cpu", dtype).eval()
    cpu_model.config.dtype = dtype
    cpu_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    eos = model.config.eos_token_id
    GenerationConfig(eos_token_id=eos, bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                     do_sample=False).save_pretrained(out)
    weights = out / "model.safetensors"
    if not weights.exists() or (out / "model.safetensors.index.json").exists():
        raise RuntimeError(f"expected a single model.safetensors in {out}")
    state = load_file(weights)
    state.update(mtp_checkpoint_state(head, dtype))
    save_file(state, weights, metadata={"format": "pt"})
    tok_files = [p for p in out.iterdir() if p.name.startswith("tokenizer") or p.name == "chat_template.jinja"]
    sizes = dict(safetensors=weights.stat().st_size, tokenizer=sum(p.stat().st_size for p in tok_files))
    sizes["total"] = sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.name not in
                         ("train_log.json", "loss.png"))
    return sizes


def plot_losses(result: dict, path) -> None:
    """Train and held-out loss (and the MTP head's) against tokens seen, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    h = result["losses"]
    if h:
        xs = [r["tokens"] for r in h]
        for key, color, label in (("loss", "C0", "train"), ("mtp_loss", "C1", "train, MTP head (t+2)")):
            ys = [r[key] for r in h]
            ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
            # Trailing mean over a fiftieth of the run: the trend through step noise,
            # without the lag an EMA tuned for long runs has on short ones.
            w = max(1, len(ys) // 50)
            csum = [0.0]
            for y in ys:
                csum.append(csum[-1] + y)
            sm = [(csum[i + 1] - csum[max(0, i + 1 - w)]) / min(w, i + 1) for i in range(len(ys))]
            ax.plot(xs, sm, color=color, lw=1.5, label=label + (f" (mean of {w} steps)" if w > 1 else ""))
    e = result["evals"]
    ax.plot([r["tokens"] for r in e], [r["heldout_loss"] for r in e], "o-", color="C2", label="held-out files")
    ax.plot([r["tokens"] for r in e], [r["heldout_mtp_loss"] for r in e], "s--", color="C3",
            label="held-out files, MTP head")
    saved = next((r for r in e if r["step"] == result.get("saved_step")), None)
    if saved is not None and saved is not e[-1]:
        ax.axvline(saved["tokens"], color="#777777", ls=":", lw=1.0, label=f"saved: step {saved['step']} (best held-out)")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("cross-entropy (nats/token)")
    c = result["config"]
    ax.set_title(f"replayssm train: size {c['size']}, {result['data']['vocab_size']} tokens, {result['device']}, "
                 f"{result['wall_s'] / 60:.1f} min" if result["wall_s"] >= 60 else f"{result['wall_s']:.0f} s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_log(out: str | os.PathLike) -> dict:
    with open(Path(out) / "train_log.json") as fh:
        return json.load(fh)
