"""PNG plots of the tools' JSON results (matplotlib, Agg backend, no display needed).

matplotlib is optional: ``pip install 'replayssm[plot]'``. Each function takes the
result dict a tool returns (or loads from its ``--json`` file) and writes one PNG.
"""

from __future__ import annotations

import os
from pathlib import Path

# Fixed colours per variant so that plots of different runs read the same way.
COLORS = {
    "snapshot": "#1f77b4",
    "fold": "#2ca02c",
    "circular": "#ff7f0e",
    "plain": "#000000",
    "open-loop": "#d62728",
}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'replayssm[plot]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_drift(result: dict, path: str | os.PathLike) -> Path:
    """Committed-state error (all heads, solid; worst head, dotted) and output error
    against committed tokens, one colour per variant, log scale."""
    plt = _pyplot()
    variants = result["variants"]
    fig, (ax_s, ax_o) = plt.subplots(1, 2, figsize=(13, 4.8), constrained_layout=True)
    for name, v in variants.items():
        s = v["samples"]
        color = COLORS.get(name)
        label = f"{name} ({v['result']})"
        # Bit-identical curves would hide each other; the legend says which coincide.
        if v.get("bitwise_equal_to_plain") and name != "plain":
            label += ", = plain"
        style = "--" if name == "plain" else "-"
        ax_s.plot(s["tokens"], _positive(s["state"]), style, color=color, label=label, lw=1.4)
        ax_s.plot(s["tokens"], _positive(s["state_worst_head"]), ":", color=color, lw=1.0)
        ax_o.plot(s["tokens"], _positive(s["output"]), style, color=color, label=name, lw=1.4)
    sh, c = result["shape"], result["config"]
    inputs = result.get("inputs", {"kind": "random"})  # results from before --inputs: random
    source = (f"GDN layer {inputs['layer']} of {inputs['model']} on held-out text" if inputs["kind"] == "model"
              else "random inputs")
    title = (
        f"{source}, H={sh['H']} HV={sh['HV']} K={sh['K']} V={sh['V']}, T={c['window']}, L={c['ring_len']}, "
        f"{c['act_dtype']} act, {c['state_dtype']} state, {result['environment']['device']}"
    )
    ax_s.set_title("committed state: ||S - S64|| / ||S64||  (dotted: worst head)")
    ax_o.set_title("outputs of accepted positions: ||o - o64|| / ||o64||")
    for ax in (ax_s, ax_o):
        ax.set_yscale("log")
        ax.set_xlabel("committed tokens per request")
        ax.grid(True, which="both", alpha=0.3)
    ax_s.set_ylabel("relative error vs float64")
    ax_s.legend(fontsize=8, loc="best")
    fig.suptitle(f"replayssm drift: {title}", fontsize=10)
    return _save(fig, path)


def _positive(values):
    # log axes cannot show 0 (a bit-exact float64 run) or None (non-finite in JSON)
    return [v if (v is not None and v > 0) else float("nan") for v in values]


