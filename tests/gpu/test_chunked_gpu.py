"""The chunked closed-form window kernel (``circular``'s verify) compiled on a CUDA GPU.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_chunked_gpu.py

Qwen3.5 shapes (K = V = 128, H = 16, HV = 32 and 64), windows 2..8, batches 1..256,
fp32 and bf16 checkpoints, fp32 and bf16 activations (a sample of combinations, to keep
compilation to a couple of minutes); histories of 0..L-T committed records, flush and
non-flush rows, a padding row and NaN in every unused ring entry.

Tolerances against the float64 oracle (the reference op run in float64 on upcast copies
of the same inputs and buffers):
  * fp32 checkpoint and activations: rtol = atol = 1e-4. The kernel's K = 128 dot
    products, fast hardware ``exp`` / ``log`` (a few ulp) and fused multiply-adds put
    each quantity ~1e-6 relative from float64; the forward substitution through
    ``(I + A)`` (entries bounded by 1) adds at most T = 8 such terms. 1e-4 leaves a wide
    margin while a wrong head, gate, position or history is off by O(0.1).
  * any bf16 (outputs rounded to bf16, or a bf16 checkpoint that a flush rounds before
    the window starts from it): one bf16 ulp of the value (rtol = 2**-7) plus 2**-7 of
    the tensor's scale (its largest magnitude). Rounding the output costs half an ulp;
    a bf16 checkpoint puts 2**-9 relative on each state element, which a K = 128 product
    turns into ~2**-11 of a typical output (random signs), a few times that at the
    largest of ~1e6 elements, still below 2**-7 of the largest output. (It was
    rtol = atol = 2e-2 on outputs whose median magnitude is ~0.05.)
  * bf16 activations run the big products in tf32 (``product_precision``): the fp32
    state is rounded to 11 significant bits, so the window's fp32 ``u`` (not rounded
    to bf16) is checked at rtol = atol = 4e-3: tf32 puts it ~5e-4 from float64, while
    a wrong product, or bf16 operands (2**-9 per term), would exceed it.
  * raw records are copies: bit for bit. Triton against Triton (flush fold vs fold
    kernel, circular vs fold strategy, graph replay vs eager): bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.ops import RawRecords, advance_cursors, gdn_chunked_window, gdn_fold, tuning
from replayssm.ops.gates import expand_heads
from replayssm.ops.records import keys_normalized, stored_keys, unit_keys
from replayssm.ops.ring_decode import gdn_ring_decode
from replayssm.state import GDNShape, StatePool

pytestmark = pytest.mark.gpu

H, K, V, L = 16, 128, 128, 16
HV_POOL, REQUESTS, STEPS = 32, 8, 48  # the strategy-level comparison
DEV = "cuda"
COPY_BANDWIDTH = 4.27e12  # bytes/s, H200 (DESIGN.md section 4)


def tol(ref, *dtypes):
    """Tolerances for comparing with ``ref`` (see the module notes), 16-bit ones against
    ``ref``'s scale."""
    if torch.bfloat16 not in dtypes:
        return dict(rtol=1e-4, atol=1e-4)
    scale = ref.double().nan_to_num(0.0).abs().max().item()
    return dict(rtol=2**-7, atol=2**-7 * scale)


def same(a, b):
    """Bitwise equality with NaN == NaN (never-written scratch)."""
    return a.shape == b.shape and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def same_keys(k_t, k_64):
    """A Triton run's ring keys against the float64 reference run's, whose float64 ring
    holds raw keys (``ops.records.keys_normalized``): in a 16-bit ring raw copies, bit for
    bit; in an fp32 ring the window's keys normalised and the history's unit keys as they
    were, against the float64 run's normalised (a unit key moves by 5e-7 there, the eps):
    within 1e-6, the same entries NaN."""
    if not keys_normalized(k_t.dtype):
        return same(k_t.double(), k_64)
    want = unit_keys(k_64, torch.float64)
    return torch.equal(k_t.isnan(), want.isnan()) and torch.allclose(
        k_t.double().nan_to_num(0.0), want.nan_to_num(0.0), rtol=1e-6, atol=1e-6)


