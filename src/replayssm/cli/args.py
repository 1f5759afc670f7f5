"""Argument types of the commands (``type=`` functions for argparse).

Each one turns a bad value into ``argparse.ArgumentTypeError``, which argparse reports
as ``replayssm CMD: error: argument --X: ...`` before the command does any work.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def _items(text: str) -> list[str]:
    """The comma-separated items of ``text``; an empty item (``"1,,2"``, ``"1,"``) is an
    error, not something to skip: it is usually a typo."""
    items = [x.strip() for x in text.split(",")]
    if any(not x for x in items):
        raise argparse.ArgumentTypeError(f"empty item in the comma-separated list {text!r}")
    return items


def int_list(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` -> ``(1, 16, 64)``: positive, distinct integers, no empty items."""
    items = _items(text)
    try:
        values = tuple(int(x) for x in items)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"duplicate values in {text!r}")
    return values


def name_list(allowed: tuple[str, ...], *, allow_none: bool = False):
    """An argument type for a comma-separated subset of ``allowed`` (distinct names, no
    empty items); with ``allow_none``, ``"none"`` gives the empty tuple."""

    def parse(text: str) -> tuple[str, ...]:
        if allow_none and text.strip().lower() == "none":
            return ()
        extra = " or 'none'" if allow_none else ""
        names = tuple(_items(text))
        if any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}{extra}, got {text!r}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"duplicate names in {text!r}")
        return names

    return parse


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def chain_from(text: str) -> int | str:
    """``--chain-from``: an integer >= 1, or ``measured``."""
    if text == "measured":
        return text
    try:
        return _int_at_least(text, 1)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or 'measured')") from None


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def probability(text: str) -> float:
    """A number in ``(0, 1]`` (e.g. top-p)."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value:g}")
    return value


def output_path(suffix: str):
    """An argument type for a file the command writes: it must end in ``suffix`` and
    its folder must exist, so that a typo fails before a long run rather than after."""

    def parse(text: str) -> Path:
        path = Path(text)
        if path.suffix.lower() != suffix:
            raise argparse.ArgumentTypeError(f"expected a path ending in {suffix}, got {text!r}")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise argparse.ArgumentTypeError(f"folder {os.fspath(parent)!r} does not exist")
        return path

    return parse


def device_name(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``; CUDA only where a CUDA device is
    present. Returns the text (commands resolve ``auto`` themselves)."""
    import torch

    if text == "auto":
        return text
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: only {torch.cuda.device_count()} CUDA device(s)")
    return text


def utf8_text(text: str) -> str:
    """Text that encodes as UTF-8. Python hands over command-line bytes that are not
    UTF-8 as lone surrogates (``surrogateescape``), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"character U+{bad:04X}"
        raise argparse.ArgumentTypeError(f"not UTF-8 text ({byte} at position {e.start})") from None
    return text


def num_draft(text: str) -> int:
    """Draft tokens per step ``k``: the verify window ``k + 1`` must be at most
    :data:`replayssm.engine.factory.MAX_WINDOW`."""
    value = positive_int(text)
    from ..engine.factory import MAX_WINDOW

    if value + 1 > MAX_WINDOW:
        raise argparse.ArgumentTypeError(f"at most {MAX_WINDOW - 1} (the verify window k + 1 is at most {MAX_WINDOW}, "
                                         f"the longest the Triton window kernel takes), got {value}")
    return value


def branching(text: str) -> tuple[int, ...]:
    """A draft tree as children per depth, e.g. ``3,2,1``."""
    from ..engine.trees import parse_branching

    try:
        return parse_branching(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
