"""Drafters: n-gram lookup, the MTP head (loaded from ``mtp.*`` weights) and a draft model.

Random weights cannot show drafting quality, so these tests check mechanics: what the
drafters propose equals a from-scratch computation, a drafter that is the target itself
gets every draft accepted, and the speculative output stays equal to plain decoding
(greedy) whatever the drafter proposes.
"""

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.drafters import (
    Draft,
    Drafter,
    MTPDrafter,
    ModelDrafter,
    NgramDrafter,
    load_mtp_head,
    read_mtp_weights,
)
from replayssm.engine.generator import SpeculativeGenerator
from replayssm.engine.kv_cache import KVCache, WindowLayout
from replayssm.engine.loading import load_model
from replayssm.engine.sampling import SamplingParams
from replayssm.engine.random_model import build_tiny_model
from replayssm.testing.checkpoints import save_tiny_checkpoint

K = 3


def engine_for(model, batch, budget, window=K + 1, strategy="fold"):
    return HybridEngine(model, strategy=strategy, num_slots=batch, window=window, max_len=64 + budget)


def plain(model, prompts, budget):
    return SpeculativeGenerator(engine_for(model, len(prompts), budget, window=1)).generate(prompts, budget)


# ---------------------------------------------------------------------- n-gram
def test_ngram_lookup(rng):
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    for _ in range(50):
        head = torch.randint(100, 200, (int(torch.randint(1, 20, (1,), generator=rng)),), generator=rng).tolist()
        motif = torch.randint(0, 50, (5,), generator=rng).tolist()
        tail = torch.randint(50, 100, (4,), generator=rng).tolist()
        seq = head + motif + tail + motif[:3]
        # the last 3 tokens occurred before, followed by motif[3:], then the tail
        assert d.lookup(seq, 4) == motif[3:] + tail[:2]
    assert d.lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix
    assert d.lookup([7, 8, 7], 5) == [8, 7, 8, 7, 8]  # a loop extends through its own proposals
    assert d.lookup([5, 5], 3) == [5, 5, 5]
    assert d.lookup([1, 2, 1], 0) == []
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)


# ---------------------------------------------------------------------- MTP
@pytest.fixture(scope="module")
def mtp_checkpoints(tmp_path_factory):
    base = torch.initial_seed() % 10_000
    out = {}
    for i, family in enumerate(("qwen3_5", "qwen3_next")):
        path = tmp_path_factory.mktemp(f"tiny_{family}")
        save_tiny_checkpoint(path, family, seed=base + i, with_mtp=True)
        out[family] = path
    return out


def mtp_from_scratch(head, engine, hidden, tokens):
    """The head over the whole sequence in one window: outputs ``[n, hidden]`` for
    pairs ``(hidden[t], tokens[t])`` at positions ``0..n-1``."""
    cache = KVCache(1, 1, head.layers[0].self_attn.k_proj.out_features // head.layers[0].self_attn.head_dim,
                    head.layers[0].self_attn.head_dim, len(tokens), dtype=engine.dtype, device=engine.device)
    layout = WindowLayout([0], [0], [len(tokens)], engine.device)
    with torch.inference_mode():
        return head.forward_layer(engine, cache, layout, torch.tensor(tokens), hidden)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_mtp_weights_load_from_checkpoint(family, mtp_checkpoints):
    path = mtp_checkpoints[family]
    model = load_model(path)
    eng = engine_for(model, 1, 16)
    raw = read_mtp_weights(path)
    head = load_mtp_head(eng, path)
    sd = head.state_dict()
    assert torch.equal(sd["fc.weight"], raw["fc.weight"])
    assert torch.equal(sd["layers.0.self_attn.q_proj.weight"], raw["layers.0.self_attn.q_proj.weight"])
    if family == "qwen3_next":  # per-expert checkpoint tensors fused as transformers 5 lays them out
        e = 2
        gate_up = sd["layers.0.mlp.experts.gate_up_proj"][e]
        torch.testing.assert_close(gate_up, torch.cat([raw[f"layers.0.mlp.experts.{e}.gate_proj.weight"],
                                                       raw[f"layers.0.mlp.experts.{e}.up_proj.weight"]]))
        assert torch.equal(sd["layers.0.mlp.experts.down_proj"][e], raw[f"layers.0.mlp.experts.{e}.down_proj.weight"])
    # the target model itself must not have picked them up
    assert not any(k.startswith("mtp.") for k in model.state_dict())