def make_case(hv, t, batch, state_dtype, act_dtype, *, flush="mixed", pad=True, key_dtype=torch.float32):
    """Buffers of ``batch + 3`` slots with random cursors and histories, and a packed
    batch of windows (``1..t`` tokens, the first row ``t``; one padding row). The ring's
    keys are ``key_dtype``: normalised in fp32 (a pool's ring), raw in 16 bits
    (``ops.records.keys_normalized``)."""
    ns = batch + 3
    lengths = torch.randint(1, t + 1, (batch,)).tolist()
    lengths[0] = t
    slots = torch.randperm(ns)[:batch]
    if pad and batch > 1:
        slots[int(torch.randint(1, batch, ()))] = -1
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    n = cu[-1].item()
    a = torch.randn(n, hv, device=DEV)
    a[torch.rand(n, hv, device=DEV) < 0.05] += 25.0  # the softplus threshold branch
    x = dict(
        q=torch.randn(n, H, K, device=DEV).to(act_dtype),
        k=torch.randn(n, H, K, device=DEV).to(act_dtype),
        v=torch.randn(n, hv, V, device=DEV).to(act_dtype),
        a=a.to(act_dtype),
        b=(torch.randn(n, hv, device=DEV) * 2).to(act_dtype),
        A_log=torch.empty(hv, device=DEV).uniform_(-3, -0.3),
        dt_bias=torch.randn(hv, device=DEV) * 0.5,
    )
    live = [s for s in slots.tolist() if s >= 0]
    write_pos = torch.randint(0, L - t + 1, (ns,), device=DEV, dtype=torch.int32)
    write_pos[live[0]] = L - t  # the longest history always runs (non-flush unless flush="all")
    cache_base = torch.randint(0, L, (ns,), device=DEV, dtype=torch.int32)
    if flush == "all":
        is_flush = torch.ones(ns, device=DEV, dtype=torch.int32)
    else:
        is_flush = (torch.rand(ns, device=DEV) < 0.5).to(torch.int32)
        is_flush[live[0]] = 0
        if len(live) > 1:
            is_flush[live[-1]] = 1
    ring = RawRecords(
        stored_keys(torch.randn(ns, L, H, K, device=DEV), key_dtype).to(key_dtype),
        torch.randn(ns, L, hv, V, device=DEV).to(act_dtype),
        -torch.empty(ns, L, hv, device=DEV).uniform_(0.02, 1.0),
        torch.rand(ns, L, hv, device=DEV),
    )
    ring_u = torch.randn(ns, L, hv, V, device=DEV) * 0.5
    logical = (torch.arange(L, device=DEV)[None, :] - cache_base[:, None].long()) % L
    unused = logical >= write_pos[:, None]  # [ns, L]: no committed record there
    for buf in (*ring, ring_u):
        buf[unused] = float("nan")
    checkpoint = (torch.randn(ns, hv, V, K, device=DEV) * 0.1).to(state_dtype)
    return dict(
        x=x, checkpoint=checkpoint, ring=ring, ring_u=ring_u,
        cursors=(slots.to(torch.int32).to(DEV), cu, write_pos, cache_base, is_flush), t=t,
    )


def with_consistent_u(case):
    """The case with every history record's ``u`` the recurrence's own corrected delta
    (float64, from the checkpoint through the raw records, as a pool's verifies leave
    it): the closed form reads the history by ``u``, the replay method by raw records,
    and on such a ring they describe the same committed state."""
    ring, ring_u = case["ring"], case["ring_u"].clone()
    _, _, write_pos, cache_base, _ = case["cursors"]
    ns, hv = ring_u.shape[0], ring_u.shape[2]
    rows = torch.arange(ns, device=DEV)
    S = case["checkpoint"].double()
    for c in range(int(write_pos.max())):
        pos = (cache_base.long() + c) % L
        live = c < write_pos
        k_hat = expand_heads(unit_keys(ring.k[rows, pos].nan_to_num(0.0), torch.float64), hv)  # [ns, HV, K]
        g, beta = ring.g[rows, pos].double().nan_to_num(0.0), ring.beta[rows, pos].double().nan_to_num(0.0)
        S2 = torch.exp(g)[..., None, None] * S
        u = beta[..., None] * (ring.v[rows, pos].double().nan_to_num(0.0) - torch.einsum("nhvk,nhk->nhv", S2, k_hat))
        S = torch.where(live[:, None, None, None], S2 + u[..., None] * k_hat[:, :, None, :], S)
        ring_u[rows[live], pos[live]] = u[live].float()
    return dict(case, ring_u=ring_u)


