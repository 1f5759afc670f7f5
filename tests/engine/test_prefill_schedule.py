"""Prompt prefill in :class:`StepGenerator`: one packed pass for the joiners, chunked
prefill interleaved with the running requests' decode steps, and the per-request time
stamps (time to first token, latency) that the reports are built from."""

from __future__ import annotations

import math

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import DeviceNgramDrafter
from replayssm.engine.generator import SpeculativeGenerator, StepGenerator
from replayssm.engine.random_model import build_tiny_model

MODES = ("plain", "snapshot", "fold", "circular")


def _prompt(rng, n):
    return torch.randint(0, 256, (n,), generator=rng).tolist()


def _generator(model, mode, slots, max_len, **kwargs):
    if mode == "plain":
        return StepGenerator(HybridEngine(model, strategy="fold", num_slots=slots, window=1, max_len=max_len), **kwargs)
    eng = HybridEngine(model, strategy=mode, num_slots=slots, window=4, max_len=max_len)
    return StepGenerator(eng, DeviceNgramDrafter(), num_draft=3, **kwargs)


def _timeline(gen):
    """Wrap ``gen``'s engine so that every prompt pass is logged as
    ``("prefill", {request slot: tokens})``; returns the log, which ``on_tokens``
    callbacks append to as well."""
    log = []
    extend = gen.engine.extend

    def logged(slots, windows, **kwargs):
        if kwargs.get("prompt"):
            log.append(("prefill", {s: len(w) for s, w in zip(slots, windows)}))
        return extend(slots, windows, **kwargs)

    gen.engine.extend = logged
    return log


@pytest.mark.parametrize("mode", MODES)
def test_a_joining_prompt_is_prefilled_between_the_running_requests_steps(mode, seed, rng):
    """Two slots; request 1 finishes early and request 2, whose prompt spans several
    chunks, joins in its slot. Its prompt passes alternate with decode steps of request
    0 (which emits tokens between them), and the greedy tokens are those of the run
    that prefills every prompt whole (fp32)."""
    model = build_tiny_model("qwen3_5", seed=seed)
    chunk = int(torch.randint(5, 9, (1,), generator=rng))
    long_len = 4 * chunk + int(torch.randint(1, chunk, (1,), generator=rng))
    prompts = [_prompt(rng, 6), _prompt(rng, 5), _prompt(rng, long_len)]
    budgets = [40, 4, 12]
    whole = _generator(model, mode, 2, 128).generate(prompts, budgets)

    gen = _generator(model, mode, 2, 128, prefill_chunk=chunk)
    log = _timeline(gen)
    res = gen.generate(prompts, budgets, on_tokens=lambda i, toks: log.append(("tokens", i)))
    assert res.tokens == whole.tokens and [len(t) for t in res.tokens] == budgets

    passes = [p for p in res.stats.prefills if 2 in p.requests]
    assert len(passes) == math.ceil(long_len / chunk) and passes[-1].completed == [2]
    assert sum(p.tokens[p.requests.index(2)] for p in passes) == long_len
    # a decode step of the running request between every two of the joiner's passes
    for a, b in zip(passes, passes[1:]):
        assert b.after_step == a.after_step + 1 and res.stats.rows[a.after_step] == 1
    # the same, seen through the callbacks: request 0 streams tokens during the prefill
    r1_done = max(i for i, e in enumerate(log) if e == ("tokens", 1))
    joiner = [i for i, e in enumerate(log) if e[0] == "prefill" and i > r1_done]
    assert len(joiner) == len(passes)
    assert log[joiner[0] : joiner[-1]].count(("tokens", 0)) == len(passes) - 1
    assert all(n <= chunk for e in log if e[0] == "prefill" for n in e[1].values())


