"""Plain decoding through ``circular``'s ring on the Triton path (DESIGN.md section 9).

Without a GPU these run under the Triton interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``) in fp32 at small shapes; on a CUDA machine the compiled kernels.

* The committed state of a Triton pool after every step (plain ring steps with a few
  speculative ones between them, flushes included) equals the Triton recurrence run
  over the committed tokens, bit for bit: a flush replays the raw records through the
  exact step the recurrence kernel takes.
* Outputs equal a reference pool's, fed the same tokens, within ``rtol = atol = 1e-5``
  (the closed form in fp32 in another association order, and Triton's ``exp`` a few ulp
  from torch's: ~1e-7 on these O(1) values; a wrong record is off by O(0.1)).
* The ring decoding kernel (what ``decode`` launches) against the window op on
  one-token windows: flushed checkpoints bit for bit, outputs and records to rounding.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from replayssm.ops import RawRecords, gdn_chunked_window, gdn_recurrence, triton_common, tuning  # noqa: E402
from replayssm.ops.ring_decode import gdn_ring_decode  # noqa: E402
from replayssm.ops.records import stored_keys  # noqa: E402
from replayssm.state import GDNShape, StatePool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_common.INTERPRETER:
    pytest.skip("CPU run without TRITON_INTERPRET=1 at import time", allow_module_level=True)

TOL = dict(rtol=1e-5, atol=1e-5)
SHAPE = GDNShape(num_heads=1, num_value_heads=1, head_k_dim=16, head_v_dim=8)


def rand_tokens(n, gen):
    s = SHAPE
    return [(torch.randn(n, *shape, generator=gen) * scale).to(DEVICE) for shape, scale in (
        ((s.num_heads, s.head_k_dim), 1.0), ((s.num_heads, s.head_k_dim), 1.0),
        ((s.num_value_heads, s.head_v_dim), 1.0), ((s.num_value_heads,), 1.0), ((s.num_value_heads,), 2.0))]


def two_requests(window, ring_len, gen):
    """A reference and a Triton circular pool with the same layer parameters and two
    requests each: ``(pools by backend, the live slots, the Triton pool's parameters)``."""
    pools = {be: StatePool(SHAPE, 1, 3, strategy="circular", window=window, ring_len=ring_len, backend=be,
                           device=DEVICE) for be in ("reference", "triton")}
    params = dict(A_log=torch.empty(1).uniform_(-2, -0.5, generator=gen), dt_bias=torch.randn(1, generator=gen) * 0.5,
                  conv_weight=torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel, generator=gen))
    for pool in pools.values():
        pool.set_layer_params(0, **params)
        live = [pool.alloc(), pool.alloc()]
    return pools, live, pools["triton"].layer_params(0)


@pytest.mark.parametrize("small_batch", [False, True], ids=["closed_form", "replay"])
def test_triton_plain_ring_steps_are_the_triton_recurrence(small_batch):
    """20 steps on 2 requests (T = 2, L = 8: a pure plain request flushes every 5
    steps), every fourth step speculative with random acceptance. ``replay``: the
    small-batch kernel (one launch, a flush at every commit)."""
    gen = torch.Generator().manual_seed(11)
    window, ring_len = 2, 8
    pools, live, p = two_requests(window, ring_len, gen)
    trit = pools["triton"]
    state = torch.zeros(2, 1, SHAPE.head_v_dim, SHAPE.head_k_dim, device=DEVICE)  # the recurrence's
    rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    flushes = 0
    with tuning.override("circular", replay_max_batch=64 if small_batch else 0):
        for step in range(20):
            spec = step % 4 == 3
            lengths = [int(torch.randint(1, window + 1, (), generator=gen)) for _ in live] if spec else [1, 1]
            accepted = [int(torch.randint(1, n + 1, (), generator=gen)) for n in lengths]
            x = rand_tokens(sum(lengths), gen)
            flushes += int(trit.buffers["is_flush"][live].sum())
            outs = {}
            for be, pool in pools.items():
                batch = pool.batch(live, lengths)
                if spec:
                    outs[be] = pool.strategy.verify(0, *x, batch)
                    pool.strategy.commit(batch, accepted)
                else:
                    outs[be] = pool.strategy.decode(0, *x, batch)
                    pool.strategy.commit(batch)
            torch.testing.assert_close(outs["triton"], outs["reference"], **TOL, msg=f"outputs, step {step}")
            keep = [t for i, n in enumerate(accepted) for t in range(sum(lengths[:i]), sum(lengths[:i]) + n)]
            cu = torch.tensor([0, accepted[0], sum(accepted)], dtype=torch.int32, device=DEVICE)
            gdn_recurrence(*(t[keep] for t in x), p["A_log"], p["dt_bias"], state, rows, cu, update_state=True,
                           max_len=window, backend="triton")
            got = trit.strategy.committed_state(0, live)
            assert torch.equal(got, state), f"committed state, step {step}: {(got - state).abs().max().item():.2e}"
            if small_batch:
                assert bool(trit.buffers["is_flush"][live].all()), "the small-batch path flushes at every commit"
    assert flushes >= (38 if small_batch else 6), flushes


