"""Draft-tree kernels and tree steps on CUDA (DESIGN.md sections 2 and 3, "Trees").

Run on the GPU machine:  python -m pytest -q tests/gpu/test_trees_gpu.py

* The tree kernels (circular's closed form with TREE, the fold/snapshot stack
  recurrence, the tree conv, the path gather) against their references at production
  head dims (K = V = 128) and a 16-node tree (3, 2, 1): fp32 within 1e-4 of the values'
  scale (the closed form's products run in fp32 "ieee" for fp32 activations; sums over
  K = 128 terms and 16 nodes of O(1) values), bf16 activations within 2e-2 (the
  output's own rounding, 2^-8, times the O(1)..O(10) outputs).
* A whole tree step of every strategy on a Triton pool, eager and replayed from one
  CUDA graph (commit_tree from a device tensor, no host read): the committed states
  equal the Triton recurrence along the accepted paths bit for bit, replay equals eager
  bit for bit, and a chain-shaped tree equals the chain step bit for bit.
"""

import pytest
import torch

from replayssm.bench import common
from replayssm.ops import DraftTrees, RawRecords, gdn_recurrence
from replayssm.ops.chunked import gdn_tree_verify
from replayssm.ops.conv import causal_conv_verify_tree
from replayssm.ops.tree_ops import gdn_tree_recurrence
from replayssm.state import GDNShape, StatePool

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
H, HV, KD, VD, NS, L = 2, 4, 128, 128, 6, 32
TREE = DraftTrees.from_branching((3, 2, 1), batch=3)  # 16 nodes, depth 3
N = TREE.max_nodes


def _inputs(n, dtype):
    a = torch.randn(n, HV, device=DEV)
    return dict(q=torch.randn(n, H, KD, device=DEV).to(dtype), k=torch.randn(n, H, KD, device=DEV).to(dtype),
                v=torch.randn(n, HV, VD, device=DEV).to(dtype), a=a.to(dtype),
                b=(torch.randn(n, HV, device=DEV) * 2).to(dtype),
                A_log=torch.empty(HV, device=DEV).uniform_(-3, -0.3), dt_bias=torch.randn(HV, device=DEV) * 0.5)


def _ring(dtype):
    ring = RawRecords(torch.randn(NS, L, H, KD, device=DEV).to(dtype), torch.randn(NS, L, HV, VD, device=DEV).to(dtype),
                      -torch.rand(NS, L, HV, device=DEV), torch.rand(NS, L, HV, device=DEV))
    return ring, torch.randn(NS, L, HV, VD, device=DEV) * 0.3


def _rel(x, ref):
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1.0))


@pytest.mark.parametrize("method", ["closed_form", "replay"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_tree_kernels_match_the_references(dtype, tol, method):
    """``replay`` (each leaf's root path through the exact step) reads a history by its
    raw records where the closed form and the reference read its ``u``; the ring's
    ``u`` here is random, so for it every live row flushes (the history is folded from
    raw records by both)."""
    x = _inputs(TREE.batch * N, dtype)
    slots = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEV)
    trees = DraftTrees.from_parents([TREE.parents[0].tolist(), [-1], TREE.parents[0].tolist()[:11]], max_nodes=N)
    ckpt = torch.randn(NS, HV, VD, KD, device=DEV) * 0.3
    wp = torch.tensor([5, 0, 0, 9, 0, 0], dtype=torch.int32, device=DEV)
    base = torch.tensor([30, 0, 0, 7, 0, 0], dtype=torch.int32, device=DEV)
    flush = torch.tensor([1, 0, 0, int(method == "replay"), 0, 0], dtype=torch.int32, device=DEV)
    outs = {}
    for backend in ("reference", "triton"):
        torch.manual_seed(0)  # the same ring for both backends
        ring, ring_u = _ring(dtype)
        c = ckpt.clone()
        o = gdn_tree_verify(*(x[f] for f in ("q", "k", "v", "a", "b", "A_log", "dt_bias")), c, ring, ring_u, slots, wp,
                            base, flush, trees, max_len=N, method=method, backend=backend)
        snaps = torch.zeros(NS, N, HV, VD, KD, device=DEV)
        o_rec = gdn_tree_recurrence(*(x[f] for f in ("q", "k", "v", "a", "b", "A_log", "dt_bias")), ckpt, slots, trees,
                                    snapshots=snaps, backend=backend)
        outs[backend] = (o, c, ring_u, o_rec, snaps)
    for got, want in zip(outs["triton"], outs["reference"]):
        assert _rel(got, want) < tol

    cdim = 2 * H * KD + HV * VD
    xc = torch.randn(TREE.batch * N, cdim, device=DEV).to(dtype)
    state, w = torch.randn(NS, cdim, 3, device=DEV).to(dtype), torch.randn(cdim, 4, device=DEV).to(dtype)
    y = [causal_conv_verify_tree(xc, state, w, None, slots, trees, backend=b) for b in ("reference", "triton")]
    assert _rel(y[1], y[0]) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tree_recurrence_methods_agree_bit_for_bit(dtype):
    """fold's and snapshot's tree verify compiled both ways (the depth-indexed stack and
    a program per leaf path): outputs, node states and records bit for bit, written at
    the same positions (buffers start as NaN), with a padding request and padded nodes."""
    x = _inputs(TREE.batch * N, dtype)
    slots = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEV)
    trees = DraftTrees.from_parents([TREE.parents[0].tolist(), [-1], TREE.parents[0].tolist()[:11]], max_nodes=N)
    ckpt = (torch.randn(NS, HV, VD, KD, device=DEV) * 0.3).to(dtype)
    runs = []
    for method in ("stack", "paths"):
        nan = float("nan")
        snaps = torch.full((NS, N, HV, VD, KD), nan, device=DEV).to(dtype)
        rec = RawRecords(torch.full((NS, N, H, KD), nan, device=DEV).to(dtype),
                         torch.full((NS, N, HV, VD), nan, device=DEV).to(dtype),
                         torch.full((NS, N, HV), nan, device=DEV), torch.full((NS, N, HV), nan, device=DEV))
        o = gdn_tree_recurrence(*(x[f] for f in ("q", "k", "v", "a", "b", "A_log", "dt_bias")), ckpt, slots, trees,
                                snapshots=snaps, records=rec, method=method, backend="triton")
        runs.append((o, snaps, *rec))
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(runs[1][1][3, :16]).all() and torch.isfinite(runs[1][1][0, :11]).all()


