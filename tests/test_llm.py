"""The Python API: ``replayssm.LLM`` on the shipped model (CPU), its outputs, its
agreement with plain decoding, and its refusals; the stable surface of the package."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

import replayssm
from replayssm import LLM, SamplingParams
from replayssm.testing.checkpoints import save_tiny_checkpoint

PROMPTS = ["def read_config(path):\n", "class Stack:\n    def push(self, item):\n"]


@pytest.fixture(scope="module")
def plain():
    return LLM("embedded", drafter=None, max_num_seqs=2, max_model_len=512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_checkpoint(path, seed=int(torch.initial_seed() % 1000))
    return path


def test_the_stable_surface_resolves_and_import_stays_light():
    for name in replayssm.__all__:
        assert getattr(replayssm, name) is not None, name
    assert set(replayssm.__all__) <= set(dir(replayssm))
    code = "import sys, replayssm; print('transformers' in sys.modules, replayssm.__all__[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "LLM"]  # the engine (and transformers) load on first use
    with pytest.raises(AttributeError):
        replayssm.NoSuchThing  # noqa: B018


def test_load_model_embedded():
    model = replayssm.load_model("embedded", device="cpu")
    assert model.config.vocab_size == len(replayssm.load_tokenizer("embedded"))


@pytest.mark.parametrize("strategy", ["fold", "circular"])
def test_speculative_generate_matches_plain_decoding(plain, strategy):
    """Greedy: the exact strategy's tokens are plain decoding's one for one; circular's
    agree to rounding, so at least their first tokens match. Per-prompt budgets hold."""
    params = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=24, ignore_eos=True)]
    ref = plain.generate(PROMPTS, params)
    llm = LLM("embedded", strategy=strategy, drafter="mtp", num_draft=3, max_num_seqs=2, max_model_len=512)
    out = llm.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in out] == [40, 24] and [o.finish_reason for o in out] == ["length"] * 2
    for o, r, text in zip(out, ref, PROMPTS):
        assert o.prompt == text and o.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        if strategy == "fold":
            assert o.token_ids == r.token_ids
        else:
            assert o.token_ids[:8] == r.token_ids[:8]
        # the MTP head of the trained model is accepted often: more than one token a step
        assert 1.0 < o.stats.tokens_per_step <= 4.0 and 0.0 < o.stats.acceptance_rate <= 1.0
        assert o.stats.steps < len(o.token_ids) - 1
        assert r.stats.tokens_per_step == 1.0 and r.stats.acceptance_rate is None


@pytest.mark.parametrize("chain_from", [None, 2, "measured"])
def test_draft_trees_match_plain_decoding(plain, chain_from):
    """``tree="3,2,1"`` with the MTP head: the window is the tree's 16 nodes, and fold's
    greedy tokens are plain decoding's, with every step a tree or, with
    ``chain_from=2``, the two requests' steps the tree's spine until one ends;
    ``"measured"`` takes the measured table's bucket for the shipped model (1: every
    step the spine)."""
    params = [SamplingParams(max_tokens=32, ignore_eos=True), SamplingParams(max_tokens=16, ignore_eos=True)]
    ref = plain.generate(PROMPTS, params)
    llm = LLM("embedded", strategy="fold", drafter="mtp", tree="3,2,1", chain_from=chain_from, max_num_seqs=2,
              max_model_len=512)
    assert llm.num_draft == 15 and llm.engine.window == 16 and llm.tree == (3, 2, 1)
    want = {None: None, 2: 2, "measured": 1}[chain_from]
    assert llm.chain_from == want
    assert "tree='3,2,1'" in repr(llm) and (chain_from is None) == ("chain_from" not in repr(llm))
    out = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert all(o.stats.tokens_per_step > 1.0 for o in out)
    (gen,) = llm._generators.values()
    assert (gen.tree is not None) and gen.chain_from == want


def test_token_prompts_stop_tokens_and_sampling(plain):
    """A token-id prompt (list or tensor) is the text's request; greedy decoding stops at
    an end-of-sequence token, which it keeps, or at max_tokens with none emitted (100
    tokens: the embedded model's greedy text repeats a function body long before); a
    sampled request of 20 tokens."""
    ids = plain.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    [greedy] = plain.generate([ids], SamplingParams(max_tokens=100))
    assert greedy.prompt is None and greedy.prompt_token_ids == ids
    # the same ids as an integer tensor: the same request, and its ids come back as a list
    [same] = plain.generate([torch.tensor(ids, dtype=torch.int32)], SamplingParams(max_tokens=100))
    assert same.prompt_token_ids == ids and same.token_ids == greedy.token_ids
    assert all(type(t) is int for t in same.prompt_token_ids)  # plain ints, as for a list prompt
    eos = set(plain._eos)
    if greedy.finish_reason == "stop":  # ended by an end-of-sequence token, which it keeps
        assert greedy.token_ids[-1] in eos and len(greedy.token_ids) <= 100
    else:
        assert len(greedy.token_ids) == 100 and not eos & set(greedy.token_ids)
    [sampled] = plain.generate(PROMPTS[0], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True))
    assert len(sampled.token_ids) == 20 and all(0 <= t < plain.engine.vocab_size for t in sampled.token_ids)
    assert math.isclose(sampled.stats.tokens_per_step, 1.0)


def test_more_prompts_than_slots(plain):
    texts = [f"x = {i}\n" for i in range(5)]
    out = plain.generate(texts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.prompt for o in out] == texts and all(len(o.token_ids) == 6 for o in out)


def test_bad_requests_raise_before_decoding(plain):
    cases = [
        (["ab\udcffc"], None, ValueError, "not UTF-8"),
        ([""], None, ValueError, "encodes to no tokens"),
        ([[1, 2, 10**6]], None, ValueError, r"prompts\[0\] holds 1000000, not a token id in"),
        ([[1, 2], "text"], None, ValueError, r"prompts\[1\] is text among token-id prompts"),
        ([[1, 2], torch.tensor([0.5])], None, ValueError, r"prompts\[1\] must be a 1-D array of integer"),
        ([], None, TypeError, "non-empty"),
        (PROMPTS, SamplingParams(max_tokens=600), ValueError, "max_model_len 512"),
        (PROMPTS, [SamplingParams()], TypeError, "list of 2"),
    ]
    for prompts, params, exc, text in cases:
        with pytest.raises(exc, match=text):
            plain.generate(prompts, params)
    assert plain.engine.pool.num_free == plain.engine.pool.num_slots  # nothing was left allocated
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_state_dtype_sets_the_checkpoints(tiny):
    """``state_dtype="bfloat16"`` gives the engine 16-bit GDN checkpoints (half the fp32
    engine's checkpoint bytes) and generates as usual."""
    engines = {sdt: LLM(tiny, strategy="circular", drafter="ngram", max_num_seqs=2, max_model_len=128, device="cpu",
                        state_dtype=sdt) for sdt in ("float32", "bfloat16")}
    pools = {sdt: llm.engine.pool for sdt, llm in engines.items()}
    assert pools["bfloat16"].state_dtype == torch.bfloat16 and pools["float32"].state_dtype == torch.float32
    assert 2 * pools["bfloat16"].nbytes()["checkpoints"] == pools["float32"].nbytes()["checkpoints"] > 0
    out = engines["bfloat16"].generate([[5, 6, 7, 8]], SamplingParams(max_tokens=9, ignore_eos=True))
    assert len(out[0].token_ids) == 9 and out[0].finish_reason == "length"
    # a draft model's engine takes the target's state dtype too
    draft = LLM(tiny, drafter="model", draft_model=tiny, max_num_seqs=1, max_model_len=64, device="cpu",
                state_dtype="bfloat16")
    draft.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    (gen,) = draft._generators.values()
    assert gen.drafter.engine.pool.state_dtype == torch.bfloat16


def test_bad_construction_raises_before_loading(tiny, tmp_path):
    cases = [
        (dict(strategy="ring"), "strategy"),
        (dict(drafter="oracle"), "drafter"),
        (dict(num_draft=100), "at most 15"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(drafter="mtp"), "no mtp"),
        (dict(draft_model="embedded-draft"), "only used with drafter='model'"),
        (dict(drafter="model"), "needs draft_model"),
        (dict(max_model_len=10**6), "max_position_embeddings"),
        (dict(state_dtype="float16"), "state_dtype must be one of"),
        (dict(tree="2,1", drafter="none"), "tree needs the ngram, mtp or model drafter"),
        (dict(tree="2,x"), "children per depth"),
        (dict(tree=(2, 0)), "tree must be children per depth"),
        (dict(tree="4,4"), "21 nodes"),
        (dict(tree="2,1", num_draft=3), "disagrees with the tree's 4 drafted nodes"),
        (dict(chain_from=2), "needs a tree"),
        (dict(tree="2,1", chain_from=0), "chain_from must be a positive int"),
        (dict(tree="2,1", chain_from="often"), "chain_from must be a positive int"),
        (dict(tree="2,1", chain_from="measured"), "no measurement for .* with ngram drafts and the 2,1 tree"),
    ]
    for kwargs, text in cases:
        with pytest.raises(ValueError, match=text):
            LLM(tiny, **kwargs)
    broken = tmp_path / "noweights"
    shutil.copytree(tiny, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no weights"):
        LLM(broken)
    with pytest.raises(ValueError, match="is a file"):
        LLM(tiny / "config.json")
    huge = tmp_path / "huge"
    shutil.copytree(tiny, huge)
    config = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**50}))
    with pytest.raises(ValueError, match=r"the KV cache .* needs .* GiB but cpu has .* GiB free"):
        LLM(huge, max_model_len=2**40, device="cpu")


