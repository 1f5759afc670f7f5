"""Draft trees in the engine: acceptance (greedy and rejection sampling), tree
attention, KV compaction of the accepted path, and the MTP head's top-k tree expansion.

Greedy acceptance is checked against a host search over every node's root path; the
sampled rule by a chi-square test that the emitted tokens follow the target (seeded,
40,000 trials, threshold p > 1e-4, with the same test rejecting a wrong target);
tree attention against a float64 softmax over each node's prefix and ancestors."""

import pytest
import torch

from replayssm.engine.attention import slot_attention, tree_attention
from replayssm.engine.kv_cache import KVCache, compact_kv_path
from replayssm.engine.sampling import accept_greedy_static, accept_greedy_tree, accept_sampled_tree
from replayssm.engine.trees import StaticTree, parse_branching
from replayssm.ops.trees import DraftTrees


def _host_greedy(argmax, tokens, tree):
    """The deepest node (first among equals) whose path follows the argmax."""
    best, best_depth = 0, 0
    for i in range(1, tree.num_nodes):
        path = DraftTrees.from_parents([tree.host_parents]).path(0, i)
        if all(tokens[j] == argmax[tree.host_parents[j]] for j in path[1:]) and tree.host_depth[i] > best_depth:
            best, best_depth = i, tree.host_depth[i]
    return best, argmax[best]


@pytest.mark.parametrize("branching", [(3, 2, 1), (2, 1, 2)])
def test_greedy_tree_acceptance_is_the_deepest_followed_path(branching, rng):
    tree = StaticTree.from_branching(branching)
    b, n = 64, tree.num_nodes
    # a vocabulary of 3 makes every depth reachable often
    tokens, argmax = torch.randint(0, 3, (b, n), generator=rng), torch.randint(0, 3, (b, n), generator=rng)
    node, nxt = accept_greedy_tree(argmax, tokens, tree)
    want = [_host_greedy(argmax[r].tolist(), tokens[r].tolist(), tree) for r in range(b)]
    assert list(zip(node.tolist(), nxt.tolist())) == want
    assert len({tree.host_depth[w[0]] for w in want}) > 2  # several accepted depths were exercised
    path = tree.path_tokens(tokens, node)
    for r in range(b):
        d = tree.host_depth[int(node[r])]
        assert (path[r, d + 1 :] == -1).all() and path[r, 0] == tokens[r, 0]


def test_chain_shaped_tree_accepts_as_the_chain(rng):
    tree = StaticTree.chain(5)
    logits = torch.randn(32, 5, 3, generator=rng)
    window = torch.randint(0, 3, (32, 5), generator=rng)
    node, nxt = accept_greedy_tree(logits.argmax(-1), window, tree)
    n, nxt_chain = accept_greedy_static(logits, window)
    assert torch.equal(tree.depth[node], n) and torch.equal(nxt, nxt_chain)


def _markov_target(v, rng):
    p1 = torch.softmax(torch.randn(v, generator=rng) * 1.5, -1)
    p2 = torch.softmax(torch.randn(v, v, generator=rng) * 1.5, -1)  # [previous token, next]
    return p1, p2


def _chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("drafts", ["deterministic", "sampled"])
def test_tree_rejection_sampling_keeps_the_target_distribution(drafts, rng):
    """A Markov target (``p1`` at the root, ``p2[x]`` after token ``x``) over 6 tokens,
    a 3,2,1 tree per trial: deterministic drafts (random tokens, ``q = onehot``) or
    sampled ones (every child drawn independently from a draft ``q`` of its parent).
    The first emitted token must follow ``p1``; after an accepted first draft ``x``, the
    second ``p2[x]``."""
    v, trials = 6, 40_000
    tree = StaticTree.from_branching((3, 2, 1))
    n = tree.num_nodes
    p1, p2 = _markov_target(v, rng)
    q_table = torch.softmax(torch.randn(v + 1, v, generator=rng), -1)  # draft after token x (row v: the root)
    tokens = torch.zeros(trials, n, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, v, (trials,), generator=rng)
    q = None
    if drafts == "sampled":
        q = torch.zeros(trials, n, v)
        for i in range(1, n):
            par = tree.host_parents[i]
            dist = q_table[v] if par == 0 else q_table[tokens[:, par]]
            q[:, i] = dist.expand(trials, v)
            tokens[:, i] = torch.multinomial(q[:, i], 1, generator=rng)[:, 0]
    else:
        tokens[:, 1:] = torch.randint(0, v, (trials, n - 1), generator=rng)
    p = p2[tokens]  # the target after each node's token ...
    p[:, 0] = p1  # ... and at the root
    node, nxt = accept_sampled_tree(p, tokens, tree, q=q, generator=rng)
    path = tree.path_tokens(tokens, node)
    depth = tree.depth[node]
    first = torch.where(depth >= 1, path[:, 1], nxt)
    counts = torch.bincount(first, minlength=v).double()
    assert _chi2_pvalue(counts, trials * p1.double()) > 1e-4
    assert _chi2_pvalue(counts, trials * p1.flip(0).double()) < 1e-6  # the test tells a wrong target apart
    deep = depth >= 1
    second = torch.where(depth >= 2, path[:, 2], nxt)[deep]
    joint = torch.zeros(v, v, dtype=torch.float64)
    joint.index_put_((first[deep], second), torch.ones(int(deep.sum()), dtype=torch.float64), accumulate=True)
    expected = joint.sum(1, keepdim=True) * p2.double()
    assert _chi2_pvalue(joint.flatten(), expected.flatten()) > 1e-4
    assert 0.2 < deep.double().mean() < 0.99  # both outcomes were exercised