def test_the_first_wave_is_one_packed_pass_and_a_budget_splits_it(seed, rng):
    """Without a chunk budget, the prompts that join together go through one forward
    (not one per prompt); with one, the passes hold at most the budget's tokens, the
    prompts in arrival order, and the tokens do not change."""
    model = build_tiny_model("qwen3_5", seed=seed)
    lengths = [int(n) for n in torch.randint(3, 15, (4,), generator=rng)]
    prompts = [_prompt(rng, n) for n in lengths]
    gen = _generator(model, "fold", 4, 64)
    log = _timeline(gen)
    whole = gen.generate(prompts, 8)
    assert [e for e in log if e[0] == "prefill"] == [("prefill", dict(zip(range(4), lengths)))]
    assert [(p.requests, p.tokens, p.completed) for p in whole.stats.prefills] == [
        ([0, 1, 2, 3], lengths, [0, 1, 2, 3])]
    budget = max(lengths) - 1
    split = _generator(model, "fold", 4, 64, prefill_chunk=budget).generate(prompts, 8)
    assert split.tokens == whole.tokens
    passes = split.stats.prefills
    assert all(sum(p.tokens) <= budget for p in passes) and sum(sum(p.tokens) for p in passes) == sum(lengths)
    order = [r for p in passes for r in p.requests]
    assert order == sorted(order)  # arrival order, a request cut only where a pass ends
    assert [r for p in passes for r in p.completed] == [0, 1, 2, 3]


def test_mtp_drafts_are_unchanged_by_chunked_prefill(tmp_path, seed, rng):
    """The MTP drafter joins with the hidden states of the whole prompt, however many
    passes prefilled it: drafts, hence accepted counts, and tokens are those of the
    unchunked run."""
    from replayssm.engine.device_drafters import DeviceMTPDrafter
    from replayssm.engine.drafters import load_mtp_head
    from replayssm.engine.loading import load_model
    from replayssm.testing.checkpoints import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path, "qwen3_5", seed=seed, with_mtp=True)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    prompts = [_prompt(rng, n) for n in (17, 4, 11)]
    runs = []
    for chunk in (None, 5):
        eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=128)
        gen = StepGenerator(eng, DeviceMTPDrafter(eng, load_mtp_head(eng, tmp_path)), num_draft=3,
                            prefill_chunk=chunk)
        runs.append(gen.generate(prompts, [30, 6, 20]))
    assert runs[1].tokens == runs[0].tokens
    assert runs[1].accept_lengths == runs[0].accept_lengths
    assert len(runs[1].stats.prefills) > len(runs[0].stats.prefills)


@pytest.mark.parametrize("step", [True, False])
def test_time_to_first_token_and_latency_per_request(step, seed, rng):
    """Every request gets its first-token and last-token times, in order: first token
    before the last, a request that waited for a slot after the one it waited for, and
    the call's times split into prefill and decode."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = [_prompt(rng, 6) for _ in range(3)]
    budgets = [5, 12, 7]
    if step:
        res = StepGenerator(HybridEngine(model, strategy="fold", num_slots=2, window=1, max_len=64)).generate(
            prompts, budgets)
    else:
        eng = HybridEngine(model, strategy="fold", num_slots=3, window=1, max_len=64)
        res = SpeculativeGenerator(eng).generate(prompts, budgets)
    assert len(res.ttft_s) == len(res.latency_s) == 3
    assert all(0 < t < lat for t, lat in zip(res.ttft_s, res.latency_s))
    assert max(res.latency_s) <= res.prefill_s + res.decode_s + 1e-3
    assert res.prefill_s > 0 and res.decode_s > 0
    if step:  # request 2 takes request 0's slot once that one finished
        assert res.ttft_s[2] > res.latency_s[0] and res.stats.prefills[1].requests == [2]


def test_prefill_chunk_must_be_a_positive_int(seed):
    eng = HybridEngine(build_tiny_model("qwen3_5", seed=seed), strategy="fold", num_slots=1, window=1, max_len=32)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            StepGenerator(eng, prefill_chunk=bad)


def test_fresh_attention_of_uneven_requests_is_the_zero_padded_batch(rng):
    """Requests of uneven lengths and a row of padding tokens (a static prompt pass's
    layout): the padded windows gathered from the packed tokens attend as windows
    padded with zeros do (the padding is past every real query), bit for bit (fp32, CPU,
    torch's SDPA on both)."""
    from replayssm.engine.kv_cache import PromptLayout, _fresh_attention

    heads, kv_heads, d = 4, 2, 16
    lengths = [9, 3, 14, 5]  # the last row: padding tokens
    n, b, t = sum(lengths), len(lengths), max(lengths)
    q, k, v = (3 * torch.randn(n, h, d, generator=rng) for h in (heads, kv_heads, kv_heads))
    row = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths))
    col = torch.cat([torch.arange(m) for m in lengths])
    layout = PromptLayout(b, t, torch.stack([row, col, col, row]))
    got = _fresh_attention(layout, q, k, v, 0.3)
    padded = [torch.zeros(b, t, x.shape[1], d) for x in (q, k, v)]
    for p, x in zip(padded, (q, k, v)):
        p[row, col] = x
    qs, ks, vs = (p.transpose(1, 2) for p in padded)
    ks, vs = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (ks, vs))
    want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.3)
    want = want.transpose(1, 2)[row, col]
    assert got.shape == (n, heads, d) and want.abs().max() > 0.5
    assert torch.equal(got, want)


