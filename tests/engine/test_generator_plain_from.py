"""Plain and speculative steps chosen per batch bucket (``StepGenerator(plain_from=)``).

Four requests start together in the 4-row bucket, which takes plain steps; when the two
short ones finish, the other two move to the 2-row bucket, which speculates. Greedy
tokens must be plain decoding's (exact strategies in fp32), every step in the big
bucket must emit one token, and the drafter must have followed the plain steps: the
oracle's drafts after the switch are right only if it counted the tokens of the plain
steps.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import DeviceNgramDrafter, OracleDrafter
from replayssm.engine.generator import StepGenerator
from replayssm.engine.random_model import build_tiny_model

K = 3
BUDGETS = [30, 30, 9, 9]  # the short pair leaves after 8 plain steps


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("qwen3_5", seed=21)


def _prompts(rng):
    return [torch.randint(0, 256, (int(n),), generator=rng).tolist() for n in torch.randint(3, 10, (4,), generator=rng)]


# circular's plain steps decode through its ring (16 records; DESIGN.md section 9)
STRATEGIES = [("fold", None), ("snapshot", None), ("circular", 16)]


def _engine(model, strategy, window, ring_len=None):
    kw = {} if ring_len is None else {"ring_len": ring_len}
    return HybridEngine(model, strategy=strategy, num_slots=4, window=window, max_len=96, backend="reference", **kw)


@pytest.mark.parametrize("strategy,ring_len", STRATEGIES)
def test_a_request_moves_from_plain_to_speculative_steps(model, rng, strategy, ring_len):
    prompts = _prompts(rng)
    plain = StepGenerator(_engine(model, "fold", 1), buckets=(1, 2, 4)).generate(prompts, BUDGETS)
    drafter = OracleDrafter(plain.tokens, 1.0, model.config.vocab_size)
    eng = _engine(model, strategy, K + 1, ring_len)
    res = StepGenerator(eng, drafter, num_draft=K, buckets=(1, 2, 4), plain_from=3).generate(prompts, BUDGETS)
    assert res.tokens == plain.tokens
    rows, counts = res.stats.rows, iter(res.accept_lengths)
    per_step = [[next(counts) for _ in range(n)] for n in rows]
    big = [c for n, c in zip(rows, per_step) if n >= 3]
    small = [c for n, c in zip(rows, per_step) if n < 3]
    assert len(big) == BUDGETS[2] - 1 and all(c == [1] * len(c) for c in big)  # plain: one token a request
    # After the switch: the first step verifies the drafts of the join (rejected), then
    # the oracle's drafts are the plain tokens' continuation, accepted in full, until
    # the budget cuts the last window.
    assert small[0] == [1, 1]
    assert all(c == [K + 1, K + 1] for c in small[1:-1]), small
    assert res.drafted == K * sum(len(c) for c in small)


@pytest.mark.parametrize("strategy,ring_len", STRATEGIES)
def test_requests_move_both_ways_as_the_batch_grows_and_shrinks(model, rng, strategy, ring_len):
    """Prompts prefilled a few tokens a pass: the first request speculates alone, the
    batch then grows into the plain bucket and shrinks out of it again; the greedy
    tokens stay plain decoding's."""
    prompts = _prompts(rng)
    budgets = [24, 20, 12, 9]
    plain = StepGenerator(_engine(model, "fold", 1), buckets=(1, 2, 4)).generate(prompts, budgets)
    res = StepGenerator(_engine(model, strategy, K + 1, ring_len), DeviceNgramDrafter(), num_draft=K,
                        buckets=(1, 2, 4), plain_from=3, prefill_chunk=4).generate(prompts, budgets)
    assert res.tokens == plain.tokens
    kinds = [n >= 3 for n in res.stats.rows]  # True: a plain step
    first_plain = kinds.index(True)
    assert first_plain > 0 and not kinds[0], "no speculative step before the plain ones"
    assert False in kinds[first_plain:], "no speculative step after the plain ones"


def test_the_ngram_drafter_keeps_the_plain_tokens_in_its_history(model, rng):
    """The n-gram drafter's history of a request holds its plain steps' tokens too."""
    prompts = _prompts(rng)
    eng = _engine(model, "fold", K + 1)
    drafter = DeviceNgramDrafter()
    res = StepGenerator(eng, drafter, num_draft=K, buckets=(1, 2, 4), plain_from=3).generate(prompts, BUDGETS)
    for i in (2, 3):  # they ran plain steps only: slots 2, 3 of a fresh pool
        n = int(drafter.length[i])
        assert drafter.history[i, :n].tolist() == (prompts[i] + res.tokens[i])[:n]
        assert n >= len(prompts[i]) + len(res.tokens[i]) - 1


@pytest.mark.parametrize("bad,err", [(0, ValueError), (True, ValueError), (2.0, ValueError)])
def test_plain_from_is_checked(model, bad, err):
    eng = _engine(model, "fold", K + 1)
    with pytest.raises(err, match="plain_from"):
        StepGenerator(eng, DeviceNgramDrafter(), num_draft=K, plain_from=bad)
    with pytest.raises(ValueError, match="needs a drafter"):
        StepGenerator(_engine(model, "fold", 1), plain_from=2)
    # circular with a ring of 2T records cannot decode through it: its plain steps would
    # run the recurrence, which needs the empty ring that a verify does not leave
    eng = _engine(model, "circular", K + 1, 2 * (K + 1))
    assert not eng.ring_decoding
    with pytest.raises(ValueError, match="ring_len > 8"):
        StepGenerator(eng, DeviceNgramDrafter(), num_draft=K, plain_from=3)
