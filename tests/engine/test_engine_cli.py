"""Command line: ``replayssm generate`` on local checkpoints saved by the test, and the
main job (``replayssm run``'s module) on the embedded default."""

import pytest
import torch

from replayssm import cli
from replayssm.engine.loading import eos_token_ids, load_model, load_tokenizer
from replayssm.engine.random_model import random_mtp_state, tiny_config
from replayssm.testing.checkpoints import save_tiny_checkpoint, tiny_tokenizer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = torch.initial_seed() % 10_000
    out = {}
    for i, family in enumerate(("qwen3_5", "qwen3_next")):
        path = tmp_path_factory.mktemp(family)
        save_tiny_checkpoint(path, family, seed=base + i, with_mtp=True)
        out[family] = str(path)
    return out


def generate(capsys, *argv) -> tuple[int, str]:
    rc = cli.main(["generate", *argv])
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("draft", ["ngram", "mtp", "model", "none"])
def test_generate_streams_and_reports(family, draft, checkpoints, capsys):
    path = checkpoints[family]
    extra = ["--draft-model", path] if draft == "model" else []
    strategy = {"ngram": "circular", "mtp": "fold", "model": "snapshot", "none": "fold"}[draft]
    rc, out = generate(capsys, "--model", path, "--prompt", "Hello, GDN", "--draft", draft, "--strategy", strategy,
                       "--max-new-tokens", "40", "--ignore-eos", "--compare-plain", *extra)
    assert rc == 0, out
    assert "generated 40 tokens" in out
    assert "tokens/s" in out and "state memory: GDN state pool" in out and "KV cache" in out
    if draft != "none":
        assert "accept length" in out
        assert "greedy agreement with plain decoding: 40/40 tokens" in out
    if draft == "model":  # the draft model is the target itself: every draft is accepted
        assert "rate 1.00" in out


