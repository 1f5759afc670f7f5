"""Greedy decoding with draft trees is plain greedy decoding, token for token.

The static step verifies a draft tree of the MTP head's top-k tokens (GDN layers through
the strategy's tree verify, attention under the ancestor mask), accepts the deepest
node the target follows, commits its path and compacts the KV cache; on the embedded
model in fp32 the tokens must be plain decoding's (64 tokens here, two shapes and two
strategies; scripts/tree_decode_check.py runs 1000+ tokens)."""

import pytest

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import DeviceMTPDrafter, DeviceNgramDrafter
from replayssm.engine.drafters import load_mtp_head
from replayssm.engine.generator import StepGenerator
from replayssm.engine.loading import embedded_model_dir, load_model, load_tokenizer
from replayssm.engine.trees import StaticTree

TEXT = 'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the command line and run."""\n'


@pytest.fixture(scope="module")
def model():
    return load_model(str(embedded_model_dir("embedded")), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts():
    return [load_tokenizer(str(embedded_model_dir("embedded"))).encode(TEXT)]


@pytest.fixture(scope="module")
def plain(model, prompts):
    """Plain greedy decoding through the exact recurrence (fold): every exact strategy's
    tokens; 4 past the 64 compared, which the teacher-forced measurement needs."""
    return StepGenerator(_engine(model, "fold", 1)).generate(prompts, 68).tokens


def _engine(model, strategy, window):
    return HybridEngine(model, strategy=strategy, num_slots=1, window=window, max_len=64 + 68 + window + 4)


@pytest.mark.parametrize("strategy,drafter,branching", [("fold", "mtp", (3, 2, 1)), ("circular", "ngram", (2, 2))])
def test_greedy_tree_decoding_equals_plain_decoding(model, prompts, plain, strategy, drafter, branching):
    tree = StaticTree.from_branching(branching)
    eng = _engine(model, strategy, tree.num_nodes)
    if drafter == "mtp":
        d = DeviceMTPDrafter(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))), tree=tree)
    else:
        d = DeviceNgramDrafter(tree=tree)
    got = StepGenerator(eng, d, tree=tree).generate(prompts, 64)
    assert got.tokens == [t[:64] for t in plain]
    assert got.mean_accept_length > 1.2  # trees were accepted past the root, so the path commits ran
    if drafter == "mtp":  # the teacher-forced measurement takes the same steps as this decoding
        from replayssm.bench.acceptance import measure_trees

        row = measure_trees(_engine(model, "fold", 1), d.head, prompts, plain, [tree], max_new_tokens=64)[0]
        assert row["steps"] == got.steps and row["teacher_forcing_mismatches"] == 0


def test_tree_needs_its_drafter(model):
    tree = StaticTree.from_branching((2, 2))
    eng = _engine(model, "fold", tree.num_nodes)
    other = DeviceMTPDrafter(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))))
    with pytest.raises(ValueError, match="same tree"):
        StepGenerator(eng, other, tree=tree)


def test_sampled_tree_steps_emit_the_budget(model, prompts):
    """Sampling through tree steps (rejection over siblings inside the step): every
    request gets its budget of vocabulary tokens, and drafts past the root get accepted."""
    from replayssm.engine.sampling import SamplingParams

    tree = StaticTree.from_branching((2, 1))
    eng = _engine(model, "fold", tree.num_nodes)
    got = StepGenerator(eng, DeviceNgramDrafter(tree=tree), tree=tree,
                        sampling=SamplingParams(temperature=0.7)).generate(prompts, 24)
    assert [len(t) for t in got.tokens] == [24] and all(0 <= x < eng.vocab_size for x in got.tokens[0])
    assert got.steps < 23


