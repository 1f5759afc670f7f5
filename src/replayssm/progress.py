"""Output pieces shared by the tools (commands, training, benchmarks): the one
progress mechanism (a ``tqdm`` bar on stderr) and the JSON result files. It depends on
nothing else in the package.

Progress never goes to stdout, where the results are; ``enabled=False`` (the tools'
``--quiet``) writes nothing. On a terminal the bar redraws in place about ten times a
second; elsewhere (a log file, CI) it redraws at most every ``log_interval`` seconds,
so long runs still show that they move without flooding the log.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm


class ProgressBar:
    """Progress of ``total`` units of work, drawn by ``tqdm``.

    Args:
        total: units of work (positive int).
        desc: label printed before the bar.
        unit: unit name printed after the counts.
        enabled: ``False`` writes nothing.
        stream: where to write (default ``sys.stderr``).
        log_interval: seconds between redraws when ``stream`` is not a terminal.

    Use as a context manager, or call :meth:`close` at the end. :meth:`update` adds
    done units and :meth:`set` moves to an absolute count, both clamped to ``total``;
    :meth:`write` prints a line above the bar (a per-item result, say).
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
        self.enabled = bool(enabled)
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        tty = bool(isatty and isatty())
        self._bar = tqdm(
            total=total, desc=desc or None, unit=unit or "it", file=self.stream, disable=not self.enabled,
            mininterval=0.1 if tty else float(log_interval), ascii=not tty, dynamic_ncols=tty, leave=True,
        )
        self.count = 0

    def update(self, n: int = 1) -> None:
        self.set(self.count + n)

    def set(self, count: int) -> None:
        count = max(0, min(int(count), self.total))
        if count != self.count:
            self._bar.update(count - self.count)
            self.count = count

    def set_description(self, desc: str) -> None:
        self._bar.set_description_str(desc, refresh=False)

    def set_postfix(self, text: str) -> None:
        """Show ``text`` after the counts (a running loss, a rate); drawn at the next redraw."""
        self._bar.set_postfix_str(text, refresh=False)

    def write(self, line: str) -> None:
        """Print ``line`` above the bar (nothing when disabled)."""
        if self.enabled:
            self._bar.write(line, file=self.stream)

    def close(self) -> None:
        """Draw the final state and end the bar's line (once)."""
        self._bar.close()

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
