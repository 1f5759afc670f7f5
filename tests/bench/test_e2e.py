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
    out = capsys.readouterr().out
    assert "SMOKE RUN" in out and "0 of " in out  # no prompt graphs on the CPU: every pass eager
    data = json.loads(js.read_text())
    assert data["smoke"] and data["mismatches"] == [] and data["config"]["graphed"] is False
    assert all(r["prompt_passes"]["static"] == 0 and r["prompt_passes"]["eager"] > 0
               for r in data["rows"] if not r["mode"].startswith("hf"))
    rows = {(r["mode"], r["acceptance"]): r for r in data["rows"]}
    assert set(rows) == ({("hf", None), ("hf-static", None), ("plain", None)}
                         | {(m, p) for m in e2e.STRATEGY_NAMES for p in (0.0, 1.0)})
    for (mode, p), r in rows.items():
        assert r["generated_tokens"] == 2 * new and r["tokens_per_s"] > 0
        assert (r["step_ms_p50"] is None) == mode.startswith("hf") and r["error"] is None
        assert r["decode_ms_per_step"] > 0 and (r["steps_ahead"] is None) == mode.startswith("hf")
        if not mode.startswith("hf"):  # launched ahead: not the first step, and the others up to a stop
            assert 0 < r["steps_ahead"] < 1
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


def test_draft_trees_with_padding_rows(tmp_path):
    """``--tree``: every speculative step verifies an n-gram tree (batch 3 runs in the
    bucket of 4, with a padding row), and the tokens are plain decoding's (fp32)."""
    js = tmp_path / "e.json"
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "3", "--max-new-tokens", "12", "--prompt-len", "6",
                   "--quiet", "--no-hf", "--strategies", "fold,circular", "--tree", "2,1", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    rows = [r for r in data["rows"] if r["mode"] != "plain"]
    assert data["config"]["tree"] == [2, 1] and len(rows) == 2
    for r in rows:
        assert r["tree"] == "2,1" and r["window"] == 5 and r["matches_plain"] and r["generated_tokens"] == 36


def test_draft_trees_and_their_spines_per_bucket(tmp_path):
    """``--tree --chain-from 2``: the batch-2 runs verify the tree's spine while both
    requests run (a bucket of 2), the batch-1 runs the whole tree at every step; both
    give plain decoding's tokens."""
    js = tmp_path / "e.json"
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "1,2", "--max-new-tokens", "12", "--prompt-len", "6",
                   "--quiet", "--no-hf", "--strategies", "fold", "--tree", "2,2", "--chain-from", "2",
                   "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert data["config"]["chain_from"] == 2
    rows = {r["batch"]: r for r in data["rows"] if r["mode"] == "fold"}
    for batch, r in rows.items():
        assert r["chain_from"] == 2 and r["matches_plain"] and r["generated_tokens"] == 12 * batch
        if batch == 1:
            assert r["tree_steps"] == r["steps"]
        else:  # tree steps only once one request has finished and one row is left
            assert r["tree_steps"] < r["steps"]


@pytest.mark.parametrize("tree", [None, "2,1"])
def test_a_checkpoint_with_its_draft_model(tmp_path, tree):
    """``--drafter model``: the draft model inside the static step (here the checkpoint
    drafting for itself, so every draft is accepted), chains or trees; the exact
    strategy's tokens are plain decoding's."""
    from replayssm.testing.checkpoints import save_tiny_checkpoint

    ckpt = tmp_path / "ckpt"
    save_tiny_checkpoint(ckpt, seed=random.randint(0, 1000))
    js = tmp_path / "e.json"
    rc = cli.main(["bench", "e2e", "--model", str(ckpt), "--drafter", "model", "--draft-model", str(ckpt),
                   "--strategies", "fold", "--no-hf", "--batches", "1,2", "--max-new-tokens", "10", "--prompt-len", "6",
                   "--quiet", "--json", str(js)] + ([] if tree is None else ["--tree", tree]))
    assert rc == 0
    data = json.loads(js.read_text())
    assert data["config"]["drafter"] == "model" and data["config"]["draft_model"] == str(ckpt)
    rows = [r for r in data["rows"] if r["mode"] == "fold"]
    assert len(rows) == 2
    for r in rows:
        assert r["matches_plain"] and r["drafter"] == "model"
        assert r["mean_accept_length"] > (2.0 if tree else 2.5)


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

    def fake_run_mode(model, mode, prompts, warm, cfg, on_done=None, batch=None):
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
        d = e2e.compare_tokens(mode, [[1, 2, 3, 4], [5, 9, 9, 8]], ref, "fp32", "bf16")  # 16-bit checkpoints
        assert d["verdict"] == "differs" and d["strict"] is False


