"""``replayssm bench e2e``: the CPU smoke run end to end (HF baseline, plain decoding,
every strategy with the oracle and the n-gram drafter), which differences fail the run,
and the warm-up's separation from the timed prompts."""

import json
import random

import pytest
import torch

from replayssm import cli
from replayssm.bench import e2e

EXACT = ("snapshot", "fold")


@pytest.fixture(autouse=True)
def _seed_random(_seed):
    random.seed(torch.initial_seed())


def test_cpu_smoke_run_with_the_oracle(tmp_path, capsys):
    js, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    new = random.randint(10, 16)
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "2", "--max-new-tokens", str(new), "--prompt-len", "8", "--quiet",
                   "--drafter", "oracle", "--acceptance", "0,1", "--seed", str(random.randint(0, 10**6)),
                   "--json", str(js), "--plot", str(png)])
    assert rc == 0
    assert "SMOKE RUN" in capsys.readouterr().out
    data = json.loads(js.read_text())
    assert data["smoke"] and data["mismatches"] == [] and data["config"]["graphed"] is False
    rows = {(r["mode"], r["acceptance"]): r for r in data["rows"]}
    assert set(rows) == {("hf", None), ("plain", None)} | {(m, p) for m in e2e.STRATEGY_NAMES for p in (0.0, 1.0)}
    for (mode, p), r in rows.items():
        assert r["generated_tokens"] == 2 * new and r["tokens_per_s"] > 0
        assert (r["step_ms_p50"] is None) == (mode == "hf")
        if mode in EXACT:  # fp32: greedy speculative decoding is plain greedy decoding
            assert r["verdict"] == "equal" and r["strict"] is True
        if mode in e2e.STRATEGY_NAMES:
            if p == 0.0:
                assert r["acceptance_rate"] < 0.05 and r["mean_accept_length"] < 1.2
            elif mode in EXACT:
                # every draft is the strategy's own greedy token: all accepted but where
                # a request's budget cuts its last window
                assert r["acceptance_rate"] > 0.75 and r["steps"] <= new // 4 + 2
    assert rows[("hf", None)]["verdict"] is None and rows[("hf", None)]["state_bytes"] is None
    assert rows[("fold", 1.0)]["speedup_vs_plain"] == pytest.approx(
        rows[("fold", 1.0)]["tokens_per_s"] / rows[("plain", None)]["tokens_per_s"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ngram_drafter_without_hf(tmp_path):
    js = tmp_path / "e.json"
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "1,3", "--max-new-tokens", "12", "--prompt-len", "6", "--quiet",
                   "--no-hf", "--strategies", "circular", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert [(r["mode"], r["batch"]) for r in data["rows"]] == [("plain", 1), ("circular", 1), ("plain", 3),
                                                                ("circular", 3)]
    for r in data["rows"]:
        assert r["generated_tokens"] == r["batch"] * 12 and r["step_ms_p50"] > 0
        if r["mode"] == "circular":
            assert r["drafter"] == "ngram" and r["steps"] <= 11  # never more steps than plain


def test_checkpoint_with_its_mtp_head(tmp_path):
    """A local checkpoint drafted by its own MTP head (inside the static step)."""
    from replayssm.testing.checkpoints import save_tiny_checkpoint

    ckpt = tmp_path / "ckpt"
    save_tiny_checkpoint(ckpt, seed=random.randint(0, 1000), with_mtp=True)
    js = tmp_path / "e.json"
    strategy = random.choice(EXACT)
    rc = cli.main(["bench", "e2e", "--model", str(ckpt), "--drafter", "mtp", "--strategies", strategy, "--no-hf",
                   "--batches", "1", "--max-new-tokens", "6", "--prompt-len", "8", "--quiet", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == ["plain", strategy] and rows[strategy]["drafter"] == "mtp"
    assert rows[strategy]["matches_plain"] is True


def test_an_exact_strategy_that_changes_the_tokens_in_fp32_fails(monkeypatch, tmp_path, capsys):
    """The equality check has teeth: in fp32, an exact strategy whose tokens differ from
    plain decoding gives exit 1; circular differing beside it does not."""
    bad = random.choice(EXACT)

    def fake_run_mode(model, mode, prompts, warm, cfg, on_done=None):
        tokens = [[7] * cfg.max_new_tokens for _ in prompts]
        if mode in (bad, "circular"):
            tokens[-1][-1] = 8
        row = {"mode": mode, "batch": len(prompts), "acceptance": None, "tokens_per_s": random.uniform(1, 2),
               "mean_accept_length": 1.0, "acceptance_rate": None, "step_ms_p50": 1.0, "step_ms_p90": 1.0}
        return [(row, tokens)]

    monkeypatch.setattr(e2e, "run_mode", fake_run_mode)
    js = tmp_path / "e.json"
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "1,3", "--max-new-tokens", "10", "--dtype", "fp32", "--quiet",
                   "--no-hf", "--json", str(js)])
    assert rc == 1
    data = json.loads(js.read_text())
    assert [(m["mode"], m["batch"]) for m in data["mismatches"]] == [(bad, 1), (bad, 3)]
    assert [m["agreement"] for m in data["mismatches"]] == [pytest.approx(0.9), pytest.approx(29 / 30)]
    assert [(d["mode"], d["reason"]) for d in data["differences"]] == [("circular", "inexact strategy")] * 2
    out = capsys.readouterr().out
    assert "FAIL" in out and f"{bad} at batch 1 (90.0% of tokens agree)" in out


def test_warmup_prompts_differ_from_the_timed_ones():
    cfg = e2e.E2EConfig(prompt_len=random.randint(3, 40), seed=random.randint(0, 100))
    b = random.randint(1, 5)
    timed, warm = e2e.make_prompts(cfg, b, 260, None), e2e.make_prompts(cfg, b, 260, None, warmup=True)
    assert all(len(p) == cfg.prompt_len for p in timed + warm)
    assert not set(map(tuple, timed)) & set(map(tuple, warm))
    assert timed == e2e.make_prompts(cfg, b, 260, None)  # reproducible


def test_compare_tokens_classification():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert e2e.compare_tokens("hf", [[9]], ref, "fp32")["verdict"] is None
    for mode in e2e.STRATEGY_NAMES:
        d = e2e.compare_tokens(mode, [[1, 2, 3, 4], [5, 9, 9, 8]], ref, "fp32")
        assert d["agreement"] == pytest.approx(6 / 8) and d["prefix_agreement"] == pytest.approx(5 / 8)
        assert d["verdict"] == ("mismatch" if mode in EXACT else "differs")
        assert e2e.compare_tokens(mode, [[1, 2, 3, 4], [5, 9, 9, 8]], ref, "bf16")["verdict"] == "differs"


@pytest.mark.parametrize("argv,message", [
    (["--batches", "0"], "batches"),
    (["--model", "/nonexistent/checkpoint"], "does not exist"),
    (["--strategies", "none", "--no-plain", "--no-hf"], "nothing to run"),
    (["--acceptance", "0.5,1.5"], "probabilities"),
    (["--random", "tiny", "--model", "embedded"], "--random"),
])
def test_cli_rejects_bad_settings(argv, message, capsys):
    rc = cli.main(["bench", "e2e", "--device", "cpu", "--quiet", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1 and err.startswith("replayssm bench e2e: error:")


@pytest.mark.gpu
def test_gpu_qwen_shapes(tmp_path):
    """On CUDA in bf16, the Qwen3.5-shaped model: every mode runs graphed and the run
    passes (nothing is strict in bf16); the oracle's exact strategies keep P's geometric
    acceptance, which needs their P > 0 runs to reproduce their own references."""
    js = tmp_path / "e2e.json"
    rc = cli.main(["bench", "e2e", "--random", "qwen3.5-shapes", "--batches", "1,16", "--max-new-tokens", "48", "--repeats", "1", "--quiet",
                   "--drafter", "oracle", "--acceptance", "0.8", "--json", str(js)])
    data = json.loads(js.read_text())
    assert rc == 0 and data["config"]["graphed"] and data["mismatches"] == []
    for r in data["rows"]:
        assert r["generated_tokens"] == r["batch"] * 48 and r["tokens_per_s"] > 0
        if r["mode"] in EXACT:  # 0.8 + 0.64 + 0.512 of 3 drafts = 0.65
            assert 0.5 < r["acceptance_rate"] < 0.8, r