def plot_memory(result: dict, path: str | os.PathLike) -> Path:
    """Maximum concurrent requests per strategy, one group of bars per model and context."""
    plt = _pyplot()
    rows = result["rows"]
    groups = []
    for r in rows:
        key = (r["model"], r["context"])
        if key not in groups:
            groups.append(key)
    names = []
    for r in rows:
        if r["strategy"] not in names:
            names.append(r["strategy"])
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(7.0, 2.8 * len(groups)), 4.8), constrained_layout=True)
    for i, name in enumerate(names):
        xs, ys = [], []
        for gi, key in enumerate(groups):
            r = next((r for r in rows if (r["model"], r["context"]) == key and r["strategy"] == name), None)
            if r is not None:
                xs.append(gi + (i - (len(names) - 1) / 2) * width)
                ys.append(r["max_requests"])
        bars = ax.bar(xs, ys, width=width, color=COLORS.get(name, None), label=name)
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks(range(len(groups)))
    tps = {(r["model"], r["context"]): r["tp"] for r in rows}
    ax.set_xticklabels([f"{m} (TP{tps[(m, ctx)]})\n{ctx} tok context" for m, ctx in groups], fontsize=8)
    ax.set_ylabel("max concurrent requests")
    budget = result["config"]
    ax.set_title(
        f"requests per GPU that fit: GDN state + KV cache per request, T={budget['window']}, L={budget['ring_len']}, "
        # results written before the conv layout was a setting counted the classic one
        f"{'conv ring' if budget.get('conv_ring', False) else 'classic conv'}",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def plot_e2e(result: dict, path: str | os.PathLike) -> Path:
    """Tokens per second against batch size, one line per mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    modes = []
    for r in result["rows"]:
        if r["mode"] not in modes:
            modes.append(r["mode"])
    for mode in modes:
        rs = sorted((r for r in result["rows"] if r["mode"] == mode), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", color=COLORS.get(mode), label=mode)
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in result["rows"]})
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens per second")
    c = result["config"]
    smoke = "\nCPU smoke run: the numbers prove the code path, not the speed" if result.get("smoke") else ""
    ax.set_title(f"replayssm bench e2e: {c.get('model', '')}, {c.get('num_draft')} drafts, "
                 f"{c.get('max_new_tokens')} new tokens{smoke}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def closed_loop(result: dict, path: str | os.PathLike) -> Path:
    """``replayssm closed-loop``: where each variant's tokens first differ from plain
    decoding's (per request; 'never' drawn at the run's length), and the committed-state
    error against the float64 run of the variant's own tokens, against position."""
    plt = _pyplot()
    variants = result["variants"]
    n = result["config"]["tokens"]
    fig, (ax_d, ax_s) = plt.subplots(1, 2, figsize=(13, 4.8), constrained_layout=True)
    names = list(variants)
    for x, name in enumerate(names):
        v = variants[name]
        color = COLORS.get(name, "#7f7f7f")
        for d in v["diverged_at"]:
            ax_d.plot([x], [n if d is None else d], "o" if d is not None else "^", color=color, ms=8,
                      mfc="none" if d is None else color)
        for r, per in enumerate(v["samples"]):
            if per:
                xs, ys = zip(*per)
                ax_s.plot(xs, _positive(ys), "--" if name == "plain" else "-", color=color, lw=1.2,
                          label=name if r == 0 else None)
    ax_d.axhline(n, color="#999999", lw=0.8, ls=":")
    ax_d.set_xticks(range(len(names)), names)
    ax_d.set_ylabel("first generated token that differs from plain decoding")
    ax_d.set_title(f"divergence (hollow triangle at {n}: never, over all {n} tokens)")
    ax_s.set_yscale("log")
    ax_s.set_xlabel("committed tokens (prompt included)")
    ax_s.set_ylabel("||S - S64|| / ||S64||, all GDN layers")
    ax_s.set_title("committed state vs a float64 run of the same tokens")
    ax_s.grid(alpha=0.3, which="both")
    ax_s.legend()
    c = result["config"]
    fig.suptitle(f"closed loop: {c['model']}, {c['dtype']} on {c['device']}, {c['requests']} request(s) x {n} tokens")
    return _save(fig, path)


def acceptance(result: dict, path: str | os.PathLike) -> Path:
    """``replayssm bench acceptance``: tokens per step against the verify window ``T``,
    one line per drafter, with the ceiling ``T`` (every draft accepted) dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.8), constrained_layout=True)
    windows = result["config"]["windows"]
    ax.plot(windows, windows, "--", color="#999999", lw=1.0, label="ceiling: every draft accepted")
    ax.axhline(1.0, color="#000000", lw=0.8, ls=":", label="plain decoding")
    for i, d in enumerate(result["config"]["drafters"]):
        rows = sorted((r for r in result["rows"] if r["drafter"] == d), key=lambda r: r["window"])
        ax.plot([r["window"] for r in rows], [r["tokens_per_step"] for r in rows], "o-", color=f"C{i}",
                label={"ngram": "n-gram lookup", "mtp": "MTP head", "model": "draft model"}.get(d, d))
    ax.set_xticks(windows)
    ax.set_xlabel("verify window T (T - 1 drafts per step)")
    ax.set_ylabel("tokens per step (accepted drafts + 1)")
    c = result["config"]
    ax.set_title(f"acceptance on {c['prompts']} held-out prompts, {c['max_new_tokens']} greedy tokens; "
                 f"held-out loss {result['heldout_loss']:.2f}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
