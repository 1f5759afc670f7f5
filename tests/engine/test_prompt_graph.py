"""Prompt passes at static shapes (engine/prompt_graph.py) against the eager prompt pass.

On the CPU the static body runs eagerly (no graph); a GPU test replays the captured
graphs. Tolerance: both passes compute the same operations in fp32, but the static one
runs the token-wise layers on N padded rows instead of n, and a matmul's blocking may
depend on its row count, so logits, hidden states and GDN states agree to ~1e-6 of their
scale, not bit for bit; a wrong row, position, slot or padding leak is off by O(1).
Integer state (KV lengths, which slots moved) must be exactly equal.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.generator import StepGenerator
from replayssm.engine.prompt_graph import MIN_TOKENS, PromptGraph, PromptGraphs
from replayssm.engine.random_model import build_tiny_model
from replayssm.testing.chunk_kernel import chunk_kernel_on_cpu as _chunk_kernel

TOL = dict(rtol=1e-5, atol=1e-5)


def _engines(model, **kw):
    common = dict(strategy="fold", num_slots=4, window=3, max_len=96, **kw)
    return HybridEngine(model, prompt_graphs=False, **common), HybridEngine(model, prompt_graphs=True, **common)


def _states(eng, slots):
    return (eng.pool.checkpoints[:, slots].clone(), eng.pool.conv_state[:, slots].clone(),
            [eng.kv.lengths[s] for s in slots])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("lengths", [(9,), (31,), (32,), (5, 17, 1)])
def test_static_prompt_pass_equals_eager(family, lengths, rng, seed):
    """Logits of the last tokens, every token's hidden state, the GDN and conv states,
    the keys and values written and the KV lengths: as the eager pass; a live request
    that is not in the pass keeps its state bit for bit."""
    model = build_tiny_model(family, seed=seed)
    eager, static = _engines(model)
    bystander = [torch.randint(0, 256, (7,), generator=rng).tolist()]
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]
    outs = []
    for eng in (eager, static):
        other = eng.alloc()
        eng.extend([other], bystander, prompt=True)
        before = _states(eng, [other])
        k_before = eng.kv.k[:, other].clone()
        slots = [eng.alloc() for _ in prompts]
        outs.append((eng.extend(slots, prompts, prompt=True), _states(eng, slots), slots))
        after = _states(eng, [other])
        assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]) and after[2] == before[2]
        assert torch.equal(eng.kv.k[:, other], k_before)
    (oe, se, sl_e), (os_, ss, sl_s) = outs
    assert static.prompt_passes == {"static": 2, "eager": 0} and eager.prompt_passes == {"static": 0, "eager": 2}
    assert os_.lengths == oe.lengths and os_.offsets == oe.offsets
    assert not os_.logits.requires_grad and not os_.hidden.requires_grad  # no autograd record, as eagerly
    scale = oe.logits.abs().max()
    torch.testing.assert_close(os_.logits / scale, oe.logits / scale, **TOL)
    torch.testing.assert_close(os_.hidden, oe.hidden, **TOL)
    torch.testing.assert_close(ss[0], se[0], **TOL)
    torch.testing.assert_close(ss[1], se[1], **TOL)
    assert ss[2] == se[2] == list(lengths)
    for s_e, s_s, n in zip(sl_e, sl_s, lengths):  # keys and values of the prompt positions
        torch.testing.assert_close(static.kv.k[:, s_s, :, :n], eager.kv.k[:, s_e, :, :n], **TOL)
        torch.testing.assert_close(static.kv.v[:, s_s, :, :n], eager.kv.v[:, s_e, :, :n], **TOL)
    assert torch.equal(static.kv.device_lengths[:-1].cpu(), torch.tensor(static.kv.lengths))


def test_greedy_generation_unchanged_by_static_prompts(rng, seed):
    """The tokens generated after a static prompt pass are the eager pass's (greedy,
    speculative steps after it), over several batches through the same shapes."""
    model = build_tiny_model("qwen3_5", seed=seed)
    eager, static = _engines(model)
    for batch in (1, 3, 1):
        prompts = [torch.randint(0, 256, (int(n),), generator=rng).tolist()
                   for n in torch.randint(3, 20, (batch,), generator=rng)]
        tokens = [StepGenerator(eng, None).generate(prompts, 6).tokens for eng in (eager, static)]
        assert tokens[0] == tokens[1]
    assert static.prompt_passes["static"] == 3 and static.prompt_passes["eager"] == 0


def test_routing_long_continued_and_all_logits_passes_run_eagerly(rng, seed):
    """Passes a shape does not take run eagerly: more tokens than the largest shape, a
    request that holds tokens already (a prompt continued in chunks), every token's
    logits asked for, a GDN-inputs hook set."""
    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=3, window=2, max_len=160, prompt_graphs=True,
                       prompt_graph_tokens=64)
    s = eng.alloc()
    eng.extend([s], [torch.randint(0, 256, (65,), generator=rng).tolist()], prompt=True)  # 65 tokens: N = 128
    eng.extend([s], [[1, 2, 3]], prompt=True)  # continued
    t = eng.alloc()
    eng.extend([t], [[4, 5]], prompt=True, all_logits=True)
    seen = []
    eng.gdn_inputs_hook = lambda j, *inputs: seen.append(j)  # an instrument sees every eager layer
    u = eng.alloc()
    eng.extend([u], [[6, 7]], prompt=True)
    assert seen and eng.prompt_passes == {"static": 0, "eager": 4}
    assert eng.prompt_graphs.shape(64) == 64 and eng.prompt_graphs.shape(65) is None
    assert eng.prompt_graphs.shape(63, requests=2) == 64 and eng.prompt_graphs.shape(64, requests=2) is None
    assert eng.prompt_graphs.shape(1) == MIN_TOKENS


def test_bad_inputs_are_refused_before_any_write(rng, seed):
    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=2, max_len=64, prompt_graphs=True)
    s = eng.alloc()
    ck = eng.pool.checkpoints.clone()
    with pytest.raises(ValueError, match="token id"):
        eng.extend([s], [[1, 300]], prompt=True)
    with pytest.raises(ValueError, match="appears twice"):
        eng.extend([s, s], [[1], [2]], prompt=True)
    with pytest.raises(ValueError, match="max_len"):
        eng.extend([s], [[1] * 65], prompt=True)
    assert torch.equal(eng.pool.checkpoints, ck) and eng.kv.lengths[s] == 0
    assert eng.prompt_passes == {"static": 0, "eager": 0}
    with pytest.raises(ValueError, match="power of two"):
        PromptGraphs(eng, max_tokens=48)
    with pytest.raises(ValueError, match="requests < tokens"):
        PromptGraph(eng, 4, 4, graph=False)
    with pytest.raises(ValueError, match="without padding is one request"):
        PromptGraph(eng, 2, 32, graph=False, padded=False)
    with pytest.raises(ValueError, match="exactly 32 tokens"):
        PromptGraph(eng, 1, 32, graph=False, padded=False).run([s], [[1] * 31])
    with pytest.raises(ValueError, match="CUDA"):
        PromptGraph(eng, 1, 32, graph=True)
    with pytest.raises(ValueError, match="exclude"):
        HybridEngine(model, num_slots=1, window=2, max_len=64, prompt_graphs=True, fixed_shape=(2, 2))


@pytest.mark.parametrize("length", [21, 32])
def test_one_request_runs_the_chunked_kernel_as_one_sequence(length, rng, seed):
    """With a chunked kernel, a one-request shape hands the kernel every token as one
    sequence with the padding tokens' gates zeroed (none at 32 tokens: the request
    fills its shape): states and logits as the eager chunked pass's; a pass of two
    requests keeps the recurrence."""
    model = build_tiny_model("qwen3_5", seed=seed)
    eager, static = _engines(model, prefill="chunk", chunk_kernel=_chunk_kernel)
    prompt = [torch.randint(0, 256, (length,), generator=rng).tolist()]
    outs = []
    for eng in (eager, static):
        slot = eng.alloc()
        outs.append((eng.extend([slot], prompt, prompt=True), _states(eng, [slot])))
    (oe, se), (os_, ss) = outs
    graph = static.prompt_graphs.prepare(1, length)
    assert graph.chunk_kernel is _chunk_kernel and graph.padded == (length < 32)
    assert static.prompt_graphs.prepare(2, length).chunk_kernel is None
    scale = oe.logits.abs().max()
    torch.testing.assert_close(os_.logits / scale, oe.logits / scale, **TOL)
    torch.testing.assert_close(ss[0], se[0], **TOL)
    torch.testing.assert_close(ss[1], se[1], **TOL)
    big = HybridEngine(model, num_slots=2, window=1, max_len=2048, prefill="chunk", chunk_kernel=_chunk_kernel,
                       prompt_graphs=True).prompt_graphs
    shapes = [big.key(n) for n in (511, 512, 513, 2048, 8191, 8192, 8193)]
    assert shapes == [(1, 512, True), (1, 512, False), (1, 768, True), (1, 2048, False), (1, 8192, True),
                      (1, 8192, False), None]
    assert big.shape(511, requests=2) == 512 and big.shape(512, requests=2) is None


def test_a_shape_may_hold_more_tokens_than_a_request_may(rng, seed):
    """A 35-token prompt in a 40-token engine takes the 64-token shape: its padding
    writes at the sink's first position, never past the cache, and the pass is the
    eager one's."""
    model = build_tiny_model("qwen3_5", seed=seed)
    common = dict(strategy="fold", num_slots=1, window=2, max_len=40)
    eager, static = HybridEngine(model, prompt_graphs=False, **common), HybridEngine(model, prompt_graphs=True, **common)
    prompt = [torch.randint(0, 256, (35,), generator=rng).tolist()]
    le, ls = (eng.extend([eng.alloc()], prompt, prompt=True).logits for eng in (eager, static))
    assert static.prompt_passes["static"] == 1 and static.prompt_graphs.shape(35) == 64
    torch.testing.assert_close(ls / le.abs().max(), le / le.abs().max(), **TOL)


def test_prepare_joins_builds_every_shape_joining_prompts_can_take(rng):
    """Passes of 1..most requests of lo..hi prompt tokens each: every such pass that
    runs at a static shape finds its shape built, and none beyond."""
    model = build_tiny_model("qwen3_5", seed=0)
    eng = HybridEngine(model, strategy="fold", num_slots=8, window=4, max_len=600)
    graphs = PromptGraphs(eng, graph=False)
    lo = int(torch.randint(3, 20, (1,), generator=rng))
    hi = lo + int(torch.randint(0, 60, (1,), generator=rng))
    graphs.prepare_joins(6, lo, hi)
    want = {graphs.key(n, k) for k in range(1, 7) for n in range(k * lo, k * hi + 1)} - {None}
    assert set(graphs._shapes) == want and want
