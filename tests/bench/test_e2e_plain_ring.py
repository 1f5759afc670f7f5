"""``replayssm bench e2e --plain-ring``: plain decoding timed both ways, through the
recurrence (``plain``) and through ``circular``'s ring (``plain-ring``), on the CPU."""

import json
import random

import pytest
import torch

from replayssm import cli
from replayssm.bench import e2e


@pytest.fixture(autouse=True)
def _seed_random(_seed):
    random.seed(torch.initial_seed())


def test_plain_decoding_both_ways(tmp_path):
    js = tmp_path / "e.json"
    new = random.randint(20, 30)  # more than one ring cycle: L = 16, T = 3 flushes every 11 tokens
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "1,2", "--max-new-tokens", str(new),
                   "--prompt-len", "6", "--quiet", "--no-hf", "--strategies", "none", "--num-draft", "2",
                   "--plain-ring", "--seed", str(random.randint(0, 10**6)), "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert [(r["mode"], r["batch"]) for r in data["rows"]] == [(m, b) for b in (1, 2) for m in ("plain", "plain-ring")]
    assert data["config"]["plain_ring"] is True and data["config"]["plain_ring_len"] == 16
    for r in data["rows"]:
        assert r["generated_tokens"] == r["batch"] * new and r["tokens_per_s"] > 0 and r["mean_accept_length"] == 1
        if r["mode"] == "plain-ring":
            assert r["window"] == 3 and r["ring_len"] == 16 and r["ring_decoding"] is True
            assert r["exact_outputs"] is False and r["strict"] is False  # compared, a difference only reported
            assert r["verdict"] in ("equal", "differs") and r["agreement"] is not None
            assert r["speedup_vs_plain"] > 0
    assert data["mismatches"] == []


def test_config_checks_and_modes():
    cfg = e2e.E2EConfig(plain_ring=True, strategies=("fold",), hf=())
    assert cfg.modes == ("plain", "plain-ring", "fold")
    assert e2e.E2EConfig(strategies=("fold",), hf=()).modes == ("plain", "fold")  # off by default
    e2e.E2EConfig(plain=False, plain_ring=True, strategies=(), hf=()).check()  # plain-ring alone is something to run
    for bad in (12, 4, 0, True):  # not a power of two >= 2 (num_draft + 1) = 8
        with pytest.raises(ValueError, match="plain_ring_len"):
            e2e.E2EConfig(plain_ring=True, plain_ring_len=bad).check()
    e2e.E2EConfig(num_draft=15, plain_ring_len=16).check()  # unused: not checked
    assert e2e.mode_engine_options("plain-ring", cfg) == {"strategy": "circular", "ring_len": 16, "plain_via_ring": True}
    assert e2e.mode_engine_options("plain", cfg) == {"strategy": "fold"}
    assert e2e.mode_engine_options("circular", cfg) == {"strategy": "circular"}


def test_cli_rejects_a_bad_ring_length(capsys):
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--plain-ring", "--plain-ring-len", "24", "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("replayssm bench e2e: error: plain_ring_len must be a power of two")


def test_speculative_modes_with_plain_buckets(tmp_path):
    """``--plain-from``: the batch-2 runs' bucket takes plain steps (one token a step, the
    drafter idle), the batch-1 runs' still speculates; circular's plain steps decode
    through its ring of ``--plain-ring-len``."""
    js = tmp_path / "e.json"
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "1,2", "--max-new-tokens", "14",
                   "--prompt-len", "6", "--quiet", "--no-hf", "--no-plain", "--strategies", "fold,circular",
                   "--num-draft", "2", "--plain-from", "2", "--drafter", "forced", "--acceptance", "1.0",
                   "--seed", str(random.randint(0, 10**6)), "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert data["config"]["plain_from"] == 2
    for r in data["rows"]:
        assert r["plain_from"] == 2
        if r["batch"] == 2:  # every step of both requests in the plain bucket: no draft examined
            assert r["mean_accept_length"] == 1 and r["plain_steps"] == r["steps"] == 13
            assert r["acceptance_rate"] is None and r["per_draft_acceptance"] is None
        else:  # forced full acceptance: windows of 3 tokens
            assert r["plain_steps"] == 0 and r["mean_accept_length"] > 2 and r["per_draft_acceptance"] == 1.0
    with pytest.raises(ValueError, match="plain_from"):
        e2e.E2EConfig(plain_from=0).check()
    assert e2e.mode_engine_options("circular", e2e.E2EConfig(plain_from=4)) == {
        "strategy": "circular", "ring_len": 16, "plain_via_ring": True}


def test_circular_ring_length(tmp_path):
    """``--ring-len``: circular's speculative steps run on a ring of that length (the row
    reports it; without the option, the engine's default of 4 (num_draft + 1)), and
    a forced acceptance gives every strategy the same accepted counts whatever L; bad
    lengths and a clash with ``--plain-from`` are one-line errors."""
    lengths = {}
    for L in (None, 8):
        js = tmp_path / f"e{L}.json"
        rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "2", "--max-new-tokens", "25",
                       "--prompt-len", "6", "--quiet", "--no-hf", "--no-plain", "--strategies", "circular",
                       "--num-draft", "2", "--drafter", "forced", "--acceptance", "0.7", "--seed", "3",
                       "--json", str(js)] + ([] if L is None else ["--ring-len", str(L)]))
        assert rc == 0
        (row,) = json.loads(js.read_text())["rows"]
        assert row["ring_len"] == (16 if L is None else 8)  # the engine's default: 4 (num_draft + 1), rounded up
        lengths[L] = (row["mean_accept_length"], row["generated_tokens"])
    assert lengths[None] == lengths[8]
    for bad in (["--ring-len", "12"], ["--ring-len", "4"], ["--ring-len", "16", "--plain-from", "2"]):
        assert cli.main(["bench", "e2e", "--random", "tiny", "--quiet", "--no-hf", "--num-draft", "2", *bad]) == 2
    with pytest.raises(ValueError, match="ring_len"):
        e2e.E2EConfig(ring_len=24).check()
    assert e2e.mode_engine_options("circular", e2e.E2EConfig(ring_len=32)) == {"strategy": "circular", "ring_len": 32}
