"""``replayssm train`` on the CPU: the split by file, the tokenizer, a short run whose
loss falls, the checkpoint round trip (model and MTP head), and the size budget of the
default preset."""

import math
import sys
import random

import pytest
import torch

from replayssm import corpus as C
from replayssm.train import data as D
from replayssm.train.model import DEFAULT_BUDGET_BYTES, SIZES, build_model, losses, mtp_forward, train_config
from replayssm.train.run import TrainConfig, read_log, run_training, save_checkpoint

# A slice of the standard library small enough for seconds of CPU work.
MAX_FILES = 48
HELDOUT = 25.0


@pytest.fixture(scope="module")
def corpus():
    return C.load_corpus(max_files=MAX_FILES, heldout_percent=HELDOUT)


def test_split_is_by_file_and_deterministic(corpus):
    train = {f.rel for f in corpus.train}
    held = {f.rel for f in corpus.heldout}
    assert train and held
    assert not train & held
    again = C.load_corpus(max_files=MAX_FILES, heldout_percent=HELDOUT)
    assert {f.rel for f in again.heldout} == held
    # The rule is the path's hash alone: fresh random paths land on the same side twice,
    # and about the asked share of them is held out.
    rng = random.Random()
    paths = [f"pkg{rng.randrange(10**9)}/mod{rng.randrange(10**9)}.py" for _ in range(4000)]
    flags = [C.is_heldout(p, 10.0) for p in paths]
    assert flags == [C.is_heldout(p, 10.0) for p in paths]
    assert 0.07 < sum(flags) / len(flags) < 0.13
    assert not any(C.is_heldout(p, 0.0) for p in paths)


