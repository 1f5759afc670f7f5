"""Draft-tree steps of every strategy (DESIGN.md sections 2 and 3, reference backend).

A tree step is ``conv_verify_tree`` + ``verify_tree`` in every layer, then
``commit_tree`` with the accepted node per request. Checked against references of the
accepted stream kept by :class:`~replayssm.testing.lifecycle.Lifecycle`, mixed with its
chain steps on the same requests (circular: with flushes and histories):

* every real node's output against the float64 recurrence run along its root path from
  the committed state: within 1e-5 relative (norm over the node's heads), fp32 rounding
  of a contractive recurrence, as the lifecycle test bounds chain outputs; ``fold`` and
  ``snapshot`` outputs equal the float32 design recurrence along the path bit for bit;
* every node's conv output equals the chain conv over its root path, bit for bit;
* after the commit, committed states equal the float32 design recurrence along the
  accepted path bit for bit (all three strategies: the path's raw records are replayed
  or its node state copied), and conv states equal sequential decoding of the path.
"""

import pytest
import torch

from replayssm.ops import DraftTrees, causal_conv_verify_reference, gdn_recurrence_reference
from replayssm.state import GDNShape, StatePool
from replayssm.state.batch import Batch
from replayssm.strategies import StepProtocolError
from replayssm.testing.lifecycle import Lifecycle, _rel, design_recurrence

STRATEGIES = ["snapshot", "fold", "circular"]
SHAPE = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=8)
N = 8  # nodes per tree (the pool's window)
TOL = 1e-5
SHAPES = [
    DraftTrees.from_branching((2, 2)).parents[0].tolist(),  # 7 nodes, depth 2
    [-1, 0, 0, 1, 1, 2, 4, 3],  # irregular, depth 4
    [-1, 0, 1],  # a short chain, padded: through the tree path
]


def make(strategy, seed=0, conv_ring=False):
    pool = StatePool(SHAPE, 2, 5, strategy=strategy, window=N, ring_len=32, conv_ring=conv_ring)
    return pool, Lifecycle(pool, num_requests=3, padding_rows=1, generator=torch.Generator().manual_seed(seed))


def tree_step(lc: Lifecycle, gen: torch.Generator):
    """One tree step on random trees and random accepted nodes, checked as the module
    says; advances the lifecycle's references along the accepted paths."""
    pool = lc.pool
    rows = lc._rows()
    parents = [SHAPES[int(torch.randint(len(SHAPES), (), generator=gen))] if s >= 0 else [-1] for s in rows]
    trees = DraftTrees.from_parents(parents, max_nodes=N)
    accepted = [int(torch.randint(len(p), (), generator=gen)) for p in parents]
    batch = pool.batch(rows, N)
    padded = ~trees.valid.reshape(-1)
    inputs, outs, convs = [], [], []
    for layer in range(pool.num_layers):
        x = lc.make_inputs(trees.batch * N)
        for t in x.values():
            t[padded] = float("nan")  # read by nothing
        convs.append(pool.strategy.conv_verify_tree(layer, x["x"], batch, trees))
        outs.append(pool.strategy.verify_tree(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch, trees))
        inputs.append(x)
    pool.strategy.commit_tree(batch, trees, accepted)

    req_of = {s: i for i, s in enumerate(lc.slots)}
    exact = pool.strategy.exact_outputs
    for layer in range(pool.num_layers):
        x, p = inputs[layer], pool.layer_params(layer)
        assert torch.isfinite(outs[layer]).all() and torch.isfinite(convs[layer]).all()
        assert torch.all(outs[layer][padded] == 0) and torch.all(convs[layer][padded] == 0)
        for r, s in enumerate(rows):
            if s < 0:
                assert torch.all(outs[layer][r * N:(r + 1) * N] == 0)
                continue
            req = req_of[s]
            for node in range(len(parents[r])):
                path = [r * N + i for i in trees.path(r, node)]
                xp = {key: t[path] for key, t in x.items()}
                cu = torch.tensor([0, len(path)], dtype=torch.int32)
                one = torch.zeros(1, dtype=torch.int32)
                o64 = gdn_recurrence_reference(*(xp[f].double() for f in "qkvab"), p["A_log"].double(),
                                               p["dt_bias"].double(), lc.oracle[layer, req][None].clone(), one, cu)
                assert _rel(outs[layer][r * N + node], o64[-1]) < TOL, (layer, r, node)
                if exact:
                    o32 = design_recurrence(xp, p["A_log"], p["dt_bias"], lc.reference[layer, req][None].clone(),
                                            [0], [len(path)])
                    assert torch.equal(outs[layer][r * N + node], o32[-1]), (layer, r, node)
                c_ref = causal_conv_verify_reference(xp["x"], lc.conv_reference[layer, req][None].clone(),
                                                     p["conv_weight"], p["conv_bias"], one, cu)
                assert torch.equal(convs[layer][r * N + node], c_ref[-1]), (layer, r, node)
            # advance the references along the accepted path
            path = [r * N + i for i in trees.path(r, accepted[r])]
            xp = {key: t[path] for key, t in x.items()}
            cu = torch.tensor([0, len(path)], dtype=torch.int32)
            rq = torch.tensor([req], dtype=torch.int32)
            gdn_recurrence_reference(*(xp[f].double() for f in "qkvab"), p["A_log"].double(), p["dt_bias"].double(),
                                     lc.oracle[layer], rq, cu, update_state=True)
            design_recurrence(xp, p["A_log"], p["dt_bias"], lc.reference[layer], [req], [len(path)])
            causal_conv_verify_reference(xp["x"], lc.conv_reference[layer], p["conv_weight"], p["conv_bias"], rq, cu,
                                         update_state=True)
        assert torch.equal(pool.strategy.committed_state(layer, lc.slots), lc.reference[layer]), layer
    slots_t = torch.tensor(lc.slots)
    assert torch.equal(pool.conv_history()[:, slots_t], lc.conv_reference)


