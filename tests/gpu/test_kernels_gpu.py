"""The compiled Triton kernels on a CUDA GPU, at Qwen3.5 shapes (DESIGN.md section 6).

Run on the GPU machine:  python -m pytest -q tests/gpu/test_kernels_gpu.py

Covers bf16 and fp32 activations and states, K = V = 128, H = 16, HV = 32 and 64,
windows 2..8 and batches 1..256 (a sample of combinations, to stay within a couple of
minutes including compilation), and CUDA-graph capture + replay of a full step.

Tolerances against the torch reference (both on the GPU, both computing in fp32):
  * fp32 outputs and states: rtol = atol = 1e-4. The two sum the K = 128 products of
    ``S k^`` / ``S q^`` in different orders, Triton's ``exp``/``log`` are the fast
    hardware approximations (a few ulp) and it fuses multiply-adds, so each step
    differs by ~1e-6 relative; 1e-4 covers 8 steps with margin while a wrong head,
    gate or position is off by O(0.1).
  * bf16 outputs, bf16 states and snapshots: one bf16 ulp of the value (rtol = 2**-7)
    plus 2**-8 of the tensor's scale (its largest magnitude). Both sides round a
    near-identical fp32 value to nearest even (8 bits of mantissa): values close to a
    rounding boundary land one ulp apart, and values near zero, where fp32's ~1e-6 of
    the scale exceeds an ulp, are held to the scale. (It was rtol = atol = 2e-2 on
    outputs whose median magnitude is ~0.05: 40% of a typical value.)
  * copies (raw records k / v, conv window buffer and state, snapshot commit, cursors)
    and Triton-vs-Triton exact paths: bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.ops import (
    RawRecords,
    advance_cursors,
    causal_conv_commit,
    causal_conv_verify,
    gdn_fold,
    gdn_recurrence,
    reset_cursors,
    snapshot_commit,
)
from replayssm.ops import tuning
from replayssm.ops.records import keys_normalized
from replayssm.state import GDNShape, StatePool

pytestmark = pytest.mark.gpu

H, K, V = 16, 128, 128
DEV = "cuda"
NAN = float("nan")


def tol(ref, *dtypes):
    """Tolerances for comparing with ``ref`` (see the module notes), 16-bit ones against
    ``ref``'s scale."""
    if torch.bfloat16 not in dtypes:
        return dict(rtol=1e-4, atol=1e-4)
    scale = ref.float().nan_to_num(0.0).abs().max().item()
    return dict(rtol=2**-7, atol=2**-8 * scale)


def rand_layer(n, hv, act):
    a = torch.randn(n, hv, device=DEV)
    a[torch.rand(n, hv, device=DEV) < 0.05] += 25.0  # the softplus threshold branch
    return dict(
        q=torch.randn(n, H, K, device=DEV).to(act),
        k=torch.randn(n, H, K, device=DEV).to(act),
        v=torch.randn(n, hv, V, device=DEV).to(act),
        a=a.to(act),
        b=(torch.randn(n, hv, device=DEV) * 2).to(act),
        A_log=torch.empty(hv, device=DEV).uniform_(-3, -0.3),
        dt_bias=torch.randn(hv, device=DEV) * 0.5,
    )


def args(x):
    return x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"]


def rand_batch(rows, t, num_slots):
    """Ragged windows of 1..t tokens (one row of exactly t), distinct random slots, one
    padding row when rows > 1."""
    lengths = torch.randint(1, t + 1, (rows,)).tolist()
    lengths[0] = t
    slots = torch.randperm(num_slots)[:rows].tolist()
    if rows > 1:
        slots[-1] = -1
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return (torch.tensor(slots, dtype=torch.int32, device=DEV), torch.tensor(cu, dtype=torch.int32, device=DEV), lengths)


def nan_records(ns, ring, hv, act, layers=None):
    lead = (ns, ring) if layers is None else (layers, ns, ring)
    return RawRecords(
        torch.full(lead + (H, K), NAN, device=DEV, dtype=act),
        torch.full(lead + (hv, V), NAN, device=DEV, dtype=act),
        torch.full(lead + (hv,), NAN, device=DEV),
        torch.full(lead + (hv,), NAN, device=DEV),
    )