def test_tokenizer_trains_to_its_size_and_round_trips(corpus):
    tok = D.train_tokenizer([f.text for f in corpus.train], 400)
    assert len(tok) == 400
    assert tok.convert_tokens_to_ids(C.EOS_TOKEN) == 0 and tok.eos_token == C.EOS_TOKEN
    for f in corpus.heldout:  # byte-level: unseen text encodes and decodes exactly
        assert tok.decode(tok.encode(f.text, add_special_tokens=False)) == f.text
    # Merges compress code: well over one byte per token even at 400 tokens, and
    # a byte-only tokenizer (258) is exactly one.
    assert D.bytes_per_token(tok, corpus.heldout) > 1.5
    assert D.bytes_per_token(D.train_tokenizer([f.text for f in corpus.train], 258), corpus.heldout) == 1.0
    stream = C.encode_files(tok, corpus.heldout)
    assert stream.dtype == torch.int32 and int((stream == 0).sum()) == len(corpus.heldout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 40-step run of the tiny preset on the slice (fresh seed each session)."""
    out = tmp_path_factory.mktemp("trained") / "ck"
    cfg = TrainConfig(out=str(out), size="tiny", vocab=384, minutes=30, steps=40, seq_len=64, batch=8, lr=3e-3,
                      warmup=5, seed=random.randrange(10**6), device="cpu", heldout_percent=HELDOUT, eval_every=20,
                      eval_windows=8, max_files=MAX_FILES, save_dtype="float32", quiet=True)
    result = run_training(cfg, log=lambda *_: None)
    return out, result


def test_training_loss_falls(trained):
    out, result = trained
    loss = [r["loss"] for r in result["losses"]]
    mtp = [r["mtp_loss"] for r in result["losses"]]
    assert len(loss) == 40
    # From ln(384) = 5.95 at random init; step-to-step noise is a few hundredths.
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.4, loss
    assert sum(mtp[-5:]) / 5 < sum(mtp[:5]) / 5 - 0.3, mtp
    evals = result["evals"]
    assert [e["step"] for e in evals] == [0, 20, 40]
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"] - 0.3
    log = read_log(out)
    assert log["steps"] == 40 and log["tokens"] == 40 * 8 * 64 and log["device"] == "cpu"
    assert "reference" in log["gdn_kernel"] or "fla" in log["gdn_kernel"]
    assert (out / "loss.png").stat().st_size > 0


def test_checkpoint_round_trip(trained):
    """Saved weights load through the engine's loaders: a fresh model and head saved in
    float32 give the same logits bit for bit, and the head loads with load_mtp_head;
    the trained run's checkpoint loads and its head drafts."""
    from replayssm.engine.adapter import HybridEngine
    from replayssm.engine.drafters import load_mtp_head
    from replayssm.engine.loading import eos_token_ids, load_model, load_tokenizer

    out, _ = trained
    tok = load_tokenizer(out)
    model, head = build_model("tiny", len(tok), 0, seed=random.randrange(10**6))
    with torch.no_grad():  # move the (1 + w) norms off zero so the test sees them
        for m in (model, head):
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.1)
    model.eval(), head.eval()
    ck = out.parent / "round_trip"
    save_checkpoint(ck, model, head, tok, torch.float32)
    loaded = load_model(ck, dtype="float32", device="cpu")
    ids = torch.randint(0, len(tok), (2, 50))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    engine = HybridEngine(loaded, strategy="fold", num_slots=1, window=4, max_len=128)
    head2 = load_mtp_head(engine, ck)
    for k, v in head.state_dict().items():
        assert torch.equal(v, head2.state_dict()[k]), k
    assert eos_token_ids(ck, tok) == [0]

    # The training form of the head (HF causal attention) is what the engine runs.
    from replayssm.engine.kv_cache import KVCache, WindowLayout

    x = ids[0]
    with torch.no_grad():
        h = loaded.model(input_ids=x[None]).last_hidden_state[0]
        want = mtp_forward(loaded, head2, h[None, :-1], x[None, 1:])[0]
        attn = head2.layers[0].self_attn
        cache = KVCache(1, 1, attn.k_proj.out_features // attn.head_dim, attn.head_dim, 128, dtype=torch.float32,
                        device="cpu")
        n = x.numel() - 1
        got = engine.lm_head(head2.forward_layer(engine, cache, WindowLayout([0], [0], [n], "cpu"), x[1:], h[:-1]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # bfloat16, the shipped dtype: the weights are the model's rounded to bf16.
    ck16 = out.parent / "round_trip_bf16"
    save_checkpoint(ck16, model, head, tok, torch.bfloat16)
    loaded16 = load_model(ck16, dtype="bfloat16", device="cpu")
    ref16 = model.to(torch.bfloat16)
    for (k, a), (k2, b) in zip(sorted(ref16.state_dict().items()), sorted(loaded16.state_dict().items())):
        assert k == k2 and torch.equal(a, b), k


def test_trained_checkpoint_generates_with_its_mtp_head(trained):
    from replayssm import cli

    out, _ = trained
    rc = cli.main(["generate", "--model", str(out), "--prompt", "def f(x):", "--draft", "mtp", "--max-new-tokens",
                   "24", "--compare-plain", "--no-stream", "--ignore-eos", "--device", "cpu"])
    assert rc == 0


def test_losses_at_init_are_near_uniform():
    """Both losses are scalars near ln(V) for a fresh model (small init: near-uniform
    predictions), so the falling loss above starts where it should."""
    model, head = build_model("tiny", 300, 0, seed=1)
    w = torch.randint(0, 300, (2, 17))
    main, mtp = losses(model, head, w)
    assert main.ndim == 0 and mtp.ndim == 0
    assert abs(main.item() - math.log(300)) < 0.5 and abs(mtp.item() - math.log(300)) < 0.5


def test_default_size_fits_budget():
    """The default preset with its MTP head, in bf16, plus a 4096-token tokenizer file
    (about 0.3 MB), stays under the 16 MB budget of the shipped checkpoint."""
    from transformers import Qwen3_5ForCausalLM

    from replayssm.engine.drafters import MTPHead

    cfg = train_config("default", 4096, 0)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
        head = MTPHead(cfg, type(model.model.layers[0]), type(model.model.norm))
    n = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in head.parameters())
    assert 2 * n + 400_000 < DEFAULT_BUDGET_BYTES, n
    assert cfg.layer_types.count("linear_attention") == 3 * cfg.layer_types.count("full_attention")
    assert set(SIZES) == {"tiny", "small", "default"}


def test_the_best_held_out_weights_are_saved(tmp_path, monkeypatch):
    """When later evaluations get worse, the checkpoint holds the weights of the best
    one (recorded here when the evaluation saw them), not the last step's."""
    from replayssm.engine.loading import load_model
    from replayssm.train import run

    scores = iter([5.0, 4.0, 3.0, 3.5, 3.6])
    seen = []

    def fake_evaluate(model, head, windows, batch, device, autocast):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return next(scores), 1.0

    monkeypatch.setattr(run, "evaluate", fake_evaluate)
    cfg = TrainConfig(out=str(tmp_path / "ck"), size="tiny", vocab=300, steps=4, seq_len=32, batch=4, lr=1e-2, warmup=1,
                      seed=random.randrange(10**6), device="cpu", heldout_percent=HELDOUT, eval_every=1,
                      eval_windows=4, max_files=MAX_FILES, save_dtype="float32", quiet=True)
    result = run_training(cfg, log=lambda *_: None)
    assert result["saved_step"] == 2 and result["steps"] == 4 and result["saved_heldout_loss"] == 3.0
    loaded = load_model(tmp_path / "ck", dtype="float32", device="cpu").state_dict()
    for k, v in seen[2].items():
        if k in loaded:
            assert torch.equal(loaded[k], v), k
    assert not all(torch.equal(loaded[k], v) for k, v in seen[4].items() if k in loaded)


def _fake_fla(monkeypatch, *, hopper: bool, above_3_4: bool, above_3_7_1: bool):
    import types

    env = types.SimpleNamespace(TRITON_ABOVE_3_4_0=above_3_4, TRITON_ABOVE_3_7_1=above_3_7_1)
    hardware = types.SimpleNamespace(IS_NVIDIA_HOPPER=hopper)
    utils = types.ModuleType("fla.utils")
    utils.env, utils.hardware = env, hardware
    fla = types.ModuleType("fla")
    fla.utils = utils
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.utils", utils)


@pytest.mark.parametrize("hopper,above_3_4,above_3_7_1,refused", [
    (True, True, False, True),     # Hopper, Triton 3.4-3.7.0: fla's gated backward refuses
    (True, True, True, False),     # Triton >= 3.7.1
    (False, True, False, False),   # not Hopper
    (True, False, False, False),   # Triton < 3.4
])
def test_fla_backward_refusal_is_known_before_training(monkeypatch, hopper, above_3_4, above_3_7_1, refused):
    import importlib.util

    from replayssm.train import model as M

    if importlib.util.find_spec("tilelang") is not None:
        pytest.skip("tilelang installed: fla takes another backward")
    _fake_fla(monkeypatch, hopper=hopper, above_3_4=above_3_4, above_3_7_1=above_3_7_1)
    reason = M.fla_backward_refusal(torch.device("cuda"))
    assert (reason is not None) == refused
    if refused:
        assert "Hopper" in reason and "#640" in reason
    assert M.fla_backward_refusal(torch.device("cpu")) is None
