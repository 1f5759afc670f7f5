"""``replayssm bench e2e``: the CPU smoke run end to end (both HF baselines, plain
decoding, every strategy with the oracle, forced and n-gram drafters), which differences
fail the run, a failing HF setting as a row, speed-ups against the faster HF setting,
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
    assert set(rows) == ({("hf", None), ("hf-static", None), ("plain", None)}
                         | {(m, p) for m in e2e.STRATEGY_NAMES for p in (0.0, 1.0)})
    for (mode, p), r in rows.items():
        assert r["generated_tokens"] == 2 * new and r["tokens_per_s"] > 0
        assert (r["step_ms_p50"] is None) == mode.startswith("hf") and r["error"] is None
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


def test_forced_drafter_and_both_hf_settings(tmp_path, capsys):
    """Both HF settings run on the tiny model (the static cache's tokens agree with the
    dynamic cache's); the forced drafter gives every strategy the same accepted counts
    (steps, tokens per step, acceptance) at each P, those of its draws, its P = 0 rows
    are plain decoding (fp32) and its P > 0 rows are not compared; speed-ups divide by
    the faster HF row."""
    js = tmp_path / "e.json"
    new, p, seed = random.randint(14, 20), random.choice((0.6, 0.8)), random.randint(0, 10**6)
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "3", "--max-new-tokens", str(new), "--prompt-len",
                   "6", "--quiet", "--drafter", "forced", "--acceptance", f"0,{p}", "--hf", "static,dynamic",
                   "--seed", str(seed), "--json", str(js)])
    assert rc == 0
    out = capsys.readouterr().out
    data = json.loads(js.read_text())
    rows = {(r["mode"], r["acceptance"]): r for r in data["rows"]}
    hf, static = rows[("hf", None)], rows[("hf-static", None)]
    assert hf["error"] is None and static["error"] is None and static["hf_cache"] == "static"
    assert hf["generated_tokens"] == static["generated_tokens"] == 3 * new
    assert static["agreement_vs_hf"] > 0.9  # fp32: near-ties aside, the same greedy tokens
    best = max((hf, static), key=lambda r: r["tokens_per_s"])
    assert data["hf_baselines"] == [{"batch": 3, "mode": best["mode"], "tokens_per_s": best["tokens_per_s"]}]
    assert f"{best['mode']} at batch 3" in out
    fold = rows[("fold", p)]
    assert fold["hf_baseline"] == best["mode"]
    assert fold["speedup_vs_hf"] == pytest.approx(fold["tokens_per_s"] / best["tokens_per_s"])
    assert fold["speedups_vs_hf"]["hf"] == pytest.approx(fold["tokens_per_s"] / hf["tokens_per_s"])
    for q in (0.0, p):
        same = {(rows[(m, q)]["steps"], rows[(m, q)]["mean_accept_length"], rows[(m, q)]["acceptance_rate"])
                for m in e2e.STRATEGY_NAMES}
        assert len(same) == 1, (q, same)
        for m in e2e.STRATEGY_NAMES:
            r = rows[(m, q)]
            assert r["drafter"] == "forced" and r["generated_tokens"] == 3 * new
            if q == 0.0:
                assert r["acceptance_rate"] == 0.0 and r["verdict"] in (("equal",) if m in EXACT else ("equal", "differs"))
            else:
                assert r["verdict"] is None and r["per_draft_acceptance"] > 0.3
                steps, mean = _forced_schedule(p, 3, seed, 3, new)
                assert r["steps"] == steps and r["mean_accept_length"] == pytest.approx(mean)
    assert data["mismatches"] == []


def test_a_failing_hf_setting_is_a_row_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    real_load = e2e.load_model

    def load(cfg):
        model, description, tokenizer = real_load(cfg)
        generate = model.generate

        def fails_static(*args, **kwargs):
            if kwargs.get("cache_implementation") == "static":
                raise NotImplementedError("this model's cache cannot be static\n(details)")
            return generate(*args, **kwargs)

        model.generate = fails_static
        return model, description, tokenizer

    monkeypatch.setattr(e2e, "load_model", load)
    js = tmp_path / "e.json"
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "1,2", "--max-new-tokens", "6", "--prompt-len", "4",
                   "--quiet", "--strategies", "none", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert [(r["mode"], r["batch"]) for r in data["rows"]] == [
        (m, b) for b in (1, 2) for m in ("hf", "hf-static", "plain")]
    for r in data["rows"]:
        if r["mode"] == "hf-static":
            assert r["error"] == "NotImplementedError: this model's cache cannot be static"
            assert r["tokens_per_s"] is None and r["speedup_vs_hf"] is None
        else:
            assert r["error"] is None and r["hf_baseline"] == "hf" and r["speedups_vs_hf"].keys() == {"hf"}
    assert [b["mode"] for b in data["hf_baselines"]] == ["hf", "hf"]
    out = capsys.readouterr().out
    assert out.count("failed: NotImplementedError: this model's cache cannot be static") == 2


def test_speedups_divide_by_the_faster_hf_setting():
    rates = {"hf": random.uniform(10, 100), "hf-static": random.uniform(10, 100), "plain": random.uniform(100, 200),
             "fold": random.uniform(100, 400)}
    rows = [{"mode": m, "tokens_per_s": t} for m, t in rates.items()]
    best = e2e.add_speedups(rows)
    faster = max(("hf", "hf-static"), key=rates.get)
    assert best is rows[list(rates).index(faster)]
    fold = rows[-1]
    assert fold["hf_baseline"] == faster
    assert fold["speedup_vs_hf"] == pytest.approx(rates["fold"] / rates[faster])
    assert fold["speedup_vs_plain"] == pytest.approx(rates["fold"] / rates["plain"])
    assert fold["speedups_vs_hf"] == pytest.approx({h: rates["fold"] / rates[h] for h in ("hf", "hf-static")})
    rows = [{"mode": "hf", "tokens_per_s": None}, {"mode": "plain", "tokens_per_s": 5.0}]  # the only HF row failed
    assert e2e.add_speedups(rows) is None and rows[1]["speedup_vs_hf"] is None and rows[1]["hf_baseline"] is None


def test_hf_max_batch_keeps_hf_to_small_batches():
    cfg = e2e.E2EConfig(batches=(1, 16, 64), hf_max_batch=16, strategies=("fold",))
    assert [cfg.modes_at(b) for b in cfg.batches] == [("hf", "hf-static", "plain", "fold")] * 2 + [("plain", "fold")]
    assert e2e.E2EConfig(hf=("static",)).modes[:2] == ("hf-static", "plain")


def test_per_draft_acceptance_counts_the_first_rejected_draft():
    # k = 3: emitted 1 (draft 0 rejected), 4 (all accepted), 3 (draft 2 rejected): 0 + 3 + 2 accepted of 1 + 3 + 3
    assert e2e.per_draft_acceptance([1, 4, 3], 3) == pytest.approx(5 / 7)
    assert e2e.per_draft_acceptance([], 3) is None


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
    """A local checkpoint drafted by its own MTP head (inside the static step), beside
    the static-cache HF baseline of the same checkpoint."""
    from replayssm.testing.checkpoints import save_tiny_checkpoint

    ckpt = tmp_path / "ckpt"
    save_tiny_checkpoint(ckpt, seed=random.randint(0, 1000), with_mtp=True)
    js = tmp_path / "e.json"
    strategy = random.choice(EXACT)
    rc = cli.main(["bench", "e2e", "--model", str(ckpt), "--drafter", "mtp", "--strategies", strategy, "--hf", "static",
                   "--batches", "1", "--max-new-tokens", "6", "--prompt-len", "8", "--quiet", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == ["hf-static", "plain", strategy] and rows[strategy]["drafter"] == "mtp"
    assert rows[strategy]["matches_plain"] is True
    assert rows["hf-static"]["error"] is None and rows["hf-static"]["generated_tokens"] == 6
    assert data["hf_baselines"][0]["mode"] == "hf-static"


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
    (["--hf", "dynamic,fast"], "--hf"),
    (["--hf-max-batch", "0"], "--hf-max-batch"),
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
                   "--drafter", "oracle", "--acceptance", "0.8", "--hf", "dynamic", "--json", str(js)])
    data = json.loads(js.read_text())
    assert rc == 0 and data["config"]["graphed"] and data["mismatches"] == []
    for r in data["rows"]:
        assert r["generated_tokens"] == r["batch"] * 48 and r["tokens_per_s"] > 0
        if r["mode"] in EXACT:  # 0.8 + 0.64 + 0.512 of 3 drafts = 0.65
            assert 0.5 < r["acceptance_rate"] < 0.8, r


def _forced_schedule(p: float, k: int, seed: int, batch: int, budget: int) -> tuple[int, float]:
    """(steps, mean tokens per request-step) that the forced drafter's draws give a
    batch of ``batch`` requests with ``budget`` tokens each, computed on the CPU."""
    from replayssm.engine.device_drafters import ForcedDrafter

    drafter = ForcedDrafter(p, 260, seed=seed)
    drafter.bind(batch, k, 8, torch.device("cpu"))
    for r in range(batch):
        drafter.start(r, [0], r)
    emitted, lengths, steps, idx = [1] * batch, [], 0, torch.arange(batch)
    while min(emitted) < budget:
        n = drafter.forced_accepts(idx).tolist()
        for r in range(batch):
            if emitted[r] < budget:
                emitted[r] += n[r] + 1
                lengths.append(n[r] + 1)
        drafter.observe(idx, torch.zeros(batch, k + 1, dtype=torch.long), torch.tensor(n) + 1)
        steps += 1
    return steps, sum(lengths) / len(lengths)


@pytest.mark.gpu
def test_gpu_forced_drafter(tmp_path):
    """On CUDA (bf16, graphed): every strategy's forced rows carry exactly the accepted
    counts the draws give on the CPU (the hash is the same on both devices, and in graph
    replays). No HF rows: the static cache's compilation would cost this test a minute;
    the H200 benchmark runs exercise both settings and report a failure as a row."""
    js = tmp_path / "e2e.json"
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "3", "--max-new-tokens", "32", "--repeats", "1",
                   "--quiet", "--drafter", "forced", "--acceptance", "0.8", "--seed", "5", "--no-hf", "--json", str(js)])
    data = json.loads(js.read_text())
    assert rc == 0 and data["config"]["graphed"] and data["mismatches"] == []
    rows = {r["mode"]: r for r in data["rows"]}
    steps, mean = _forced_schedule(0.8, 3, 5, 3, 32)
    for m in e2e.STRATEGY_NAMES:
        assert rows[m]["steps"] == steps and rows[m]["mean_accept_length"] == pytest.approx(mean), rows[m]
