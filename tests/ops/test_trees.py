"""Draft trees as data and the closed-form tree verify (DESIGN.md section 2, "Trees").

The oracle is the float64 recurrence run along each node's root path from the committed
state (checkpoint + ring history): ``state_update`` per path node, then ``readout``.
"""

from types import SimpleNamespace

import pytest
import torch
from test_reference_ops import cu_of, fill_history, make_ring, rand_layer

from replayssm.ops import (
    DraftTrees,
    RawRecords,
    gdn_chunked_window_reference,
    gdn_fold_reference,
    gdn_tree_window_reference,
    readout,
    state_update,
)
from replayssm.ops.recurrent import prepare_window

H, KD, VD, L = 2, 8, 4, 32
F64 = torch.float64
FIELDS = ("q", "k", "v", "a", "b")

#: an irregular tree: one deep branch, a wide root, a leaf at depth 1
IRREGULAR = [-1, 0, 0, 1, 1, 2, 4, 3, 0, 6]
SHAPES = {
    "branching_2_2": DraftTrees.from_branching((2, 2)).parents[0].tolist(),
    "branching_3_2_1": DraftTrees.from_branching((3, 2, 1)).parents[0].tolist(),
    "chain_6": DraftTrees.chain(6).parents[0].tolist(),
    "irregular": IRREGULAR,
}


def make_batch(parent_lists, group, max_nodes, seed):
    """Requests with the given trees on random slots, a padding request (slot -1) last,
    each live slot with a random committed history (wrapping the ring) on a random
    checkpoint; padded nodes' inputs are NaN so that reading one shows."""
    torch.manual_seed(seed)
    trees = DraftTrees.from_parents(list(parent_lists) + [[-1]], max_nodes)
    nb, nn, hv = trees.batch, trees.max_nodes, H * group
    ns = nb + 1
    ckpt = torch.randn(ns, hv, VD, KD, dtype=F64)
    ring, ring_u = make_ring(ns, L, H, hv, KD, VD, F64)  # NaN outside the histories
    slots = torch.randperm(ns)[:nb].to(torch.int32)
    slots[-1] = -1
    wp, cb = torch.zeros(ns, dtype=torch.int32), torch.zeros(ns, dtype=torch.int32)
    committed = {}
    for s in slots[:-1].tolist():
        hist, base = int(torch.randint(1, L - nn + 1, ())), int(torch.randint(0, L, ()))
        committed[s], _ = fill_history(ring, ring_u, s, ckpt, [(base + c) % L for c in range(hist)], H, hv, KD, VD, F64)
        wp[s], cb[s] = hist, base
    x = rand_layer(nb * nn, H, hv, KD, VD)
    padded = ~trees.valid.reshape(-1)
    for f in FIELDS:
        x[f][padded] = float("nan")
    return SimpleNamespace(trees=trees, ckpt=ckpt, ring=ring, ring_u=ring_u, slots=slots, wp=wp, cb=cb, x=x,
                           committed=committed, hv=hv)


def tree_verify(c, trees=None):
    return gdn_tree_window_reference(*(c.x[f] for f in FIELDS), c.x["A_log"], c.x["dt_bias"], c.ckpt, c.ring,
                                     c.ring_u, c.slots, c.wp, c.cb, c.trees if trees is None else trees)


def path_recurrence(c, r, node):
    """``(o, u, S)`` at ``node`` of request ``r``: ``state_update`` along its root path
    from the committed state, in float64."""
    path = c.trees.path(r, node)
    rows = [r * c.trees.max_nodes + p for p in path]
    q_hat, k_hat, v, g, beta = prepare_window(*(c.x[f][rows] for f in FIELDS), c.x["A_log"], c.x["dt_bias"], F64)
    S = c.committed[int(c.slots[r])]
    for j in range(len(path)):
        S_parent = S
        S = state_update(S, k_hat[j], v[j], g[j], beta[j])
    u = beta[-1][:, None] * (v[-1] - (torch.exp(g[-1])[:, None, None] * S_parent * k_hat[-1][:, None, :]).sum(-1))
    return readout(S, q_hat[-1]), u, S


def assert_unchanged(before, after):
    torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)


