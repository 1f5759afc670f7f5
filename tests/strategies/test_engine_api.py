"""The calls an engine makes besides verify/commit: load_states, save_states /
restore_states, chunk_prefill and chunk_prefill_static (reference backend).

Oracle bounds: fp32 against float64 on a few contractive steps (|exp(g)| <= 1, beta in
(0, 1), unit keys) stays within 1e-5 of the values' scale.
"""

import itertools

import pytest
import torch

from replayssm.strategies import chunk_list, chunk_list_length
from replayssm.testing.chunk_kernel import check_chunk_list
from replayssm.testing.lifecycle import Lifecycle
from replayssm.ops.recurrent import gdn_recurrence_reference
from replayssm.state import GDNShape, StatePool, StepProtocolError

STRATEGIES = ["snapshot", "fold", "circular"]
SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=8)
TOL = 1e-5


def make(strategy, *, requests=2, slots=5, layers=2, window=4, ring_len=8, seed=0, state_dtype=torch.float32):
    pool = StatePool(SHAPE, layers, slots, strategy=strategy, window=window, ring_len=ring_len, state_dtype=state_dtype)
    lc = Lifecycle(pool, num_requests=requests, padding_rows=1, generator=torch.Generator().manual_seed(seed))
    return pool, lc


def committed(pool, slots):
    return torch.stack([pool.strategy.committed_state(layer, slots) for layer in range(pool.num_layers)])


def rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def scratch_step(pool, lc, slots, lengths, accepted):
    batch = pool.batch(slots, lengths)
    for layer in range(pool.num_layers):
        x = lc.make_inputs(batch.num_tokens)
        pool.strategy.conv_verify(layer, x["x"], batch)
        pool.strategy.verify(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
    pool.strategy.commit(batch, accepted)


# ---------------------------------------------------------------------------- load_states
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_states_sets_fresh_slots_and_decoding_continues_from_them(strategy):
    """New API: load_states(layer, slots, states) with -1 entries skipped, cast to the
    state dtype; a decode step afterwards starts from the loaded state (float64 oracle)."""
    pool, lc = make(strategy, requests=1, state_dtype=torch.bfloat16)
    a, b = pool.alloc(), pool.alloc()
    s = SHAPE
    states = torch.randn(pool.num_layers, 3, s.num_value_heads, s.head_v_dim, s.head_k_dim) * 0.3
    slots = torch.tensor([a, -1, b], dtype=torch.int32)
    for layer in range(pool.num_layers):
        pool.strategy.load_states(layer, slots, states[layer])
    got = committed(pool, [a, b])
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, states[:, [0, 2]].to(torch.bfloat16))
    assert torch.equal(committed(pool, lc.slots), torch.zeros_like(committed(pool, lc.slots))), "bystander changed"
    # decode 3 tokens for a: the state must be the oracle's from the loaded one
    batch = pool.batch([a], [3], prefill=True)
    x = lc.make_inputs(3)
    x = {k: v for k, v in x.items()}
    for layer in range(pool.num_layers):
        pool.strategy.prefill(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
        p = pool.layer_params(layer)
        oracle = states[layer, 0:1].to(torch.bfloat16).double().clone()
        gdn_recurrence_reference(
            *(x[n].double() for n in "qkvab"), p["A_log"].double(), p["dt_bias"].double(), oracle,
            torch.tensor([0], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), update_state=True,
        )
        # bf16 storage of the final state: 2^-8 relative rounding
        assert rel(pool.strategy.committed_state(layer, [a])[0], oracle[0]) < 2**-8


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_states_rejects_bad_input_and_changes_nothing(strategy):
    pool, lc = make(strategy, requests=2)
    for _ in range(3):
        lc.step()
    fresh = pool.alloc()
    s = SHAPE
    good = torch.randn(1, s.num_value_heads, s.head_v_dim, s.head_k_dim)
    before = {n: b.clone() for n, b in pool.buffers.items()}
    one = torch.tensor([fresh], dtype=torch.int64)
    cases = [
        ((0, one, good[:, :2]), ValueError, "states must have shape"),
        ((0, one, good.to(torch.int32)), TypeError, "states must have dtype"),
        ((0, one.float(), good), TypeError, "slots must have dtype"),
        ((5, one, good), ValueError, "layer"),
        ((0, torch.tensor([4], dtype=torch.int64), good), ValueError, "not allocated"),
        ((0, torch.tensor([fresh, fresh]), torch.cat([good, good])), ValueError, "unique"),
    ]
    if strategy == "circular":  # a request with committed history is not fresh
        cases.append(((0, torch.tensor([lc.slots[0]]), good), StepProtocolError, "history"))
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            pool.strategy.load_states(*args)
    batch = pool.batch([fresh], [2])
    x = lc.make_inputs(2)
    pool.strategy.verify(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
    after_verify = {n: b.clone() for n, b in pool.buffers.items()}
    with pytest.raises(StepProtocolError, match="open step"):
        pool.strategy.load_states(0, one, good)
    for n, b in pool.buffers.items():
        assert torch.equal(b.nan_to_num(7.0), after_verify[n].nan_to_num(7.0)), n
    pool.strategy.abort(batch)
    for n in ("checkpoints", "conv_state"):
        assert torch.equal(pool.buffers[n], before[n]), n


# ---------------------------------------------------------------------------- save / restore
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_save_restore_undoes_scratch_decoding(strategy):
    """New API: save_states / restore_states undo scratch steps (circular included:
    ring and cursors come back). The lifecycle's float64 oracle never sees the scratch
    steps, so its agreement afterwards shows that the restored state is the committed
    one, flushes and all."""
    pool, lc = make(strategy, requests=2, seed=4)
    for _ in range(5):
        lc.step()
    saved = pool.strategy.save_states(lc.slots)
    state0, conv0 = committed(pool, lc.slots), pool.buffers["conv_state"][:, lc.slots].clone()
    for step in range(5):  # scratch decoding: several flushes for circular (L = 2T)
        scratch_step(pool, lc, lc.slots, [4, 3], [4, 3])
    assert not torch.equal(committed(pool, lc.slots), state0)
    pool.strategy.restore_states(saved)
    assert torch.equal(committed(pool, lc.slots), state0)
    assert torch.equal(pool.buffers["conv_state"][:, lc.slots], conv0)
    for _ in range(6):
        r = lc.step()
        assert r.state_err < TOL and r.conv_bitexact and r.out_err < TOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_save_restore_protocol(strategy):
    pool, lc = make(strategy, requests=2)
    lc.step()
    s0, s1 = lc.slots
    batch = pool.batch([s0], [2])
    x = lc.make_inputs(2)
    pool.strategy.verify(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
    with pytest.raises(StepProtocolError):
        pool.strategy.save_states([s1])
    pool.strategy.abort(batch)
    saved = pool.strategy.save_states([s0, s1])
    pool.strategy.verify(0, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
    with pytest.raises(StepProtocolError):
        pool.strategy.restore_states(saved)
    pool.strategy.abort(batch)
    with pytest.raises(ValueError, match="unique"):
        pool.strategy.save_states([s0, s0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.strategy.save_states([4])
    pool.free(s1)
    pool.alloc(slot=s1)
    with pytest.raises(ValueError, match="changed hands"):
        pool.strategy.restore_states(saved)
    other, _ = make(strategy)
    with pytest.raises(TypeError, match="save_states"):
        other.strategy.restore_states(saved)


# ---------------------------------------------------------------------------- chunk_prefill
def fake_chunk_kernel(q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                      state_v_first, chunk_indices=None):
    """fla-core's (>= 0.6) chunk_gated_delta_rule contract, computed token by token in
    float64 from DESIGN.md section 1, written here without the library's ops: q, k
    [1, N, H, K] shared by groups of HV / H value heads, outputs [1, N, HV, V], final
    states [B, HV, V, K] (state_v_first); without cu_seqlens (fla's batch mode) q, k
    [B, T, H, K], each batch row one sequence, outputs [B, T, HV, V]. A chunk list
    (chunk_prefill_static's) is checked against the offsets, as fla-core would trust it."""
    assert initial_state is None and output_final_state and use_qk_l2norm_in_kernel and state_v_first
    if chunk_indices is not None:
        check_chunk_list(cu_seqlens, chunk_indices)
    assert cu_seqlens is None or (cu_seqlens.dtype == torch.int64 and q.shape[0] == 1)
    rows, n, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[-1]
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    key_head = torch.arange(hv) // (hv // h)
    o = torch.zeros(rows, n, hv, vd, dtype=torch.float64)
    if cu_seqlens is None:
        seqs = [(r, 0, n) for r in range(rows)]
    else:
        cu = cu_seqlens.tolist()
        seqs = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    final = torch.zeros(len(seqs), hv, vd, kd, dtype=torch.float64)
    for i, (r, start, end) in enumerate(seqs):
        S = torch.zeros(hv, vd, kd, dtype=torch.float64)
        for t in range(start, end):
            kh = (k[r, t] / torch.sqrt((k[r, t] ** 2).sum(-1, keepdim=True) + 1e-6))[key_head]
            qh = (q[r, t] / torch.sqrt((q[r, t] ** 2).sum(-1, keepdim=True) + 1e-6) * kd**-0.5)[key_head]
            S = torch.exp(g[r, t])[:, None, None] * S
            u = beta[r, t][:, None] * (v[r, t] - torch.einsum("hvk,hk->hv", S, kh))
            S = S + u[:, :, None] * kh[:, None, :]
            o[r, t] = torch.einsum("hvk,hk->hv", S, qh)
        final[i] = S
    return o.float(), final.float()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_chunk_prefill_matches_prefill(strategy):
    """New API: chunk_prefill computes the gates, calls the kernel with fla's signature
    (key heads shared by value heads, states [V, K]) and loads the final states for the live rows;
    padding rows get zero outputs. Against strategy.prefill on an identical pool: outputs
    and committed states within 1e-5 of their scale (the fake kernel is float64)."""
    pools = [make(strategy, requests=0, slots=4, seed=9) for _ in range(2)]
    slots = [[p.alloc() for _ in range(2)] for p, _ in pools]
    lengths = [5, 3, 6]
    x_all = [pools[0][1].make_inputs(sum(lengths)) for _ in range(pools[0][0].num_layers)]
    outs = []
    for (pool, _), sl, use_chunk in zip(pools, slots, (True, False)):
        batch = pool.batch([sl[0], -1, sl[1]], lengths, prefill=True)
        o_layers = []
        for layer, x in enumerate(x_all):
            args = (layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
            o_layers.append(pool.strategy.chunk_prefill(*args, kernel=fake_chunk_kernel) if use_chunk
                            else pool.strategy.prefill(*args))
        outs.append(o_layers)
    for o_c, o_p in zip(*outs):
        assert o_c.dtype == o_p.dtype == torch.float32
        assert torch.equal(o_c[5:8], torch.zeros_like(o_c[5:8])), "padding rows must be zero"
        assert (o_c - o_p).abs().max() <= TOL * o_p.abs().max()
    for layer in range(pools[0][0].num_layers):
        c = pools[0][0].strategy.committed_state(layer, slots[0])
        p = pools[1][0].strategy.committed_state(layer, slots[1])
        assert (c - p).abs().max() <= TOL * p.abs().max()


def test_chunk_prefill_checks_the_kernel_and_the_rows():
    pool, lc = make("circular", requests=1)
    lc.step()
    fresh = pool.alloc()
    x = lc.make_inputs(4)
    args = (0, x["q"], x["k"], x["v"], x["a"], x["b"])
    before = pool.buffers["checkpoints"].clone()
    with pytest.raises(StepProtocolError, match="history"):
        pool.strategy.chunk_prefill(*args, pool.batch([lc.slots[0]], [4], prefill=True), kernel=fake_chunk_kernel)

    def bad_kernel(*a, **kw):
        o, final = fake_chunk_kernel(*a, **kw)
        return o, final.transpose(-1, -2).contiguous()[:, :, :4]

    with pytest.raises(ValueError, match="kernel's final state"):
        pool.strategy.chunk_prefill(*args, pool.batch([fresh], [4], prefill=True), kernel=bad_kernel)
    with pytest.raises(TypeError, match="kernel"):
        pool.strategy.chunk_prefill(*args, pool.batch([fresh], [4], prefill=True), kernel=None)
    assert torch.equal(pool.buffers["checkpoints"], before)


def _chunks(lengths, pad):
    """chunk_prefill_static's ``chunks`` for requests of ``lengths`` packed first, then
    a padding request of ``pad`` tokens, at the list length of their shape."""
    n = sum(lengths) + pad
    cu, chunks = chunk_list(lengths + [pad], chunk_list_length(n, len(lengths) + 1))
    return torch.from_numpy(cu), torch.from_numpy(chunks)


def test_chunk_list_is_every_chunk_in_order_then_the_empty_sequence():
    """chunk_list against a plain loop over random lengths, and its fixed length is the
    most chunks any split of the tokens reaches (here reached: every sequence one token
    past a chunk boundary)."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        lens = (torch.randint(1, 300, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)).tolist()
        size = chunk_list_length(sum(lens), len(lens))
        cu, chunks = chunk_list(lens, size)
        want = [(s, c) for s, n in enumerate(lens) for c in range((n + 63) // 64)]
        assert cu.tolist() == [0, *itertools.accumulate(lens), sum(lens)]
        assert [tuple(e) for e in chunks[: len(want)].tolist()] == want
        assert (chunks[len(want):] == [len(lens), 0]).all() and len(chunks) == size >= len(want)
    lens = [65, 129, 1]
    assert chunk_list_length(sum(lens), 3) == 2 + 3 + 1
    with pytest.raises(ValueError, match="more than size"):
        chunk_list(lens, 5)
    with pytest.raises(ValueError, match=">= 1 tokens"):
        chunk_list([4, 0], 4)


def test_teeth_the_chunk_list_check_refuses_a_wrong_list():
    """The stand-in kernels' check (the one that stands for fla-core's trust in the
    list): a chunk missing, chunks out of order, or spare entries on a sequence with
    tokens (the real kernel would write that chunk again from another chunk's state)
    are refused; the list chunk_list builds passes."""
    cu, chunks = _chunks([128, 64], 1)  # 4 chunks, a list of 5
    check_chunk_list(cu, chunks)
    assert chunks[-1].tolist() == [3, 0]
    bad = [chunks[1:], chunks[[1, 0, *range(2, len(chunks))]], chunks.clone()]
    bad[2][-1] = torch.tensor([2, 0])  # the padding request: 1 token
    for b in bad:
        with pytest.raises(ValueError, match="are not the chunks"):
            check_chunk_list(cu, b)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_static_chunk_prefill_of_several_requests_equals_the_varlen_pass(strategy):
    """chunk_prefill_static with chunks: requests of 128, 3 and 6 tokens, a padding
    request and the empty sequence, the kernel given the fixed-length chunk list (one
    entry spare, on the empty sequence), final
    states into the slots. Against chunk_prefill's varlen call on an identical pool,
    the fake kernel computing in float64 token by token: the real rows' outputs and the
    committed states bit for bit."""
    pools = [make(strategy, requests=0, slots=4, seed=9) for _ in range(2)]
    slots = [[p.alloc() for _ in range(3)] for p, _ in pools]
    lengths, pad = [128, 3, 6], 4
    n = sum(lengths) + pad
    x_all = [pools[0][1].make_inputs(n) for _ in range(pools[0][0].num_layers)]
    chunks = _chunks(lengths, pad)
    assert chunks[1][-1].tolist() == [4, 0]
    outs = []
    for (pool, _), sl, static in zip(pools, slots, (True, False)):
        batch = pool.batch(sl + [-1], lengths + [pad], prefill=True)
        o_layers = []
        for layer, x in enumerate(x_all):
            args = (layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch)
            o_layers.append(pool.strategy.chunk_prefill_static(*args, kernel=fake_chunk_kernel, chunks=chunks)
                            if static else pool.strategy.chunk_prefill(*args, kernel=fake_chunk_kernel))
        outs.append(o_layers)
    for o_s, o_c in zip(*outs):
        assert o_s.shape == o_c.shape == (n, SHAPE.num_value_heads, SHAPE.head_v_dim)
        assert torch.equal(o_s[: sum(lengths)], o_c[: sum(lengths)])
    for layer in range(pools[0][0].num_layers):
        s = pools[0][0].strategy.committed_state(layer, slots[0])
        c = pools[1][0].strategy.committed_state(layer, slots[1])
        assert torch.equal(s, c) and s.abs().max() > 0


def test_static_chunk_prefill_refuses_bad_chunks_before_any_write():
    pool, lc = make("circular", requests=1)
    lc.step()
    fresh, other = [pool.alloc(), pool.alloc()], pool.alloc()
    x = lc.make_inputs(8)
    args = (0, x["q"], x["k"], x["v"], x["a"], x["b"])
    cu, chunks = _chunks([3, 4], 1)
    batch = pool.batch(fresh + [-1], [3, 4, 1], prefill=True)
    before = {name: buf.clone() for name, buf in pool.buffers.items()}
    cases = [
        (dict(chunks=cu), TypeError, "chunks must be a"),
        (dict(chunks=(cu.int(), chunks)), TypeError, "cu_seqlens must have dtype"),
        (dict(chunks=(cu, chunks.float())), TypeError, "chunk_indices must have dtype"),
        (dict(chunks=(cu[None], chunks)), ValueError, "cu_seqlens must have 1 dimensions"),
        (dict(chunks=(cu[:3], chunks)), ValueError, "B \\+ 3 >= 4 entries"),
        (dict(chunks=(cu, chunks[:2])), ValueError, "chunk_indices must have shape"),
        (dict(chunks=(cu, chunks[:, :1])), ValueError, "chunk_indices must have shape"),
        (dict(chunks=(cu, chunks.t().contiguous().t())), ValueError, "chunk_indices must be contiguous"),
        (dict(chunks=(cu[1:], chunks)), ValueError, "cu_seqlens holds 1 requests"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            pool.strategy.chunk_prefill_static(*args, batch, fake_chunk_kernel, **kw)
    with pytest.raises(ValueError, match="cu_seqlens holds 2 requests"):  # the last row is no padding row
        pool.strategy.chunk_prefill_static(*args, pool.batch(fresh + [other], [3, 4, 1], prefill=True),
                                           fake_chunk_kernel, chunks=(cu, chunks))
    with pytest.raises(StepProtocolError, match="history"):  # a request with committed tokens
        pool.strategy.chunk_prefill_static(*args, pool.batch([fresh[0], lc.slots[0], -1], [3, 4, 1], prefill=True),
                                           fake_chunk_kernel, chunks=(cu, chunks))
    for name, buf in pool.buffers.items():
        assert torch.equal(buf.nan_to_num(7.0), before[name].nan_to_num(7.0)), name
