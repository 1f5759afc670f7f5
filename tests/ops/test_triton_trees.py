"""Tree kernels against their references (DESIGN.md section 2, "Trees").

Under the Triton interpreter without a GPU (fp32, tiny shapes); the compiled kernels on
a CUDA machine (tests/gpu/test_trees_gpu.py adds bf16 and larger heads there).

Tolerances: the closed form with the ancestor mask against the fp32 reference op,
``rtol = atol = 1e-5``, for the reasons tests/ops/test_triton_chunked.py gives (the same
kernels and sums over at most ``N = 8`` nodes of O(1) values, where a wrong mask is
off by O(0.1)); raw record copies and the gathers are bit for bit; exact recurrences
are bit for bit with each other on one device and within 1e-5 of the reference.
"""

from __future__ import annotations

import pytest
import torch
from layer_inputs import args, rand_layer

triton = pytest.importorskip("triton")

from replayssm.ops import DraftTrees, RawRecords, gdn_recurrence, triton_common, tuning  # noqa: E402
from replayssm.ops.chunked import gdn_chunked_window, gdn_tree_verify  # noqa: E402
from replayssm.ops.conv import causal_conv_verify, causal_conv_verify_tree  # noqa: E402
from replayssm.ops.gates import expand_heads  # noqa: E402
from replayssm.ops.records import stored_keys, unit_keys  # noqa: E402
from replayssm.ops.tree_ops import compact_path, gdn_tree_recurrence  # noqa: E402
from replayssm.ops.trees import accepted_paths  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_common.INTERPRETER:
    pytest.skip("CPU run without TRITON_INTERPRET=1 at import time", allow_module_level=True)

H, GROUP, KD, VD, L, N, NS = 2, 2, 16, 8, 32, 8, 6
HV = H * GROUP
TOL = dict(rtol=1e-5, atol=1e-5)
SHAPES = [
    DraftTrees.from_branching((2, 2)).parents[0].tolist(),  # 7 nodes
    [-1, 0, 0, 1, 1, 2, 4, 3],
    [-1, 0, 1],  # a short chain, padded
]


def case(parent_lists, seed, consistent_u=False):
    """Requests with the given trees (a padding request second) on random slots, with
    random histories (wrapping the ring), alternating flush rows, NaN everywhere in the
    ring outside the histories and NaN inputs on padded nodes. With ``consistent_u``
    every history record's ``u`` is the recurrence's own corrected delta (float64 from
    the checkpoint through the raw records, as a pool's verifies leave it), so reading
    a history by ``u`` (closed form) or by raw records (replay) gives one state."""
    torch.manual_seed(seed)
    lists = list(parent_lists)
    lists.insert(1, [-1])
    trees = DraftTrees.from_parents(lists, max_nodes=N)
    slots = torch.randperm(NS)[: trees.batch].to(torch.int32)
    slots[1] = -1
    nan = float("nan")
    ring = RawRecords(torch.full((NS, L, H, KD), nan), torch.full((NS, L, HV, VD), nan), torch.full((NS, L, HV), nan),
                      torch.full((NS, L, HV), nan))
    ring_u = torch.full((NS, L, HV, VD), nan)
    wp = torch.randint(0, L - N + 1, (NS,), dtype=torch.int32)
    base = torch.randint(0, L, (NS,), dtype=torch.int32)
    flush = (torch.arange(NS) % 2).to(torch.int32)
    for s in range(NS):
        pos = [(int(base[s]) + c) % L for c in range(int(wp[s]))]
        ring.k[s, pos] = stored_keys(torch.randn(len(pos), H, KD), ring.k.dtype)
        ring.v[s, pos] = torch.randn(len(pos), HV, VD)
        ring.g[s, pos] = -torch.rand(len(pos), HV)
        ring.beta[s, pos] = torch.rand(len(pos), HV)
        ring_u[s, pos] = torch.randn(len(pos), HV, VD) * 0.3
    x = rand_layer(trees.batch * N, H, HV, KD, VD)
    padded = ~trees.valid.reshape(-1)
    for f in "qkvab":
        x[f][padded] = nan
    ckpt = torch.randn(NS, HV, VD, KD) * 0.5
    if consistent_u:
        for s in range(NS):
            S = ckpt[s].double()
            for c in range(int(wp[s])):
                p = (int(base[s]) + c) % L
                k_hat = expand_heads(unit_keys(ring.k[s, p], torch.float64), HV)  # [HV, K]
                S = torch.exp(ring.g[s, p].double())[:, None, None] * S
                u = ring.beta[s, p].double()[:, None] * (ring.v[s, p].double() - torch.einsum("hvk,hk->hv", S, k_hat))
                S = S + u[:, :, None] * k_hat[:, None, :]
                ring_u[s, p] = u.float()
    state = dict(ckpt=ckpt, ring=ring, ring_u=ring_u, wp=wp, base=base, flush=flush)
    return trees, slots.to(DEVICE), {k: _to(v) for k, v in x.items()}, {k: _to(v) for k, v in state.items()}


