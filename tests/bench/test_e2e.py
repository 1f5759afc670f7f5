"""``replayssm bench e2e``: the CPU smoke run end to end (JSON, plot, the plain-decoding
equality check), its failure path, and its settings."""

import json
import random

import pytest
import torch

from replayssm import cli
from replayssm.bench import e2e

MODES = ("plain", "snapshot", "fold", "circular")


@pytest.fixture(autouse=True)
def _seed_random(_seed):
    random.seed(torch.initial_seed())


def test_cpu_smoke_run(tmp_path, capsys):
    js, png = tmp_path / "e2e.json", tmp_path / "plots" / "e2e.png"
    new = random.randint(8, 14)
    rc = cli.main(["bench", "e2e", "--batches", "2", "--max-new-tokens", str(new), "--prompt-len", "8", "--quiet",
                   "--seed", str(random.randint(0, 10**6)), "--json", str(js), "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "SMOKE RUN" in out
    data = json.loads(js.read_text())
    assert data["smoke"] and data["mismatches"] == [] and data["environment"]["backend"] == "reference"
    assert data["config"]["embedded"] == "tiny" and data["config"]["repeats"] == 1
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == list(MODES) and all(r["batch"] == 2 for r in rows.values())
    for mode, r in rows.items():
        assert r["generated_tokens"] == 2 * new  # end-of-sequence tokens are ignored
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_with_prefill"] <= r["tokens_per_s"]
        assert r["decode_s"] > 0 and len(r["tokens_per_s_runs"]) == 1
        assert r["speedup_vs_plain"] == pytest.approx(r["tokens_per_s"] / rows["plain"]["tokens_per_s"])
        assert r["state_bytes"]["total"] > 0
        if mode == "plain":
            assert r["matches_plain"] is None and r["mean_accept_length"] == 1.0 and r["acceptance_rate"] is None
            assert r["steps"] == new - 1  # the first token comes from the prefill
        else:
            # greedy speculative decoding with an exact strategy is plain greedy decoding
            assert r["matches_plain"] is True, mode
            assert 1.0 <= r["mean_accept_length"] <= 4.0 and 0.0 <= r["acceptance_rate"] <= 1.0
            assert r["steps"] <= new - 1 and r["drafter"] == "ngram"
    # speculative state costs more than plain decoding's, snapshot the most
    sb = {m: rows[m]["state_bytes"]["total"] for m in MODES}
    assert sb["plain"] <= sb["fold"] < sb["circular"] < sb["snapshot"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_with_its_mtp_head(tmp_path):
    """A local checkpoint (the tiny model saved with random mtp.* weights) drafted by its
    own MTP head: the loading and drafter paths of a real model."""
    from replayssm.engine.tiny import save_tiny_checkpoint

    ckpt = tmp_path / "ckpt"
    save_tiny_checkpoint(ckpt, seed=random.randint(0, 1000), with_mtp=True)
    js = tmp_path / "e.json"
    strategy = random.choice(["snapshot", "fold", "circular"])
    rc = cli.main(["bench", "e2e", "--model", str(ckpt), "--drafter", "mtp", "--strategies", strategy, "--batches", "1",
                   "--max-new-tokens", "6", "--prompt-len", "8", "--quiet", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert data["config"]["model"] == str(ckpt) and data["config"]["drafter"] == "mtp"
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == ["plain", strategy]
    assert rows[strategy]["matches_plain"] is True and rows[strategy]["drafter"] == "mtp"
    assert rows[strategy]["generated_tokens"] == rows["plain"]["generated_tokens"] == 6


def test_a_strategy_that_changes_the_tokens_fails(monkeypatch, tmp_path, capsys):
    """The equality check has teeth: tokens that differ from plain decoding give exit 1."""
    bad = random.choice(["snapshot", "fold", "circular"])

    def fake_run_mode(model, mode, prompts, cfg, on_done=None):
        for _ in range(cfg.repeats):
            on_done()
        tokens = [[7] * cfg.max_new_tokens for _ in prompts]
        if mode == bad:
            tokens[-1][-1] = 8
        row = {"mode": mode, "batch": len(prompts), "tokens_per_s": random.uniform(1, 2),
               "tokens_per_s_with_prefill": 1.0, "mean_accept_length": 1.0, "acceptance_rate": None}
        return row, tokens

    monkeypatch.setattr(e2e, "run_mode", fake_run_mode)
    js = tmp_path / "e.json"
    rc = cli.main(["bench", "e2e", "--batches", "1,3", "--quiet", "--json", str(js)])
    assert rc == 1
    data = json.loads(js.read_text())
    assert data["mismatches"] == [{"mode": bad, "batch": 1}, {"mode": bad, "batch": 3}]
    assert [r["matches_plain"] for r in data["rows"] if r["mode"] == bad] == [False, False]
    assert "FAIL" in capsys.readouterr().out


def test_prompts_have_the_asked_length():
    cfg = e2e.E2EConfig(prompt_len=random.randint(3, 40), seed=random.randint(0, 100))
    b = random.randint(1, 5)
    p = e2e.make_prompts(cfg, b, 260, None)
    assert len(p) == b and all(len(x) == cfg.prompt_len for x in p)
    assert all(0 <= t < 256 for x in p for t in x)
    assert p == e2e.make_prompts(cfg, b, 260, None)  # reproducible

    class FakeTokenizer:
        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text[:5]]}

    p = e2e.make_prompts(cfg, 3, 1000, FakeTokenizer())
    assert all(len(x) == cfg.prompt_len for x in p)
    assert p[0][:5] == [ord(c) for c in e2e.TEXT_PROMPTS[0][:5]]


@pytest.mark.parametrize("argv,message", [
    (["--batches", "0"], "batches"),
    (["--num-draft", "0"], "num_draft"),
    (["--drafter", "mtp"], "needs --model"),
    (["--model", "/nonexistent/checkpoint"], "checkpoint directory"),
    (["--strategies", "none", "--no-plain"], "nothing to run"),
])
def test_cli_rejects_bad_settings(argv, message, capsys):
    try:
        rc = cli.main(["bench", "e2e", "--device", "cpu", "--quiet", *argv])
    except SystemExit as e:  # rejected by the argument parser itself
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_defaults():
    cfg = e2e.config_from_args(cli.build_parser().parse_args(["bench", "e2e"]))
    if torch.cuda.is_available():
        assert cfg.embedded == "qwen3.5-shapes" and cfg.dtype == "bf16" and cfg.batches == (1, 4, 16, 64)
    else:
        assert cfg.embedded == "tiny" and cfg.dtype == "fp32" and cfg.repeats == 1
    assert cfg.modes == MODES and cfg.drafter == "ngram" and cfg.num_draft == 3


@pytest.mark.gpu
def test_gpu_qwen_shapes(tmp_path):
    """On CUDA, the embedded Qwen3.5-shaped model: every strategy reproduces plain greedy
    decoding at batch 1 and 16, and every mode produces its tokens."""
    js = tmp_path / "e2e.json"
    rc = cli.main(["bench", "e2e", "--batches", "1,16", "--max-new-tokens", "64", "--repeats", "1", "--quiet",
                   "--json", str(js)])
    data = json.loads(js.read_text())
    assert rc == 0 and data["mismatches"] == [] and not data["smoke"]
    assert data["environment"]["backend"] == "triton"
    assert {(r["mode"], r["batch"]) for r in data["rows"]} == {(m, b) for m in MODES for b in (1, 16)}
    assert all(r["generated_tokens"] == r["batch"] * 64 and r["tokens_per_s"] > 0 for r in data["rows"])
