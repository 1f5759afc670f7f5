"""What the tools share for output: progress bar on stderr, strict JSON files."""

import io
import json
import math
import random

import numpy as np
import pytest

from replayssm.bench.progress import ProgressBar, json_safe, write_json


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_log_lines_when_not_a_terminal():
    out = io.StringIO()
    total = random.randint(5, 50)
    with ProgressBar(total, "job", unit="tok", stream=out, log_interval=1e-9) as bar:
        for _ in range(total + 3):  # overshoot is clamped
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == total  # one line per update (interval ~0), the final one not repeated
    assert lines[-1].startswith(f"job |{'#' * 24}| {total}/{total} tok 100%")
    assert "eta" not in lines[-1] and "eta" in lines[0]
    assert bar.count == total


def test_terminal_redraws_in_place_and_ends_the_line():
    out = Terminal()
    bar = ProgressBar(10, "t", stream=out)
    bar.set(4)
    bar.close()
    bar.close()  # closing twice draws once
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "4/10" in text  # the real final count, not a fake 100%


def test_disabled_writes_nothing_and_bad_totals_raise():
    out = io.StringIO()
    with ProgressBar(3, stream=out, enabled=False) as bar:
        bar.update(3)
    assert out.getvalue() == ""
    for total in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="total"):
            ProgressBar(total)
    with pytest.raises(ValueError, match="log_interval"):
        ProgressBar(3, log_interval=0)


def test_json_safe_and_write_json(tmp_path):
    x = random.random()
    payload = {"a": (1, x, math.inf), "b": {"c": -math.inf, "d": math.nan, "e": np.float64(x), "f": np.int64(3)}}
    assert json_safe(payload) == {"a": [1, x, None], "b": {"c": None, "d": None, "e": x, "f": 3}}
    path = write_json(tmp_path / "deep" / "r.json", payload)
    assert json.loads(path.read_text()) == json_safe(payload)
    assert not list(path.parent.glob("*.tmp"))
    with pytest.raises(TypeError, match="payload"):
        write_json(tmp_path / "x.json", [1])
