"""Judging an error series: does it grow, and does it leave the fp32 recurrence?"""

from __future__ import annotations

import math

import numpy as np


def assess(tokens, errors, *, warmup_frac: float = 0.05, window_frac: float = 0.1, growth_factor: float = 2.0, min_slope: float = 0.1) -> dict:
    """Growth of an error series over a run.

    Samples before ``warmup_frac`` of the run are skipped (the state is still filling).
    Of the rest, ``early`` is the median of the first ``window_frac`` (at least 2
    samples) and ``late`` the median of the last ``window_frac``; ``growth = late /
    early``; ``slope`` is the least-squares slope of ``log(error)`` against
    ``log(tokens)`` over the same samples (0.5 for a random walk, 0 for a bounded
    error). ``grows`` when ``growth > growth_factor`` and ``slope > min_slope``.

    Raises:
        ValueError: mismatched lengths, fewer than 4 samples after the warm-up, or a
            negative error.
    """
    t = np.asarray(tokens, dtype=np.float64)
    e = np.asarray(errors, dtype=np.float64)
    if t.shape != e.shape or t.ndim != 1:
        raise ValueError(f"tokens and errors must be 1-D and of equal length, got {t.shape} and {e.shape}")
    if np.any(e < 0):
        raise ValueError("errors must be non-negative")
    finite = bool(np.all(np.isfinite(e)))
    post = t > warmup_frac * t.max() if t.size else t.astype(bool)
    tp, ep = t[post], e[post]
    if tp.size < 4:
        raise ValueError(f"need at least 4 samples after the {warmup_frac:.0%} warm-up, got {tp.size}")
    k = max(2, int(math.ceil(window_frac * tp.size)))
    early = float(np.median(ep[:k]))
    late = float(np.median(ep[-k:]))
    if not finite:
        growth, slope = math.inf, math.inf
    elif early > 0:
        growth = late / early
        pos = ep > 0
        slope = float(np.polyfit(np.log(tp[pos]), np.log(ep[pos]), 1)[0]) if pos.sum() >= 2 else 0.0
    else:
        growth = 1.0 if late == 0 else math.inf
        slope = 0.0 if late == 0 else math.inf
    return {
        "early": early,
        "late": late,
        "max": float(np.max(e)),
        "growth": growth,
        "slope": slope,
        "finite": finite,
        "grows": (not finite) or (growth > growth_factor and slope > min_slope),
    }


def verdict(assessment: dict, plain: dict, excess_factor: float) -> dict:
    """Compare one variant's assessments (per series) with ``plain``'s.

    ``excess`` = late error / plain's late error; a series *departs* when its excess
    exceeds ``excess_factor``, and *drifts* when it grows while plain's does not.
    ``flagged`` is true when any series departs or drifts.
    """
    out = {}
    for name, a in assessment.items():
        p = plain[name]
        if p["late"] > 0:
            excess = a["late"] / p["late"]
        else:
            excess = 1.0 if a["late"] == 0 else math.inf
        departs = (not a["finite"]) or excess > excess_factor
        drifts = a["grows"] and not p["grows"]
        out[name] = {"excess_over_plain": excess, "departs": departs, "drifts": drifts}
    out["flagged"] = any(v["departs"] or v["drifts"] for k, v in out.items() if k != "flagged")
    return out