def _to(x):
    return RawRecords(*(t.to(DEVICE) for t in x)) if isinstance(x, RawRecords) else x.to(DEVICE)


def _copy(st):
    return {k: _to(RawRecords(*(t.clone() for t in v))) if isinstance(v, RawRecords) else v.clone() for k, v in st.items()}


def run_tree(backend, trees, slots, x, st, method=None):
    return gdn_tree_verify(*args(x), st["ckpt"], st["ring"], st["ring_u"], slots, st["wp"], st["base"], st["flush"],
                           trees, max_len=N, method=method, backend=backend)


@pytest.mark.parametrize("method,short_tail", [("closed_form", 0), ("closed_form", 64), ("replay", 0)],
                         ids=["closed_form", "closed_form-flush_first", "replay"])
def test_tree_verify_matches_the_reference(method, short_tail):
    """Both methods: outputs (zeros on padded nodes and the padding request, whose
    inputs are NaN), folded checkpoints, records written where the nodes' window
    positions are and nowhere else. ``flush_first``: the closed form's outputs grid
    with the folding requests first (``closed_form.short_tail`` past the batch)."""
    trees, slots, x, st = case(SHAPES, seed=1, consistent_u=method == "replay")
    ref, tri = _copy(st), _copy(st)
    o_ref = run_tree("reference", trees, slots, x, ref)
    with tuning.override("closed_form", short_tail=short_tail):
        o_tri = run_tree("triton", trees, slots, x, tri, method=method)
    assert torch.isfinite(o_tri).all()
    torch.testing.assert_close(o_tri, o_ref, **TOL)
    torch.testing.assert_close(tri["ckpt"], ref["ckpt"], **TOL)  # flush rows folded
    # v copied bit for bit, k normalised by each side (an fp32 ring: a few ulp), NaN where
    # nothing was written
    torch.testing.assert_close(tri["ring"].v, ref["ring"].v, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(tri["ring"].k, ref["ring"].k, rtol=1e-6, atol=1e-7, equal_nan=True)
    for a, b in ((tri["ring"].g, ref["ring"].g), (tri["ring"].beta, ref["ring"].beta), (tri["ring_u"], ref["ring_u"])):
        torch.testing.assert_close(a, b, equal_nan=True, **TOL)


def test_tree_method_follows_the_shape_table(monkeypatch):
    """``method=None`` replays the leaf paths exactly when requests x leaf paths is at
    most the table's ``circular.tree_replay_max_paths``; the CUDA default's edge is 48."""
    from replayssm.ops import chunked as chunked_ops

    trees, slots, x, st = case(SHAPES, seed=6)  # 4 requests, at most 4 leaf paths each: 16
    calls = []
    monkeypatch.setattr(chunked_ops, "launch_tree_replay", lambda *a, **k: calls.append("replay"))
    monkeypatch.setattr(chunked_ops, "launch_closed_form", lambda *a, **k: calls.append("closed_form"))
    for most in (15, 16, 0):
        with tuning.override("circular", tree_replay_max_paths=most):
            run_tree("triton", trees, slots, x, _copy(st))
    assert calls == ["closed_form", "replay", "closed_form"]
    cuda = dict(kd=128, vd=128, state_dtype=torch.float32, device=torch.device("cuda"))
    assert chunked_ops.replays_tree(8, 6, **cuda) and not chunked_ops.replays_tree(7, 7, **cuda)


@pytest.mark.parametrize("method", ["closed_form", "replay"])
def test_chain_tree_is_the_chain_bit_for_bit(method):
    """A chain-shaped tree runs the chain's arithmetic in either method: ``closed_form``
    (TREE on with a chain's ancestor sets) against the chain's closed form, ``replay``
    (one leaf path a request, its flush rows folded in a launch of their own) against
    the chain's small-batch kernel. The same outputs (zeros for the padding request),
    records and folded checkpoints, bit for bit."""
    trees, slots, x, st = case([list(range(-1, N - 1))] * 2, seed=2)
    x = {k: torch.nan_to_num(v) for k, v in x.items()}  # full chains: no padded node, except the padding request
    chain, tree = _copy(st), _copy(st)
    cu = torch.arange(0, (trees.batch + 1) * N, N, dtype=torch.int32, device=DEVICE)
    o_chain = gdn_chunked_window(*args(x), chain["ckpt"], chain["ring"], chain["ring_u"], slots, cu, chain["wp"],
                                 chain["base"], chain["flush"], max_len=N, method=method, backend="triton")
    o_tree = run_tree("triton", DraftTrees.chain(N, batch=trees.batch), slots, x, tree, method=method)
    live = torch.repeat_interleave(slots >= 0, N)
    assert torch.equal(o_tree[live], o_chain[live]) and not o_tree[~live].any()
    assert torch.equal(tree["ckpt"], chain["ckpt"]) and not torch.equal(tree["ckpt"], st["ckpt"])
    for a, b in zip(list(tree["ring"]) + [tree["ring_u"]], list(chain["ring"]) + [chain["ring_u"]]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("load_ahead", [0, 1])
def test_tree_replay_nodes_are_their_root_paths_recurrence(load_ahead):
    """Each node's output from the trees' small-batch path is the Triton recurrence's
    along the node's root path from the row's folded state, bit for bit, whichever of
    the paths through the node stored it (a node on several paths is stepped by each),
    with each node's inputs loaded during the step before or at its own
    (``exact_read_only.load_ahead``)."""
    from replayssm.ops import tuning

    trees, slots, x, st = case(SHAPES, seed=5)
    st["flush"].fill_(1)  # every row folds first, so each path starts from the checkpoint
    tri = _copy(st)
    with tuning.override("exact_read_only", load_ahead=load_ahead):
        o_tri = run_tree("triton", trees, slots, x, tri, method="replay")
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for r in (0, 2, 3):
        s = int(slots[r])
        for node in range(int(trees.num_nodes[r])):
            rows = [r * N + p for p in trees.path(r, node)]
            cu = torch.tensor([0, len(rows)], dtype=torch.int32, device=DEVICE)
            o = gdn_recurrence(*(x[f][rows] for f in "qkvab"), x["A_log"], x["dt_bias"], tri["ckpt"][s:s + 1].clone(),
                               one, cu, update_state=True, max_len=N, backend="triton")
            assert torch.equal(o_tri[r * N + node], o[-1]), (r, node)


def _tree_recurrence(backend, trees, slots, x, st, method=None, fill=0.0):
    """Outputs, snapshots and records of the tree recurrence (fold's records and
    snapshot's states in one launch), into buffers filled with ``fill``."""
    snaps = torch.full((NS, N, HV, VD, KD), fill, device=DEVICE)
    rec = RawRecords(torch.full((NS, N, H, KD), fill, device=DEVICE), torch.full((NS, N, HV, VD), fill, device=DEVICE),
                     torch.full((NS, N, HV), fill, device=DEVICE), torch.full((NS, N, HV), fill, device=DEVICE))
    o = gdn_tree_recurrence(*args(x), st["ckpt"], slots, trees, snapshots=snaps, records=rec, method=method,
                            backend=backend)
    return o, snaps, rec


@pytest.mark.parametrize("method", ["stack", "paths"])
def test_tree_recurrence_and_conv_match_the_reference(method):
    trees, slots, x, st = case(SHAPES, seed=3)
    outs = {backend: _tree_recurrence(backend, trees, slots, x, st, method=method)
            for backend in ("reference", "triton")}
    (o_ref, snaps_ref, rec_ref), (o_tri, snaps_tri, rec_tri) = outs["reference"], outs["triton"]
    torch.testing.assert_close(o_tri, o_ref, **TOL)
    torch.testing.assert_close(snaps_tri, snaps_ref, **TOL)
    assert torch.equal(rec_tri.v, rec_ref.v)
    torch.testing.assert_close(rec_tri.k, rec_ref.k, rtol=1e-6, atol=1e-7)  # normalised by each side
    torch.testing.assert_close(rec_tri.g, rec_ref.g, **TOL)
    # nodes on two branches of the irregular tree, bit for bit the Triton recurrence
    # along their root paths (the same helpers, so the stack copies nothing wrong)
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    r, s = 2, int(slots[2])
    for node in (5, 6):
        rows = [r * N + p for p in trees.path(r, node)]
        st1 = st["ckpt"][s:s + 1].clone()
        cu = torch.tensor([0, len(rows)], dtype=torch.int32, device=DEVICE)
        o = gdn_recurrence(*(x[f][rows] for f in "qkvab"), x["A_log"], x["dt_bias"], st1, one, cu,
                           update_state=True, max_len=N, backend="triton")
        assert torch.equal(o_tri[r * N + node], o[-1]), node
        assert torch.equal(snaps_tri[s, node], st1[0]), node

    c = 2 * H * KD + HV * VD
    xc = torch.randn(trees.batch * N, c, device=DEVICE)
    conv_state, w, bias = torch.randn(NS, c, 3, device=DEVICE), torch.randn(c, 4, device=DEVICE), torch.randn(c, device=DEVICE)
    ys, bufs = [], []
    for backend in ("reference", "triton"):
        buf = torch.zeros(NS, N, c, device=DEVICE)
        ys.append(causal_conv_verify_tree(xc, conv_state, w, bias, slots, trees, window_buf=buf, backend=backend))
        bufs.append(buf)
    torch.testing.assert_close(ys[1], ys[0], **TOL)
    assert torch.equal(bufs[1], bufs[0])


def test_tree_recurrence_methods_agree_bit_for_bit():
    """The stack and the leaf paths give the same outputs, node states and records bit
    for bit, and write the same positions (buffers start as NaN: a missing or extra
    write shows). The trees share nodes between paths (7 nodes on 4 leaf paths), pad
    nodes with NaN inputs and hold a padding request."""
    trees, slots, x, st = case(SHAPES + [[-1, 0, 0, 0, 1, 2, 3]], seed=11)
    stack = _tree_recurrence("triton", trees, slots, x, st, method="stack", fill=float("nan"))
    paths = _tree_recurrence("triton", trees, slots, x, st, method="paths", fill=float("nan"))
    same = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(paths[0], stack[0], **same)
    torch.testing.assert_close(paths[1], stack[1], **same)
    for a, b in zip(paths[2], stack[2]):
        torch.testing.assert_close(a, b, **same)
    live = [int(s) for s in slots if s >= 0]
    assert torch.isfinite(paths[1][live[0], : int(trees.num_nodes[0])]).all()  # every real node's state written


def test_tree_recurrence_method_follows_the_shape_table(monkeypatch):
    """``method=None`` walks the leaf paths exactly when requests x leaf paths is at most
    the table's ``exact_tree.path_max_paths`` (on CUDA 96: 16 requests of a 3,2,1 tree;
    on the CPU 0, the stack); a bad name raises."""
    from replayssm.ops import tree_ops, tuning

    trees, slots, x, st = case(SHAPES, seed=6)  # 4 requests, at most 4 leaf paths each: 16
    calls = []

    class Launch:  # kernel[grid](...) records the kernel's name instead of running it
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(self.name)

    for name in ("_tree_path_kernel", "_tree_recurrence_kernel"):
        monkeypatch.setattr(tree_ops, name, Launch(name))
    for most in (15, 16, 0):
        with tuning.override("exact_tree", path_max_paths=most):
            _tree_recurrence("triton", trees, slots, x, st)
    assert calls == ["_tree_recurrence_kernel", "_tree_path_kernel", "_tree_recurrence_kernel"]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert tree_ops.walks_paths(16, 6, kd=128, vd=128, state_dtype=torch.float32, device=cuda)
    assert not tree_ops.walks_paths(17, 6, kd=128, vd=128, state_dtype=torch.float32, device=cuda)
    assert not tree_ops.walks_paths(1, 1, kd=128, vd=128, state_dtype=torch.float32, device=cpu)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="method must be None or one of"):
            _tree_recurrence(backend, trees, slots, x, st, method="chain")


@pytest.mark.parametrize("w,with_bias", [(4, True), (2, False), (6, True)])
def test_tree_conv_keeps_the_window_buffer_and_matches_the_reference(w, with_bias):
    """The tree conv alone: trees with nodes shallower than ``W - 1`` (taps from the conv
    state) and deeper, a padding request, NaN inputs on padded nodes and a NaN-filled
    window buffer: outputs against the reference, the buffer bit for bit (the nodes'
    inputs, NaN where nothing is written), the conv state untouched; and a chain tree
    gives the chain conv's bits, outputs and buffer."""
    lists = list(SHAPES)
    lists.insert(1, [-1])
    trees = DraftTrees.from_parents(lists, max_nodes=N)
    slots = torch.randperm(NS)[: trees.batch].to(torch.int32)
    slots[1] = -1
    slots = slots.to(DEVICE)
    c = 40
    x = torch.randn(trees.batch * N, c, device=DEVICE)
    x[~trees.valid.reshape(-1).to(DEVICE)] = float("nan")
    state0 = torch.randn(NS, c, w - 1, device=DEVICE)
    weight = torch.randn(c, w, device=DEVICE)
    bias = torch.randn(c, device=DEVICE) if with_bias else None
    buf0 = torch.full((NS, N, c), float("nan"), device=DEVICE)
    out = {}
    for backend in ("reference", "triton"):
        state, buf = state0.clone(), buf0.clone()
        y = causal_conv_verify_tree(x, state, weight, bias, slots, trees, window_buf=buf, backend=backend)
        assert torch.equal(state, state0), backend
        out[backend] = (y, buf)
    (y_r, b_r), (y_t, b_t) = out["reference"], out["triton"]
    assert torch.isfinite(y_t).all()
    torch.testing.assert_close(y_t, y_r, **TOL)
    torch.testing.assert_close(b_t, b_r, rtol=0, atol=0, equal_nan=True)
    for r, s in enumerate(slots.tolist()):
        if s >= 0:  # the rows written are the real nodes' inputs
            count = int(trees.num_nodes[r])
            assert torch.equal(b_t[s, :count], x[r * N : r * N + count]) and b_t[s, count:].isnan().all()

    chain = DraftTrees.chain(N, batch=trees.batch)
    x = x.nan_to_num(1.5)
    cu = torch.arange(0, (trees.batch + 1) * N, N, dtype=torch.int32, device=DEVICE)
    b_tree, b_chain = buf0.clone(), buf0.clone()
    y_tree = causal_conv_verify_tree(x, state0, weight, bias, slots, chain, window_buf=b_tree, backend="triton")
    y_chain = causal_conv_verify(x, state0, weight, bias, slots, cu, window_buf=b_chain, backend="triton")
    assert torch.equal(y_tree, y_chain)
    torch.testing.assert_close(b_tree, b_chain, rtol=0, atol=0, equal_nan=True)


def test_compact_path_matches_the_reference():
    trees, slots, _, st = case(SHAPES, seed=4)
    dev = trees.on(DEVICE)
    accepted = torch.tensor([6, 0, 7, 2], dtype=torch.int32, device=DEVICE)
    path, count = accepted_paths(dev, accepted)
    assert path[0, : int(count[0])].tolist() == trees.path(0, 6)
    assert path[2, : int(count[2])].tolist() == trees.path(2, 7)
    offset = (st["base"] + st["wp"]) % L
    init = [torch.randn(2, NS, L, H, KD, device=DEVICE), torch.randn(2, NS, L, HV, device=DEVICE)]
    ref, tri = [t.clone() for t in init], [t.clone() for t in init]
    compact_path(ref, slots, path, count, offset, backend="reference")
    compact_path(tri, slots, path, count, offset, backend="triton")
    for a, b in zip(tri, ref):
        assert torch.equal(a, b)
    s = int(slots[2])
    o = int(offset[s])
    for d, node in enumerate(trees.path(2, 7)):
        assert torch.equal(ref[0][:, s, (o + d) % L], init[0][:, s, (o + node) % L])
    assert torch.equal(ref[1][:, int(slots[0]), (int(offset[int(slots[0])]) + 3) % L],
                       init[1][:, int(slots[0]), (int(offset[int(slots[0])]) + 3) % L])  # past the path: untouched
