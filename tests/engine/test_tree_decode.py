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
