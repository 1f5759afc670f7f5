"""The benchmark-only forced drafter: a seeded draw, not the target, sets how many drafts
a static step accepts.

Claims: the draws follow the truncated geometric law of ``P`` (each draft accepted with
probability ``P`` after an accepted one); they are a function of (seed, request, the
request's step, draft) only, as an independent integer implementation of the hash
recomputes them; every strategy, run through the eager static steps with continuous
batching, sees the same accepted counts, emits exactly the drafts it accepted followed
by the target's greedy token, and at ``P = 0`` is plain greedy decoding (fp32).
"""

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import ForcedDrafter
from replayssm.engine.generator import StepGenerator
from replayssm.engine.sampling import SamplingParams
from replayssm.engine.random_model import build_tiny_model
from replayssm.strategies import STRATEGY_NAMES
from replayssm.testing.hashes import counter_hash_int as _ref_hash

VOCAB = 260


def _ref_step(seed: int, p: float, k: int, request: int, step: int) -> tuple[int, list[int]]:
    """(accepted drafts, the k drafts) of one request's step, from the documented law."""
    threshold = torch.tensor(p, dtype=torch.float32).item() * 2**24  # P as the drafter holds it
    n = 0
    while n < k and (_ref_hash(seed, request, step, n) >> 8) < threshold:
        n += 1
    return n, [_ref_hash(seed, request, step, k + i) % VOCAB for i in range(k)]


def _draws(p: float, k: int, seed: int, requests: list[int], steps: int,
           backend: str = "auto") -> tuple[torch.Tensor, ForcedDrafter]:
    """``[steps, len(requests)]`` forced counts, each request in its own slot, and the
    drafter after those steps."""
    drafter = ForcedDrafter(p, VOCAB, seed=seed)
    drafter.backend = backend
    drafter.bind(len(requests), k, 8, torch.device("cpu"))
    for slot, r in enumerate(requests):
        drafter.start(slot, [1, 2], r)
    idx = torch.arange(len(requests))
    out = []
    for _ in range(steps):
        out.append(drafter.forced_accepts(idx))
        drafter.observe(idx, torch.zeros(len(requests), k + 1, dtype=torch.long), out[-1] + 1)
    return torch.stack(out), drafter