class TestDraftTrees:
    def test_branching_parents_depth_and_ancestors(self):
        t = DraftTrees.from_branching((2, 1))
        assert t.parents.tolist() == [[-1, 0, 0, 1, 2]]
        assert t.depth.tolist() == [[0, 1, 1, 2, 2]]
        expected = torch.tensor([
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [1, 0, 1, 0, 1],
        ], dtype=torch.bool)
        assert torch.equal(t.ancestors()[0], expected)
        assert t.path(0, 4) == [0, 2, 4]
        assert DraftTrees.from_branching((3, 2, 1)).max_nodes == 16

    def test_chain_is_the_causal_window(self):
        t = DraftTrees.chain(5, batch=2, max_nodes=7)
        assert t.parents[0].tolist() == [-1, 0, 1, 2, 3, -1, -1]
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        assert torch.equal(t.ancestors()[1, :5, :5], causal)
        assert t.depth[0].tolist() == [0, 1, 2, 3, 4, -1, -1]

    def test_padded_nodes_are_masked(self):
        t = DraftTrees.from_parents([IRREGULAR, [-1, 0]], max_nodes=12)
        anc = t.ancestors()
        assert t.valid[1].tolist() == [True, True] + [False] * 10
        assert not anc[1, 2:].any() and not anc[1, :, 2:].any()
        assert not anc[0, 10:].any() and not anc[0, :, 10:].any()
        # every real node's row is its root path
        for i in range(len(IRREGULAR)):
            assert anc[0, i].nonzero().flatten().tolist() == t.path(0, i)
            assert int(t.depth[0, i]) == len(t.path(0, i)) - 1

    @pytest.mark.parametrize("parents, num_nodes, match", [
        ([[0, 0]], [2], r"parents\[0, 0\]"),
        ([[-1, 1]], [2], r"parents\[0, 1\] = 1 must lie in \[0, 1\)"),
        ([[-1, 0, 3, -1]], [4], r"parents\[0, 2\] = 3"),
        ([[-1, 0, 0]], [2], r"parents\[0, 2\] = 0: padded node"),
        ([[-1, 0]], [3], r"num_nodes\[0\] = 3"),
        ([[-1, 0]], [0], r"num_nodes\[0\] = 0"),
    ])
    def test_bad_parents_and_sizes(self, parents, num_nodes, match):
        with pytest.raises(ValueError, match=match):
            DraftTrees(torch.tensor(parents), torch.tensor(num_nodes))

    def test_bad_constructor_arguments(self):
        with pytest.raises(ValueError, match="branching"):
            DraftTrees.from_branching((2, 0))
        with pytest.raises(ValueError, match="branching"):
            DraftTrees.from_branching((2.0,))
        with pytest.raises(ValueError, match="length"):
            DraftTrees.chain(0)
        with pytest.raises(ValueError, match="batch"):
            DraftTrees.chain(3, batch=0)
        with pytest.raises(ValueError, match="max_nodes"):
            DraftTrees.from_branching((2, 2), max_nodes=6)
        with pytest.raises(ValueError, match="parents"):
            DraftTrees.from_parents([])
        with pytest.raises(TypeError, match="parents"):
            DraftTrees(torch.tensor([[-1.0]]), torch.tensor([1]))
        with pytest.raises(ValueError, match="num_nodes"):
            DraftTrees(torch.tensor([[-1, 0]]), torch.tensor([2, 2]))
        with pytest.raises(ValueError, match="node"):
            DraftTrees.chain(3, max_nodes=5).path(0, 3)