def same(a, b):
    """Bitwise equality with NaN == NaN (never-written scratch)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def close_nan(a, b, **t):
    assert torch.equal(a.isnan(), b.isnan())
    torch.testing.assert_close(a.nan_to_num(0).float(), b.nan_to_num(0).float(), **t)


# (HV, activation dtype, state dtype, batch rows, window T)
VERIFY_CASES = [
    (32, torch.bfloat16, torch.float32, 1, 2),
    (64, torch.bfloat16, torch.bfloat16, 3, 8),
    (32, torch.float32, torch.float32, 17, 5),
    (64, torch.float32, torch.bfloat16, 64, 3),
    (32, torch.bfloat16, torch.float32, 256, 4),
]


@pytest.mark.parametrize("hv,act,sdt,rows,t", VERIFY_CASES)
def test_recurrence_matches_reference(hv, act, sdt, rows, t):
    ns = rows + 2
    slots, cu, lengths = rand_batch(rows, t, ns)
    x = rand_layer(sum(lengths), hv, act)
    state0 = torch.randn(ns, hv, V, K, device=DEV).to(sdt)
    snaps0 = torch.full((ns, t, hv, V, K), NAN, device=DEV, dtype=sdt)

    st_r, sn_r = state0.clone(), snaps0.clone()
    o_r = gdn_recurrence(*args(x), st_r, slots, cu, snapshots=sn_r, update_state=True, backend="reference")
    st_t, sn_t = state0.clone(), snaps0.clone()
    o_t = gdn_recurrence(*args(x), st_t, slots, cu, snapshots=sn_t, update_state=True, backend="triton")
    torch.testing.assert_close(o_t.float(), o_r.float(), **tol(o_r, act))
    torch.testing.assert_close(st_t.float(), st_r.float(), **tol(st_r, sdt))
    close_nan(sn_t, sn_r, **tol(sn_r, sdt))

    live = set(slots.tolist())
    for s in range(ns):
        if s not in live:
            assert torch.equal(st_t[s], state0[s]) and sn_t[s].isnan().all()
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            assert not o_t[cu[i] : cu[i + 1]].any(), "padding row output not zero"

    # Record side channel: reference-equal copies, outputs bit-identical to no channel.
    rec_r, rec_t = nan_records(ns, t, hv, act), nan_records(ns, t, hv, act)
    gdn_recurrence(*args(x), state0.clone(), slots, cu, records=rec_r, backend="reference")
    o_side = gdn_recurrence(*args(x), state0, slots, cu, records=rec_t, backend="triton")
    o_plain = gdn_recurrence(*args(x), state0, slots, cu, max_len=t, backend="triton")
    assert torch.equal(o_side, o_plain)
    assert torch.equal(o_t, o_plain), "snapshot writes changed the outputs"
    assert same(rec_t.v, rec_r.v)
    if keys_normalized(rec_t.k.dtype):  # an fp32 ring's keys, normalised by each side: a few ulp
        close_nan(rec_t.k, rec_r.k, rtol=1e-6, atol=1e-7)
    else:  # raw copies
        assert same(rec_t.k, rec_r.k)
    close_nan(rec_t.g, rec_r.g, rtol=1e-5, atol=1e-6)
    close_nan(rec_t.beta, rec_r.beta, rtol=1e-5, atol=1e-6)


# (HV, activation dtype, batch rows, window T); fp32 state (the exactness contract)
EXACT_CASES = [
    (32, torch.bfloat16, 1, 4),
    (64, torch.bfloat16, 8, 8),
    (32, torch.float32, 5, 2),
    (64, torch.bfloat16, 256, 3),
]


@pytest.mark.parametrize("hv,act,rows,t", EXACT_CASES)
def test_exact_paths_bit_identical(hv, act, rows, t):
    """Per layer: recurrence(update_state) on the accepted tokens; verify with records,
    then one fold launch for all layers; verify with snapshots, then one snapshot
    commit for all layers. The fp32 checkpoints agree bit for bit (they share the
    state-step helpers on four-part full-K tiles, even where the launchers pick different BV)."""
    layers, ns = 2, rows + 1
    slots, cu, lengths = rand_batch(rows, t, ns)
    accepted = [int(torch.randint(1, n + 1, ())) for n in lengths]
    acc = torch.tensor(accepted, dtype=torch.int32, device=DEV)
    keep = torch.cat([torch.arange(cu[i].item(), cu[i].item() + accepted[i]) for i in range(rows)]).to(DEV)
    cu_acc = torch.tensor([0] + torch.tensor(accepted).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ckpt0 = torch.randn(layers, ns, hv, V, K, device=DEV)

    direct, folded, snapped = ckpt0.clone(), ckpt0.clone(), ckpt0.clone()
    rec = nan_records(ns, t, hv, act, layers=layers)
    snaps = torch.full((layers, ns, t, hv, V, K), NAN, device=DEV)
    for layer in range(layers):
        x = rand_layer(sum(lengths), hv, act)
        sub = [y[keep] for y in args(x)[:5]]
        gdn_recurrence(*sub, x["A_log"], x["dt_bias"], direct[layer], slots, cu_acc, update_state=True, max_len=t,
                       backend="triton")
        gdn_recurrence(*args(x), folded[layer], slots, cu, records=RawRecords(*(r[layer] for r in rec)), backend="triton")
        gdn_recurrence(*args(x), snapped[layer], slots, cu, snapshots=snaps[layer], backend="triton")
    gdn_fold(folded, *rec, slots, torch.zeros_like(acc), acc, backend="triton")
    snapshot_commit(snapped, snaps, slots, acc, backend="triton")
    torch.cuda.synchronize()

    assert not torch.equal(direct, ckpt0)
    assert torch.equal(folded, direct), f"fold differs: max {(folded - direct).abs().max().item():.3e}"
    assert torch.equal(snapped, direct), f"snapshot differs: max {(snapped - direct).abs().max().item():.3e}"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [8, 256])
@pytest.mark.parametrize("warps,block_v", [(8, 64), (2, 16), (2, 64), (1, 16)])
def test_exact_kernels_on_other_warp_counts_keep_every_bit(state_dtype, rows, warps, block_v):
    """The exact kernels on 1, 2 or 8 warps (``num_warps`` of ``exact_write``,
    ``exact_snapshot`` and ``exact_read_only``; the warps stack along V, see
    ``triton_common.exact_warps``) against the same kernels on the table's 4: the state
    update and its outputs, the snapshots of a writing verify, the read-only verify's
    outputs, its records and the fold of them, all bit for bit."""
    t, hv, layers, ns = 4, 32, 1, rows + 1
    slots, cu, lengths = rand_batch(rows, t, ns)
    acc = torch.tensor([int(torch.randint(1, n + 1, ())) for n in lengths], dtype=torch.int32, device=DEV)
    x = rand_layer(sum(lengths), hv, torch.bfloat16)
    ckpt0 = torch.randn(layers, ns, hv, V, K, device=DEV).to(state_dtype)

    def path(warps, block_v):
        with tuning.override("exact_write", num_warps=warps, block_v=block_v), \
                tuning.override("exact_snapshot", num_warps=warps, block_v=block_v), \
                tuning.override("exact_read_only", num_warps=warps, block_v=2 * block_v):
            updated, folded = ckpt0.clone(), ckpt0.clone()
            o_upd = gdn_recurrence(*args(x), updated[0], slots, cu, update_state=True, max_len=t, backend="triton")
            snaps = torch.full((ns, t, hv, V, K), NAN, device=DEV, dtype=state_dtype)
            o_snap = gdn_recurrence(*args(x), ckpt0[0].clone(), slots, cu, snapshots=snaps, backend="triton")
            rec = nan_records(ns, t, hv, torch.bfloat16, layers=layers)
            o_ver = gdn_recurrence(*args(x), folded[0], slots, cu, records=RawRecords(*(r[0] for r in rec)),
                                   backend="triton")
            gdn_fold(folded, *rec, slots, torch.zeros_like(acc), acc, backend="triton")
            torch.cuda.synchronize()
            return updated, o_upd, o_snap, o_ver, snaps, rec, folded

    other, four = path(warps, block_v), path(4, 64)
    assert not torch.equal(four[0], ckpt0)
    for i, name in enumerate(("updated state", "update outputs", "snapshot outputs", "verify outputs")):
        assert torch.equal(other[i], four[i]), f"{name} differ at {warps} warps"
    assert same(other[4], four[4]), f"snapshots differ at {warps} warps"
    assert all(same(a, b) for a, b in zip(other[5], four[5])), f"records differ at {warps} warps"
    assert torch.equal(other[6], four[6]), f"folded checkpoints differ at {warps} warps"


@pytest.mark.parametrize("hv,act,t", [(32, torch.bfloat16, 4), (64, torch.float32, 8)])
def test_conv_and_cursors_match_reference(hv, act, t):
    c, w, ns, rows = 2 * H * K + hv * V, 4, 12, 9
    slots, cu, lengths = rand_batch(rows, t, ns)
    x = torch.randn(sum(lengths), c, device=DEV).to(act)
    weight = torch.randn(c, w, device=DEV).to(act)
    bias = torch.randn(c, device=DEV).to(act)
    state0 = torch.randn(ns, c, w - 1, device=DEV).to(act)
    buf_r = torch.full((ns, t, c), NAN, device=DEV, dtype=act)
    buf_t = buf_r.clone()
    y_r = causal_conv_verify(x, state0, weight, bias, slots, cu, window_buf=buf_r, backend="reference")
    y_t = causal_conv_verify(x, state0, weight, bias, slots, cu, window_buf=buf_t, backend="triton")
    torch.testing.assert_close(y_t.float(), y_r.float(), **tol(y_r, act))
    assert same(buf_t, buf_r)
    s_r, s_t = state0.clone(), state0.clone()
    causal_conv_verify(x, s_r, weight, bias, slots, cu, update_state=True, max_len=t, backend="reference")
    causal_conv_verify(x, s_t, weight, bias, slots, cu, update_state=True, max_len=t, backend="triton")
    assert torch.equal(s_t, s_r)

    layers = 3
    cs0 = torch.randn(layers, ns, c, w - 1, device=DEV).to(act)
    wbuf = torch.randn(layers, ns, t, c, device=DEV).to(act)
    acc = torch.tensor([int(torch.randint(1, n + 1, ())) for n in lengths], dtype=torch.int32, device=DEV)
    cs_r, cs_t = cs0.clone(), cs0.clone()
    causal_conv_commit(cs_r, wbuf, slots, acc, backend="reference")
    causal_conv_commit(cs_t, wbuf, slots, acc, backend="triton")
    assert torch.equal(cs_t, cs_r)

    ring_len = 1 << (2 * t - 1).bit_length()  # the smallest power of two >= 2T
    cur_r = [torch.zeros(ns, dtype=torch.int32, device=DEV) for _ in range(3)]
    cur_t = [z.clone() for z in cur_r]
    for _ in range(10):
        acc = torch.randint(1, t + 1, (rows,), dtype=torch.int32, device=DEV)
        advance_cursors(*cur_r, slots, acc, t, ring_len, backend="reference")
        advance_cursors(*cur_t, slots, acc, t, ring_len, backend="triton")
        assert all(torch.equal(p, q) for p, q in zip(cur_t, cur_r))
    assert cur_t[2].any() and cur_t[1].any(), "no flush / base move: the flush branch went untested"
    reset_cursors(*cur_r, slots, backend="reference")
    reset_cursors(*cur_t, slots, backend="triton")
    assert all(torch.equal(p, q) for p, q in zip(cur_t, cur_r))


def test_conv_prompt_token_blocks(monkeypatch):
    """Prompts through the conv's token blocks at Qwen3.5's C = 8192, bf16: a 2048-token
    prompt beside windows around the block size and a padding row, against the
    reference (the state bit for bit), and the same bits at another token block (4
    tokens in groups of 2, so a window of 16 takes four blocks instead of one)."""
    from replayssm.ops import conv as conv_ops

    c, w, ns, act = 2 * H * K + 32 * V, 4, 12, torch.bfloat16
    lengths = [1, 15, 16, 2048, 17, 53, 700, 33]
    slot_list = torch.randperm(ns)[: len(lengths)].tolist()
    slot_list[-1] = -1
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    slots = torch.tensor(slot_list, dtype=torch.int32, device=DEV)
    x = torch.randn(sum(lengths), c, device=DEV).to(act)
    weight = torch.randn(c, w, device=DEV).to(act)
    bias = torch.randn(c, device=DEV).to(act)
    state0 = torch.randn(ns, c, w - 1, device=DEV).to(act)

    def run(backend, rows=len(lengths)):
        state = state0.clone()
        y = causal_conv_verify(x[: int(cu[rows])], state, weight, bias, slots[:rows], cu[: rows + 1],
                               update_state=True, max_len=max(lengths[:rows]), backend=backend)
        return y, state

    y_r, s_r = run("reference")
    y_t, s_t = run("triton")
    torch.testing.assert_close(y_t.float(), y_r.float(), **tol(y_r, act))
    assert torch.equal(s_t, s_r)
    short = [run("triton", rows=3)]  # windows of at most 16 tokens: one token block
    monkeypatch.setattr(conv_ops, "CONV_TOKEN_BLOCK", 4)
    monkeypatch.setattr(conv_ops, "CONV_TOKEN_GROUP", 2)
    short.append(run("triton", rows=3))
    y_4, s_4 = run("triton")
    assert torch.equal(y_4, y_t) and torch.equal(s_4, s_t)
    assert torch.equal(short[0][0], short[1][0]) and torch.equal(short[0][1], short[1][1])
    assert torch.equal(y_t[-lengths[-1]:], torch.zeros_like(y_t[-lengths[-1]:])), "padding row not zeroed"


def test_conv_prompts_of_new_lengths_compile_nothing():
    """After one prompt longer than a token block, prompts of other lengths reuse its
    compiled conv kernel (the block size, not the length, is the kernel's constant)."""
    from replayssm.ops import conv as conv_ops

    caches = getattr(conv_ops._conv_verify_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    c, w, ns, act = 2 * H * K + 32 * V, 4, 4, torch.bfloat16
    weight = torch.randn(c, w, device=DEV).to(act)
    state = torch.randn(ns, c, w - 1, device=DEV).to(act)

    def prefill(n):
        slots = torch.tensor([1], dtype=torch.int32, device=DEV)
        cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
        causal_conv_verify(torch.randn(n, c, device=DEV).to(act), state, weight, None, slots, cu, update_state=True,
                           max_len=n, backend="triton")

    def compiled():
        return sum(len(entry[0]) for entry in caches.values())

    prefill(100)
    before = compiled()
    for n in (37, 300, 1000, 2047, 4100):
        prefill(n)
    assert compiled() == before


# ---------------------------------------------------------------------------- CUDA graphs
@pytest.mark.parametrize("strategy", ["snapshot", "fold"])
def test_cuda_graph_step_replays_eager_step(strategy):
    """Every layer's conv + verify, then the commit, captured once: replays with new
    inputs give exactly the eager step's outputs and buffers (bf16 activations, fp32
    state, Qwen3.5 heads, a padding row)."""
    shape = GDNShape(num_heads=H, num_value_heads=32, head_k_dim=K, head_v_dim=V)
    layers, window = 2, 4
    pool = StatePool(shape, layers, 6, strategy=strategy, window=window, act_dtype=torch.bfloat16, device=DEV)
    for layer in range(layers):
        pool.set_layer_params(layer, A_log=torch.empty(32).uniform_(-3, -0.3), dt_bias=torch.randn(32) * 0.5,
                              conv_weight=torch.randn(shape.conv_dim, 4) * 0.5, conv_bias=torch.randn(shape.conv_dim) * 0.1)
    slots = [pool.alloc() for _ in range(5)]
    pool.buffers["checkpoints"].normal_(0, 0.1)
    pool.buffers["conv_state"].normal_()
    lengths = [4, 2, 3, 4, 1]
    batch = pool.batch([slots[0], slots[1], -1, slots[3], slots[4]], lengths)
    n, hk = sum(lengths), H * K
    static_x = [torch.zeros(n, shape.conv_dim, device=DEV, dtype=torch.bfloat16) for _ in range(layers)]
    static_ab = [torch.zeros(2, n, 32, device=DEV, dtype=torch.bfloat16) for _ in range(layers)]
    static_acc = torch.ones(len(lengths), dtype=torch.int32, device=DEV)
    outs = [None] * layers

    def step():
        for layer in range(layers):
            y = pool.strategy.conv_verify(layer, static_x[layer], batch)
            q, k, v = y[:, :hk].view(n, H, K), y[:, hk : 2 * hk].view(n, H, K), y[:, 2 * hk :].view(n, 32, V)
            outs[layer] = pool.strategy.verify(layer, q, k, v, static_ab[layer][0], static_ab[layer][1], batch)
        pool.strategy.commit(batch, static_acc)

    def new_inputs():
        for layer in range(layers):
            static_x[layer].copy_(torch.randn(n, shape.conv_dim, device=DEV))
            static_ab[layer].copy_(torch.randn(2, n, 32, device=DEV))
        static_acc.copy_(torch.tensor([int(torch.randint(1, m + 1, ())) for m in lengths], dtype=torch.int32))

    # Warm up (compiles every kernel variant) on a side stream, as graph capture wants.
    new_inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the launches; runs nothing
        step()
    graph_outs = list(outs)  # tensors in the graph's pool, rewritten by every replay

    for replay in range(3):
        new_inputs()
        before = {k: b.clone() for k, b in pool.buffers.items()}
        graph.replay()
        torch.cuda.synchronize()
        got = {k: b.clone() for k, b in pool.buffers.items()}
        got_out = [o.clone() for o in graph_outs]
        for name, b in pool.buffers.items():
            b.copy_(before[name])
        step()
        torch.cuda.synchronize()
        for name, b in pool.buffers.items():
            assert same(got[name], b), f"replay {replay}: buffer {name} differs from the eager step"
        for layer in range(layers):
            assert torch.equal(got_out[layer], outs[layer]), f"replay {replay}: layer {layer} outputs differ"
        assert not torch.equal(got["checkpoints"], before["checkpoints"]), "the step committed nothing"
