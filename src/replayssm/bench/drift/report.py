"""The drift run's table on stdout."""

from __future__ import annotations

import math
import sys

from .config import PLAIN


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.2e}" if (x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4)) else f"{x:.2f}"


def _slope(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:+.2f}")


def describe_inputs(inputs: dict) -> str:
    """One line on where the layer's inputs came from."""
    if inputs["kind"] == "model":
        return (f"GDN layer {inputs['layer']} of {inputs['gdn_layers']} (decoder layer {inputs['decoder_layer']}) "
                f"of {inputs['model']}, teacher-forced over {inputs['text']} ({inputs['stream_tokens']} tokens; "
                f"contexts of {inputs['context']} tokens; model time {inputs.get('model_s', 0.0):.1f} s)")
    lo, hi = inputs["decay_range"]
    return (f"random ({inputs['shape']} shape, mean decays {lo:g}..{hi:g}, "
            f"key correlation {inputs['key_correlation']:g})")


def print_report(result: dict, file=None) -> None:
    file = file or sys.stdout
    c, sh = result["config"], result["shape"]
    print(
        f"replayssm drift: {result['tokens_per_request']} tokens x {c['requests']} requests, {result['steps']} steps, "
        f"H={sh['H']} HV={sh['HV']} K={sh['K']} V={sh['V']}, T={c['window']}, L={c['ring_len']}, "
        f"{c['act_dtype']} activations, {c['state_dtype']} state, {result['environment']['device']} "
        f"({result['environment']['backend']}), {result['elapsed_s']:.1f} s",
        file=file,
    )
    print(f"inputs: {describe_inputs(result['inputs'])}", file=file)
    print(
        "committed-state error vs float64 (median of first / last 10% of samples), growth = last/first, "
        "slope of log-log fit, x plain = last / fp32 recurrence's last",
        file=file,
    )
    head = f"{'variant':<10} {'state first':>11} {'state last':>11} {'growth':>7} {'slope':>6} {'x plain':>8} {'worst head':>11} {'output':>9} {'==plain':>7}  result"
    print(head, file=file)
    for name, v in result["variants"].items():
        a = v["assessment"]
        vd = v.get("verdict")
        print(
            f"{name:<10} {_fmt(a['state']['early']):>11} {_fmt(a['state']['late']):>11} {_fmt(a['state']['growth']):>7} "
            f"{_slope(a['state']['slope']):>6} {_fmt(vd['state']['excess_over_plain']) if vd else '1.00':>8} "
            f"{_fmt(a['state_worst_head']['late']):>11} {_fmt(a['output']['late']):>9} "
            f"{'yes' if v['bitwise_equal_to_plain'] else 'no':>7}  {v['result']}",
            file=file,
        )
    if result["variants"][PLAIN]["assessment"]["state"]["grows"]:
        remedy = "run longer" + (" or raise the --decay-range minimum" if result["inputs"]["kind"] == "random" else "")
        print(
            "note: the fp32 recurrence's own error still grows over this run (heads with memories longer than "
            f"the run); {remedy}",
            file=file,
        )
    if result["failed"]:
        print(f"FAIL: {', '.join(result['failed'])} left the exact recurrence or drift", file=file)
    if result["control_required"] and not result["control_detected"]:
        print("FAIL: the open-loop control was not detected: the check has no teeth on this configuration", file=file)
    if result["exit_code"] == 0:
        print("result: no exact strategy drifts" + ("; the open-loop control is detected" if result["control_detected"] else ""), file=file)