def test_draws_follow_the_truncated_geometric_law(rng):
    """16384 request-steps per P: the frequency of every count ``j`` is within 5 sigma
    of ``P^j (1 - P)`` (``P^k`` for ``j = k``), sigma = sqrt(p (1 - p) / N) <= 0.004;
    the estimate of P (accepted drafts over drafts examined) within 5 sigma of P,
    sigma = sqrt(P (1 - P) / examined) <= 0.005."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    k = int(torch.randint(2, 6, (1,), generator=rng))
    for p in (float(torch.empty(1).uniform_(0.15, 0.45, generator=rng)),
              float(torch.empty(1).uniform_(0.6, 0.9, generator=rng))):
        n = _draws(p, k, seed, list(range(4096)), 4)[0].flatten()
        total = n.numel()
        pmf = torch.tensor([p**j * (1 - p) for j in range(k)] + [p**k], dtype=torch.float64)
        freq = torch.bincount(n, minlength=k + 1).double() / total
        sigma = (pmf * (1 - pmf) / total).sqrt()
        assert bool(((freq - pmf).abs() <= 5 * sigma).all()), (p, k, freq, pmf)
        accepted = int(n.sum())
        examined = accepted + int((n < k).sum())
        assert abs(accepted / examined - p) <= 5 * (p * (1 - p) / examined) ** 0.5, (p, accepted / examined)
    assert _draws(0.0, k, seed, list(range(64)), 3)[0].max() == 0
    assert _draws(1.0, k, seed, list(range(64)), 3)[0].min() == k


def test_draws_depend_on_request_step_and_seed_only(rng):
    """Slots, batch composition and order do not matter; the request, its step and the
    seed do; an independent implementation of the documented hash gives the same
    counts and drafts."""
    seed, k, p = int(torch.randint(0, 2**40, (1,), generator=rng)), 3, 0.6
    requests = torch.randperm(50, generator=rng)[:12].tolist()
    a = _draws(p, k, seed, requests, 5)[0]
    b = _draws(p, k, seed, requests[::-1] + [999], 5)[0]  # other slots, one more row
    assert torch.equal(a, b[:, :12].flip(1))
    assert not torch.equal(a, _draws(p, k, seed + 1, requests, 5)[0])
    assert not torch.equal(a[0], a[1])  # the step counter moves the draws
    _, d = _draws(p, k, seed, requests, 2)  # two steps observed: the next proposal is step 2's
    proposed = d.propose(torch.arange(len(requests))).tolist()
    for col, r in enumerate(requests):
        assert [_ref_step(seed, p, k, r, s)[0] for s in range(5)] == a[:, col].tolist()
        assert proposed[col] == _ref_step(seed, p, k, r, 2)[1]


def test_the_gpu_path_draws_the_same_in_three_launches_a_step(rng):
    """The Triton path (here under the interpreter), which CUDA runs: the reference
    path's counts and drafts, step after step, and a step's drafter work (its counts,
    the step counters' increment, the next drafts) in 3 launches, 17 as tensor ops
    around the hash: a count past 3 is a launch added to every forced step."""
    from replayssm.testing.op_count import count_ops

    seed, k = int(torch.randint(0, 2**40, (1,), generator=rng)), 3
    requests = torch.randperm(60, generator=rng)[:9].tolist()
    ref, d_ref = _draws(0.7, k, seed, requests, 4)
    got, d_got = _draws(0.7, k, seed, requests, 4, backend="triton")
    assert torch.equal(got, ref)
    idx = torch.arange(len(requests))
    assert torch.equal(d_got.propose(idx), d_ref.propose(idx))
    emitted, accepted = torch.zeros(len(requests), k + 1, dtype=torch.long), torch.ones(len(requests), dtype=torch.long)
    with count_ops(run_triton=False) as ops:  # the step's own work, not its arguments
        d_got.forced_accepts(idx)
        d_got.observe(idx, emitted, accepted)
        d_got.propose(idx)
    assert ops.total <= 3, ops.counts


def test_every_strategy_sees_the_same_accepted_counts(seed, rng):
    """fp32, eager static steps, 5 requests over 3 slots with different budgets: every
    strategy's accepted counts follow the law's draws per request and step, the emitted
    tokens are the accepted drafts then the target's greedy token (checked against the
    HF forward for the exact strategies), and at P = 0 the text is plain decoding's."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = [torch.randint(0, 256, (int(torch.randint(4, 12, (1,), generator=rng)),), generator=rng).tolist()
               for _ in range(5)]
    budgets = torch.randint(8, 30, (5,), generator=rng).tolist()
    k, p, dseed = 3, float(torch.empty(1).uniform_(0.5, 0.9, generator=rng)), int(seed)
    lengths = {}
    for strategy in STRATEGY_NAMES:
        eng = HybridEngine(model, strategy=strategy, num_slots=3, window=k + 1, max_len=64)
        res = StepGenerator(eng, ForcedDrafter(p, VOCAB, seed=dseed), num_draft=k).generate(prompts, budgets)
        lengths[strategy] = res.accept_lengths
        assert [len(t) for t in res.tokens] == budgets
        for r, (prompt, toks) in enumerate(zip(prompts, res.tokens)):
            bonus, pos, step = [], 1, 0  # token 0 comes from the prefill
            while pos < len(toks):
                n, drafts = _ref_step(dseed, p, k, r, step)
                assert toks[pos : pos + n] == drafts[: len(toks) - pos][:n], (strategy, r, step)
                pos += n
                if pos < len(toks):
                    bonus.append(pos)
                pos, step = pos + 1, step + 1
            if strategy != "circular":  # circular's outputs equal the recurrence's to rounding only
                logits = model(torch.tensor([prompt + toks])).logits[0]
                greedy = logits[[len(prompt) + b - 1 for b in bonus]].argmax(-1).tolist()
                assert greedy == [toks[b] for b in bonus], (strategy, r)
    assert lengths["fold"] == lengths["snapshot"] == lengths["circular"]
    assert sum(n > 1 for n in lengths["fold"]) > len(lengths["fold"]) // 3  # drafts were accepted

    plain = StepGenerator(HybridEngine(model, strategy="fold", num_slots=3, window=1, max_len=64)).generate(
        prompts, budgets)
    for strategy in ("snapshot", "fold"):
        eng = HybridEngine(model, strategy=strategy, num_slots=3, window=k + 1, max_len=64)
        res = StepGenerator(eng, ForcedDrafter(0.0, VOCAB, seed=dseed), num_draft=k).generate(prompts, budgets)
        assert res.tokens == plain.tokens and set(res.accept_lengths) == {1}, strategy


def test_bad_settings_are_rejected_before_any_work():
    with pytest.raises(ValueError, match="acceptance"):
        ForcedDrafter(1.2, VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        ForcedDrafter(0.5, 0)
    with pytest.raises(TypeError, match="seed"):
        ForcedDrafter(0.5, VOCAB, seed=1.5)
    model = build_tiny_model("qwen3_5", seed=1)
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=32)
    drafter = ForcedDrafter(0.5, VOCAB)
    with pytest.raises(ValueError, match="greedy"):
        StepGenerator(eng, drafter, num_draft=3, sampling=SamplingParams(temperature=0.8))
    assert not hasattr(drafter, "step")  # never bound
