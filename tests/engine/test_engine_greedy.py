"""End to end: greedy speculative decoding returns exactly plain greedy decoding.

For both model families (tiny random Qwen3.5 and Qwen3-Next, fp32, CPU) and every
strategy, n-gram speculative decoding of a batch whose requests finish at different
steps (512, 150 and 77 new tokens) must emit the tokens of plain decoding (one token
per step through the exact recurrence) token for token, with drafts actually accepted
(the mean accepted length is asserted and reported). A deliberately broken rollback must
make the comparison fail.
"""

import zlib

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.drafters import NgramDrafter
from replayssm.engine.generator import SpeculativeGenerator
from replayssm.engine.random_model import build_tiny_model

FAMILIES = ("qwen3_5", "qwen3_next")
STRATEGIES = ("snapshot", "fold", "circular")
BUDGETS = [512, 150, 77]
K = 3


def run(model, prompts, budgets, strategy=None, eos=(), drafter=None, room=0):
    window = 1 if strategy is None else K + 1
    eng = HybridEngine(model, strategy=strategy or "fold", num_slots=len(prompts), window=window,
                       max_len=max(len(p) for p in prompts) + max(budgets) + K + 2 + room)
    if strategy is not None and drafter is None:
        drafter = NgramDrafter()
    return SpeculativeGenerator(eng, drafter, num_draft=K, eos_token_ids=eos).generate(prompts, budgets)


@pytest.fixture(scope="module")
def plain_runs(request):
    """Per family: the model, the prompts and plain greedy decoding (computed once).
    The seed derives from the module's name, so it does not depend on test order."""
    base = zlib.crc32(request.module.__name__.encode()) % 10_000
    cache = {}

    def get(family):
        if family not in cache:
            model = build_tiny_model(family, seed=base + len(cache))
            g = torch.Generator().manual_seed(base)
            prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 6, 21)]
            cache[family] = (model, prompts, run(model, prompts, BUDGETS))
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_speculative_equals_plain(family, strategy, plain_runs, record_property, capsys):
    model, prompts, plain = plain_runs(family)
    assert [len(t) for t in plain.tokens] == BUDGETS
    spec = run(model, prompts, BUDGETS, strategy)
    for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"request {i}: first difference at token {first} of {len(b)}"
    assert spec.finish_reasons == ["length"] * 3
    # Drafts must actually be accepted, or the comparison proves nothing.
    assert spec.accepted > 0.3 * spec.num_generated, (spec.accepted, spec.num_generated)
    assert spec.mean_accept_length > 1.5
    assert spec.steps < plain.steps / 1.5
    record_property("mean_accept_length", round(spec.mean_accept_length, 3))
    with capsys.disabled():
        print(f"\n  {family}/{strategy}: {spec.num_generated} tokens equal to plain decoding, "
              f"mean accept length {spec.mean_accept_length:.2f} (k={K}), {spec.steps} steps vs {plain.steps}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eos_stops_requests_at_different_steps(strategy, seed, rng):
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (9, 14, 5)]
    budgets = [150, 120, 90]
    free = run(model, prompts, budgets)
    # An end-of-sequence token that request 1 emits mid-way (and maybe others too).
    eos = free.tokens[1][40]
    plain = run(model, prompts, budgets, eos=[eos])
    spec = run(model, prompts, budgets, strategy, eos=[eos])
    assert spec.tokens == plain.tokens
    assert spec.finish_reasons == plain.finish_reasons
    assert plain.finish_reasons[1] == "eos" and plain.tokens[1][-1] == eos
    assert len(plain.tokens[1]) <= 41
    for toks, reason, full in zip(plain.tokens, plain.finish_reasons, free.tokens):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert toks == full[:cut] and reason == ("eos" if eos in full else "length")


@pytest.mark.parametrize("broken", ["gdn_state", "kv_length"])
def test_broken_rollback_is_caught(broken, seed, rng, monkeypatch):
    """Committing the whole window instead of the accepted prefix (GDN state or KV
    length) must change the output: the equality test has teeth. The model keeps
    transformers' embedding init here, so its tokens depend on context more than the
    loop-prone default does, and rejections are frequent."""
    model = build_tiny_model("qwen3_5", seed=seed, embed_std=None)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (13, 6, 21)]
    budgets = [160, 100, 77]
    plain = run(model, prompts, budgets)
    if broken == "gdn_state":
        from replayssm.strategies.base import Strategy

        real = Strategy.commit

        def commit_all(self, batch, accepted):
            return real(self, batch, torch.tensor(batch.lengths, dtype=torch.int32))

        monkeypatch.setattr(Strategy, "commit", commit_all)
    else:
        from replayssm.engine.kv_cache import KVCache

        real_advance = KVCache.advance
        state = {"pending": None}
        real_verify = HybridEngine.verify

        def verify(self, slots, windows):
            state["pending"] = [len(w) for w in windows]
            return real_verify(self, slots, windows)

        def advance(self, slots, counts):
            return real_advance(self, slots, state["pending"] or counts)

        monkeypatch.setattr(HybridEngine, "verify", verify)
        monkeypatch.setattr(KVCache, "advance", advance)
    spec = run(model, prompts, budgets, "fold", room=4 * max(budgets) if broken == "kv_length" else 0)
    assert spec.drafted - spec.accepted > 20  # rejections happened, so the broken rollback mattered
    assert spec.tokens != plain.tokens