@pytest.mark.parametrize("early_tile,split_flush,dot,flush_warps",
                         [(0, 0, 0, 4), (1, 0, 0, 4), (0, 1, 0, 4), (1, 2, 0, 4), (0, 0, 1, 4), (0, 2, 1, 4),
                          (0, 1, 0, 2)])
def test_ring_decode_kernel_against_the_window_op(early_tile, split_flush, dot, flush_warps):
    """``gdn_ring_decode`` (Triton) on one-token windows over histories of 0..7 records,
    flush and non-flush rows (one with no records: the token kernel's) and a padding
    row (V = 24: two 16-row blocks), with the checkpoint tile loaded before or after the
    cursors, in one launch or with the flush rows in their own kernel, the other rows'
    products by FMA or on tensor cores (``dot_products``), against
    ``gdn_chunked_window``: the
    flushed checkpoints bit for bit against the Triton window op's (both the fold's
    replay), outputs and ``u`` within ``TOL`` of the reference's (the history's sum in
    another order; these values are O(1)), the values exactly, keys and gates bit for bit
    the Triton window op's (the same helpers)."""
    gen = torch.Generator().manual_seed(3)
    h, hv, kd, vd, L, slots_n = 1, 2, 16, 24, 8, 6
    # Slots 0 and 4 fold (rows 2 and 4: the flush kernel's walk must skip row 3);
    # slot 2 raises is_flush with no records, so the token kernel takes it.
    slots = torch.tensor([3, -1, 0, 4, 1, 5, 2], dtype=torch.int32, device=DEVICE)
    cu = torch.arange(len(slots) + 1, dtype=torch.int32, device=DEVICE)
    x = [(torch.randn(len(slots), *sh, generator=gen) * sc).to(DEVICE)
         for sh, sc in (((h, kd), 1.0), ((h, kd), 1.0), ((hv, vd), 1.0), ((hv,), 1.0), ((hv,), 2.0))]
    A_log = torch.empty(hv).uniform_(-2, -0.5, generator=gen).to(DEVICE)
    dt_bias = (torch.randn(hv, generator=gen) * 0.5).to(DEVICE)
    checkpoint = (torch.randn(slots_n, hv, vd, kd, generator=gen) * 0.5).to(DEVICE)
    ring = RawRecords(stored_keys(torch.randn(slots_n, L, h, kd, generator=gen), torch.float32),
                      torch.randn(slots_n, L, hv, vd, generator=gen),
                      -torch.empty(slots_n, L, hv).uniform_(0.02, 1.0, generator=gen),
                      torch.rand(slots_n, L, hv, generator=gen))
    ring = RawRecords(*(t.to(DEVICE) for t in ring))
    ring_u = (torch.randn(slots_n, L, hv, vd, generator=gen) * 0.5).to(DEVICE)
    write_pos = torch.tensor([4, 2, 0, 3, 1, 7], dtype=torch.int32, device=DEVICE)
    cache_base = torch.tensor([5, 1, 7, 0, 3, 6], dtype=torch.int32, device=DEVICE)
    is_flush = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    results = {}
    def decode(*a):
        with tuning.override("ring_decode", early_tile=early_tile, split_flush=split_flush, dot_products=dot,
                             flush_warps=flush_warps):
            return gdn_ring_decode(*a, backend="triton")

    for name, run in (
        ("decode", decode),
        ("window", lambda *a: gdn_chunked_window(*a, max_len=1, method="closed_form", backend="triton")),
        ("reference", lambda *a: gdn_chunked_window(*a, max_len=1, backend="reference")),
    ):
        ck, rg, ru = checkpoint.clone(), RawRecords(*(t.clone() for t in ring)), ring_u.clone()
        o = run(*x, A_log, dt_bias, ck, rg, ru, slots, cu, write_pos, cache_base, is_flush)
        results[name] = dict(o=o, checkpoint=ck, ring=rg, ring_u=ru)
    got, ref = results["decode"], results["reference"]
    assert torch.equal(got["checkpoint"], results["window"]["checkpoint"]), "flushed checkpoints"
    assert not torch.equal(got["checkpoint"], checkpoint), "the flush rows must fold"
    torch.testing.assert_close(got["o"], ref["o"], **TOL)
    torch.testing.assert_close(got["ring_u"], ref["ring_u"], **TOL)
    assert not torch.equal(got["ring_u"], ring_u), "the token's u must be written"
    assert torch.equal(got["ring"].v, ref["ring"].v), "ring.v"
    # Triton's exp is a few ulp from torch's, and the key is normalised (an fp32 ring) by
    # each side: against the Triton window op, which normalises with the same helper
    for f in ("k", "g", "beta"):
        assert torch.equal(getattr(got["ring"], f), getattr(results["window"]["ring"], f)), f"ring.{f}"
    assert torch.equal(got["o"][1], torch.zeros_like(got["o"][1])), "padding row"