def _cache(rng, slots=3, kv_heads=2, length=24, d=16):
    k = torch.randn(slots, kv_heads, length, d, generator=rng)
    return k, torch.randn(slots, kv_heads, length, d, generator=rng)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tree_attention_sees_the_prefix_and_the_ancestors(backend, rng):
    tree = StaticTree.from_branching((2, 2))
    kc, vc = _cache(rng)
    b, n = 2, tree.num_nodes
    slot_idx, starts = torch.tensor([2, 0]), torch.tensor([5, 11])
    q = torch.randn(b, n, 4, 16, generator=rng)
    out = tree_attention(q, kc, vc, slot_idx, starts, tree.ancestors, 0.25, backend=backend)
    for r in range(b):
        for i in range(n):
            seen = list(range(int(starts[r]))) + [int(starts[r]) + j for j in range(n) if tree.ancestors[i, j]]
            keys = kc[slot_idx[r], :, seen].double().repeat_interleave(2, 0)  # [heads, L, D]
            vals = vc[slot_idx[r], :, seen].double().repeat_interleave(2, 0)
            w = torch.softmax(torch.einsum("hd,hld->hl", q[r, i].double(), keys) * 0.25, -1)
            want = torch.einsum("hl,hld->hd", w, vals)
            assert (out[r, i].double() - want).abs().max() < 1e-5 * want.abs().max()  # fp32 against float64


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_chain_shaped_tree_attention_is_the_causal_window(backend, rng):
    tree = StaticTree.chain(4)
    kc, vc = _cache(rng)
    slot_idx, starts = torch.tensor([1, 2]), torch.tensor([3, 9])
    q = torch.randn(2, 4, 4, 16, generator=rng)
    got = tree_attention(q, kc, vc, slot_idx, starts, tree.ancestors, 0.3, backend=backend)
    assert torch.equal(got, slot_attention(q, kc, vc, slot_idx, starts, 0.3, backend=backend))


def test_kv_compaction_moves_the_accepted_path_and_nothing_else(rng):
    tree = StaticTree.from_branching((3, 2))
    cache = KVCache(2, 3, 2, 8, 32, dtype=torch.float32, device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=rng))
    cache.v.copy_(torch.randn(cache.v.shape, generator=rng))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    slot_idx, starts = torch.tensor([2, 0, 3]), torch.tensor([4, 10, 0])  # slot 3: the sink (padding)
    node = torch.tensor([8, 2, 0])  # depth 2 (via node 2), depth 1, the root alone
    compact_kv_path(cache, slot_idx, starts, tree.path[node])
    for r, s in enumerate(slot_idx.tolist()):
        path = DraftTrees.from_parents([tree.host_parents]).path(0, int(node[r]))
        for d, j in enumerate(path):
            at, src = int(starts[r]) + d, int(starts[r]) + j
            assert torch.equal(cache.k[:, s, :, at], before_k[:, s, :, src])
            assert torch.equal(cache.v[:, s, :, at], before_v[:, s, :, src])
        # nothing before the window nor past the tree's depth moved
        end = int(starts[r]) + tree.max_depth + 1
        assert torch.equal(cache.k[:, s, :, : int(starts[r])], before_k[:, s, :, : int(starts[r])])
        assert torch.equal(cache.k[:, s, :, end:], before_k[:, s, :, end:])
    assert torch.equal(cache.k[:, 1], before_k[:, 1])  # a slot of no row