def test_static_prompt_attention_backend_is_cudnn_on_sm90_only(monkeypatch):
    """A static pass's attention asks for cuDNN on an sm_90 card with cuDNN's SDPA
    enabled, and flash on any other card, with it disabled, or on the CPU; an eager
    pass's layout always asks for flash (no per-shape plan)."""
    from torch.nn.attention import SDPBackend

    from replayssm.engine import kv_cache

    cuda = torch.device("cuda", 0)
    for cap, enabled, want in (((9, 0), True, SDPBackend.CUDNN_ATTENTION), ((8, 0), True, SDPBackend.FLASH_ATTENTION),
                               ((10, 0), True, SDPBackend.FLASH_ATTENTION),
                               ((9, 0), False, SDPBackend.FLASH_ATTENTION)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda enabled=enabled: enabled)
        assert kv_cache.static_attention_backend(cuda) == want, (cap, enabled)
    assert kv_cache.static_attention_backend(torch.device("cpu")) == SDPBackend.FLASH_ATTENTION
    assert kv_cache.WindowLayout.attention_backend == SDPBackend.FLASH_ATTENTION
    index = torch.zeros(4, 6, dtype=torch.int64)
    assert kv_cache.PromptLayout(2, 4, index).attention_backend == SDPBackend.FLASH_ATTENTION  # a CPU pass
    # a static pass's layout takes the choice for its index's device
    seen = []
    monkeypatch.setattr(kv_cache, "static_attention_backend", lambda device: seen.append(device) or "chosen")
    assert kv_cache.PromptLayout(2, 4, index).attention_backend == "chosen" and seen == [index.device]


@pytest.mark.parametrize("batch", [1, 3])
def test_fresh_prompt_attention_equals_the_masked_cache_attention(batch, rng):
    """A pass of fresh requests attends within each window with a causal mask only
    (right-padded windows, grouped key heads); the general path (keys gathered from
    the cache, an explicit mask) gives the same outputs, and both write the cache."""
    from replayssm.engine.kv_cache import KVCache, WindowLayout, cached_attention

    heads, kv_heads, d = 4, 2, 16
    lengths = [int(n) for n in torch.randint(1, 12, (batch,), generator=rng)]
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, d, generator=rng) for h in (heads, kv_heads, kv_heads))
    outs, caches = [], []
    for fresh in (True, False):
        cache = KVCache(1, batch + 1, kv_heads, d, 16, dtype=torch.float32, device="cpu")
        layout = WindowLayout(list(range(1, batch + 1)), [0] * batch, lengths, "cpu")
        assert layout.fresh
        layout.fresh = fresh
        outs.append(cached_attention(cache, 0, layout, q, k, v, 0.3))
        caches.append(cache.k.clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(caches[0], caches[1]) and caches[0].abs().sum() > 0
