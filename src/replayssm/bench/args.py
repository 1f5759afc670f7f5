"""Argument types shared by the measurement commands."""

from __future__ import annotations

import argparse


def int_list(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` -> ``(1, 16, 64)``: positive, distinct integers."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"duplicate values in {text!r}")
    return values


def name_list(allowed: tuple[str, ...], *, allow_none: bool = False):
    """An argument type for a comma-separated subset of ``allowed`` (distinct names);
    with ``allow_none``, ``"none"`` gives the empty tuple."""

    def parse(text: str) -> tuple[str, ...]:
        if allow_none and text.strip().lower() in ("", "none"):
            return ()
        names = tuple(x.strip() for x in text.split(",") if x.strip())
        if not names or any(n not in allowed for n in names):
            extra = " or 'none'" if allow_none else ""
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}{extra}, got {text!r}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"duplicate names in {text!r}")
        return names

    return parse