@pytest.mark.parametrize("conv_ring", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tree_steps_mixed_with_chain_steps(strategy, conv_ring):
    """Tree steps and chain steps in turn on the same requests; with ``conv_ring`` the
    conv history and window are one ring a slot (16 entries for trees of 8 nodes), so
    the accepted paths are gathered where the history continues."""
    pool, lc = make(strategy, seed=1, conv_ring=conv_ring)
    gen = torch.Generator().manual_seed(2)
    flushes = 0
    for step in range(8):
        if step % 2:
            r = lc.step()
            assert r.state_bitexact and r.conv_bitexact and r.state_err < TOL
        else:
            if "is_flush" in pool.buffers:
                flushes += int(pool.buffers["is_flush"][lc.slots].sum())
            tree_step(lc, gen)
    if strategy == "circular":
        assert flushes > 0, "the tree steps must meet flush rows"
        assert int(pool.buffers["write_pos"][lc.slots].max()) > 0


def _run_step(pool, lc, rows, x_layers, trees=None, accepted=None):
    batch = pool.batch(rows, N)
    outs = []
    st = pool.strategy
    for layer, x in enumerate(x_layers):
        if trees is None:
            outs.append(st.conv_verify(layer, x["x"], batch))
            outs.append(st.verify(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch))
        else:
            outs.append(st.conv_verify_tree(layer, x["x"], batch, trees))
            outs.append(st.verify_tree(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch, trees))
    if trees is None:
        st.commit(batch, [n + 1 for n in accepted])
    else:
        st.commit_tree(batch, trees, accepted)
    return outs


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_chain_tree_is_the_chain_step_bit_for_bit(strategy):
    """A chain-shaped tree (full chains) runs the chain step: outputs, conv outputs and
    every pool buffer equal a chain step's bit for bit, node ``a`` committing ``a + 1``
    tokens; over several steps, so circular's histories and flushes take part."""
    (pa, la), (pb, lb) = make(strategy, seed=3), make(strategy, seed=3)
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):
        rows = la._rows()
        assert rows == lb._rows()
        xs = [la.make_inputs(len(rows) * N) for _ in range(pa.num_layers)]
        lb.make_inputs(len(rows) * N)  # keep the generators in step
        [lb.make_inputs(len(rows) * N) for _ in range(pa.num_layers - 1)]
        accepted = [int(torch.randint(N, (), generator=gen)) for _ in rows]
        chain = DraftTrees.chain(N, batch=len(rows))
        assert chain.is_chain
        for a, b in zip(_run_step(pa, la, rows, xs, accepted=accepted),
                        _run_step(pb, lb, rows, xs, trees=chain, accepted=accepted)):
            _same(a, b)
        for name, buf in pa.buffers.items():
            _same(buf, pb.buffers[name])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bad_tree_input_raises_before_anything_changes(strategy):
    pool, lc = make(strategy, seed=5)
    lc.step()
    lc.step()
    st = pool.strategy
    rows = [lc.slots[0], -1, lc.slots[2]]
    trees = DraftTrees.from_parents([SHAPES[0], [-1], SHAPES[1]], max_nodes=N)
    x = lc.make_inputs(3 * N)
    gate = (x["q"], x["k"], x["v"], x["a"], x["b"])
    before = {name: buf.clone() for name, buf in pool.buffers.items()}
    batch = pool.batch(rows, N)

    def unchanged():
        for name, buf in pool.buffers.items():
            _same(buf, before[name])

    with pytest.raises(TypeError, match="trees"):
        st.verify_tree(0, *gate, batch, trees.parents)
    with pytest.raises(ValueError, match="trees.batch"):
        st.verify_tree(0, *gate, batch, DraftTrees.chain(N, batch=2))
    with pytest.raises(ValueError, match="trees.max_nodes = 7"):
        st.conv_verify_tree(0, x["x"], batch, DraftTrees.from_parents([[-1]] * 3, max_nodes=7))
    with pytest.raises(ValueError, match="batch windows reach"):
        xl = lc.make_inputs(3 * (N + 1))
        st.verify_tree(0, *(xl[f] for f in "qkvab"), Batch.build(rows, [N + 1] * 3, "cpu"),
                       DraftTrees.from_parents([[-1]] * 3, max_nodes=N + 1))
    unchanged()
    assert not st.step_open

    # protocol: a tree step takes tree calls only, and commit_tree checks its nodes
    st.verify_tree(0, *gate, batch, trees)
    with pytest.raises(StepProtocolError, match="trees"):
        st.verify(1, *gate, batch)
    with pytest.raises(StepProtocolError, match="same DraftTrees"):
        st.verify_tree(1, *gate, batch, DraftTrees.from_parents([SHAPES[0], [-1], SHAPES[1]], max_nodes=N))
    st.verify_tree(1, *gate, batch, trees)
    committed = [st.committed_state(layer, lc.slots) for layer in range(2)]
    with pytest.raises(StepProtocolError, match="commit_tree"):
        st.commit(batch, [1, 1, 1])
    with pytest.raises(ValueError, match=r"accepted\[2\] = 8"):
        st.commit_tree(batch, trees, [0, 0, 8])
    with pytest.raises(ValueError, match=r"accepted\[0\] = 7"):
        st.commit_tree(batch, trees, [7, 0, 0])  # node 7 is padding in a 7-node tree
    for layer in range(2):
        assert torch.equal(st.committed_state(layer, lc.slots), committed[layer])
    st.commit_tree(batch, trees, [6, 0, 7])
    assert not st.step_open
