"""Acceptance rules: greedy, and rejection sampling preserving the target distribution.

The statistical tests simulate speculative sampling of a position-indexed target (the
target distribution at sequence position ``t`` is ``P[t]`` whatever came before) with a
different draft distribution ``Q[t]``, over many independent sequences at once and over
several steps per sequence (accepted drafts, corrections and bonus tokens all count).
Exact speculative sampling must then emit independent tokens with marginals ``P[t]``:
chi-square tests of each position's marginal and of the joint of two positions, at a
significance level of 1e-4 each (critical values computed, not tabulated).
"""

import math

import pytest
import torch

from replayssm.engine.sampling import SamplingParams, greedy_accept, rejection_sample, warp_probs

Z_1E4 = 3.719  # standard normal quantile of 1 - 1e-4


def chi2_critical(df: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over cells with positive expected count."""
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def simulate(P: torch.Tensor, Q: torch.Tensor | None, k: int, length: int, trials: int, gen: torch.Generator,
             fixed_drafts: torch.Tensor | None = None) -> torch.Tensor:
    """Speculative sampling of ``trials`` sequences of ``length`` tokens from the
    position-indexed target ``P [L + k, V]`` with drafts from ``Q`` (or deterministic
    ``fixed_drafts [L + k]`` when ``Q`` is None). Returns ``[trials, length]`` tokens."""
    v = P.shape[1]
    out = torch.full((trials, length + k + 1), -1, dtype=torch.long)
    pos = torch.zeros(trials, dtype=torch.long)
    rows = torch.arange(trials)
    while bool((pos < length).any()):
        # [M, k+1] positions of the window (finished sequences read clamped rows, unused)
        idx = (pos[:, None] + torch.arange(k + 1)[None]).clamp(max=P.shape[0] - 1)
        p = P[idx]  # [M, k+1, V]
        if Q is None:
            drafts = fixed_drafts[idx[:, :k]]
            q = None
        else:
            q = Q[idx[:, :k]]  # [M, k, V]
            drafts = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(trials, k)
        num = torch.full((trials,), k, dtype=torch.long)
        accepted, nxt = rejection_sample(p, drafts, q, num, gen)
        for j in range(k):
            take = (j < accepted) & (pos < length)
            out[rows[take], pos[take] + j] = drafts[take, j]
        done = pos < length
        out[rows[done], pos[done] + accepted[done]] = nxt[done]
        pos = torch.where(done, pos + accepted + 1, pos)
    return out[:, :length]


def random_dists(rows: int, v: int, gen: torch.Generator, sharp: float = 1.5) -> torch.Tensor:
    return torch.softmax(sharp * torch.randn(rows, v, generator=gen), -1)


@pytest.mark.parametrize("draft_kind", ["sampled", "deterministic"])
def test_rejection_sampling_preserves_target_distribution(draft_kind, rng):
    v, k, length, trials = 6, 3, 6, 60_000
    P = random_dists(length + k + 1, v, rng)
    if draft_kind == "sampled":
        Q = random_dists(length + k + 1, v, rng)
        fixed = None
    else:
        Q = None
        fixed = torch.randint(0, v, (length + k + 1,), generator=rng)
    tokens = simulate(P, Q, k, length, trials, rng, fixed)
    assert bool((tokens >= 0).all())
    for t in range(length):
        counts = torch.bincount(tokens[:, t], minlength=v).double()
        stat, df = chi2_stat(counts, P[t].double())
        assert stat < chi2_critical(df), f"position {t}: chi2 {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"
    # Joint of positions 1 and 2 (inside one window or across a step boundary):
    # independent with the product of the marginals.
    pair = tokens[:, 1] * v + tokens[:, 2]
    counts = torch.bincount(pair, minlength=v * v).double()
    stat, df = chi2_stat(counts, (P[1][:, None] * P[2][None, :]).reshape(-1).double())
    assert stat < chi2_critical(df), f"joint (1, 2): chi2 {stat:.1f} >= {chi2_critical(df):.1f}"


def test_rejection_sampling_test_has_teeth(rng):
    """Drafts taken as if always accepted (no rejection step) must fail the same test:
    the emitted distribution is then the draft's, not the target's."""
    v, k, length, trials = 6, 3, 4, 60_000
    P = random_dists(length + k + 1, v, rng)
    Q = random_dists(length + k + 1, v, rng)
    tv = 0.5 * (P[:length] - Q[:length]).abs().sum(-1)
    assert float(tv.max()) > 0.15  # the draft is genuinely different
    t = int(tv.argmax())
    drafts = torch.multinomial(Q[t].expand(trials, v), 1, generator=rng)[:, 0]
    counts = torch.bincount(drafts, minlength=v).double()
    expected = P[t].double() * trials
    stat = ((counts - expected) ** 2 / expected).sum().item()
    assert stat > chi2_critical(v - 1)


def test_acceptance_rate_matches_theory(rng):
    """P(first draft accepted) = sum_x min(p(x), q(x)) (Leviathan et al., eq. 1)."""
    v, trials = 10, 100_000
    p = random_dists(2, v, rng)
    q = random_dists(1, v, rng)
    drafts = torch.multinomial(q[0].expand(trials, v), 1, generator=rng)
    accepted, _ = rejection_sample(p.expand(trials, 2, v), drafts, q.expand(trials, 1, v),
                                   torch.ones(trials, dtype=torch.long), rng)
    alpha = torch.minimum(p[0], q[0]).sum().item()
    rate = accepted.double().mean().item()
    assert abs(rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / trials)


def test_identical_draft_is_always_accepted(rng):
    v, trials, k = 8, 2000, 3
    p = random_dists(k + 1, v, rng)
    drafts = torch.stack([torch.multinomial(p[j], trials, replacement=True, generator=rng) for j in range(k)], 1)
    accepted, _ = rejection_sample(p.expand(trials, k + 1, v), drafts, p[:k].expand(trials, k, v),
                                   torch.full((trials,), k, dtype=torch.long), rng)
    assert bool((accepted == k).all())


def test_rejection_sample_respects_num_drafts_and_validates(rng):
    v = 5
    p = random_dists(3, v, rng).expand(4, 3, v).clone()
    drafts = p[:, :2].argmax(-1)  # likely tokens
    num = torch.tensor([0, 1, 2, 1])
    for _ in range(20):
        accepted, nxt = rejection_sample(p, drafts, None, num, rng)
        assert bool((accepted <= num).all()) and bool(((nxt >= 0) & (nxt < v)).all())
    with pytest.raises(ValueError, match="num_drafts"):
        rejection_sample(p, drafts, None, torch.tensor([0, 1, 3, 1]), rng)
    with pytest.raises(ValueError, match="drafts"):
        rejection_sample(p, drafts[:, :1], None, num, rng)
    with pytest.raises(ValueError, match="q must be"):
        rejection_sample(p, drafts, torch.rand(4, 2, v + 1), num, rng)


def test_greedy_accept(rng):
    for _ in range(200):
        n = int(torch.randint(0, 5, (1,), generator=rng))
        argmax = torch.randint(0, 3, (n + 1,), generator=rng).tolist()
        drafts = torch.randint(0, 3, (n,), generator=rng).tolist()
        acc, nxt = greedy_accept(argmax, drafts)
        expect = 0
        while expect < n and drafts[expect] == argmax[expect]:
            expect += 1
        assert (acc, nxt) == (expect, argmax[expect])


def test_warp_probs(rng):
    logits = 3 * torch.randn(4, 50, generator=rng)
    p = warp_probs(logits, SamplingParams(temperature=0.7))
    torch.testing.assert_close(p, torch.softmax(logits / 0.7, -1))
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_k=5))
    assert bool(((p > 0).sum(-1) == 5).all())
    assert bool((p.argmax(-1) == logits.argmax(-1)).all())
    full = torch.softmax(logits, -1)
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))
    for row_full, row in zip(full, p):
        kept = row > 0
        # the kept set is the most likely tokens, reaching 0.6 and minimal
        assert row_full[kept].min() >= row_full[~kept].max() if (~kept).any() else True
        assert row_full[kept].sum() >= 0.6 - 1e-6
        assert row_full[kept].sum() - row_full[kept].min() < 0.6
        torch.testing.assert_close(row.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="greedy"):
        warp_probs(logits, SamplingParams())
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(top_k=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
