"""``replayssm bench acceptance`` and the shipped checkpoints, on the CPU.

The shipped models are trained: their held-out loss sits far below the uniform
``ln(4096) = 8.3`` nats of an untrained model, and every drafter is accepted more than a
random one would be (1 in 4096). Speculative tokens under the exact strategy equal plain
decoding's in fp32."""

import json
import math

import pytest

from replayssm import cli
from replayssm.engine.loading import embedded_model_dir, load_tokenizer
from replayssm.train.model import DEFAULT_BUDGET_BYTES

CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.mark.parametrize("name", ["embedded", "embedded-draft"])
def test_shipped_checkpoints_are_complete_and_within_budget(name):
    path = embedded_model_dir(name)
    for f in CHECKPOINT_FILES:
        assert (path / f).is_file(), f
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    assert size <= DEFAULT_BUDGET_BYTES, size
    # no training by-products in the package
    assert not (path / "train_log.json").exists() and not (path / "loss.png").exists()


def test_draft_model_shares_the_default_tokenizer_and_is_smaller():
    default, draft = embedded_model_dir("embedded"), embedded_model_dir("embedded-draft")
    assert load_tokenizer(default).get_vocab() == load_tokenizer(draft).get_vocab()
    assert (draft / "model.safetensors").stat().st_size < (default / "model.safetensors").stat().st_size / 2


def test_acceptance_command(tmp_path, capsys):
    js, png = tmp_path / "acc.json", tmp_path / "acc.png"
    rc = cli.main(["bench", "acceptance", "--device", "cpu", "--prompts", "2", "--prompt-len", "48",
                   "--max-new-tokens", "24", "--windows", "2,4", "--heldout-windows", "2", "--quiet",
                   "--json", str(js), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads(js.read_text())
    assert 1.0 < data["heldout_loss"] < 0.6 * math.log(4096), data["heldout_loss"]
    rows = {(r["drafter"], r["window"]): r for r in data["rows"]}
    assert set(rows) == {(d, t) for d in ("ngram", "mtp", "model") for t in (2, 4)}
    for (d, t), r in rows.items():
        assert r["equals_plain"], (d, t)  # fp32: the fold strategy is exact
        assert 1.0 <= r["tokens_per_step"] <= t, r
        assert r["accepted_per_step"] == pytest.approx(r["tokens_per_step"] - 1)
        assert 0 <= r["acceptance_rate"] <= 1 and r["drafted"] > 0
    # trained drafters: the MTP head and the draft model are right far more often than chance
    assert rows[("mtp", 2)]["acceptance_rate"] > 0.2 and rows[("model", 2)]["acceptance_rate"] > 0.2
    assert png.stat().st_size > 0
    assert "held-out loss" in out and "tokens/step" in out


@pytest.mark.parametrize("argv,message", [
    (["--windows", "1,4"], "--windows"),
    (["--draft-model", "/nonexistent/draft"], "--draft-model"),
    (["--drafters", "ngram,oracle"], "--drafters"),
    (["--fit-tree", "16"], "--fit-tree needs --tree"),
    (["--tree", "4,4,1"], "has 37 nodes"),
    (["--tree", "2,1", "--fit-tree", "1"], "--fit-tree must be in"),
    (["--tree", "2,0"], "--tree"),
])
def test_acceptance_rejects_bad_arguments(argv, message, capsys):
    rc = cli.main(["bench", "acceptance", "--device", "cpu", "--quiet", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_acceptance_tree_command(tmp_path, capsys):
    """``--tree``: the MTP tree against the chains of its depth and node count,
    teacher-forced; the chain's own row is the 0% reference and a tree of the chain's
    depth accepts at least as deep as the chain (its top-1 path is the chain)."""
    js = tmp_path / "trees.json"
    rc = cli.main(["bench", "acceptance", "--device", "cpu", "--drafters", "mtp", "--prompts", "2", "--prompt-len",
                   "48", "--max-new-tokens", "24", "--heldout-windows", "1", "--tree", "2,1", "--quiet",
                   "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {r["tree"]: r for r in json.loads(js.read_text())["trees"]}
    assert set(rows) == {"1,1", "2,1", "1,1,1,1"}
    assert rows["1,1"]["vs_chain_same_depth"] == 0 and rows["2,1"]["nodes"] == 5
    assert rows["2,1"]["tokens_per_step"] >= rows["1,1"]["tokens_per_step"] > 1.0
    assert all(r["teacher_forcing_mismatches"] == 0 and r["tokens"] == 2 * 23 for r in rows.values())
    assert "vs chain, same depth" in out


def test_fit_tree_keeps_the_most_followed_nodes_as_a_top_k_tree():
    from replayssm.bench.acceptance import fit_tree

    probe = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]  # 3,2: nodes 4, 5 under 1; 6, 7 under 2; 8, 9 under 3
    hits = [100, 90, 6, 2, 70, 15, 5, 1, 1, 0]
    assert fit_tree(probe, hits, 5) == [-1, 0, 0, 1, 1]  # nodes 0, 1, 2, 4, 5 renumbered breadth first
    assert fit_tree(probe, hits, 4) == [-1, 0, 1, 1]
    # a rank-1 child needs its rank-0 sibling (top-k fills children best first): no room for both
    hits = [100, 90, 6, 2, 10, 70, 5, 1, 1, 0]
    assert fit_tree(probe, hits, 3) == [-1, 0, 1]
    assert fit_tree(probe, hits, 4) == [-1, 0, 1, 1]
