"""Prompt passes at static shapes (engine/prompt_graph.py) against the eager prompt pass.

On the CPU the static body runs eagerly (no graph); a GPU test replays the captured
graphs. Tolerance: both passes compute the same operations in fp32, but the static one
runs the token-wise layers on N padded rows instead of n, and a matmul's blocking may
depend on its row count, so logits, hidden states and GDN states agree to ~1e-6 of their
scale, not bit for bit; a wrong row, position, slot or padding leak is off by O(1).
Integer state (KV lengths, which slots moved) must be exactly equal.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.generator import StepGenerator
from replayssm.engine.prompt_graph import MAX_HEADS, MIN_TOKENS, PromptGraph, PromptGraphs
from replayssm.engine.random_model import build_tiny_model
from replayssm.strategies import chunk_list_length
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


def test_prompt_head_runs_in_static_passes_with_shapes_per_head(rng, seed):
    """A prompt head set on the engine runs at the end of each static pass, on the
    pass's layout, ids, hidden states and requests, and the pass's output names it;
    shapes are built per head, so a pass under another head (or none) does not replay a
    shape built with this one: while no new shape may be built, it runs eagerly, with
    no head. The shapes of the :data:`MAX_HEADS` heads most recently set are kept."""
    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=3, window=2, max_len=96, prompt_graphs=True)
    seen = []

    def head(layout, ids, hidden, kv_rows, kv_lengths):
        seen.append((ids.clone(), hidden.clone(), kv_rows.clone(), kv_lengths.clone(), layout.positions.clone()))

    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (5, 9)]
    eng.set_prompt_head(head)
    slots = [eng.alloc() for _ in prompts]
    out = eng.extend(slots, prompts, prompt=True)
    assert out.prompt_head is head and len(seen) == 1
    ids, hidden, kv_rows, kv_lengths, positions = seen[0]
    assert ids[:14].tolist() == prompts[0] + prompts[1] and positions[:14].tolist() == [*range(5), *range(9)]
    assert kv_rows.tolist() == slots and kv_lengths.tolist() == [5, 9]
    assert torch.equal(hidden[:14], out.hidden)
    eng.prompt_graphs.capture_new = False
    for h, kind in ((None, "eager"), (head, "static")):  # the same shape, built for ``head`` only
        eng.free_many(slots)
        eng.set_prompt_head(h)
        slots = [eng.alloc() for _ in prompts]
        out = eng.extend(slots, prompts, prompt=True)
        assert out.prompt_head is h and eng.prompt_passes[kind] == 1 + (kind == "static")
    assert len(seen) == 2
    eng.free_many(slots)
    slots = [eng.alloc() for _ in prompts]  # fresh: what ``fits`` asks of a static pass
    others = iter(range(100))

    def more_heads(n):
        for i in itertools.islice(others, n):
            eng.set_prompt_head(lambda *a, i=i: None)

    more_heads(MAX_HEADS - 1)  # ``head`` and three newer ones: all kept
    assert eng.prompt_graphs.fits(slots, prompts) is False  # a new head's: none built
    for _ in range(2):  # set again, it is the most recently set: three newer heads keep it
        eng.set_prompt_head(head)
        assert eng.prompt_graphs.fits(slots, prompts) is True
        more_heads(MAX_HEADS - 1)
    more_heads(1)  # ``head`` is the least recently set of five: its shapes go
    eng.set_prompt_head(head)
    assert not eng.prompt_graphs.fits(slots, prompts)


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
    for bad in ([1, 300], [1, 2**70], [True, 2], [1, 2.0]):  # past the vocabulary or int64; not plain ints
        with pytest.raises(ValueError, match="token id"):
            eng.extend([s], [bad], prompt=True)
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
    with pytest.raises(ValueError, match="ids must be"):
        PromptGraph(eng, 1, 32, graph=False).run([s], [[1] * 5], ids=np.arange(4))
    with pytest.raises(ValueError, match="CUDA"):
        PromptGraph(eng, 1, 32, graph=True)
    with pytest.raises(ValueError, match="exclude"):
        HybridEngine(model, num_slots=1, window=2, max_len=64, prompt_graphs=True, fixed_shape=(2, 2))


def test_int_subclass_token_ids_pack_as_their_values(rng, seed):
    """Token ids of an int subclass (not plain ints: the token-by-token check admits
    them) pack into the static pass's ids as their values: the pass equals the one of
    the same ids as plain ints, bit for bit."""

    class Token(int):
        pass

    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=2, max_len=64, prompt_graphs=True)
    prompt = torch.randint(0, 256, (11,), generator=rng).tolist()
    plain = eng.extend([eng.alloc()], [prompt], prompt=True)
    sub = eng.extend([eng.alloc()], [[Token(t) for t in prompt]], prompt=True)
    assert eng.prompt_passes == {"static": 2, "eager": 0}
    assert torch.equal(sub.logits, plain.logits) and torch.equal(sub.hidden, plain.hidden)


@pytest.mark.parametrize("length", [21, 32])
def test_one_request_runs_the_chunked_kernel_as_one_sequence(length, rng, seed):
    """With a chunked kernel, a one-request shape hands the kernel every token as one
    sequence with the padding tokens' gates zeroed (none at 32 tokens: the request
    fills its shape): states and logits as the eager chunked pass's; a pass of two
    requests takes the chunk list's layout."""
    model = build_tiny_model("qwen3_5", seed=seed)
    eager, static = _engines(model, prefill="chunk", chunk_kernel=_chunk_kernel)
    prompt = [torch.randint(0, 256, (length,), generator=rng).tolist()]
    outs = []
    for eng in (eager, static):
        slot = eng.alloc()
        outs.append((eng.extend([slot], prompt, prompt=True), _states(eng, [slot])))
    (oe, se), (os_, ss) = outs
    graph = static.prompt_graphs.prepare(1, length)
    assert graph.chunk_kernel is _chunk_kernel and graph.padded == (length < 32) and graph.capacity is None
    pair = static.prompt_graphs.prepare(2, length, length - 1)
    assert pair.chunk_kernel is _chunk_kernel and pair.capacity == 32
    scale = oe.logits.abs().max()
    torch.testing.assert_close(os_.logits / scale, oe.logits / scale, **TOL)
    torch.testing.assert_close(ss[0], se[0], **TOL)
    torch.testing.assert_close(ss[1], se[1], **TOL)
    big = HybridEngine(model, num_slots=2, window=1, max_len=2048, prefill="chunk", chunk_kernel=_chunk_kernel,
                       prompt_graphs=True).prompt_graphs
    shapes = [big.key(n) for n in (511, 512, 513, 2048, 33023, 33024, 33025)]
    assert shapes == [(1, 512, None, True), (1, 512, None, False), (1, 768, None, True), (1, 2048, None, False),
                      (1, 33024, None, True), (1, 33024, None, False), None]


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