def test_mtp_missing_or_misfit_weights_raise(tmp_path, mtp_checkpoints, seed):
    bare = tmp_path / "bare"
    save_tiny_checkpoint(bare, "qwen3_5", seed=seed, with_mtp=False)
    eng = engine_for(load_model(bare), 1, 16)
    with pytest.raises(ValueError, match="no mtp"):
        load_mtp_head(eng, bare)
    other = engine_for(load_model(mtp_checkpoints["qwen3_next"]), 1, 16)
    with pytest.raises(ValueError, match="do not fit|shape"):
        load_mtp_head(eng, mtp_checkpoints["qwen3_next"])  # Qwen3-Next MTP weights on a Qwen3.5 model
    assert other.family == "qwen3_next"
    with pytest.raises(ValueError, match="not a directory"):
        read_mtp_weights(tmp_path / "missing")


class Recorder(Drafter):
    """Wraps a drafter and records (sequence so far, proposed drafts)."""

    def __init__(self, inner, sequences):
        self.inner, self.seqs, self.log = inner, sequences, []
        self.name, self.needs_hidden = inner.name, inner.needs_hidden

    def add(self, rid, tokens, hidden):
        self.seqs[rid] = list(tokens)
        self.inner.add(rid, tokens, hidden)

    def observe(self, rid, new, hidden):
        self.seqs[rid] += new
        self.inner.observe(rid, new, hidden)

    def remove(self, rid):
        self.inner.remove(rid)

    def propose(self, rids, counts, sampling, gen):
        out = self.inner.propose(rids, counts, sampling, gen)
        for r, d in zip(rids, out):
            self.log.append((r, list(self.seqs[r]), list(d.tokens)))
        return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_mtp_drafts_match_from_scratch_and_output_equals_plain(family, mtp_checkpoints, rng):
    path = mtp_checkpoints[family]
    model = load_model(path)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (10, 4)]
    budget = 60
    ref = plain(model, prompts, budget)
    eng = engine_for(model, 2, budget)
    head = load_mtp_head(eng, path)
    seqs = {}
    rec = Recorder(MTPDrafter(eng, head), seqs)
    res = SpeculativeGenerator(eng, rec, num_draft=K).generate(prompts, budget)
    assert res.tokens == ref.tokens
    assert res.drafted > 0
    # Recompute the drafts from scratch: target hidden states of the whole sequence,
    # then the head over all pairs (h_t, x_{t+1}) and, for draft 2, its own output.
    full = [p + t for p, t in zip(prompts, ref.tokens)]
    checker = engine_for(model, 1, 2 * budget)
    hidden = []
    for seq in full:
        s = checker.alloc()
        hidden.append(checker.extend([s], [seq], all_logits=True).hidden)
        checker.free(s)
    checked = 0
    with torch.inference_mode():
        for rid, seq, drafts in rec.log[::4]:  # a sample of the steps keeps the test quick
            if len(drafts) < 2:
                continue
            p = len(seq) - 1  # position of the last token, the window's first
            h = hidden[rid][:p]
            out = mtp_from_scratch(head, eng, h, seq[1 : p + 1])
            d1 = int(eng.lm_head(out[-1]).argmax())
            assert drafts[0] == d1
            out2 = mtp_from_scratch(head, eng, torch.cat([h, out[-1:]]), seq[1 : p + 1] + [d1])
            assert drafts[1] == int(eng.lm_head(out2[-1]).argmax())
            checked += 1
    assert checked >= 3


def test_mtp_drafter_under_sampling(mtp_checkpoints, rng):
    path = mtp_checkpoints["qwen3_5"]
    model = load_model(path)
    eng = engine_for(model, 2, 40)
    drafter = MTPDrafter(eng, load_mtp_head(eng, path))
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (6, 9)]
    captured = []
    real = drafter.propose

    def propose(*a, **kw):
        out = real(*a, **kw)
        captured.extend(out)
        return out

    drafter.propose = propose
    res = SpeculativeGenerator(eng, drafter, num_draft=K, sampling=SamplingParams(temperature=0.8, top_p=0.9),
                               seed=3).generate(prompts, 40)
    assert [len(t) for t in res.tokens] == [40, 40]
    assert all(0 <= t < eng.vocab_size for toks in res.tokens for t in toks)
    with_drafts = [d for d in captured if d.tokens]
    assert with_drafts and all(d.q is not None and d.q.shape == (len(d.tokens), eng.vocab_size) for d in with_drafts)
    for d in with_drafts:  # sampled drafts come from their own distribution
        assert all(float(d.q[j, t]) > 0 for j, t in enumerate(d.tokens))


