"""The drift run itself: drive every variant through the same teacher-forced steps,
sample their errors against the float64 oracle, and judge each series."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import numpy as np
import torch

from ..common import environment
from ...progress import ProgressBar
from .config import ACT_DTYPES, PLAIN, SERIES, SHAPES, DriftConfig
from .inputs import InputStream, gate_params
from .judge import assess, verdict
from .model_inputs import ModelInputStream
from .oracle import Oracle64
from .variants import OpenLoopControl, PlainRecurrence, StrategyVariant, Variant


@dataclass
class Series:
    tokens: list[int] = field(default_factory=list)
    state: list[float] = field(default_factory=list)
    state_worst_head: list[float] = field(default_factory=list)
    output: list[float] = field(default_factory=list)
    equal_to_plain: list[bool] = field(default_factory=list)


def _state_errors(S: torch.Tensor, S64: torch.Tensor) -> tuple[float, float]:
    d = S.double() - S64
    total = (d.norm() / S64.norm()).item()
    per_head = d.flatten(2).norm(dim=-1) / S64.flatten(2).norm(dim=-1).clamp_min(1e-300)
    return total, per_head.max().item()


def _inputs(cfg: DriftConfig, progress: bool):
    """``(shape, params, stream, info)`` of ``cfg``'s inputs: the layer's shape, its
    ``A_log``, ``dt_bias``, ``conv_weight`` for the pools, the window stream
    (``window_inputs()``, ``accept(k, accepted)``) and what the inputs are, for the
    report."""
    act = ACT_DTYPES[cfg.act_dtype]
    if cfg.inputs == "model":
        from ...engine.loading import resolve_model_path

        if progress:
            print(f"drift: loading {cfg.model_name} and the held-out text", file=sys.stderr, flush=True)
        stream = ModelInputStream(resolve_model_path(cfg.model_name), cfg.layer, cfg.requests, cfg.window, act,
                                  cfg.device, model_name=cfg.model_name)
        return stream.shape, stream.params, stream, stream.info
    shape = SHAPES[cfg.random_shape]
    A_log, dt_bias = gate_params(shape.num_value_heads, cfg.random_decay_range)
    conv_gen = torch.Generator().manual_seed(cfg.seed + 1)
    # The conv is not part of this experiment (it is copied exactly, not folded); the
    # pool still wants taps, so it gets random ones that are never used.
    params = {"A_log": A_log, "dt_bias": dt_bias,
              "conv_weight": torch.randn(shape.conv_dim, shape.conv_kernel, generator=conv_gen)}
    stream = InputStream(shape, cfg.requests, cfg.window, act, cfg.device, cfg.seed, cfg.random_key_correlation)
    info = {"kind": "random", "shape": cfg.random_shape, "decay_range": list(cfg.random_decay_range),
            "key_correlation": cfg.random_key_correlation}
    return shape, params, stream, info


def run_drift(cfg: DriftConfig, *, progress: bool = True) -> dict:
    """Run the drift experiment of ``cfg``; returns the JSON-ready result (see the
    module doc for what is measured and how it is judged)."""
    cfg.check()
    device = torch.device(cfg.device)
    shape, params, stream, inputs = _inputs(cfg, progress)

    variants: list[Variant] = [StrategyVariant(name, cfg, shape, params) for name in cfg.strategies]
    if cfg.control:
        variants.append(OpenLoopControl(cfg, shape, params))
    plain = PlainRecurrence(cfg, shape, params)
    everyone = variants + [plain]
    oracle = Oracle64(shape, cfg.requests, params["A_log"], params["dt_bias"], device)
    host = torch.Generator().manual_seed(cfg.seed + 2)  # window lengths and acceptance

    series = {v.name: Series() for v in everyone}
    out_err2 = {v.name: torch.zeros((), dtype=torch.float64, device=device) for v in everyone}
    out_ref2 = torch.zeros((), dtype=torch.float64, device=device)
    committed = np.zeros(cfg.requests, dtype=np.int64)
    next_mark, steps = cfg.every, 0
    B, T = cfg.requests, cfg.window
    t_index = torch.arange(T, device=device)
    bar = ProgressBar(cfg.tokens, "drift", unit="tok", enabled=progress)
    t0 = time.perf_counter()

    def sample():
        S64 = oracle.S
        plain_S = plain.committed()
        ref = out_ref2.item()
        for v in everyone:
            S = plain_S if v is plain else v.committed()
            total, worst = _state_errors(S, S64)
            s = series[v.name]
            s.tokens.append(int(committed.min()))
            s.state.append(total)
            s.state_worst_head.append(worst)
            s.output.append(math.sqrt(out_err2[v.name].item() / ref) if ref > 0 else 0.0)
            s.equal_to_plain.append(bool(torch.equal(S, plain_S)))
            out_err2[v.name].zero_()
        out_ref2.zero_()

    while committed.min() < cfg.tokens:
        lengths = torch.randint(1, T + 1, (B,), generator=host)
        accepted_cpu = (torch.rand(B, generator=host) * lengths).long() + 1  # uniform in 1..m
        lengths_list, accepted_list = lengths.tolist(), accepted_cpu.tolist()
        accepted = accepted_cpu.to(device=device, dtype=torch.int32)
        x = stream.window_inputs()
        win_mask = t_index[None] < lengths.to(device)[:, None]
        keep_mask = t_index[None] < accepted[:, None]
        packed = {k: t[win_mask] for k, t in x.items()}
        kept = {k: t[keep_mask] for k, t in x.items()}

        o64 = oracle.advance(x, accepted, max(accepted_list))[keep_mask]
        out_ref2 += (o64 * o64).sum()
        for v in everyone:
            o = v.step(packed, lengths_list, accepted, accepted_list, kept)
            out_err2[v.name] += ((o.double() - o64) ** 2).sum()
        stream.accept(x["k"], accepted)
        committed += accepted_cpu.numpy()
        steps += 1
        done = int(committed.min())
        if done >= next_mark or done >= cfg.tokens:
            sample()
            while next_mark <= done:
                next_mark += cfg.every
        bar.set(done)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    bar.close()

    assessments = {}
    for v in everyone:
        s = series[v.name]
        assessments[v.name] = {
            name: assess(s.tokens, getattr(s, name), growth_factor=cfg.growth_factor, min_slope=cfg.min_slope)
            for name in SERIES
        }
    results = {}
    failed, control_detected = [], None
    for v in everyone:
        s = series[v.name]
        entry = {
            "claims_exact_state": v.claims_exact,
            "samples": asdict(s),
            "assessment": assessments[v.name],
            "bitwise_equal_to_plain": all(s.equal_to_plain),
        }
        if v is not plain:
            vd = verdict(assessments[v.name], assessments[PLAIN], cfg.excess_factor)
            entry["verdict"] = vd
            if v.claims_exact:
                entry["result"] = "fail" if vd["flagged"] else "pass"
                if vd["flagged"]:
                    failed.append(v.name)
            else:
                control_detected = vd["flagged"]
                entry["result"] = "detected" if vd["flagged"] else "undetected"
        else:
            entry["result"] = "reference"
        results[v.name] = entry

    if failed:
        exit_code = 1
    elif cfg.control_required and not control_detected:
        exit_code = 3
    else:
        exit_code = 0
    if isinstance(stream, ModelInputStream):
        inputs["model_s"] = stream.read_s  # part of elapsed_s: the model reads as the run goes
    mean_decay = (-oracle.g_sum / int(committed.sum())).tolist()
    return {
        "tool": "replayssm drift",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(cfg), "strategies": list(cfg.strategies),
                   "decay_range": None if cfg.decay_range is None else list(cfg.decay_range)},
        "environment": environment(device, cfg.backend),
        "inputs": inputs,
        "shape": {"H": shape.num_heads, "HV": shape.num_value_heads, "K": shape.head_k_dim, "V": shape.head_v_dim},
        "gates": {
            "mean_decay_per_head": mean_decay,
            "memory_tokens_per_head": [1.0 / d if d > 0 else None for d in mean_decay],
        },
        "steps": steps,
        "tokens_per_request": int(committed.min()),
        "elapsed_s": elapsed,
        "variants": results,
        "failed": failed,
        "control_required": cfg.control_required,
        "control_detected": control_detected,
        "exit_code": exit_code,
    }