def test_tree_spines_are_the_first_child_paths():
    """The spine is the root and then each node's first child (the best candidate) down
    to a leaf: in index order for full trees, and along the first children of an
    irregular one even where a later child goes deeper."""
    from replayssm.ops.trees import DraftTrees

    assert StaticTree.from_branching((3, 2, 1)).spine.tolist() == [0, 1, 4, 10]
    assert StaticTree.from_branching((2, 2)).spine.tolist() == [0, 1, 3]
    assert StaticTree.chain(4).spine.tolist() == [0, 1, 2, 3]
    # root -> (1, 2); 1 -> 3; 2 -> 4 -> 5: the spine stops at leaf 3
    irregular = StaticTree(DraftTrees.from_parents([[-1, 0, 0, 1, 2, 4]]))
    assert irregular.spine.tolist() == [0, 1, 3]


def _two_prompts(model):
    tok = load_tokenizer(str(embedded_model_dir("embedded")))
    return [tok.encode(TEXT), tok.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")]


@pytest.mark.parametrize("strategy,drafter,branching", [("fold", "mtp", (3, 2, 1)), ("circular", "ngram", (2, 2))])
def test_tree_and_spine_steps_mixed_per_bucket_equal_plain_decoding(model, strategy, drafter, branching):
    """``chain_from=2``: two requests run as a bucket of 2 (spine steps: the tree's best
    chain) until the shorter one ends, then as a bucket of 1 (tree steps), so each
    request takes both kinds; greedy tokens are plain decoding's, and drafts past the
    root are accepted in the spine steps too."""
    prompts = _two_prompts(model)
    budgets = [20, 48]
    want = StepGenerator(HybridEngine(model, strategy="fold", num_slots=1, window=1, max_len=160)).generate(
        prompts, budgets).tokens
    tree = StaticTree.from_branching(branching)
    eng = HybridEngine(model, strategy=strategy, num_slots=2, window=tree.num_nodes, max_len=160)
    if drafter == "mtp":
        d = DeviceMTPDrafter(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))), tree=tree)
    else:
        d = DeviceNgramDrafter(tree=tree)
    gen = StepGenerator(eng, d, tree=tree, chain_from=2)
    assert (gen.verifies_tree(1), gen.verifies_tree(2)) == (True, False)
    got = gen.generate(prompts, budgets)
    assert got.tokens == want
    rows = got.stats.rows
    assert 2 in rows and 1 in rows, rows
    spine = len(tree.spine)
    # drafts verified: the spine's at two rows, the whole tree's at one
    assert got.drafted == sum(r * ((spine - 1) if r == 2 else (tree.num_nodes - 1)) for r in rows)
    # the two-row steps come first; one of them accepted two drafts in a row, so the
    # spine's second draft is its first draft's child
    two = got.accept_lengths[: 2 * rows.count(2)]
    assert max(two) >= 3, two


def test_chain_from_needs_a_tree(model):
    eng = _engine(model, "fold", 4)
    d = DeviceMTPDrafter(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))))
    with pytest.raises(ValueError, match="chain_from .*needs a tree"):
        StepGenerator(eng, d, num_draft=3, chain_from=2)
    tree = StaticTree.from_branching((2, 1))
    eng = _engine(model, "fold", tree.num_nodes)
    d = DeviceNgramDrafter(tree=tree)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="chain_from must be a positive int"):
            StepGenerator(eng, d, tree=tree, chain_from=bad)


def test_a_spine_step_needs_a_tree_drafter_and_no_tree_of_its_own(model):
    import torch

    from replayssm.engine.graph_step import StaticStep

    tree = StaticTree.from_branching((2, 1))
    eng = _engine(model, "fold", tree.num_nodes)
    windows = torch.zeros((2, tree.num_nodes), dtype=torch.int64)
    with pytest.raises(ValueError, match="tree or its spine"):
        StaticStep(eng, windows, 1, drafter=DeviceNgramDrafter(tree=tree), tree=tree, spine=True)
    with pytest.raises(ValueError, match="drafter that proposes trees"):
        StaticStep(eng, windows, 1, drafter=DeviceNgramDrafter(), spine=True)
    with pytest.raises(ValueError, match="5-node trees, got 3 columns"):
        StaticStep(eng, windows[:, :3], 1, drafter=DeviceNgramDrafter(tree=tree), spine=True)
    with pytest.raises(TypeError, match="spine must be a bool"):
        StaticStep(eng, windows, 1, drafter=DeviceNgramDrafter(tree=tree), spine=1)