def test_a_tiny_checkpoint_with_its_draft_model(tiny):
    """The draft-model drafter (the eager loop, chunked by the engine's slots) on a
    random checkpoint whose draft model is itself: every draft is accepted."""
    llm = LLM(tiny, strategy="snapshot", drafter="model", draft_model=tiny, num_draft=2, max_num_seqs=2,
              max_model_len=256)
    out = llm.generate(["ab", "cd", "ef"], SamplingParams(max_tokens=12, ignore_eos=True))
    ref = LLM(tiny, drafter=None, max_num_seqs=3, max_model_len=256).generate(
        ["ab", "cd", "ef"], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert all(o.stats.acceptance_rate > 0.9 for o in out)  # the draft model is the target
    assert "strategy='snapshot'" in repr(llm)


def test_a_tiny_checkpoint_with_its_draft_model_in_trees(tiny):
    """``drafter="model"`` with a tree: the draft model's top-k trees inside the static
    step (three requests through two slots); with the target as its own draft model
    every step takes the tree's whole depth."""
    params = SamplingParams(max_tokens=13, ignore_eos=True)
    llm = LLM(tiny, strategy="fold", drafter="model", draft_model=tiny, tree="2,2", max_num_seqs=2, max_model_len=256)
    out = llm.generate(["ab", "cd", "ef"], params)
    ref = LLM(tiny, drafter=None, max_num_seqs=3, max_model_len=256).generate(["ab", "cd", "ef"], params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    (gen,) = llm._generators.values()
    assert type(gen.drafter).__name__ == "DeviceModelDrafter" and gen.tree is not None
    assert all(o.stats.tokens_per_step == pytest.approx(3.0) for o in out)  # 12 tokens after the prefill: 4 steps
