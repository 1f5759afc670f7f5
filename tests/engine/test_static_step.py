"""The static-shape step (what a CUDA graph replays), on the CPU: its forward against
Hugging Face's, its device drafters and acceptance against the host versions, and
greedy exactness of the continuous-batching generator over long generations."""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.attention import slot_attention
from replayssm.engine.device_drafters import DeviceNgramDrafter, OracleDrafter
from replayssm.engine.drafters import NgramDrafter
from replayssm.engine.generator import SpeculativeGenerator, StepGenerator
from replayssm.engine.norms import norm_eps, norm_kind, rms_norm
from replayssm.engine.sampling import (SamplingParams, accept_greedy_static, accept_sampled_static, greedy_accept,
                                       warp_probs)
from replayssm.engine.random_model import build_tiny_model

FAMILIES = ("qwen3_5", "qwen3_next")


def _prompts(rng, n, lo=4, hi=20):
    return [torch.randint(0, 256, (int(torch.randint(lo, hi, (1,), generator=rng)),), generator=rng).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_slot_attention_against_brute_force(backend, rng):
    b, t, heads, kv_heads, d, slots, cap = 3, 4, 8, 2, 16, 5, 40
    kc, vc = torch.randn(slots, kv_heads, cap, d, generator=rng), torch.randn(slots, kv_heads, cap, d, generator=rng)
    q = torch.randn(b, t, heads, d, generator=rng)
    slot = torch.randperm(slots, generator=rng)[:b]
    starts = torch.randint(0, cap - t, (b, 2), generator=rng)[:, 0]  # a strided view, as the engine passes
    out = slot_attention(q, kc, vc, slot, starts, 0.3, backend=backend)
    g = heads // kv_heads
    for i in range(b):
        for j in range(t):
            n = int(starts[i]) + j + 1
            for h in range(heads):
                w = torch.softmax(kc[slot[i], h // g, :n] @ q[i, j, h] * 0.3, 0)
                torch.testing.assert_close(out[i, j, h], w @ vc[slot[i], h // g, :n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_norms_match_the_modules(family, rng):
    model = build_tiny_model(family, seed=1)
    mods = [m for m in model.modules() if norm_kind(m)]
    assert {norm_kind(m) for m in mods} == {"offset", "gated"}
    for m in mods:
        with torch.no_grad():
            m.weight.copy_(0.3 * torch.randn(m.weight.shape, generator=rng))
        x = 3 * torch.randn(7, m.weight.shape[0], generator=rng)
        if norm_kind(m) == "gated":
            z = torch.randn(x.shape, generator=rng)
            ref, got = m(x, z), rms_norm(x, m.weight, norm_eps(m), "gated", z)
        else:
            ref, got = m(x), rms_norm(x, m.weight, norm_eps(m), "offset")
        # fp32: the kernel's reduction order differs from torch's (a few ulp of values ~1)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_static_forward_matches_hf(family, backend, seed, rng):
    """The static step's logits after a prompt equal HF's forward over prompt + window
    (fp32): attention over the slot cache, MoE without host syncs and fused norms."""
    model = build_tiny_model(family, seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=3, window=4, max_len=64, backend=backend)
    prompts = _prompts(rng, 2, 5, 12)
    windows = [torch.randint(0, 256, (4,), generator=rng).tolist() for _ in prompts]
    slots = [eng.alloc() for _ in prompts]
    with torch.inference_mode():
        eng.extend(slots, prompts, prompt=True)
        batch = eng.static_batch(3, 4)
        batch.slots.copy_(torch.tensor(slots + [-1], dtype=batch.slots.dtype))
        slot_idx = torch.tensor(slots + [eng.kv.sink])
        starts = eng.kv.device_lengths[slot_idx]
        logits, _ = eng.forward_static(torch.tensor(windows + [[0] * 4]), starts[:, None] + torch.arange(4),
                                       slot_idx, batch, verify=True)
        eng.strategy.commit(batch, torch.tensor([1, 1, 1], dtype=torch.int32))
        for i, (p, w) in enumerate(zip(prompts, windows)):
            ref = model(torch.tensor([p + w])).logits[0, -4:].float()
            torch.testing.assert_close(logits[4 * i : 4 * i + 4], ref, rtol=1e-4, atol=1e-4)


def test_device_ngram_proposes_what_the_host_lookup_does(rng):
    host = NgramDrafter()
    dev = DeviceNgramDrafter()
    dev.bind(8, 5, 64, torch.device("cpu"))
    seqs = []
    for s in range(8):
        base = torch.randint(0, 6, (int(torch.randint(2, 9, (1,), generator=rng)),), generator=rng).tolist()
        seq = (base * 8)[: int(torch.randint(3, 60, (1,), generator=rng))]
        if s % 3 == 0:
            seq = torch.randint(0, 200, (len(seq),), generator=rng).tolist()  # rarely a match
        dev.start(s, seq, s)
        seqs.append(seq)
    got = dev.propose(torch.arange(8)).tolist()
    for s, seq in enumerate(seqs):
        want = host.lookup(seq, 5)
        assert got[s] == (want or [seq[-1]] * 5), (seq, got[s], want)
    # observe appends only the accepted tokens
    emitted = torch.tensor([[7, 8, -1, -1]] * 8)
    dev.observe(torch.arange(8), emitted, torch.full((8,), 2))
    got = dev.propose(torch.arange(8)).tolist()
    for s, seq in enumerate(seqs):
        assert got[s] == (host.lookup(seq + [7, 8], 5) or [8] * 5)


@pytest.mark.parametrize("family", FAMILIES)
def test_step_generator_exact_strategies_equal_plain_for_128_tokens(family, seed, rng):
    """fp32: greedy speculative decoding with every exact strategy, through the static
    step with device n-gram drafts and continuous batching (more prompts than slots,
    budgets of different lengths, up to 130 tokens: some 60 to 100 steps a strategy,
    the short request's slot taken by a waiting one), emits plain greedy decoding's
    tokens one for one."""
    model = build_tiny_model(family, seed=seed)
    prompts = _prompts(rng, 5)
    budgets = [128, 38, 130, 8, 63]
    plain = SpeculativeGenerator(HybridEngine(model, strategy="fold", num_slots=5, window=1, max_len=600)).generate(
        prompts, budgets)
    for strategy in ("snapshot", "fold"):
        eng = HybridEngine(model, strategy=strategy, num_slots=3, window=4, max_len=600)
        res = StepGenerator(eng, DeviceNgramDrafter(), num_draft=3).generate(prompts, budgets)
        assert res.tokens == plain.tokens, strategy
        assert res.mean_accept_length > 1.2 and len(set(res.stats.rows)) > 1
    # plain decoding through static steps with any strategy (circular: its ring stays empty)
    fast_plain = StepGenerator(HybridEngine(model, strategy="circular", num_slots=2, window=1, max_len=600)).generate(
        prompts, budgets)
    assert fast_plain.tokens == plain.tokens


def test_oracle_drafter_sets_the_acceptance(seed, rng):
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = _prompts(rng, 3)
    plain = StepGenerator(HybridEngine(model, strategy="fold", num_slots=3, window=1, max_len=200)).generate(prompts, 90)
    rates = {}
    for p in (0.0, 0.6, 1.0):
        eng = HybridEngine(model, strategy="fold", num_slots=3, window=4, max_len=200)
        res = StepGenerator(eng, OracleDrafter(plain.tokens, p, 260, seed=seed), num_draft=3).generate(prompts, 90)
        assert res.tokens == plain.tokens
        rates[p] = res.acceptance_rate
    assert rates[0.0] == 0.0 and rates[1.0] > 0.95
    # P = 0.6: draft j is accepted with probability 0.6^j: 0.6 + 0.36 + 0.216 of 3 = 0.39
    assert 0.25 < rates[0.6] < 0.55
    with pytest.raises(ValueError, match="acceptance"):
        OracleDrafter(plain.tokens, 1.5, 260)
    with pytest.raises(ValueError, match="references"):
        OracleDrafter([[300]], 0.5, 260)


def test_greedy_acceptance_of_full_windows(rng):
    logits = torch.randn(50, 4, 6, generator=rng)
    window = torch.randint(0, 6, (50, 4), generator=rng)
    argmax = logits.argmax(-1)
    window[::2, 1:] = argmax[::2, :-1]  # some windows fully right
    n, nxt = accept_greedy_static(logits, window)
    for i in range(50):
        assert (int(n[i]), int(nxt[i])) == greedy_accept(argmax[i].tolist(), window[i, 1:].tolist())


def test_rejection_of_deterministic_drafts_keeps_the_target_distribution():
    """Whatever the drafts, the emitted first token is distributed as the target's
    warped probabilities at window position 0 (Monte Carlo, 40000 rows, 5 sigma)."""
    g = torch.Generator().manual_seed(5)
    v, rows = 5, 40_000
    logits = torch.randn(1, 3, v, generator=g).expand(rows, 3, v).contiguous()
    window = torch.tensor([[0, 2, 1]]).expand(rows, 3)
    params = SamplingParams(temperature=0.9, top_k=4)
    n, nxt = accept_sampled_static(logits, window, params, generator=g)
    first = torch.where(n > 0, window[:, 1], nxt)
    p = warp_probs(logits[0, 0], params)
    freq = torch.bincount(first, minlength=v).float() / rows
    sigma = (p * (1 - p) / rows).sqrt()
    assert bool(((freq - p).abs() <= 5 * sigma + 1e-9).all()), (freq, p)


@pytest.mark.parametrize("family", FAMILIES)
def test_device_mtp_drafts_what_the_host_mtp_drafter_does(family, tmp_path, seed, rng):
    """The MTP head inside the static step proposes the host drafter's tokens after the
    prompt and after every verified step (fp32, drafts compared directly), and the
    generator with it emits plain decoding's tokens."""
    from replayssm.engine.device_drafters import DeviceMTPDrafter
    from replayssm.engine.drafters import MTPDrafter, load_mtp_head
    from replayssm.engine.loading import load_model
    from replayssm.engine.sampling import greedy_accept
    from replayssm.testing.checkpoints import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path, family, seed=seed, with_mtp=True)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    prompt = _prompts(rng, 1, 8, 16)[0]
    eng = HybridEngine(model, strategy="fold", num_slots=1, window=4, max_len=200)
    head = load_mtp_head(eng, tmp_path)
    host, dev = MTPDrafter(eng, head), DeviceMTPDrafter(eng, head)
    dev.bind(1, 3, 200, torch.device("cpu"))
    slot = eng.alloc()
    with torch.inference_mode():
        out = eng.extend([slot], [prompt], prompt=True)
        first = int(out.logits[0].argmax())
        host.add(0, prompt + [first], out.hidden)
        want = host.propose([0], [3], SamplingParams(), None)[0].tokens
        got = dev.join([slot], [prompt], [first], [0], hidden=out.hidden, offsets=out.offsets)[0].tolist()
        assert got == want
        last = first
        for _ in range(12):
            window = [last] + want
            v = eng.verify([slot], [window])
            n, nxt = greedy_accept(v.logits.argmax(-1).tolist(), want)
            start = eng.length(slot)
            eng.commit([n + 1])
            new = want[:n] + [nxt]
            host.observe(0, new, v.hidden[: n + 1])
            emitted = torch.tensor([new + [-1] * (3 - n)])
            dev.observe(torch.tensor([slot]), emitted, torch.tensor([n + 1]), hidden=v.hidden,
                        positions=start + torch.arange(4)[None])
            want = host.propose([0], [3], SamplingParams(), None)[0].tokens
            assert dev.propose(torch.tensor([slot]))[0].tolist() == want
            last = nxt
    n = 60
    plain = SpeculativeGenerator(HybridEngine(model, strategy="fold", num_slots=1, window=1, max_len=200)).generate(
        [prompt], n)
    eng_d = HybridEngine(model, strategy="circular", num_slots=1, window=4, max_len=200)
    res = StepGenerator(eng_d, DeviceMTPDrafter(eng_d, load_mtp_head(eng_d, tmp_path)), num_draft=3).generate(
        [prompt], n)
    assert res.tokens == plain.tokens


def test_rejection_of_sampled_drafts_keeps_the_target_distribution():
    """Drafts drawn from q != p: the emitted first token is distributed as p at window
    position 0, the acceptance rate is sum_x min(p, q) (Monte Carlo, 5 sigma)."""
    g = torch.Generator().manual_seed(6)
    v, rows = 5, 40_000
    logits = torch.randn(1, 2, v, generator=g).expand(rows, 2, v).contiguous()
    params = SamplingParams(temperature=1.0)
    p = warp_probs(logits[0, 0], params)
    q_row = torch.softmax(torch.randn(v, generator=g), 0)
    drafts = torch.multinomial(q_row, rows, replacement=True, generator=g)
    window = torch.stack([torch.zeros(rows, dtype=torch.long), drafts], 1)
    q = q_row.expand(rows, 1, v).contiguous()
    n, nxt = accept_sampled_static(logits, window, params, generator=g, q=q)
    first = torch.where(n > 0, drafts, nxt)
    freq = torch.bincount(first, minlength=v).float() / rows
    sigma = (p * (1 - p) / rows).sqrt()
    assert bool(((freq - p).abs() <= 5 * sigma + 1e-9).all()), (freq, p)
    rate = torch.minimum(p, q_row).sum()
    assert abs(n.float().mean() - rate) < 5 * (rate * (1 - rate) / rows).sqrt()


def test_sampled_mtp_drafts_in_the_static_step(tmp_path, seed, rng):
    from replayssm.engine.device_drafters import DeviceMTPDrafter
    from replayssm.engine.drafters import load_mtp_head
    from replayssm.engine.loading import load_model
    from replayssm.testing.checkpoints import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path, "qwen3_5", seed=seed, with_mtp=True)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    params = SamplingParams(temperature=0.9, top_k=50)
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=200)
    drafter = DeviceMTPDrafter(eng, load_mtp_head(eng, tmp_path), sampling=params)
    res = StepGenerator(eng, drafter, num_draft=3, sampling=params).generate(_prompts(rng, 3), 40)
    assert all(len(t) == 40 and all(0 <= x < 260 for x in t) for t in res.tokens)
    q = drafter.draft_probs(torch.arange(2))
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))  # real distributions were kept


def test_attention_stages_fit_the_shared_memory(monkeypatch):
    """The key pass takes KV_STAGES stages where their key and value blocks fit a
    block's shared memory, fewer where not (at least one): an H200's 227 KiB holds three
    bf16 stages of 256-wide heads and two fp32 ones; a 99 KiB card two bf16 ones."""
    from replayssm.engine import attention

    cuda = torch.device("cuda", 0)
    for room, itemsize, want in ((232448, 2, 3), (232448, 4, 2), (101376, 2, 2), (40000, 4, 1)):
        monkeypatch.setattr(attention, "_shared_memory", lambda index, room=room: room)
        assert attention.kv_stages(cuda, 32, 32, 256, itemsize) == want, (room, itemsize)
    assert attention.kv_stages(torch.device("cpu"), 32, 32, 256, 4) == attention.KV_STAGES