# ---------------------------------------------------------------------- draft model
def test_model_drafter_that_is_the_target_gets_everything_accepted(seed, rng):
    model = build_tiny_model("qwen3_next", seed=seed)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (7, 12, 3)]
    budgets = [50, 31, 17]
    ref = SpeculativeGenerator(engine_for(model, 3, 50, window=1)).generate(prompts, budgets)
    eng = engine_for(model, 3, 50)
    drafter = ModelDrafter(engine_for(model, 3, 60, window=1, strategy="snapshot"), eng.vocab_size)
    res = SpeculativeGenerator(eng, drafter, num_draft=K).generate(prompts, budgets)
    assert res.tokens == ref.tokens
    assert res.accepted == res.drafted > 0
    # every step but a request's last emits k + 1 tokens
    assert res.mean_accept_length > 0.9 * (K + 1)
    assert drafter.engine.pool.num_free == 3  # draft slots were returned


def test_model_drafter_with_another_model_keeps_greedy_output(seed, rng):
    target = build_tiny_model("qwen3_5", seed=seed)
    small = build_tiny_model("qwen3_5", seed=seed + 1, num_hidden_layers=2,
                             layer_types=["linear_attention", "full_attention"])
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (8, 5)]
    ref = plain(target, prompts, 60)
    for strategy in ("snapshot", "circular"):
        eng = engine_for(target, 2, 60, strategy=strategy)
        drafter = ModelDrafter(engine_for(small, 2, 70, window=1), eng.vocab_size)
        res = SpeculativeGenerator(eng, drafter, num_draft=K).generate(prompts, 60)
        assert res.tokens == ref.tokens
        assert res.drafted > 0
    # a circular draft engine rolls back through save/restore of its ring and cursors
    drafter = ModelDrafter(engine_for(small, 2, 70, window=1, strategy="circular"), eng.vocab_size)
    assert SpeculativeGenerator(eng, drafter, num_draft=K).generate(prompts, 60).tokens == ref.tokens


def test_model_drafter_sampling_acceptance_near_one(seed, rng):
    """With the target as its own draft, p and q agree up to rounding, so rejection
    sampling accepts (almost) every draft: sum_x min(p, q) ~ 1."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = [torch.randint(0, 256, (6,), generator=rng).tolist() for _ in range(2)]
    eng = engine_for(model, 2, 60)
    drafter = ModelDrafter(engine_for(model, 2, 70, window=1), eng.vocab_size)
    res = SpeculativeGenerator(eng, drafter, num_draft=K, sampling=SamplingParams(temperature=1.0),
                               seed=11).generate(prompts, 60)
    assert res.drafted > 50 and res.acceptance_rate > 0.97


def test_sampling_is_reproducible_and_strategy_independent(seed, rng):
    """Same seed, same draws: the exact strategies give identical logits, hence
    identical sampled outputs; a different seed gives a different output."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = [torch.randint(0, 256, (9,), generator=rng).tolist() for _ in range(2)]
    sp = SamplingParams(temperature=0.9, top_k=40)
    outs = {}
    for strategy, s in (("snapshot", 5), ("fold", 5), ("fold", 6)):
        eng = engine_for(model, 2, 50, strategy=strategy)
        outs[(strategy, s)] = SpeculativeGenerator(eng, NgramDrafter(), num_draft=K, sampling=sp,
                                                   seed=s).generate(prompts, 50).tokens
    assert outs[("snapshot", 5)] == outs[("fold", 5)]
    assert outs[("fold", 5)] != outs[("fold", 6)]


def test_generator_validation(seed):
    model = build_tiny_model("qwen3_5", seed=seed)
    eng = engine_for(model, 2, 20)
    with pytest.raises(ValueError, match="window"):
        SpeculativeGenerator(eng, NgramDrafter(), num_draft=K + 1)
    with pytest.raises(TypeError, match="drafter"):
        SpeculativeGenerator(eng, object())
    with pytest.raises(TypeError, match="sampling"):
        SpeculativeGenerator(eng, sampling={"temperature": 1})
    gen = SpeculativeGenerator(eng, NgramDrafter(), num_draft=K)
    with pytest.raises(ValueError, match="free slots"):
        gen.generate([[1], [2], [3]], 5)
    with pytest.raises(ValueError, match="empty"):
        gen.generate([[1], []], 5)
    with pytest.raises(ValueError, match="max_len"):
        gen.generate([[1]], 80)
    with pytest.raises(ValueError, match="positive"):
        gen.generate([[1]], 0)
    assert eng.pool.num_free == 2  # validation failures leak no slot

    class Greedy(NgramDrafter):
        def propose(self, rids, counts, sampling, generator):
            return [Draft([1] * (c + 1)) for c in counts]

    with pytest.raises(RuntimeError, match="proposed"):
        SpeculativeGenerator(eng, Greedy(), num_draft=K).generate([[1, 2]], 10)
    assert eng.pool.num_free == 2  # an error mid-generation still frees the slots