def test_state_dtype_reaches_the_pool(tmp_path, capsys):
    """``--state-dtype bf16`` builds 16-bit checkpoints: every engine mode reports half
    the fp32 run's checkpoint bytes (and the same conv state), the header names it, and
    no row is strict."""
    rows = {}
    for sdt in ("fp32", "bf16"):
        js = tmp_path / f"{sdt}.json"
        rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "2", "--max-new-tokens", "6", "--prompt-len", "5",
                       "--quiet", "--no-hf", "--strategies", "fold,circular", "--drafter", "forced", "--acceptance", "0.5",
                       "--state-dtype", sdt, "--seed", str(random.randint(0, 10**6)), "--json", str(js)])
        assert rc == 0
        assert f"{sdt} states" in capsys.readouterr().out
        data = json.loads(js.read_text())
        assert data["config"]["state_dtype"] == sdt
        rows[sdt] = {r["mode"]: r for r in data["rows"]}
    for mode, r in rows["bf16"].items():
        assert r["strict"] is False
        fp32 = rows["fp32"][mode]["state_bytes"]
        assert 2 * r["state_bytes"]["checkpoints"] == fp32["checkpoints"] > 0
        assert r["state_bytes"]["conv_state"] == fp32["conv_state"]


def test_no_run_ahead_reaches_the_generator_and_the_report(tmp_path, capsys, read_flags):
    """``--no-run-ahead`` launches every step after the read of the one before (the
    generator never queues one before a read), the JSON records it and the header says
    so; by default steps are queued before reads."""
    flags = read_flags
    for extra in ([], ["--no-run-ahead"]):
        flags.clear()
        js = tmp_path / f"e2e{len(extra)}.json"
        rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "2", "--max-new-tokens", "10", "--prompt-len",
                       "5", "--quiet", "--no-hf", "--strategies", "fold", "--drafter", "forced", "--acceptance", "0.5",
                       "--seed", str(random.randint(0, 10**6)), "--json", str(js), *extra])
        assert rc == 0
        header = capsys.readouterr().out.splitlines()[0]
        ahead = not extra
        assert json.loads(js.read_text())["config"]["run_ahead"] is ahead
        assert ("each step after the read" in header) is bool(extra)
        assert flags and any(flags) is ahead