def _feasible_passes(most, lo, hi):
    """``(k, n, longest)`` of every pass of ``1..most`` prompts of ``lo..hi`` tokens."""
    for k in range(1, most + 1):
        for n in range(k * lo, k * hi + 1):
            for longest in range(max(lo, -(-n // k)), min(hi, n - (k - 1) * lo) + 1):
                yield k, n, longest


@pytest.mark.parametrize("chunk", [False, True])
def test_prepare_joins_builds_every_shape_joining_prompts_can_take(chunk, rng):
    """Passes of 1..most requests of lo..hi prompt tokens each: every such pass that
    runs at a static shape finds its shape built, and none beyond (with a chunked
    kernel, every capacity C the passes' longest prompts take); built largest first;
    too many shapes are refused before any is built."""
    model = build_tiny_model("qwen3_5", seed=0)
    eng = HybridEngine(model, strategy="fold", num_slots=8, window=4, max_len=600,
                       **(dict(prefill="chunk", chunk_kernel=_chunk_kernel) if chunk else {}))
    graphs = PromptGraphs(eng, graph=False, max_chunked_tokens=768)
    lo = int(torch.randint(3, 20, (1,), generator=rng))
    hi = lo + int(torch.randint(0, 60, (1,), generator=rng))
    graphs.prepare_joins(6, lo, hi)
    want = {graphs.key(n, k, longest) for k, n, longest in _feasible_passes(6, lo, hi)} - {None}
    assert set(graphs._shapes) == want and want
    assert any(s.capacity is not None for s in want) == chunk
    built = [s.tokens for s in graphs._shapes]
    assert built == sorted(built, reverse=True)
    with pytest.raises(ValueError, match="max_shapes"):
        graphs.prepare_joins(8, 3, 300, max_shapes=len(graphs.join_shapes(8, 3, 300)) - 1)
    assert set(graphs._shapes) == want
    fixed = graphs.join_shapes(6, 40, 40)  # prompts of one length: one shape per request count
    assert sorted(s.requests for s in fixed) == list(range(1, 7))
    # With capture_new off (a timed run), a pass whose shape is not built runs eagerly:
    # fits() says no for it and yes for a built one.
    graphs.capture_new = False
    free = [s for s in range(eng.kv.num_slots) if not eng.kv.lengths[s]][:2]
    outside = [[1] * 250, [1] * 250]  # far longer than any joining prompt
    assert graphs.key(500, 2, 250 if chunk else None) not in graphs._shapes
    assert not graphs.fits(free, outside)
    inside = [[1] * lo, [1] * lo]
    assert graphs.key(2 * lo, 2, lo if chunk else None) in graphs._shapes
    assert graphs.fits(free, inside)
    graphs.capture_new = True
    assert graphs.fits(free, outside)


def _engine_pair(model, **kw):
    common = dict(strategy="fold", num_slots=6, window=3, max_len=96, prefill="chunk", **kw)
    calls = []

    def kernel(q, *args, cu_seqlens=None, chunk_indices=None, **kwargs):  # the CPU stand-in, its calls recorded
        calls.append((tuple(q.shape[:2]), None if cu_seqlens is None else len(cu_seqlens),
                      None if chunk_indices is None else len(chunk_indices)))
        return _chunk_kernel(q, *args, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, **kwargs)

    eager = HybridEngine(model, prompt_graphs=False, chunk_kernel=_chunk_kernel, **common)
    return eager, HybridEngine(model, prompt_graphs=True, chunk_kernel=kernel, **common), calls


def _prompt_pass(eng, prompts, bystander):
    """A bystander's prompt, then ``prompts`` into fresh slots: the output, the new
    slots' GDN and conv states, keys and values, and whether the bystander kept its
    state bit for bit."""
    other = eng.alloc()
    eng.extend([other], [bystander], prompt=True)
    before = _states(eng, [other]) + (eng.kv.k[:, other].clone(),)
    slots = [eng.alloc() for _ in prompts]
    out = eng.extend(slots, prompts, prompt=True)
    after = _states(eng, [other]) + (eng.kv.k[:, other].clone(),)
    kept = all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(before, after))
    kv = [(eng.kv.k[:, s, :, : len(p)].clone(), eng.kv.v[:, s, :, : len(p)].clone()) for s, p in zip(slots, prompts)]
    return out, _states(eng, slots), kv, kept


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("lengths,backend", [((5, 40, 17), "auto"), ((32, 7, 32, 1), "auto"), ((3, 3), "auto"),
                                             ((70, 5), "auto"), ((70, 5), "triton")])
def test_several_requests_run_the_chunked_kernel_on_their_chunk_list(family, lengths, backend, rng, seed):
    """With a chunked kernel, a static pass of several requests of different lengths
    runs every GDN layer through the kernel on the packed tokens, the requests, the
    padding request and an empty sequence, with the pass's chunk list at its shape's
    fixed length (the stand-in checks it against the offsets): the last tokens'
    logits, every token's hidden state, the GDN and conv states, the keys and values
    and the KV lengths as the eager pass's (fla's varlen call without a list), a
    bystander untouched. fp32, the same kernel per sequence: agreement to ~1e-6 of the
    values' scale (the token-wise layers run on N rows instead of n). ``triton``: both
    engines on the GPU's kernels under the interpreter (fused norms; the static pass's
    rotary and output gate too, the eager pass keeps transformers')."""
    model = build_tiny_model(family, seed=seed)
    eager, static, calls = _engine_pair(model, backend=backend)
    bystander = torch.randint(0, 256, (7,), generator=rng).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]
    (oe, se, kve, kept_e), (os_, ss, kvs, kept_s) = (_prompt_pass(eng, prompts, bystander) for eng in (eager, static))
    assert static.prompt_passes == {"static": 2, "eager": 0} and kept_s and kept_e
    shape = static.prompt_graphs.key(sum(lengths), len(lengths), max(lengths))
    c = max(MIN_TOKENS, 1 << (max(lengths) - 1).bit_length())
    assert shape.capacity == c and static.prompt_graphs._shapes[shape].chunk_kernel is not None
    layers = len(static.mixers)
    b, n = len(lengths), shape.tokens
    assert calls[-layers:] == [((1, n), b + 3, chunk_list_length(n, b + 1))] * layers
    scale = oe.logits.abs().max()
    torch.testing.assert_close(os_.logits / scale, oe.logits / scale, **TOL)
    torch.testing.assert_close(os_.hidden, oe.hidden, **TOL)
    for got, want in zip(ss[:2], se[:2]):  # GDN states, conv states
        torch.testing.assert_close(got / want.abs().max(), want / want.abs().max(), **TOL)
    assert ss[2] == se[2] == list(lengths)
    for (ks, vs), (ke, ve) in zip(kvs, kve):
        torch.testing.assert_close(ks, ke, **TOL)
        torch.testing.assert_close(vs, ve, **TOL)
    assert torch.equal(static.kv.device_lengths[:-1].cpu(), torch.tensor(static.kv.lengths))


def test_teeth_a_stale_chunk_list_is_refused(rng, seed, monkeypatch):
    """The pass's chunk list must be this pass's: the capture-time list (every row
    padding) left in place of the new one is refused by the stand-in's check before
    anything is computed, so the comparison above runs on checked lists."""
    import replayssm.engine.prompt_graph as pg

    model = build_tiny_model("qwen3_5", seed=seed)
    _, static, _ = _engine_pair(model)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (5, 70, 17)]  # request 1's 2 chunks
    fresh = pg.chunk_list
    stale = {}

    def keep_first(lengths, size):  # the first list built for a shape (its capture's) for every pass after
        return stale.setdefault(size, fresh(lengths, size))

    monkeypatch.setattr(pg, "chunk_list", keep_first)
    slots = [static.alloc() for _ in prompts]
    with pytest.raises(ValueError, match="are not the chunks"):
        static.extend(slots, prompts, prompt=True)


