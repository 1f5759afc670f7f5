"""What the tools share for output: the progress bar (stderr only, silent when
disabled, counts clamped to the total) and strict, atomic JSON files."""

import io
import json
import math
import random

import numpy as np
import pytest

from replayssm.progress import ProgressBar, json_safe, write_json


def test_bar_counts_clamp_and_end_at_the_real_count():
    out = io.StringIO()
    total = random.randint(5, 50)
    with ProgressBar(total, "job", unit="tok", stream=out, log_interval=1e-9) as bar:
        for _ in range(total + 3):  # overshoot is clamped
            bar.update(1)
        bar.write("a result line")
    assert bar.count == total
    assert f"{total}/{total}" in out.getvalue().splitlines()[-1]
    assert "a result line\n" in out.getvalue()
    out = io.StringIO()
    bar = ProgressBar(10, "t", stream=out)
    bar.set(4)
    bar.close()
    assert "4/10" in out.getvalue().splitlines()[-1]  # the real final count, not a fake 100%


def test_disabled_writes_nothing_and_bad_totals_raise():
    out = io.StringIO()
    with ProgressBar(3, stream=out, enabled=False) as bar:
        bar.update(3)
        bar.write("x")
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