def _two_slot_ring(seed: int, tokens: int):
    """Random inputs of ``tokens`` tokens and a two-slot ring (H = HV = 1, K = 16, V = 8,
    L = 8): ``(x, params, checkpoint, ring, ring_u, before)``, ``before`` a copy of every
    buffer a failed call must leave as it was."""
    gen = torch.Generator().manual_seed(seed)
    h, hv, kd, vd, L = 1, 1, 16, 8, 8
    x = [(torch.randn(tokens, *sh, generator=gen)).to(DEVICE) for sh in ((h, kd), (h, kd), (hv, vd), (hv,), (hv,))]
    params = [torch.full((hv,), -1.0, device=DEVICE), torch.zeros(hv, device=DEVICE)]
    checkpoint = torch.randn(2, hv, vd, kd, generator=gen).to(DEVICE)
    ring = RawRecords(*(t.to(DEVICE) for t in (torch.randn(2, L, h, kd, generator=gen), torch.randn(2, L, hv, vd, generator=gen),
                                              -torch.rand(2, L, hv, generator=gen), torch.rand(2, L, hv, generator=gen))))
    ring_u = torch.randn(2, L, hv, vd, generator=gen).to(DEVICE)
    return x, params, checkpoint, ring, ring_u, [checkpoint.clone(), ring_u.clone(), *(t.clone() for t in ring)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ring_decode_refuses_a_window_of_two_tokens_before_writing(backend):
    x, params, checkpoint, ring, ring_u, before = _two_slot_ring(5, 3)
    cursors = [torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in ([1, 0], [0, 3], [0, 0])]
    with pytest.raises(ValueError, match="max_len|window"):
        gdn_ring_decode(*x, *params, checkpoint, ring, ring_u, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                        torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE), *cursors, backend=backend)
    for a, b in zip(before, [checkpoint, ring_u, *ring]):
        assert torch.equal(a, b)


def test_ring_decode_refuses_tensor_core_products_on_an_early_tile_before_writing():
    """``dot_products`` streams the checkpoint; ``early_tile`` holds it in registers: a
    table row with both is refused by name before any kernel runs."""
    x, params, checkpoint, ring, ring_u, before = _two_slot_ring(6, 2)
    cursors = [torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in ([3, 0], [1, 2], [1, 0])]
    with tuning.override("ring_decode", dot_products=1, early_tile=1), \
            pytest.raises(ValueError, match="dot_products.*early_tile"):
        gdn_ring_decode(*x, *params, checkpoint, ring, ring_u, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                        torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE), *cursors, backend="triton")
    for a, b in zip(before, [checkpoint, ring_u, *ring]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tree_replay", [False, True], ids=["closed_form", "path_replay"])
def test_triton_tree_steps_are_the_recurrence_along_the_accepted_paths(tree_replay):
    """Tree steps on a Triton circular pool (T = 4, L = 16), with plain ring steps
    between them, through the trees' closed form or their small-batch path (every
    leaf's root path replayed): after each step the committed state is the Triton
    recurrence over the committed tokens, bit for bit, and the outputs are a
    reference pool's fed the same tokens within ``TOL``; the path replay flushes
    every row at its commit."""
    from replayssm.ops import DraftTrees

    gen = torch.Generator().manual_seed(5)
    window, ring_len = 4, 16
    trees = DraftTrees.from_parents([[-1, 0, 0, 1], [-1, 0, 1, 0]], max_nodes=4)
    pools, live, p = two_requests(window, ring_len, gen)
    trit = pools["triton"]
    state = torch.zeros(2, 1, SHAPE.head_v_dim, SHAPE.head_k_dim, device=DEVICE)
    rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with tuning.override("circular", replay_max_batch=0, tree_replay_max_paths=64 if tree_replay else 0):
        for step in range(8):
            tree_step = step % 2 == 1
            n = trees.max_nodes if tree_step else 1
            x = rand_tokens(2 * n, gen)
            node = [int(torch.randint(0, int(c), (), generator=gen)) for c in trees.num_nodes] if tree_step else [0, 0]
            outs = {}
            for be, pool in pools.items():
                batch = pool.batch(live, n)
                if tree_step:
                    outs[be] = pool.strategy.verify_tree(0, *x, batch, trees)
                    pool.strategy.commit_tree(batch, trees, torch.tensor(node, dtype=torch.int32, device=DEVICE))
                else:
                    outs[be] = pool.strategy.decode(0, *x, batch)
                    pool.strategy.commit(batch)
            torch.testing.assert_close(outs["triton"], outs["reference"], **TOL, msg=f"outputs, step {step}")
            paths = [trees.path(r, node[r]) if tree_step else [0] for r in range(2)]
            keep = [r * n + i for r in range(2) for i in paths[r]]
            cu = torch.tensor([0, len(paths[0]), len(keep)], dtype=torch.int32, device=DEVICE)
            gdn_recurrence(*(t[keep] for t in x), p["A_log"], p["dt_bias"], state, rows, cu, update_state=True,
                           max_len=window, backend="triton")
            got = trit.strategy.committed_state(0, live)
            assert torch.equal(got, state), f"committed state, step {step}: {(got - state).abs().max().item():.2e}"
            if tree_step:
                assert bool(trit.buffers["is_flush"][live].all()) == tree_replay