def test_several_request_shapes_and_their_bounds(rng, seed):
    """Keys of several requests with a chunked kernel: ``C`` from the longest prompt
    (powers of two to 512, then multiples of 256); ``N`` and ``B C`` within
    ``max_chunked_tokens`` (16 x 2048 fits the default), else the recurrence's shape
    within ``max_tokens``, else eager; ``longest`` required and checked. In an engine:
    each pass takes the path its key names, and every shape writes its outputs into
    the same shared buffers."""
    model = build_tiny_model("qwen3_5", seed=seed)
    big = HybridEngine(model, num_slots=16, window=1, max_len=2048, prefill="chunk", chunk_kernel=_chunk_kernel,
                       prompt_graphs=True).prompt_graphs
    assert big.key(16 * 2048, 16, 2048) == (16, 33024, 2048, True)
    assert big.key(17 * 2048, 17, 2048) is None
    assert big.key(511, 2, 300) == (2, 512, 512, True) and big.key(512, 2, 300) == (2, 768, 512, True)
    assert big.key(600, 2, 513) == (2, 768, 768, True)
    assert big.key(500, 100, 401) == (100, 512, None, True)  # B C = 51200: the recurrence's shape
    assert big.key(600, 100, 401) is None
    for args, match in (((100, 2), "longest"), ((100, 2, 49), "no pass"), ((100, 2, 100), "no pass"),
                        ((100, 1, 99), "one request")):
        with pytest.raises(ValueError, match=match):
            big.key(*args)
    with pytest.raises(ValueError, match="shape capacity"):
        PromptGraphs(big.engine, max_chunked_tokens=1000)
    plain = PromptGraphs(HybridEngine(model, num_slots=2, window=1, max_len=64), graph=False)
    assert plain.key(63, 2) == (2, 64, None, True) and plain.key(512, 2, 500) is None  # longest unused

    eng = HybridEngine(model, strategy="fold", num_slots=6, window=2, max_len=96, prefill="chunk",
                       chunk_kernel=_chunk_kernel, prompt_graphs=True)
    eng.prompt_graphs = PromptGraphs(eng, max_tokens=64, max_chunked_tokens=64)
    for lengths, path in (((20, 30), "static"), ((40, 20), "static"), ((40, 40), "eager")):
        slots = [eng.alloc() for _ in lengths]
        before = dict(eng.prompt_passes)
        eng.extend(slots, [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths], prompt=True)
        assert eng.prompt_passes[path] == before[path] + 1, lengths
        eng.free_many(slots)
    shapes = eng.prompt_graphs._shapes
    assert set(shapes) == {(2, 64, 32, True), (2, 64, None, True)}  # B C = 128 > 64: the recurrence
    ptrs = {(g.logits.data_ptr(), g.hidden.data_ptr()) for g in shapes.values()}
    assert len(ptrs) == 1


