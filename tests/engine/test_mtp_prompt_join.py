"""The MTP drafter's join inside a static prompt pass (``HybridEngine.set_prompt_head``).

A :class:`StepGenerator` whose drafter has a prompt head sets it on the engine; the
engine's static prompt passes (their eager bodies here, on the CPU) then write the
head's keys and values of the prompts' pairs, and the joining requests take
:meth:`DeviceMTPDrafter.join_cached`: only each prompt's last pair and the drafts run
after the pass. Held against the eager join of an engine without prompt graphs: the
same first drafts, the head's cache at every prompt position within the tolerance of
test_prompt_graph.py (the static pass runs its matmuls on padded rows, so its values
agree to ~1e-6 of their scale, not bit for bit; a wrong pair is off by O(1)), the same
tokens and accepted counts; with the pairs' shift broken, the cache leaves the eager
join's.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import DeviceMTPDrafter
from replayssm.engine.drafters import load_mtp_head
from replayssm.engine.generator import StepGenerator
from replayssm.engine.loading import load_model
from replayssm.testing.checkpoints import save_tiny_checkpoint

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp")
    save_tiny_checkpoint(path, "qwen3_5", seed=7, with_mtp=True)
    return path


def _run(checkpoint, prompts, budgets, *, prompt_graphs: bool, mutate=None, device="cpu"):
    """Generate on a fresh engine; returns the result, each join's ``(kind, drafts, the
    head's keys and values of each joiner's prompt pairs)`` and the engine."""
    model = load_model(str(checkpoint), dtype=torch.float32, device=device)
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=128, prompt_graphs=prompt_graphs)
    d = DeviceMTPDrafter(eng, load_mtp_head(eng, checkpoint))
    joins = []

    def record(kind, f, slots, lengths):
        def wrapped(*a, **k):
            drafts = f(*a, **k)
            kv = [(d.cache.k[0, s, :, : n - 1].clone(), d.cache.v[0, s, :, : n - 1].clone())
                  for s, n in zip(slots(a), lengths(a))]
            joins.append((kind, drafts.clone(), kv))
            return drafts
        return wrapped

    d.join = record("eager", d.join, lambda a: a[0], lambda a: [len(p) for p in a[1]])
    d.join_cached = record("cached", d.join_cached, lambda a: a[0], lambda a: a[1])
    gen = StepGenerator(eng, d, num_draft=3)
    if mutate is not None:
        mutate(d)
    return gen.generate(prompts, budgets), joins, eng


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_joins_inside_static_prompt_passes_are_the_eager_joins(checkpoint, device, rng):
    """Four requests through two slots (joins of two requests, then of one at a time as
    slots free up). On CUDA the prompt passes, the head inside them and the join's
    drafts replay captured graphs, against eager joins after eager passes."""
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (17, 4, 11, 30)]
    budgets = [24, 6, 15, 9]
    want, eager_joins, eager = _run(checkpoint, prompts, budgets, prompt_graphs=False, device=device)
    got, joins, static = _run(checkpoint, prompts, budgets, prompt_graphs=True, device=device)
    assert eager.prompt_passes["static"] == 0 and static.prompt_passes["eager"] == 0
    assert [k for k, _, _ in eager_joins] == ["eager"] * len(eager_joins)
    assert [k for k, _, _ in joins] == ["cached"] * len(joins) and len(joins) == len(eager_joins) >= 2
    for (_, d_got, kv_got), (_, d_want, kv_want) in zip(joins, eager_joins):
        assert torch.equal(d_got, d_want)
        for (k_got, v_got), (k_want, v_want) in zip(kv_got, kv_want):
            assert k_want.abs().max() > 0.1
            torch.testing.assert_close(k_got, k_want, **TOL)
            torch.testing.assert_close(v_got, v_want, **TOL)
    assert got.tokens == want.tokens
    assert got.accept_lengths == want.accept_lengths


def test_teeth_pairs_without_the_shift_leave_the_eager_join(checkpoint, rng):
    """The prompt head's pair at a token takes the next token; with each token paired
    with itself instead, the keys and values the joins find differ from the eager
    join's by far more than the tolerance."""
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (13, 9)]
    _, eager_joins, _ = _run(checkpoint, prompts, [4, 4], prompt_graphs=False)

    def mutate(d):  # the head's keys and values of each token paired with itself
        kv = d._prompt_kv
        d._prompt_kv = lambda layout, ids, hidden: kv(layout, torch.roll(ids, 1), hidden)

    _, joins, _ = _run(checkpoint, prompts, [4, 4], prompt_graphs=True, mutate=mutate)
    assert joins, "no join ran"
    k_got, k_want = joins[0][2][0][0], eager_joins[0][2][0][0]
    assert (k_got - k_want).abs().max() > 100 * TOL["atol"] * max(1.0, float(k_want.abs().max()))