def test_generate_with_draft_trees(checkpoints, capsys):
    rc, out = generate(capsys, "--model", checkpoints["qwen3_5"], "--prompt", "Hello, GDN", "--draft", "mtp",
                       "--tree", "2,1", "--strategy", "circular", "--max-new-tokens", "24", "--ignore-eos",
                       "--compare-plain")
    assert rc == 0, out
    assert "generated 24 tokens" in out and "greedy agreement with plain decoding: 24/24 tokens" in out
    rc = cli.main(["generate", "--model", checkpoints["qwen3_5"], "--prompt", "x", "--draft", "none", "--tree", "2,1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--tree needs --draft ngram, mtp or model" in err and err.count("\n") == 1
    rc = cli.main(["generate", "--model", checkpoints["qwen3_5"], "--prompt", "x", "--draft", "mtp", "--chain-from", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "--chain-from chooses between a draft tree and its spine" in err and err.count("\n") == 1
    rc = cli.main(["generate", "--model", checkpoints["qwen3_5"], "--prompt", "x", "--draft", "mtp", "--tree", "2,1",
                   "--chain-from", "soon"])
    err = capsys.readouterr().err
    assert rc == 2 and "(or 'measured')" in err and err.count("\n") == 1
    rc = cli.main(["generate", "--model", checkpoints["qwen3_5"], "--prompt", "x", "--draft", "mtp", "--tree", "2,1",
                   "--chain-from", "measured"])
    err = capsys.readouterr().err
    assert rc == 2 and "no measurement for" in err and "embedded with mtp drafts and the 3,2,1 tree" in err
    assert err.count("\n") == 1


def test_generate_with_the_draft_models_trees(checkpoints, capsys):
    """``--draft model --tree``: the draft model's top-k trees inside the static step."""
    path = checkpoints["qwen3_5"]
    rc, out = generate(capsys, "--model", path, "--prompt", "Hello, GDN", "--draft", "model", "--draft-model", path,
                       "--tree", "2,1", "--strategy", "fold", "--max-new-tokens", "16", "--ignore-eos",
                       "--compare-plain")
    assert rc == 0, out
    assert "greedy agreement with plain decoding: 16/16 tokens" in out


def test_generate_with_draft_trees_and_spine_buckets(checkpoints, capsys):
    """``--chain-from 2`` with two prompts: their steps verify the tree's spine while both
    run; the greedy tokens are still plain decoding's."""
    rc, out = generate(capsys, "--model", checkpoints["qwen3_5"], "--prompt", "Hello, GDN", "--prompt", "a b c",
                       "--draft", "mtp", "--tree", "2,1", "--chain-from", "2", "--strategy", "fold",
                       "--max-new-tokens", "16", "--ignore-eos", "--compare-plain")
    assert rc == 0, out
    assert "greedy agreement with plain decoding: 32/32 tokens" in out


def test_generate_with_16_bit_states(checkpoints, capsys):
    """``--state-dtype bfloat16`` reaches the engine's pool: the header names the
    checkpoints' dtype read back from it (the bytes: tests/test_llm.py)."""
    for sdt in ("float32", "bfloat16"):
        rc = cli.main(["generate", "--model", checkpoints["qwen3_5"], "--prompt", "Hello, GDN", "--draft", "ngram",
                       "--strategy", "fold", "--max-new-tokens", "12", "--ignore-eos", "--state-dtype", sdt])
        cap = capsys.readouterr()
        assert rc == 0, cap.err
        assert f"torch.{sdt} states" in cap.err and "generated 12 tokens" in cap.out


def test_generate_batch_sampling_and_chat(checkpoints, capsys):
    path = checkpoints["qwen3_5"]
    rc, out = generate(capsys, "--model", path, "--prompt", "one", "--prompt", "two two", "--chat",
                       "--temperature", "0.8", "--top-p", "0.9", "--max-new-tokens", "24", "--seed", "4")
    assert rc == 0
    assert out.count("--- [") == 2 and "'two two'" in out


def test_loading_functions(checkpoints):
    path = checkpoints["qwen3_next"]
    assert eos_token_ids(path) == [256]
    tok = load_tokenizer(path)
    assert tok.decode(tok.encode("state")) == "state"
    model = load_model(path, dtype="float32", device="cpu")
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    with pytest.raises(ValueError, match="dtype"):
        load_model(path, dtype="int8")


def test_multimodal_qwen35_checkpoint_with_mtp(tmp_path, capsys, seed):
    """Released Qwen3.5 checkpoints are multimodal (language model under
    ``model.language_model``, ``mtp.*`` at the top level); the language model loads and
    the MTP head drafts."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_config("qwen3_5").to_dict()
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
        temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16))
    torch.manual_seed(seed)
    vlm = Qwen3_5ForConditionalGeneration(cfg).eval()
    vlm.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    state.update(random_mtp_state(load_model(tmp_path), seed=seed))
    save_file(state, weights, metadata={"format": "pt"})
    rc, out = generate(capsys, "--model", str(tmp_path), "--prompt", "multimodal", "--draft", "mtp",
                       "--max-new-tokens", "20", "--ignore-eos", "--compare-plain")
    assert rc == 0 and "greedy agreement with plain decoding: 20/20 tokens" in out


def test_main_job(capsys):
    """``replayssm run`` (the main job) on 2 requests of 32 tokens, 16 steps a
    strategy (its defaults: 4 of 96), the held-out loss over one window of 512 tokens
    (its default: 8): the exact strategies equal plain decoding, and every drafter's
    acceptance is reported, within (1, T]."""
    rc = cli.main(["run", "--max-new-tokens", "32", "--batch", "2", "--heldout-windows", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "held-out loss" in out and "(1 windows of held-out" in out
    for strategy in ("snapshot", "fold", "circular"):
        assert f"[{strategy}] 64 tokens" in out and "EQUALS plain decoding (64/64 tokens)" in out
    assert "OK: greedy speculative outputs" in out
    # the acceptance summary: one row per drafter, tokens per step within (1, T]
    for label in ("n-gram", "MTP head", "draft model"):
        row = next(line for line in out.splitlines() if line.startswith(label + " "))
        assert 1.0 < float(row.split()[-2]) <= 4.0, row