def test_bad_capacities_are_refused(rng, seed):
    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=3, window=2, max_len=96, prefill="chunk",
                       chunk_kernel=_chunk_kernel, prompt_graphs=True)
    plain = HybridEngine(model, strategy="fold", num_slots=3, window=2, max_len=96, prompt_graphs=True)
    for args, kw, match in (((eng, 1, 64), dict(capacity=32), "several requests"),
                            ((plain, 2, 64), dict(capacity=32), "chunked kernel"),
                            ((eng, 2, 64), dict(capacity=0), "capacity must be"),
                            ((eng, 2, 4096), dict(capacity=32), "cannot fill")):
        with pytest.raises(ValueError, match=match):
            PromptGraph(*args, graph=False, **kw)
    s, t = eng.alloc(), eng.alloc()
    ck = eng.pool.checkpoints.clone()
    with pytest.raises(ValueError, match="at most 32"):
        PromptGraph(eng, 2, 64, graph=False, capacity=32).run([s, t], [[1] * 40, [2] * 3])
    assert torch.equal(eng.pool.checkpoints, ck) and eng.kv.lengths[s] == 0


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_attention_is_the_transformers_form_bit_for_bit(family, dtype, rng, seed):
    """A static prompt pass's attention layer (queries and keys normed into one buffer,
    rotated in place) against :func:`attention_forward` (transformers' rotary), over a
    layout of requests of 3 and 5 tokens and 2 padding tokens in the sink: the keys and
    values written to the cache bit for bit, the outputs to one rounding of the output
    gate (torch's CPU sigmoid rounds a strided gate, as the fast layer reads it, by its
    scalar loop and a contiguous one by its vector loop: one ulp apart at times; the
    product, the attention and the matmul are the same ops on the same bits); and no
    concatenation is left in it."""
    from replayssm.engine.adapter import attention_forward, prompt_attention_forward
    from replayssm.engine.kv_cache import PromptLayout
    from replayssm.engine.rotary import rope_rows
    from replayssm.testing.op_count import count_ops

    model = build_tiny_model(family, seed=seed, dtype=dtype)
    eng = HybridEngine(model, strategy="fold", num_slots=3, window=2, max_len=32)
    attn = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
    x = torch.randn(10, model.config.hidden_size, generator=rng).to(dtype)
    row = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2])
    col = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0, 1])
    pos = torch.where(row < 2, col, 0)
    slot = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, eng.kv.sink, eng.kv.sink])
    layout = PromptLayout(3, 5, torch.stack([row, col, pos, slot]))
    cos, sin = eng.rotary_cos_sin(x, pos)
    rope = rope_rows(cos, sin)[None]  # once per pass, for every layer
    outs = []
    for fast in (False, True):
        eng.kv.k.zero_(), eng.kv.v.zero_()
        with torch.inference_mode(), count_ops() as ops:
            if fast:
                o = prompt_attention_forward(attn, x, rope, eng.kv, 0, layout, eng.static_norm)
            else:
                o = attention_forward(attn, x, cos, sin, eng.kv, 0, layout, eng.static_norm)
        outs.append((o, eng.kv.k[0, :2].clone(), eng.kv.v[0, :2].clone(), ops.counts))
    (o_hf, k_hf, v_hf, ops_hf), (o, k, v, ops_fast) = outs
    assert torch.equal(k, k_hf) and torch.equal(v, v_hf) and k.abs().max() > 0
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-8
    assert (o - o_hf).abs().max() <= 4 * ulp * o_hf.abs().max(), (o - o_hf).abs().max()
    assert ops_hf["aten.cat"] > 0 and "aten.cat" not in ops_fast, (ops_hf, ops_fast)