def test_sampled_spine_steps_emit_the_budget(model, prompts):
    """Sampling through spine steps (the tree drafter's best chain as deterministic
    drafts, rejection as for any chain): every request gets its budget of vocabulary
    tokens, and drafts get accepted."""
    from replayssm.engine.sampling import SamplingParams

    tree = StaticTree.from_branching((2, 1))
    eng = _engine(model, "fold", tree.num_nodes)
    gen = StepGenerator(eng, DeviceNgramDrafter(tree=tree), tree=tree, chain_from=1,
                        sampling=SamplingParams(temperature=0.7))
    got = gen.generate(prompts, 24)
    assert not gen.verifies_tree(1)
    assert [len(t) for t in got.tokens] == [24] and all(0 <= x < eng.vocab_size for x in got.tokens[0])
    assert got.drafted == 2 * got.steps and got.steps < 23


def test_mtp_spine_drafts_are_the_spine_of_its_tree(model, prompts):
    """The MTP head drafts a spine alone (``propose_spine``: the greedy chain, one head pass
    a depth) as the tokens its tree proposal puts on the spine, at each of a few steps'
    drafter states; spine steps then propose only that (``drafts_spines``)."""
    import torch

    tree = StaticTree.from_branching((3, 2, 1))
    eng = _engine(model, "fold", tree.num_nodes)
    d = DeviceMTPDrafter(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))), tree=tree)
    assert d.drafts_spines and not DeviceNgramDrafter(tree=tree).drafts_spines
    slot = torch.tensor([0])
    seen = set()
    for budget in (3, 9, 17):
        StepGenerator(eng, d, tree=tree).generate(prompts, budget)
        with torch.inference_mode():
            whole = d.propose(slot)
            spine = d.propose_spine(slot)
        assert spine.shape == (1, tree.max_depth)
        assert spine.tolist() == whole[:, tree.spine[1:] - 1].tolist(), budget
        seen.add(tuple(spine[0].tolist()))
    assert len(seen) == 3  # three different drafter states, not one proposal compared thrice


def test_spine_steps_propose_only_the_spine_where_the_drafter_can(model, prompts, plain, monkeypatch):
    """Every step a spine step (``chain_from=1``) with the MTP head: each proposes the
    spine alone (never the whole tree), and the tokens are plain decoding's."""
    tree = StaticTree.from_branching((3, 2, 1))
    eng = _engine(model, "fold", tree.num_nodes)
    d = DeviceMTPDrafter(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))), tree=tree)
    calls = {"propose": 0, "propose_spine": 0}
    for name in calls:
        def counted(*args, _name=name, _f=getattr(d, name)):
            calls[_name] += 1
            return _f(*args)
        monkeypatch.setattr(d, name, counted)
    got = StepGenerator(eng, d, tree=tree, chain_from=1).generate(prompts, 32)
    assert got.tokens == [t[:32] for t in plain]
    assert calls == {"propose": 0, "propose_spine": got.steps}, calls


def test_the_measured_chain_from_table():
    """The shipped model's row, its path resolved to its name, and a refusal naming the
    measured configurations for any other."""
    from replayssm.engine.loading import shipped_model_name
    from replayssm.engine.trees import measured_chain_from

    assert shipped_model_name(embedded_model_dir("embedded")) == "embedded"
    assert shipped_model_name("/elsewhere/model") == "/elsewhere/model"
    assert measured_chain_from("embedded", "mtp", [3, 2, 1]) == 1
    for other in (("embedded", "ngram", (3, 2, 1)), ("embedded", "mtp", (2, 2)), ("/elsewhere/model", "mtp", (3, 2, 1))):
        with pytest.raises(ValueError, match="no measurement for .*measured: embedded with mtp drafts and the 3,2,1"):
            measured_chain_from(*other)