def _pool(strategy, seed):
    torch.manual_seed(seed)
    shape = GDNShape(num_heads=H, num_value_heads=HV, head_k_dim=KD, head_v_dim=VD)
    pool = StatePool(shape, 2, 4, strategy=strategy, window=N, ring_len=L, device=DEV, act_dtype=torch.bfloat16)
    for layer in range(2):
        pool.set_layer_params(layer, A_log=torch.empty(HV).uniform_(-3, -0.3), dt_bias=torch.randn(HV) * 0.5,
                              conv_weight=torch.randn(shape.conv_dim, shape.conv_kernel) * 0.5)
    slots = [pool.alloc() for _ in range(3)]
    for layer in range(2):
        pool.strategy.load_states(layer, torch.tensor(slots, device=DEV), torch.randn(3, HV, VD, KD, device=DEV) * 0.3)
    return pool, slots


@pytest.mark.parametrize("strategy", ["snapshot", "fold", "circular"])
def test_tree_step_graph_replay_and_committed_states(strategy):
    pool, slots = _pool(strategy, 1)
    batch = pool.batch(slots, N)
    xs = [_inputs(3 * N, torch.bfloat16) for _ in range(2)]
    node = torch.tensor([15, 4, 9], dtype=torch.int32, device=DEV)
    st = pool.strategy

    def step():
        outs = [st.verify_tree(layer, *(x[f] for f in "qkvab"), batch, TREE) for layer, x in enumerate(xs)]
        st.commit_tree(batch, TREE, node)
        return outs

    for _ in range(3):  # eager steps; each commits depth + 1 tokens along the same paths
        before = [st.committed_state(layer, slots) for layer in range(2)]
        step()
        for layer, x in enumerate(xs):
            p = pool.layer_params(layer)
            for r, s in enumerate(slots):
                rows = [r * N + i for i in TREE.path(r, int(node[r]))]
                S = before[layer][r:r + 1].clone()
                cu = torch.tensor([0, len(rows)], dtype=torch.int32, device=DEV)
                gdn_recurrence(*(x[f][rows] for f in "qkvab"), p["A_log"], p["dt_bias"], S,
                               torch.zeros(1, dtype=torch.int32, device=DEV), cu, update_state=True, max_len=N, backend="triton")
                assert torch.equal(st.committed_state(layer, [s])[0], S[0]), (layer, r)

    graph = common.capture_graph(step, warmup_steps=1)
    eager_pool, _ = _pool(strategy, 1)
    for name, buf in pool.buffers.items():
        eager_pool.buffers[name].copy_(buf)
    graph.replay()
    torch.cuda.synchronize()
    eb = eager_pool.batch(slots, N)
    for layer, x in enumerate(xs):
        eager_pool.strategy.verify_tree(layer, *(x[f] for f in "qkvab"), eb, TREE)
    eager_pool.strategy.commit_tree(eb, TREE, node)
    for name, buf in pool.buffers.items():
        assert torch.isclose(buf, eager_pool.buffers[name], rtol=0, atol=0, equal_nan=True).all() \
            if buf.dtype.is_floating_point else torch.equal(buf, eager_pool.buffers[name]), name
    pool.check_errors()


@pytest.mark.parametrize("strategy", ["snapshot", "fold", "circular"])
def test_chain_tree_is_the_chain_step_on_cuda(strategy):
    (pa, slots), (pb, _) = _pool(strategy, 2), _pool(strategy, 2)
    chain = DraftTrees.chain(N, batch=3)
    xs = [_inputs(3 * N, torch.bfloat16) for _ in range(2)]
    ba, bb = pa.batch(slots, N), pb.batch(slots, N)
    oa = [pa.strategy.verify(layer, *(x[f] for f in "qkvab"), ba) for layer, x in enumerate(xs)]
    ob = [pb.strategy.verify_tree(layer, *(x[f] for f in "qkvab"), bb, chain) for layer, x in enumerate(xs)]
    pa.strategy.commit(ba, torch.tensor([4, 16, 1], dtype=torch.int32, device=DEV))
    pb.strategy.commit_tree(bb, chain, torch.tensor([3, 15, 0], dtype=torch.int32, device=DEV))
    for a, b in zip(oa, ob):
        assert torch.equal(a, b)
    for name, buf in pa.buffers.items():
        other = pb.buffers[name]
        assert (torch.isclose(buf, other, rtol=0, atol=0, equal_nan=True).all() if buf.dtype.is_floating_point
                else torch.equal(buf, other)), name