@pytest.mark.parametrize("argv,message", [
    (["--batches", "0"], "batches"),
    (["--model", "/nonexistent/checkpoint"], "does not exist"),
    (["--strategies", "none", "--no-plain", "--no-hf"], "nothing to run"),
    (["--acceptance", "0.5,1.5"], "probabilities"),
    (["--random", "tiny", "--model", "embedded"], "--random"),
    (["--hf", "dynamic,fast"], "--hf"),
    (["--hf-max-batch", "0"], "--hf-max-batch"),
    (["--prompt-len", "9-4"], "--prompt-len"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--max-new-tokens", "8-x"], "--max-new-tokens"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--prefill", "fast"], "--prefill"),
    (["--state-dtype", "fp16"], "--state-dtype"),
    (["--tree", "3,x"], "--tree"),
    (["--tree", "4,4"], "21 nodes"),
    (["--tree", "2,1", "--drafter", "forced"], "tree needs a drafter"),
    (["--chain-from", "2"], "chain_from chooses between a draft tree and its spine"),
    (["--drafter", "model"], "--drafter model needs --draft-model"),
    (["--draft-model", "embedded-draft"], "--draft-model is only used with --drafter model"),
    (["--plain-ring-len", "32"], "--plain-ring-len is only used with --plain-ring"),
    (["--plain-ring-len", "32", "--plain-from", "2", "--strategies", "fold"], "--plain-from with circular"),
    (["--ring-len", "16", "--strategies", "fold"], "ring_len is circular's ring length"),
    (["--ring-len", "3", "--strategies", "fold"], "ring_len is circular's ring length"),
    (["--random", "tiny", "--drafter", "model", "--draft-model", "embedded-draft"], "needs a checkpoint"),
    (["--tree", "2,1", "--chain-from", "0"], "--chain-from"),
    (["--requests-per-slot", "0"], "--requests-per-slot"),
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


def test_length_ranges_ttft_latency_and_the_prefill_floor(tmp_path, capsys):
    """Prompt lengths and budgets drawn per request from ranges: every mode (the HF
    baselines included) emits each request's own budget; every row reports time to
    first token before latency, its prefill time beside the batch's compute floor, and
    its rates with and without the prefill; the tables print them."""
    js = tmp_path / "e.json"
    lo, hi, seed = random.randint(3, 6), random.randint(14, 20), random.randint(0, 10**6)
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "4", "--max-new-tokens", "5-12", "--prompt-len",
                   f"{lo}-{hi}", "--quiet", "--strategies", random.choice(EXACT), "--drafter", "oracle",
                   "--acceptance", "0.8", "--seed", str(seed), "--json", str(js)])
    assert rc == 0
    out = capsys.readouterr().out
    data = json.loads(js.read_text())
    assert data["config"]["prompt_len"] == [lo, hi] and data["config"]["max_new_tokens"] == [5, 12]
    cfg = e2e.E2EConfig(prompt_len=(lo, hi), max_new_tokens=(5, 12), seed=seed)
    budgets = e2e.request_budgets(cfg, 4)
    lengths = [len(p) for p in e2e.make_prompts(cfg, 4, 260, None)]
    assert all(lo <= n <= hi for n in lengths) and all(5 <= b <= 12 for b in budgets)
    assert data["mismatches"] == [] and len(data["rows"]) == 4
    (floor,) = data["prefill_floors"]
    assert floor["floor_ms"] == pytest.approx(1e3 * floor["flops"]["total"] / data["matmul"]["flops_per_s"])
    for r in data["rows"]:
        assert r["error"] is None and r["generated_tokens"] == sum(budgets), r["mode"]
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p90"] < r["latency_ms_p90"]
        assert r["ttft_ms_p50"] < r["latency_ms_p50"] <= r["latency_ms_p90"]
        assert r["prefill_floor_ms"] == floor["floor_ms"] and r["prefill_vs_floor"] == pytest.approx(
            r["prefill_ms"] / floor["floor_ms"])
        assert r["tokens_per_s_with_prefill"] < r["tokens_per_s"]
        assert r["speedup_vs_plain_with_prefill"] is not None
    assert f"{lo}-{hi} prompt + 5-12 new tokens" in out and "TTFT p50" in out and "x floor" in out


def test_requests_queue_through_the_slots(tmp_path, capsys):
    """``--requests-per-slot K``: K x batch requests through batch slots. Every mode
    generates each request's budget; plain decoding runs K closed batches back to back
    (its requests finish together); the exact strategy at P = 0 is still plain greedy
    decoding (fp32), so a queued request starts from a clean slot; Hugging Face runs
    the requests a batch at a time, so the last call's requests wait for the first's."""
    js = tmp_path / "e.json"
    # k >= 3: the p90 request's first token then comes after the median request's last
    k, new, seed = random.randint(3, 4), random.randint(6, 10), random.randint(0, 10**6)
    strategy = random.choice(EXACT)
    rc = cli.main(["bench", "e2e", "--random", "tiny", "--batches", "2", "--requests-per-slot", str(k),
                   "--max-new-tokens", str(new), "--prompt-len", "5", "--quiet", "--strategies", strategy,
                   "--drafter", "forced", "--acceptance", "0,0.8", "--hf", "dynamic", "--seed", str(seed),
                   "--json", str(js)])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"loaded: {k} x batch requests through batch slots" in out
    data = json.loads(js.read_text())
    assert data["config"]["requests_per_slot"] == k and data["mismatches"] == []
    rows = {(r["mode"], r["acceptance"]): r for r in data["rows"]}
    for r in rows.values():
        assert r["batch"] == 2 and r["requests"] == 2 * k and r["generated_tokens"] == 2 * k * new, r["mode"]
    assert rows[("plain", None)]["steps"] == k * (new - 1)  # the first token comes from the prefill
    assert rows[(strategy, 0.0)]["verdict"] == "equal"
    hf = rows[("hf", None)]
    assert hf["error"] is None and hf["ttft_ms_p90"] > hf["latency_ms_p50"]


