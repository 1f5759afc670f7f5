"""The draft model inside the static step (:class:`DeviceModelDrafter`), on the CPU.

Greedy decoding with its chains, its top-k trees and their spines is plain greedy
decoding token for token (fp32, an exact strategy); a draft model that is the target
itself has every draft accepted (so the draft engine commits exactly what the target
commits, step after step, joins included); the shipped draft model drafting for the
shipped model, with more requests than slots, keeps the tokens too."""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.generator import StepGenerator
from replayssm.engine.loading import embedded_model_dir, load_model, load_tokenizer
from replayssm.engine.model_drafter import DeviceModelDrafter
from replayssm.engine.sampling import SamplingParams
from replayssm.engine.trees import StaticTree
from replayssm.testing.checkpoints import save_tiny_checkpoint

MAX_LEN = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_checkpoint(path, seed=int(torch.initial_seed() % 1000))
    return path


def _prompts(rng, n):
    return [torch.randint(0, 200, (int(torch.randint(3, 9, (1,), generator=rng)),), generator=rng).tolist()
            for _ in range(n)]


def _plain(model, prompts, budget):
    return StepGenerator(HybridEngine(model, strategy="fold", num_slots=1, window=1, max_len=MAX_LEN)).generate(
        prompts, budget).tokens


def _drafter(path, slots, window, tree=None, strategy="fold", sampling=None):
    draft = HybridEngine(load_model(str(path), dtype="float32", device="cpu"), strategy=strategy, num_slots=slots,
                         window=window, max_len=MAX_LEN + window)
    return DeviceModelDrafter(draft, draft.vocab_size, sampling=sampling, tree=tree)


@pytest.mark.parametrize("branching,chain_from", [(None, None), ((2, 1), None), ((2, 2), 2)])
def test_the_target_drafting_for_itself_accepts_every_draft(tiny, rng, branching, chain_from):
    """Two slots, three requests (the third joins a freed slot, its draft slot fresh):
    every step emits the whole chain, tree path or spine (budgets aside), and the
    tokens are plain decoding's."""
    model = load_model(str(tiny), dtype="float32", device="cpu")
    prompts, budget = _prompts(rng, 3), 17
    tree = None if branching is None else StaticTree.from_branching(branching)
    window = 4 if tree is None else tree.num_nodes
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=window, max_len=MAX_LEN)
    gen = StepGenerator(eng, _drafter(tiny, 2, window, tree), num_draft=3, tree=tree, chain_from=chain_from)
    got = gen.generate(prompts, budget)
    assert got.tokens == _plain(model, prompts, budget)
    full = 4 if tree is None else tree.max_depth + 1
    # a request's last step may be cut by its budget; every other step takes everything
    assert sorted(got.accept_lengths)[len(prompts):] == [full] * (len(got.accept_lengths) - len(prompts))
    assert got.acceptance_rate == pytest.approx(1.0) if tree is None else True


def test_the_shipped_draft_model_keeps_plain_decodings_tokens():
    """The shipped draft model for the shipped model, chains and a 3,2,1 tree, four
    requests through two slots: greedy tokens equal plain decoding's, and drafts are
    accepted (the draft model was trained on the same data)."""
    model = load_model(str(embedded_model_dir("embedded")), dtype="float32", device="cpu")
    tok = load_tokenizer(str(embedded_model_dir("embedded")))
    prompts = [tok.encode(t) for t in ("def main(argv):\n", "import os\nimport sys\n", "class Stack:\n",
                                       "for i in range(10):\n")]
    want = _plain(model, prompts, 24)
    draft_dir = embedded_model_dir("embedded-draft")
    for tree in (None, StaticTree.from_branching((3, 2, 1))):
        window = 4 if tree is None else tree.num_nodes
        eng = HybridEngine(model, strategy="fold", num_slots=2, window=window, max_len=MAX_LEN)
        got = StepGenerator(eng, _drafter(draft_dir, 2, window, tree), num_draft=3, tree=tree).generate(prompts, 24)
        assert got.tokens == want
        assert got.mean_accept_length > 1.3, got.mean_accept_length


def test_sampled_chains_emit_every_budget(tiny, rng):
    model = load_model(str(tiny), dtype="float32", device="cpu")
    sampling = SamplingParams(temperature=0.8)
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=MAX_LEN)
    d = _drafter(tiny, 2, 4, sampling=sampling)
    got = StepGenerator(eng, d, num_draft=3, sampling=sampling).generate(_prompts(rng, 2), 12)
    assert [len(t) for t in got.tokens] == [12, 12] and all(0 <= x < eng.vocab_size for t in got.tokens for x in t)
    assert d.q is not None and got.mean_accept_length > 1.0


def test_bad_draft_engines_are_refused(tiny):
    with pytest.raises(ValueError, match="strategy must be one of"):
        _drafter(tiny, 2, 4, strategy="circular")
    model = load_model(str(tiny), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="needs the target's 2 slots, has 3"):
        StepGenerator(HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=MAX_LEN),
                      _drafter(tiny, 3, 4), num_draft=3)
    with pytest.raises(ValueError, match="window 3 is shorter than the 4 tokens"):
        StepGenerator(HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=MAX_LEN),
                      _drafter(tiny, 2, 3), num_draft=3)
    short = HybridEngine(load_model(str(tiny), dtype="float32", device="cpu"), strategy="fold", num_slots=2,
                         window=4, max_len=16)
    with pytest.raises(ValueError, match="holds fewer than the 100 tokens"):
        StepGenerator(HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=MAX_LEN),
                      DeviceModelDrafter(short, short.vocab_size), num_draft=3)
    with pytest.raises(TypeError, match="engine must be a HybridEngine"):
        DeviceModelDrafter(object(), 10)