def test_tree_shapes_and_bad_branching():
    tree = StaticTree.from_branching((3, 2, 1))
    assert tree.num_nodes == 16 and tree.max_depth == 3 and not tree.is_chain
    assert StaticTree.chain(4).is_chain
    assert parse_branching("3,2,1") == (3, 2, 1)
    for bad in ("3,0", "a,b", ""):
        with pytest.raises(ValueError, match="children per depth"):
            parse_branching(bad)
    with pytest.raises(ValueError, match="visible"):
        tree_attention(torch.zeros(1, 4, 2, 16), *_cache(torch.Generator().manual_seed(0)), torch.tensor([0]),
                       torch.tensor([0]), torch.ones(3, 4, dtype=torch.bool), 1.0)


def test_mtp_tree_expansion_follows_the_head(tmp_path, seed, rng):
    """The MTP head's tree: the root's children are the head's top tokens, and the
    best-first path through the tree is the chain drafter's drafts (siblings' tentative
    pairs stay out of each other's attention), after the prompt and after a step."""
    from replayssm.engine.adapter import HybridEngine
    from replayssm.engine.device_drafters import DeviceMTPDrafter
    from replayssm.engine.drafters import load_mtp_head
    from replayssm.engine.loading import load_model
    from replayssm.testing.checkpoints import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path, "qwen3_5", seed=seed, with_mtp=True)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=10, max_len=96)
    head = load_mtp_head(eng, tmp_path)
    tree = StaticTree.from_branching((3, 2, 1))
    chain, wide = DeviceMTPDrafter(eng, head), DeviceMTPDrafter(eng, head, tree=tree)
    chain.bind(2, 3, 96, torch.device("cpu"))
    wide.bind(2, tree.num_nodes - 1, 96, torch.device("cpu"))
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (9, 14)]
    slots = [eng.alloc(), eng.alloc()]
    idx = torch.tensor(slots)
    with torch.inference_mode():
        out = eng.extend(slots, prompts, prompt=True, all_logits=True)
        firsts = [int(out.window_logits(i)[-1].argmax()) for i in range(2)]
        kw = dict(hidden=out.hidden, offsets=out.offsets)
        want = chain.join(slots, prompts, firsts, [0, 1], **kw)
        got = wide.join(slots, prompts, firsts, [0, 1], **kw)
        best = tree.path_tokens(torch.cat([torch.tensor(firsts)[:, None], got], 1), torch.tensor([10, 10]))
        assert torch.equal(best[:, 1:], want)  # node 10: the rank-0 child of the rank-0 child of the rank-0 child
        assert len(set(got[0, :3].tolist())) == 3  # the root's three children: distinct top tokens
        # one step: the first draft accepted, then a correction; both drafters observe it
        window = [[f] + w for f, w in zip(firsts, want.tolist())]
        v = eng.verify(slots, window)
        starts = torch.tensor([eng.length(s) for s in slots])
        eng.commit([2, 2])
        emitted = torch.tensor([[w[1], 7, -1, -1] for w in window])
        for d in (chain, wide):
            d.observe(idx, emitted, torch.tensor([2, 2]), hidden=v.hidden, positions=starts[:, None] + torch.arange(4))
        want, got = chain.propose(idx), wide.propose(idx)
        best = tree.path_tokens(torch.cat([torch.full((2, 1), 7), got], 1), torch.tensor([10, 10]))
        assert torch.equal(best[:, 1:], want)


def test_ngram_tree_takes_several_continuations(rng):
    from replayssm.engine.device_drafters import DeviceNgramDrafter

    tree = StaticTree.from_branching((2, 1))
    d = DeviceNgramDrafter(max_ngram=3, tree=tree)
    d.bind(2, tree.num_nodes - 1, 32, torch.device("cpu"))
    d.start(0, [1, 2, 3, 10, 11, 1, 2, 3, 20, 21, 1, 2, 3], 0)  # "1 2 3" was followed by 10 11, later by 20 21
    d.start(1, [5, 6, 7], 1)  # no match: every node repeats the last token
    got = d.propose(torch.tensor([0, 1]))
    assert got.tolist() == [[20, 10, 21, 11], [7, 7, 7, 7]]  # latest match first, each continued
    # a chain-shaped tree proposes the chain drafter's tokens
    chain, as_tree = DeviceNgramDrafter(), DeviceNgramDrafter(tree=StaticTree.chain(5))
    for x in (chain, as_tree):
        x.bind(4, 4, 40, torch.device("cpu"))
    for s in range(4):
        hist = torch.randint(0, 4, (int(torch.randint(3, 30, (1,), generator=rng)),), generator=rng).tolist()
        chain.start(s, hist, s)
        as_tree.start(s, hist, s)
    idx = torch.arange(4)
    assert torch.equal(chain.propose(idx), as_tree.propose(idx))