def test_hf_cuts_each_request_at_its_budget(tmp_path):
    """Hugging Face generate runs the batch (left-padded prompts of several lengths) to
    the longest budget; each request keeps its own budget's tokens, which are the
    tokens that request alone gets (greedy, fp32), and its latency ends there."""
    cfg = e2e.E2EConfig(random_model="tiny", batches=(3,), prompt_len=(4, 12), max_new_tokens=(3, 9), repeats=1,
                        dtype="fp32", seed=random.randint(0, 10**6))
    model, _, _ = e2e.load_model(cfg)
    prompts = e2e.make_prompts(cfg, 3, 260, None)
    budgets = e2e.request_budgets(cfg, 3)
    row, tokens = e2e.run_hf(model, prompts, e2e.make_prompts(cfg, 3, 260, None, warmup=True), cfg)
    assert row["error"] is None and [len(t) for t in tokens] == budgets
    for p, b, t in zip(prompts, budgets, tokens):
        alone = model.generate(torch.tensor([p]), max_new_tokens=b, min_new_tokens=b, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist()
        assert t == alone
    assert row["ttft_ms_p50"] < row["latency_ms_p50"] <= row["latency_ms_p90"]


def test_prefill_flops_follow_the_config():
    """The module count of prefill_flops against the shapes written out from the
    config, for a dense model and a MoE one (its router, shared expert and top-k
    routed experts per token)."""
    from replayssm.bench.compute_floor import prefill_flops
    from replayssm.engine.random_model import build_tiny_model

    lengths = [random.randint(1, 40) for _ in range(3)]
    tokens, pairs = sum(lengths), sum(n * (n + 1) // 2 for n in lengths)
    for family in ("qwen3_5", "qwen3_next"):
        model = build_tiny_model(family)
        c = model.config
        h, hd = c.hidden_size, c.head_dim
        kq, kv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        gdn_proj = h * (2 * kq + kv) + h * kv + 2 * h * c.linear_num_value_heads + kv * h
        attn_proj = h * 2 * c.num_attention_heads * hd + 2 * h * c.num_key_value_heads * hd + c.num_attention_heads * hd * h
        if family == "qwen3_5":
            mlp = 3 * h * c.intermediate_size
        else:
            mlp = (c.num_experts * h + c.num_experts_per_tok * 3 * h * c.moe_intermediate_size
                   + 3 * h * c.shared_expert_intermediate_size + h)
        n_gdn = sum(t == "linear_attention" for t in c.layer_types)
        n_attn = len(c.layer_types) - n_gdn
        got = prefill_flops(model, lengths)
        assert got["linear"] == 2 * tokens * (n_gdn * gdn_proj + n_attn * attn_proj + len(c.layer_types) * mlp)
        assert got["attention"] == n_attn * 4 * c.num_attention_heads * hd * pairs
        assert got["gdn"] == n_gdn * 6 * tokens * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        assert got["lm_head"] == 2 * len(lengths) * c.vocab_size * h
        assert got["total"] == sum(v for k, v in got.items() if k != "total")
    with pytest.raises(ValueError, match="prompt_lengths"):
        prefill_flops(model, [3, 0])


def test_measured_matmul_rate_is_a_rate():
    from replayssm.bench.compute_floor import measure_matmul_rate

    m = measure_matmul_rate("cpu", torch.bfloat16, n=64, repeats=2)
    assert m["dtype"] == "float32" and m["n"] == 64  # the CPU times fp32 whatever the model's dtype
    assert m["flops_per_s"] == pytest.approx(2 * 64**3 / m["seconds"])


def test_drawn_lengths_are_seeded_and_cover_the_range():
    lo, hi, seed = random.randint(1, 50), random.randint(60, 100), random.randint(0, 10**6)
    xs = e2e.draw_lengths((lo, hi), 400, seed)
    assert xs == e2e.draw_lengths((lo, hi), 400, seed) and xs != e2e.draw_lengths((lo, hi), 400, seed + 1)
    assert min(xs) == lo and max(xs) == hi  # 400 draws from at most 100 values reach both ends
    assert e2e.draw_lengths(7, 3, seed) == [7, 7, 7]
    cfg = e2e.E2EConfig(max_new_tokens=(lo, hi), seed=seed)
    assert e2e.request_budgets(cfg, 5) != e2e.request_budgets(cfg, 5, warmup=True)
