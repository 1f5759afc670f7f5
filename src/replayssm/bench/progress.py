"""Output pieces shared by the user-facing tools (drift, memory, e2e): a progress bar on
stderr and the JSON result files.

On a terminal it redraws one line in place::

    drift  |##########----------|  16384/32768 tok  51%  41.2 s  eta 40.1 s

Elsewhere (a log file, CI, a captured stream) it writes a plain line at most every
``log_interval`` seconds and one at the end, so long runs still show that they move
without flooding the log. Nothing is written when disabled; results never go to stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

_BAR_WIDTH = 24


class ProgressBar:
    """Progress of ``total`` units of work.

    Args:
        total: units of work (positive int).
        desc: label printed before the bar.
        unit: unit name printed after the counts.
        enabled: ``False`` writes nothing.
        stream: where to write (default ``sys.stderr``).
        log_interval: seconds between lines when ``stream`` is not a terminal.

    Use as a context manager, or call :meth:`close` at the end. :meth:`update` adds
    done units; :meth:`set` moves to an absolute count (clamped to ``total``).
    """

    def __init__(
        self,
        total: int,
        desc: str = "",
        *,
        unit: str = "",
        enabled: bool = True,
        stream: TextIO | None = None,
        log_interval: float = 10.0,
    ):
        if not isinstance(total, int) or isinstance(total, bool) or total < 1:
            raise ValueError(f"total must be a positive int, got {total!r}")
        if not isinstance(log_interval, (int, float)) or log_interval <= 0:
            raise ValueError(f"log_interval must be a positive number, got {log_interval!r}")
        self.total = total
        self.desc = desc
        self.unit = unit
        self.enabled = bool(enabled)
        self.stream = stream if stream is not None else sys.stderr
        self.log_interval = float(log_interval)
        self.count = 0
        self._t0 = time.perf_counter()
        self._last_draw = -float("inf")
        self._drawn = -1  # count shown by the last line written
        self._closed = False
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        # Redraw a terminal line at most ~10 times a second: drawing is not free.
        self._interval = 0.1 if self._tty else self.log_interval

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def update(self, n: int = 1) -> None:
        self.set(self.count + n)

    def set(self, count: int) -> None:
        self.count = max(0, min(int(count), self.total))
        now = time.perf_counter()
        if self.count != self._drawn and now - self._last_draw >= self._interval:
            self._draw(now)

    def _line(self, now: float) -> str:
        frac = self.count / self.total
        fill = int(round(frac * _BAR_WIDTH))
        elapsed = now - self._t0
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
        eta_s = f"eta {eta:.1f} s" if frac > 0 and frac < 1 else ""
        unit = f" {self.unit}" if self.unit else ""
        return (
            f"{self.desc} |{'#' * fill}{'-' * (_BAR_WIDTH - fill)}| {self.count:>{len(str(self.total))}}/{self.total}{unit}"
            f" {100 * frac:3.0f}%  {elapsed:.1f} s  {eta_s}"
        ).rstrip()

    def _draw(self, now: float, final: bool = False) -> None:
        self._last_draw = now
        if not self.enabled:
            return
        if final and not self._tty and self._drawn == self.count:
            return  # the log already has this line
        self._drawn = self.count
        line = self._line(now)
        if self._tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state (once)."""
        if self._closed:
            return
        self._closed = True
        self._draw(time.perf_counter(), final=True)

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``None`` (strict JSON has no
    ``inf``/``nan``), tuples turned into lists and numpy scalars into Python numbers."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", None) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` (made :func:`json_safe`) as indented JSON, creating parent
    folders; the file appears whole or not at all (written beside it, then renamed)."""
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict, got {type(payload).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(payload), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def write_outputs(result: dict, json_path, plot_path, plot: str) -> None:
    """The ``--json`` / ``--plot`` outputs of a command: ``result`` as JSON, and a PNG
    drawn by ``replayssm.bench.plotting.<plot>(result, path)``; each path is printed."""
    if json_path is not None:
        write_json(json_path, result)
        print(f"wrote {json_path}")
    if plot_path is not None:
        from . import plotting

        getattr(plotting, plot)(result, plot_path)
        print(f"wrote {plot_path}")