class TestTreeVerify:
    @pytest.mark.parametrize("shape", sorted(SHAPES))
    @pytest.mark.parametrize("group", [1, 2])
    def test_matches_per_path_recurrence(self, shape, group):
        """Every node's output and corrected delta == the float64 recurrence along its
        root path from the committed state. Rounding of a few hundred float64
        operations on O(1)..O(10) values: within 1e-10 of the values' scale; reading a
        sibling's update (a causal instead of an ancestor mask) is off by O(1)."""
        c = make_batch([SHAPES[shape], IRREGULAR[:7]], group, max_nodes=18, seed=10 * sorted(SHAPES).index(shape) + group)
        before = (c.ckpt.clone(), [t.clone() for t in c.ring], c.ring_u.clone())
        o, U = tree_verify(c)
        assert o.dtype == F64 and U.dtype == F64 and o.shape == (c.trees.batch * 18, c.hv, VD)
        for r in range(c.trees.batch - 1):
            for i in range(int(c.trees.num_nodes[r])):
                o_ref, u_ref, _ = path_recurrence(c, r, i)
                row = r * 18 + i
                assert (o[row] - o_ref).abs().max() <= 1e-10 * o_ref.abs().max(), (r, i)
                assert (U[row] - u_ref).abs().max() <= 1e-10 * u_ref.abs().max(), (r, i)
        # padded nodes (NaN inputs) and the padding request give zeros and leak nowhere
        padded = ~c.trees.valid.reshape(-1)
        padded[-18:] = True
        assert torch.all(o[padded] == 0) and torch.all(U[padded] == 0)
        assert torch.isfinite(o).all() and torch.isfinite(U).all()
        # verify writes nothing
        assert_unchanged(before[0], c.ckpt)
        for b, t in zip(before[1], c.ring):
            assert_unchanged(b, t)
        assert_unchanged(before[2], c.ring_u)

    def test_causal_mask_on_a_tree_is_wrong(self):
        """Teeth: the same inputs verified as a chain (siblings in each other's past)
        miss the per-path recurrence by a large fraction of the scale."""
        c = make_batch([SHAPES["branching_2_2"]], 1, max_nodes=7, seed=7)
        o, _ = gdn_tree_window_reference(*(c.x[f] for f in FIELDS), c.x["A_log"], c.x["dt_bias"], c.ckpt, c.ring,
                                         c.ring_u, c.slots, c.wp, c.cb, DraftTrees.chain(7, batch=2, max_nodes=7))
        o_ref, _, _ = path_recurrence(c, 0, 6)  # node 6: parent 2, whose chain past holds 1, 3, 4, 5
        assert (o[6] - o_ref).abs().max() > 1e-3 * o_ref.abs().max()

    @pytest.mark.parametrize("group", [1, 2])
    def test_chain_tree_is_the_chunked_window_bit_for_bit(self, group):
        """A chain-shaped tree runs the same float64 operations as the chunked window
        (prefix-sum gates, causal mask, forward substitution): outputs and corrected
        deltas are equal bit for bit, padded nodes of the shorter chains aside."""
        lengths = [5, 3, 7]
        c = make_batch([list(range(-1, n - 1)) for n in lengths], group, max_nodes=7, seed=11 + group)
        o_tree, U_tree = tree_verify(c)
        live = c.slots[:-1]
        rows = [r * 7 + j for r, n in enumerate(lengths) for j in range(n)]
        ring_copy, u_copy = RawRecords(*(t.clone() for t in c.ring)), c.ring_u.clone()
        o_chunk = gdn_chunked_window_reference(
            *(c.x[f][rows] for f in FIELDS), c.x["A_log"], c.x["dt_bias"], c.ckpt.clone(), ring_copy, u_copy, live,
            cu_of(lengths), c.wp, c.cb, torch.zeros_like(c.wp), max_len=7,
        )
        assert torch.equal(o_tree[rows], o_chunk)
        for r, n in enumerate(lengths):
            s = int(live[r])
            pos = [(int(c.cb[s]) + int(c.wp[s]) + j) % L for j in range(n)]
            assert torch.equal(U_tree[r * 7: r * 7 + n], u_copy[s, pos])

    @pytest.mark.parametrize("shape", ["branching_3_2_1", "irregular"])
    def test_commit_of_the_accepted_path_is_the_path_state(self, shape):
        """Appending the accepted root path's raw records (gathered from their window
        rows) after the history and folding checkpoint + history + path with the exact
        replay gives the per-path recurrence's state at the accepted node bit for bit:
        the same ``state_update`` calls on the same values."""
        c = make_batch([SHAPES[shape], IRREGULAR], 2, max_nodes=16, seed=3)
        nn = c.trees.max_nodes
        for r in range(c.trees.batch - 1):
            s = int(c.slots[r])
            node = int(torch.randint(1, int(c.trees.num_nodes[r]), ()))
            path = c.trees.path(r, node)
            rows = [r * nn + p for p in path]
            _, _, _, g, beta = prepare_window(*(c.x[f][rows] for f in FIELDS), c.x["A_log"], c.x["dt_bias"], F64)
            wp, base = int(c.wp[s]), int(c.cb[s])
            for j, row in enumerate(rows):
                c.ring.write(s, (base + wp + j) % L, c.x["k"][row], c.x["v"][row], g[j], beta[j])
            ckpts = c.ckpt[None].clone()
            gdn_fold_reference(ckpts, *(t[None] for t in c.ring), torch.tensor([s]), torch.tensor([base]),
                               torch.tensor([wp + len(path)]))
            _, _, S_path = path_recurrence(c, r, node)
            assert torch.equal(ckpts[0, s], S_path), (shape, r, node)
            others = [t for t in range(c.ckpt.shape[0]) if t != s]
            assert torch.equal(ckpts[0, others], c.ckpt[others])

    def test_bad_inputs_raise_before_anything_is_touched(self):
        c = make_batch([IRREGULAR], 1, max_nodes=10, seed=5)
        before = (c.ckpt.clone(), c.ring_u.clone())
        layer = [c.x[f] for f in FIELDS] + [c.x["A_log"], c.x["dt_bias"]]
        state = [c.ckpt, c.ring, c.ring_u]
        with pytest.raises(TypeError, match="trees"):
            gdn_tree_window_reference(*layer, *state, c.slots, c.wp, c.cb, c.trees.parents)
        with pytest.raises(ValueError, match="trees.batch"):
            gdn_tree_window_reference(*layer, *state, c.slots, c.wp, c.cb, DraftTrees.chain(3, batch=2))
        with pytest.raises(ValueError, match="slots"):
            gdn_tree_window_reference(*layer, *state, c.slots[:1], c.wp, c.cb, c.trees)
        with pytest.raises(ValueError, match="slots"):
            gdn_tree_window_reference(*layer, *state, torch.tensor([5, -1], dtype=torch.int32), c.wp, c.cb, c.trees)
        with pytest.raises(ValueError, match="write_pos"):
            wp = c.wp.clone()
            wp[int(c.slots[0])] = L + 1
            gdn_tree_window_reference(*layer, *state, c.slots, wp, c.cb, c.trees)
        with pytest.raises(ValueError, match="ring_u"):
            gdn_tree_window_reference(*layer, c.ckpt, c.ring, c.ring_u[:, :4], c.slots, c.wp, c.cb, c.trees)
        assert_unchanged(before[0], c.ckpt)
        assert_unchanged(before[1], c.ring_u)


