"""The graphed engine on a CUDA GPU: a whole decode step per CUDA graph replay.

Run on the GPU machine:  python -m pytest -q -s tests/gpu/test_graphed_engine.py

Claims (tiny random Qwen3.5 and Qwen3-Next models, bf16 unless said):

* Graph replay gives the tokens of the same static steps run eagerly, for plain
  decoding and for every strategy with device n-gram drafts, while requests join (more
  prompts than slots) and finish (budgets of different lengths), so that the batch
  bucket changes between steps.
* bf16: an exact strategy's tokens do not depend on their position in the window (the
  e2e oracle drafter relies on it). Equality with plain decoding is not claimed on the
  GPU: a step of ``B x T`` rows rounds GEMMs differently from one of ``B`` rows.
* The oracle drafter at P = 1 has every draft accepted (up to each request's budget),
  and at P = 0 none.
* Sampling (rejection of deterministic drafts) runs inside the graph and emits valid
  tokens.
* The forced drafter (a seeded draw sets the accepted counts) gives the same counts in
  graph replays as eagerly, for every strategy alike, and the replays' tokens equal the
  eager steps'.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import DeviceNgramDrafter, ForcedDrafter, OracleDrafter
from replayssm.engine.generator import StepGenerator
from replayssm.engine.sampling import SamplingParams
from replayssm.engine.random_model import build_tiny_model
from replayssm.strategies import STRATEGY_NAMES

pytestmark = pytest.mark.gpu

FAMILIES = ("qwen3_5", "qwen3_next")
K = 3
SLOTS = 6


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _budgets(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(40, 160, (n,), generator=g).tolist()


def _engine(model, strategy: str, window: int) -> HybridEngine:
    return HybridEngine(model, strategy=strategy, num_slots=SLOTS, window=window, max_len=256)


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_replay_equals_eager_with_joins_and_finishes(family):
    model = build_tiny_model(family, seed=7, dtype=torch.bfloat16, device="cuda")
    prompts, budgets = _prompts(1, 10), _budgets(1, 10)
    for mode in ("plain",) + STRATEGY_NAMES:
        runs = {}
        for graphs in (False, True):
            if mode == "plain":
                gen = StepGenerator(_engine(model, "fold", 1), graphs=graphs)
            else:
                gen = StepGenerator(_engine(model, mode, K + 1), DeviceNgramDrafter(), num_draft=K, graphs=graphs)
            runs[graphs] = gen.generate(prompts, budgets)
        eager, graphed = runs[False], runs[True]
        assert [len(t) for t in graphed.tokens] == budgets, mode
        assert graphed.tokens == eager.tokens, f"{family} {mode}: graph replay differs from the eager steps"
        assert len(set(graphed.stats.rows)) > 1, "the bucket never changed: joins/finishes not exercised"
        print(f"\n  {family} {mode}: {graphed.steps} steps, accept length {graphed.mean_accept_length:.2f}")


@pytest.mark.parametrize("family", FAMILIES)
def test_window_position_does_not_change_a_tokens_logits(family):
    """What the e2e oracle relies on, in bf16: an exact strategy's greedy tokens with
    every draft rejected (each token at window position 0) are reproduced when drafts
    are accepted (tokens at positions 1..k of the same step shape)."""
    model = build_tiny_model(family, seed=8, dtype=torch.bfloat16, device="cuda")
    prompts, budgets = _prompts(2, SLOTS), _budgets(2, SLOTS)
    vocab = model.config.vocab_size
    for strategy in ("snapshot", "fold"):
        eng = _engine(model, strategy, K + 1)
        own = StepGenerator(eng, OracleDrafter({}, 0.0, vocab), num_draft=K).generate(prompts, budgets)
        again = StepGenerator(eng, OracleDrafter(own.tokens, 1.0, vocab), num_draft=K).generate(prompts, budgets)
        assert again.tokens == own.tokens, f"{family} {strategy}"
        assert again.acceptance_rate > 0.9


def test_oracle_acceptance_extremes():
    model = build_tiny_model("qwen3_5", seed=9, dtype=torch.float32, device="cuda")
    prompts = _prompts(3, 4)
    plain = StepGenerator(_engine(model, "fold", 1)).generate(prompts, 64)
    for p, expect in ((1.0, K + 1), (0.0, 1)):
        drafter = OracleDrafter(plain.tokens, p, model.config.vocab_size)
        res = StepGenerator(_engine(model, "circular", K + 1), drafter, num_draft=K).generate(prompts, 64)
        lengths = res.accept_lengths
        if p == 1.0:
            assert res.tokens == plain.tokens
            # every step but a request's last (cut by its budget) emits the full window
            assert sum(n == expect for n in lengths) >= len(lengths) - len(prompts)
        else:
            assert all(n == 1 for n in lengths)


def test_forced_counts_in_the_graph_equal_eager_for_every_strategy():
    model = build_tiny_model("qwen3_5", seed=10, dtype=torch.bfloat16, device="cuda")
    prompts, budgets = _prompts(4, 10), _budgets(4, 10)
    lengths = {}
    for strategy in STRATEGY_NAMES:
        runs = {}
        for graphs in (False, True):
            drafter = ForcedDrafter(0.7, model.config.vocab_size, seed=11)
            runs[graphs] = StepGenerator(_engine(model, strategy, K + 1), drafter, num_draft=K,
                                         graphs=graphs).generate(prompts, budgets)
        assert runs[True].accept_lengths == runs[False].accept_lengths, strategy
        assert runs[True].tokens == runs[False].tokens, f"{strategy}: graph replay differs from the eager steps"
        lengths[strategy] = runs[True].accept_lengths
        print(f"\n  forced P=0.7 {strategy}: {runs[True].steps} steps, accept length {runs[True].mean_accept_length:.2f}")
    assert len({tuple(v) for v in lengths.values()}) == 1, "strategies saw different accepted counts"
    # 1 + 0.7 + 0.49 + 0.343 = 2.53 tokens per step, less where budgets cut the last window
    assert 2.2 < sum(lengths["fold"]) / len(lengths["fold"]) < 2.8


def test_sampling_in_the_graph_emits_valid_tokens():
    model = build_tiny_model("qwen3_5", seed=10, dtype=torch.bfloat16, device="cuda")
    gen = StepGenerator(_engine(model, "fold", K + 1), DeviceNgramDrafter(), num_draft=K,
                        sampling=SamplingParams(temperature=0.8, top_p=0.9))
    res = gen.generate(_prompts(4, 5), 50)
    vocab = model.config.vocab_size
    assert all(len(t) == 50 and all(0 <= x < vocab for x in t) for t in res.tokens)
    assert 1.0 <= res.mean_accept_length <= K + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_drafting_inside_the_graph_equals_eager(family, tmp_path):
    """The MTP head drafts inside the captured step: the same tokens as the eager static
    steps, with requests joining and finishing."""
    from replayssm.engine.device_drafters import DeviceMTPDrafter
    from replayssm.engine.drafters import load_mtp_head
    from replayssm.engine.loading import load_model
    from replayssm.testing.checkpoints import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path, family, seed=12, with_mtp=True)
    model = load_model(str(tmp_path), dtype=torch.bfloat16, device="cuda")
    prompts, budgets = _prompts(5, 10), _budgets(5, 10)
    runs = {}
    for graphs in (False, True):
        eng = _engine(model, "fold", K + 1)
        gen = StepGenerator(eng, DeviceMTPDrafter(eng, load_mtp_head(eng, tmp_path)), num_draft=K, graphs=graphs)
        runs[graphs] = gen.generate(prompts, budgets)
    assert runs[True].tokens == runs[False].tokens
    assert [len(t) for t in runs[True].tokens] == budgets


def test_sampled_mtp_drafts_and_rejection_inside_the_graph(tmp_path):
    """Sampled MTP drafts keep their probabilities per slot and the rejection rule reads
    them, inside the captured step: valid tokens, real draft distributions."""
    from replayssm.engine.device_drafters import DeviceMTPDrafter
    from replayssm.engine.drafters import load_mtp_head
    from replayssm.engine.loading import load_model
    from replayssm.testing.checkpoints import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path, "qwen3_5", seed=13, with_mtp=True)
    model = load_model(str(tmp_path), dtype=torch.bfloat16, device="cuda")
    params = SamplingParams(temperature=0.9, top_p=0.95)
    eng = _engine(model, "circular", K + 1)
    drafter = DeviceMTPDrafter(eng, load_mtp_head(eng, tmp_path), sampling=params)
    res = StepGenerator(eng, drafter, num_draft=K, sampling=params).generate(_prompts(6, 8), 60)
    vocab = model.config.vocab_size
    assert all(len(t) == 60 and all(0 <= x < vocab for x in t) for t in res.tokens)
    q = drafter.draft_probs(torch.arange(SLOTS, device="cuda"))
    torch.testing.assert_close(q.sum(-1), torch.ones(SLOTS, K, device="cuda"))


@pytest.mark.parametrize("strategy", ["fold", "circular"])
def test_plain_buckets_beside_speculative_ones_in_the_graph_equal_eager(strategy):
    """``plain_from``: the big buckets' plain steps (the drafter observing inside the
    graph) and the small buckets' speculative ones, captured, emit the eager steps'
    tokens and accept counts; circular's plain steps decode through its ring."""
    model = build_tiny_model("qwen3_5", seed=12, dtype=torch.float32, device="cuda")
    prompts, budgets = _prompts(5, SLOTS), _budgets(5, SLOTS)
    runs = {}
    for graphs in (False, True):
        eng = HybridEngine(model, strategy=strategy, num_slots=SLOTS, window=K + 1, max_len=256, ring_len=16)
        gen = StepGenerator(eng, DeviceNgramDrafter(), num_draft=K, graphs=graphs, plain_from=4)
        runs[graphs] = gen.generate(prompts, budgets)
    assert runs[True].tokens == runs[False].tokens
    assert runs[True].accept_lengths == runs[False].accept_lengths
    assert any(n >= 4 for n in runs[True].stats.rows) and any(n < 4 for n in runs[True].stats.rows)