def run(case, backend, dtype=None, method=None):
    cv = (lambda y: y.clone()) if dtype is None else (lambda y: y.to(dtype))
    ins = [case["x"][n] if dtype is None else case["x"][n].to(dtype) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]
    ckpt, ring, ring_u = cv(case["checkpoint"]), RawRecords(*(cv(y) for y in case["ring"])), cv(case["ring_u"])
    if method == "decode":  # one-token windows through the ring decoding op
        o = gdn_ring_decode(*ins, ckpt, ring, ring_u, *case["cursors"], backend=backend)
    else:
        o = gdn_chunked_window(*ins, ckpt, ring, ring_u, *case["cursors"], max_len=case["t"], method=method,
                               backend=backend)
    return o, ckpt, ring, ring_u


# (HV, T, batch, checkpoint dtype, activation dtype)
CASES = [
    (32, 2, 1, torch.float32, torch.bfloat16),
    (32, 4, 64, torch.float32, torch.bfloat16),
    (32, 8, 256, torch.float32, torch.float32),
    (32, 5, 128, torch.bfloat16, torch.bfloat16),
    (64, 3, 16, torch.bfloat16, torch.bfloat16),
    (64, 6, 256, torch.float32, torch.bfloat16),
    (64, 8, 5, torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("method", ["closed_form", "replay"])
@pytest.mark.parametrize("hv,t,batch,state_dtype,act_dtype", CASES)
def test_chunked_window_matches_float64_oracle(hv, t, batch, state_dtype, act_dtype, method):
    """Both methods against the float64 closed form, on rings whose ``u`` agree with
    their records (the replay method reads the records; see :func:`with_consistent_u`).
    The replay method's products are fp32 FMA at every activation dtype."""
    case = with_consistent_u(make_case(hv, t, batch, state_dtype, act_dtype))
    o_t, ck_t, ring_t, u_t = run(case, "triton", method=method)
    o_64, ck_64, ring_64, u_64 = run(case, "reference", torch.float64)
    torch.testing.assert_close(o_t.double(), o_64, **tol(o_64, state_dtype, act_dtype))
    slots, cu = case["cursors"][0].tolist(), case["cursors"][1].tolist()
    for i, s in enumerate(slots):
        if s < 0:
            assert torch.equal(o_t[cu[i]:cu[i + 1]], torch.zeros_like(o_t[cu[i]:cu[i + 1]])), "padding row output"
    # Ring: copies exact, keys as their ring stores them; gates and u close; never-written
    # entries keep their NaN.
    assert same_keys(ring_t.k, ring_64.k) and same(ring_t.v.double(), ring_64.v)
    for got, want, tt in ((ring_t.g, ring_64.g, dict(rtol=1e-5, atol=1e-5)),
                          (ring_t.beta, ring_64.beta, dict(rtol=1e-5, atol=1e-5)),
                          (u_t, u_64, tol(u_64, state_dtype, act_dtype))):
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got.double().nan_to_num(0.0), want.nan_to_num(0.0), **tt)
    if state_dtype == torch.float32 and act_dtype == torch.bfloat16:  # tf32 products, fp32 u
        torch.testing.assert_close(u_t.double().nan_to_num(0.0), u_64.nan_to_num(0.0), rtol=4e-3, atol=4e-3)
    # Checkpoints: flush rows folded, every other slot untouched.
    is_flush = case["cursors"][4].tolist()
    for s in range(ck_t.shape[0]):
        if s in slots and is_flush[s]:
            torch.testing.assert_close(ck_t[s].double(), ck_64[s], **tol(ck_64[s], state_dtype, act_dtype))
        else:
            assert torch.equal(ck_t[s], case["checkpoint"][s]), f"checkpoint of slot {s} changed"


@pytest.mark.parametrize("batch,state_dtype,act_dtype", [
    (256, torch.float32, torch.bfloat16), (64, torch.bfloat16, torch.bfloat16), (5, torch.float32, torch.float32),
    (1, torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("block_v", [64, 128])
@pytest.mark.parametrize("dot", [0, 1], ids=["fma", "dot"])
def test_ring_decode_matches_float64_oracle(batch, state_dtype, act_dtype, block_v, dot):
    """The ring decoding kernel (one token per request, histories of 0..L-1 records) against
    the float64 closed form; its flushed checkpoints bit for bit against the window op's
    (both the fold's replay), at two tile heights, with the products of the rows that do
    not flush by FMA or on tensor cores (``ring_decode.dot_products``, split or not)."""
    case = with_consistent_u(make_case(HV_POOL, 1, batch, state_dtype, act_dtype))
    choice = dict(dot_products=1, early_tile=0, split_flush=2 if batch >= 64 else 0) if dot else {}
    with tuning.override("ring_decode", block_v=block_v, token_block_v=block_v, **choice):
        o_t, ck_t, ring_t, u_t = run(case, "triton", method="decode")
    o_64, ck_64, ring_64, u_64 = run(case, "reference", torch.float64)
    torch.testing.assert_close(o_t.double(), o_64, **tol(o_64, state_dtype, act_dtype))
    torch.testing.assert_close(u_t.double().nan_to_num(0.0), u_64.nan_to_num(0.0), **tol(u_64, state_dtype, act_dtype))
    assert same_keys(ring_t.k, ring_64.k) and same(ring_t.v.double(), ring_64.v)
    assert torch.equal(ring_t.g.isnan(), ring_64.g.isnan())
    _, ck_w, ring_w, _ = run(case, "triton", method="closed_form")
    assert torch.equal(ck_t, ck_w)
    assert same(ring_t.g, ring_w.g) and same(ring_t.beta, ring_w.beta)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("param,value,dot", [("max_registers", 128, 0), ("max_registers", 168, 0), ("early_tile", 1, 0),
                                             ("split_flush", 1, 0), ("split_flush", 2, 0), ("split_flush", 1, 1),
                                             ("split_flush", 2, 1), ("max_registers", 128, 1)])
def test_ring_decode_launch_choices_change_no_bit(state_dtype, param, value, dot):
    """The ring decoding kernel under a register cap (``ring_decode.max_registers``; the
    compiler spills the tile instead), with its checkpoint tile loaded before the
    cursors (``ring_decode.early_tile = 1``, the table's choice from batch 33) or with
    the flush rows in a kernel of their own (``ring_decode.split_flush``, in order with the
    token kernel or beside it on a side stream; both kernels at the one launch's tile height,
    so every row keeps its lanes) gives the kernel's outputs, ``u`` and folded
    checkpoints without it (the entry at 0) bit for bit, on histories of 0..L-1 records
    with flush rows, with the other rows' products by FMA or on tensor cores
    (``dot_products``; its checkpoint streams, so the tile is never loaded early)."""
    products = dict(dot_products=dot, **({"early_tile": 0} if dot else {}))
    # Split, the rows that do not flush take the token kernel's tile (token_block_v); at
    # another height than the one launch's their history sums in another order. Held at
    # the one launch's, every row keeps its lanes.
    row = tuning.lookup("ring_decode", K=128, V=128, state_dtype=state_dtype, batch=64, device="cuda")
    products["token_block_v"] = row["block_v"]
    _decode_bits_equal(state_dtype, dict(products, **{param: value}), dict(products, **{param: 0}))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_v", [16, 32, 128])
def test_ring_decode_flush_on_two_warps_keeps_its_bits(state_dtype, block_v):
    """The rows-apart flush kernel on 2 warps (``ring_decode.flush_warps = 2``) at several
    flush tile heights: outputs, ``u`` and folded checkpoints bit for bit those of the
    same split on 4 warps (the K axis keeps its lanes; rows a warp holds differ)."""
    split = dict(split_flush=1, block_v=block_v)
    _decode_bits_equal(state_dtype, dict(split, flush_warps=2), dict(split, flush_warps=4))


def _decode_bits_equal(state_dtype, choice: dict, base: dict) -> None:
    """Ring decoding under the table entries ``choice`` and ``base`` (histories of 0..L-1
    records, flush rows): outputs, ``u`` and folded checkpoints bit for bit."""
    case = make_case(HV_POOL, 1, 64, state_dtype, torch.bfloat16, pad=False)
    with tuning.override("ring_decode", **choice):
        got = run(case, "triton", method="decode")
    with tuning.override("ring_decode", **base):
        want = run(case, "triton", method="decode")
    assert same(got[0], want[0]), "outputs differ"
    assert same(got[3], want[3]), "u differs"
    assert torch.equal(got[1], want[1]), "checkpoints differ"
    assert not torch.equal(got[1], case["checkpoint"]), "no row flushed"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("warps,block_v,cap", [(8, 128, 0), (8, 128, 128), (2, 64, 0), (1, 32, 0)])
def test_ring_decode_on_other_warp_counts_keeps_the_flush_bits(state_dtype, warps, block_v, cap):
    """The ring decoding kernel, one launch, on 8 warps (with or without a register cap),
    2 or 1 (``ring_decode.num_warps``; the tile's rows per warp as at 4 warps and 128
    rows): its folded checkpoints are the 4-warp kernel's bit for bit, and so the fold's;
    its outputs and ``u`` agree with the 4-warp kernel's to fp32 rounding (the history's
    sums over records change order), far below the values' scale."""
    case = with_consistent_u(make_case(HV_POOL, 1, 64, state_dtype, torch.bfloat16, pad=False))
    with tuning.override("ring_decode", num_warps=warps, max_registers=cap, block_v=block_v, split_flush=0):
        o_w, ck_w, ring_w, u_w = run(case, "triton", method="decode")
    o4, ck4, ring4, u4 = run(case, "triton", method="decode")
    assert not torch.equal(ck4, case["checkpoint"]), "no row flushed"
    assert torch.equal(ck_w, ck4), "checkpoints differ"
    assert same(ring_w.g, ring4.g) and same(ring_w.beta, ring4.beta) and same(ring_w.k, ring4.k)
    scale = o4.float().abs().max().item()
    assert scale > 1e-3, "outputs too small to compare"  # the case's outputs peak near 0.07
    torch.testing.assert_close(o_w.float(), o4.float(), rtol=0, atol=1e-2 * scale)  # bf16 outputs: an ulp or two
    u_scale = u4.nan_to_num(0.0).abs().max().item()
    torch.testing.assert_close(u_w.nan_to_num(0.0), u4.nan_to_num(0.0), rtol=0, atol=1e-5 * u_scale)


@pytest.mark.parametrize("method", ["closed_form", "replay"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_flush_fold_is_the_fold_kernel_bit_for_bit(state_dtype, act_dtype, method):
    """Every row flushes: the folded checkpoints equal the fold kernel's on the same
    records, with either method (the replay method folds in its own kernel)."""
    case = make_case(HV_POOL, 4, 64, state_dtype, act_dtype, flush="all", pad=False)
    _, ck_t, _, _ = run(case, "triton", method=method)
    slots, _, write_pos, cache_base, _ = case["cursors"]
    ck_f = case["checkpoint"].clone()
    r = case["ring"]
    idx = slots.long()
    gdn_fold(ck_f[None], r.k[None], r.v[None], r.g[None], r.beta[None], slots, cache_base[idx], write_pos[idx], backend="triton")
    assert torch.equal(ck_t, ck_f)
    assert not torch.equal(ck_t, case["checkpoint"])


@pytest.mark.parametrize("state_dtype,replay_max_batch", [(torch.float32, 0), (torch.float32, 256), (torch.bfloat16, 256)],
                         ids=["fp32-closed_form", "fp32-replay", "bf16-replay"])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_circular_committed_state_equals_fold_strategy_bit_for_bit(act_dtype, state_dtype, replay_max_batch):
    """Two Triton pools, ``circular`` and ``fold``, fed the same tokens and acceptances
    for STEPS steps (several flushes per request): the committed states are identical at
    every step. Circular's checkpoint is folded by this kernel at flushes and the rest of
    its history by the fold kernel; fold's by the fold kernel at every commit; both
    replay the same raw records through the same exact step. ``replay``: circular's
    small-batch mode forced on (one-launch verify, a flush at every commit). bf16 states
    only there: a 16-bit checkpoint is rounded where it is stored, after every commit's
    records for fold and for circular's small-batch mode, after a whole history for its
    closed-form mode, so that mode matches fold bit for bit in fp32 only."""
    with tuning.override("circular", replay_max_batch=replay_max_batch):
        _circular_vs_fold(act_dtype, state_dtype)


def _circular_vs_fold(act_dtype, state_dtype):
    hv, window, requests = HV_POOL, 4, REQUESTS
    shape = GDNShape(num_heads=H, num_value_heads=hv, head_k_dim=K, head_v_dim=V)
    pools = {}
    params = dict(
        A_log=torch.empty(hv).uniform_(-3, -0.3), dt_bias=torch.randn(hv) * 0.5,
        conv_weight=torch.randn(shape.conv_dim, shape.conv_kernel) * 0.5,
    )
    for name in ("circular", "fold"):
        pool = StatePool(shape, 1, requests, strategy=name, window=window, ring_len=L, act_dtype=act_dtype,
                         state_dtype=state_dtype, device=DEV, backend="triton")
        pool.set_layer_params(0, **params)
        pools[name] = pool
        slots = [pool.alloc() for _ in range(requests)]
    init = (torch.randn(pools["fold"].buffers["checkpoints"].shape, device=DEV) * 0.1).to(state_dtype)
    for pool in pools.values():
        pool.buffers["checkpoints"].copy_(init)
    flushes = 0
    for step in range(STEPS):
        lengths = torch.randint(1, window + 1, (requests,)).tolist()
        n = sum(lengths)
        ins = [torch.randn(n, H, K, device=DEV).to(act_dtype), torch.randn(n, H, K, device=DEV).to(act_dtype),
               torch.randn(n, hv, V, device=DEV).to(act_dtype), torch.randn(n, hv, device=DEV).to(act_dtype),
               (torch.randn(n, hv, device=DEV) * 2).to(act_dtype)]
        accepted = [int(torch.randint(1, m + 1, ())) for m in lengths]
        flushes += int(pools["circular"].buffers["is_flush"][slots].sum())
        for pool in pools.values():
            batch = pool.batch(slots, lengths)
            pool.strategy.verify(0, *ins, batch)
            pool.strategy.commit(batch, accepted)
        circ = pools["circular"].strategy.committed_state(0, slots)
        fold = pools["fold"].strategy.committed_state(0, slots)
        assert torch.equal(circ, fold), f"step {step}: committed states differ"
    assert flushes >= requests, "every request should have flushed at least once"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch,tail", [(16, 16), (256, 256), (256, 16)], ids=["16-first", "256-first", "256-tail16"])
def test_short_tail_changes_no_bit(state_dtype, batch, tail):
    """The outputs kernel's grid with short programs last (``closed_form.short_tail``:
    every folding row first, or the last 16 rows that do not fold moved to the end)
    against its grid in batch order: outputs, checkpoints, records and ``u`` bit for bit
    (each row runs the same code wherever the grid puts it), with padding rows and about
    half the rows folding. Fresh inputs each round."""
    for _ in range(3):
        case = make_case(32, 4, batch, state_dtype, torch.bfloat16, pad=True)
        got = {}
        for t in (0, tail):
            with tuning.override("closed_form", short_tail=t):
                got[t] = run(case, "triton", method="closed_form")
        assert not torch.equal(got[tail][1], case["checkpoint"])
        for i, name in ((0, "outputs"), (1, "checkpoints"), (3, "u")):
            assert same(got[tail][i], got[0][i]), name
        assert all(same(a, b) for a, b in zip(got[tail][2], got[0][2])), "records differ"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [16, 64])
@pytest.mark.parametrize("warps,block_v", [(2, 32), (2, 64)], ids=["2x32", "2x64"])
def test_closed_form_on_other_warp_counts_keeps_the_flush_bits(state_dtype, batch, warps, block_v):
    """The outputs kernel on 2 warps (``closed_form.num_warps``, through
    ``exact_warps``) on tiles of ``block_v`` rows: the folded checkpoints and the raw
    records are the 4-warp kernel's bit for bit (the fold's rows keep their layout), so
    the fold kernel's; outputs and ``u`` agree to the window products' tf32 rounding on
    other tile heights (measured 1.1e-3 of the outputs' largest value on 32-row tiles;
    bound 5e-3, the early-tile test's). About half the rows fold; fresh inputs. (On
    1 warp and 16 rows the checkpoints differed: the table refuses 1 warp here.)"""
    case = make_case(32, 4, batch, state_dtype, torch.bfloat16, pad=True)
    with tuning.override("closed_form", num_warps=warps, block_v=block_v, flush_block_v=block_v, early_tile=0):
        got = run(case, "triton", method="closed_form")
    with tuning.override("closed_form", num_warps=4, block_v=64, early_tile=0):
        want = run(case, "triton", method="closed_form")
    assert not torch.equal(want[1], case["checkpoint"]), "no row folded"
    assert same(got[1], want[1]), "checkpoints differ"
    assert all(same(a, b) for a, b in zip(got[2], want[2])), "records differ"
    for i, name in ((0, "outputs"), (3, "u")):
        g, w = got[i].float().nan_to_num(), want[i].float().nan_to_num()
        assert w.abs().max() > 1e-3, f"{name} too small to compare"
        assert (g - w).abs().max() <= 5e-3 * w.abs().max(), name


@pytest.mark.parametrize("method", ["closed_form", "replay"])
def test_cuda_graph_replay_of_a_circular_step(method):
    """One circular layer-step (this kernel) plus the commit's cursor update, captured in
    a CUDA graph and replayed on fresh inputs: outputs and every buffer equal the eager
    twin's bit for bit, flushes included (``replay``: with a flush at every commit)."""
    hv, t, batch = 32, 4, 16
    case = make_case(hv, t, batch, torch.float32, torch.bfloat16, pad=True)
    slots, cu, write_pos, cache_base, is_flush = case["cursors"]
    write_pos.zero_()
    is_flush.zero_()
    lengths = (cu[1:] - cu[:-1]).tolist()
    ins = {n: case["x"][n].clone() for n in ("q", "k", "v", "a", "b")}
    accepted = torch.tensor([t] + [max(1, m - 1) for m in lengths[1:]], dtype=torch.int32, device=DEV)
    A_log, dt_bias = case["x"]["A_log"], case["x"]["dt_bias"]

    def state(ckpt, ring, ring_u, wp, base, fl):
        return dict(ckpt=ckpt, ring=ring, ring_u=ring_u, wp=wp, base=base, fl=fl)

    def step(st):
        o = gdn_chunked_window(ins["q"], ins["k"], ins["v"], ins["a"], ins["b"], A_log, dt_bias, st["ckpt"], st["ring"],
                               st["ring_u"], slots, cu, st["wp"], st["base"], st["fl"], max_len=t, method=method,
                               backend="triton")
        advance_cursors(st["wp"], st["base"], st["fl"], slots, accepted, t, L, flush_every=method == "replay",
                        backend="triton")
        return o

    def clone(st):
        return {k: (RawRecords(*(y.clone() for y in v)) if k == "ring" else v.clone()) for k, v in st.items()}

    graphed = state(case["checkpoint"], case["ring"], case["ring_u"], write_pos, cache_base, is_flush)
    eager = clone(graphed)
    step(clone(graphed))  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o_static = step(graphed)
    flushed = 0
    for _ in range(8):
        for name, x in ins.items():
            x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype))
        flushed += int(graphed["fl"][slots[slots >= 0].long()].sum())
        g.replay()
        o_eager = step(eager)
        torch.cuda.synchronize()
        assert same(o_static, o_eager)
        for k in graphed:
            pairs = zip(graphed[k], eager[k]) if k == "ring" else [(graphed[k], eager[k])]
            assert all(same(a, b) for a, b in pairs), f"{k} differs between replay and eager"
    assert flushed > 0, "the replays must include a flush"



@pytest.mark.parametrize("hv,t,batch,state_dtype", [(32, 4, 64, torch.float32), (32, 8, 256, torch.bfloat16)])
def test_closed_form_with_fp32_coefficient_products(hv, t, batch, state_dtype):
    """The outputs kernel's small products with the coefficients as fp32 FMA
    (``closed_form.tf32_coefficients = 0``; the default, tf32, is what the oracle test
    above runs with 16-bit activations): outputs within the bf16 tolerance of the
    float64 oracle, and the window's fp32 ``u`` within the tf32 bound of the module
    notes (4e-3), which the state's own tf32 products set."""
    case = with_consistent_u(make_case(hv, t, batch, state_dtype, torch.bfloat16))
    with tuning.override("closed_form", tf32_coefficients=0):
        o_t, _, _, u_t = run(case, "triton", method="closed_form")
    o_64, _, _, u_64 = run(case, "reference", torch.float64)
    torch.testing.assert_close(o_t.double(), o_64, **tol(o_64, state_dtype, torch.bfloat16))
    assert torch.equal(u_t.isnan(), u_64.isnan())
    torch.testing.assert_close(u_t.double().nan_to_num(0.0), u_64.nan_to_num(0.0), rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("batch,state_dtype", [(16, torch.float32), (64, torch.bfloat16), (256, torch.float32)])
def test_dependent_launch_equals_ordered_launch(batch, state_dtype):
    """The outputs kernel launched as the coefficient kernel's programmatic dependent
    (the default on this GPU) against the same kernels in stream order: outputs and
    every buffer bit for bit, on fresh inputs each round. The dependent run goes first,
    so its coefficient buffer (the allocator's reused block) still holds the previous
    round's coefficients: a read before the wait would show."""
    from replayssm.ops.triton_common import dependent_launch

    assert dependent_launch(torch.device(DEV)), "this GPU should allow dependent launches"
    for _ in range(4):
        case = make_case(32, 4, batch, state_dtype, torch.bfloat16)
        with tuning.override("closed_form", dependent_launch=1):
            got = run(case, "triton", method="closed_form")
        with tuning.override("closed_form", dependent_launch=0):
            want = run(case, "triton", method="closed_form")
        assert same(got[0], want[0]), "outputs differ"
        assert same(got[1], want[1]), "checkpoints differ"
        assert all(same(a, b) for a, b in zip(got[2], want[2])), "raw records differ"
        assert same(got[3], want[3]), "u differs"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("param,cap", [("max_registers", 128), ("coef_max_registers", 128),
                                       ("coef_max_registers", 96)])
def test_register_cap_changes_no_bit(state_dtype, param, cap):
    """The outputs kernel or the coefficient kernel under a register cap
    (``closed_form.max_registers`` / ``coef_max_registers``: the compiler spills
    instead) computes what it computes uncapped, bit for bit, flush rows (the fold's
    checkpoints) included; the folded checkpoints are still the fold kernel's."""
    case = make_case(32, 4, 64, state_dtype, torch.bfloat16, pad=False)
    with tuning.override("closed_form", **{param: cap}):
        capped = run(case, "triton", method="closed_form")
    with tuning.override("closed_form", **{param: 0}):
        free = run(case, "triton", method="closed_form")
    assert same(capped[0], free[0]), "outputs differ"
    assert same(capped[1], free[1]), "checkpoints differ"
    assert same(capped[3], free[3]), "u differs"
    slots, _, write_pos, cache_base, is_flush = case["cursors"]
    ck_f = case["checkpoint"].clone()
    r = case["ring"]
    idx = slots.long()
    count = torch.where(is_flush[idx] != 0, write_pos[idx], 0)  # only the flush rows fold
    gdn_fold(ck_f[None], r.k[None], r.v[None], r.g[None], r.beta[None], slots, cache_base[idx], count, backend="triton")
    assert torch.equal(capped[1], ck_f)
    assert not torch.equal(capped[1], case["checkpoint"])


PRODUCT_DTYPES = pytest.mark.parametrize("state_dtype,act_dtype", [(torch.float32, torch.bfloat16),
                                                                    (torch.bfloat16, torch.bfloat16),
                                                                    (torch.float32, torch.float32)],
                                         ids=["fp32", "bf16", "fp32_acts"])


def check_products_only(choice: dict, base: dict, state_dtype, act_dtype):
    """The closed form under the table overrides ``choice`` against ``base``, where the
    two differ only in how a non-flush row sums ``S0 x``: the folded checkpoints and
    the raw records are the same bit for bit (so the fold kernel's), and some row
    folded; outputs and ``u`` agree to the products' rounding (relative error under
    1e-5 in fp32 products, 5e-3 in tf32; scale: the values' largest); ``choice``'s
    outputs match the float64 reference. Fresh inputs, batch 64, about half the rows
    folding."""
    case = make_case(32, 4, 64, state_dtype, act_dtype, pad=True)
    with tuning.override("closed_form", **choice):
        got = run(case, "triton", method="closed_form")
    with tuning.override("closed_form", **base):
        want = run(case, "triton", method="closed_form")
    assert same(got[1], want[1]), "checkpoints differ"
    assert not torch.equal(got[1], case["checkpoint"]), "no row folded"
    assert all(same(a, b) for a, b in zip(got[2], want[2])), "records differ"
    rel = 1e-5 if act_dtype == torch.float32 else 5e-3
    for g, w, name in ((got[0], want[0], "outputs"), (got[3], want[3], "u")):
        g, w = g.float().nan_to_num(), w.float().nan_to_num()
        assert w.abs().max() > 1e-3, f"{name} too small to compare"
        assert (g - w).abs().max() <= rel * w.abs().max(), name
    ref = run(case, "reference", dtype=torch.float64)
    torch.testing.assert_close(got[0].double(), ref[0], **tol(ref[0], state_dtype, act_dtype))


@PRODUCT_DTYPES
def test_one_key_chunk_keeps_the_checkpoints_and_the_outputs(state_dtype, act_dtype):
    """A non-flush row's ``S0 x`` in one 128-key chunk (``closed_form.k_chunk = 128``,
    the table's from batch 33) against two 64-key chunks (:func:`check_products_only`:
    the fold does not use the chunks)."""
    check_products_only(dict(k_chunk=128), dict(k_chunk=64), state_dtype, act_dtype)


@PRODUCT_DTYPES
def test_early_tile_keeps_the_checkpoints_and_the_outputs(state_dtype, act_dtype):
    """Every row's checkpoint tile loaded before its cursors (``closed_form.early_tile =
    1``) against the pipelined pass (:func:`check_products_only`): a non-flush row's
    ``S0 x`` is summed over four 32-key parts instead of the table's key chunks, and a
    flush row's fold is the pipelined kernel's."""
    check_products_only(dict(early_tile=1), dict(early_tile=0), state_dtype, act_dtype)