def test_leaf_paths_cover_every_node_with_consecutive_paths():
    """Every leaf's root path, leaves in depth-first preorder: each real node lies on a
    path, the paths through a node are consecutive (so "the previous path has it" marks
    a node's first path), padded nodes and requests with fewer leaves get -1."""
    trees = DraftTrees.from_parents([[-1, 0, 0, 1, 1, 2, 4, 3], [-1, 0, 1], [-1]], max_nodes=8)
    table = trees.leaf_paths()
    assert table.shape == (3, 3, 4)
    assert table[0].tolist() == [[0, 1, 3, 7], [0, 1, 4, 6], [0, 2, 5, -1]]
    assert table[1].tolist()[0] == [0, 1, 2, -1] and (table[1, 1:] == -1).all()
    assert table[2, 0].tolist() == [0, -1, -1, -1] and (table[2, 1:] == -1).all()
    for r in range(trees.batch):
        for node in range(int(trees.num_nodes[r])):
            on = [p for p in range(table.shape[1]) if node in table[r, p].tolist()]
            assert on and on == list(range(on[0], on[-1] + 1)), (r, node)
            assert all(table[r, p].tolist()[: len(trees.path(r, node))] == trees.path(r, node) for p in on)
    wide = DraftTrees.from_branching((3, 2, 1), batch=2).leaf_paths()
    assert wide.shape == (2, 6, 4) and wide[1].tolist()[5] == [0, 3, 9, 15]
