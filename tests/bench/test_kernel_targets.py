"""``scripts/check_kernel_targets.py``: the kernel benchmark's rows against the targets
in ``benchmarks/kernel_targets.json`` (issue 3's), which are kept out of the library."""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from replayssm.bench import kernels

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_kernel_targets", ROOT / "scripts" / "check_kernel_targets.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
ALL = kernels.STRATEGY_NAMES + kernels.BASELINE_NAMES


@pytest.fixture(autouse=True)
def _seed_random(_seed):
    random.seed(torch.initial_seed())


def _row(name, batch, us, floor):
    return {"strategy": name, "kind": "strategy" if name in kernels.STRATEGY_NAMES else "baseline", "batch": batch,
            "us_per_layer_step": us, "floor_ratio": us / floor}


def _random_rows():
    floor = random.uniform(1, 100)
    times = {(n, b): random.uniform(0.5, 8) * floor for b in (1, 16, 64, 256) for n in ALL}
    return floor, times, [_row(n, b, t, floor) for (n, b), t in times.items()]


def test_targets_follow_the_issue():
    targets = json.loads(check.DEFAULT_TARGETS.read_text())
    floor, times, rows = _random_rows()
    results = check.evaluate(rows, targets)
    for t in results:
        assert t["passed"] == (t["value"] <= t["limit"])
    for batch in (1, 16, 64, 256):
        best = min(kernels.STRATEGY_NAMES, key=lambda n: times[n, batch])
        mine = [t for t in results if t["batch"] == batch]
        ratio = [t for t in mine if "floor" in t["target"]]
        if batch == 1:
            assert not ratio
            vs = [t for t in mine if t["target"].startswith("best")]
            assert vs[0]["value"] == times[best, 1] and vs[0]["limit"] == times["snapshot", 1]
        else:
            assert len(ratio) == 1 and ratio[0]["limit"] == (1.5 if batch >= 64 else 2.0)
            assert ratio[0]["value"] == pytest.approx(times[best, batch] / floor)
        others = [t for t in mine if t["target"].endswith(" vs snapshot") and not t["target"].startswith("best")]
        assert {t["target"].split()[0] for t in others} == {"fold", "circular"}
        sv = [t for t in mine if "snapshot_verify" in t["target"]]
        assert len(sv) == 1 and sv[0]["passed"] == (times["snapshot", batch] <= times["snapshot_verify", batch])


def test_script_exit_status_follows_the_targets(tmp_path, capsys):
    _, times, rows = _random_rows()
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"smoke": False, "rows": rows}))
    results = check.evaluate(rows, json.loads(check.DEFAULT_TARGETS.read_text()))
    assert check.main([str(path)]) == (1 if any(not t["passed"] for t in results) else 0)
    # a target file whose limits every row meets
    lax = tmp_path / "lax.json"
    lax.write_text(json.dumps({"best_strategy_floor_ratio": [{"min_batch": 1, "limit": 1e9}]}))
    assert check.main([str(path), "--targets", str(lax)]) == 0
    assert "[FAIL]" not in capsys.readouterr().out.split("targets from")[-1]
    path.write_text(json.dumps({"smoke": True, "rows": rows}))
    assert check.main([str(path)]) == 0  # a smoke run claims no floor
    assert check.main([str(tmp_path / "missing.json")]) == 2
