"""The MTP drafter's head pass in few kernels, with the same numbers.

:class:`DeviceMTPDrafter` runs its head through a pass of its own (norms written into
shared buffers, a rotary table, queries and keys rotated in place together). Here it is
held against the head composed op by op (:meth:`MTPHead.pair_input`,
``rotary_cos_sin`` and transformers' rotary arithmetic, adds apart from norms): drafts,
head outputs and head KV caches bit for bit (fp32, CPU), greedy, sampled and tree; and
its kernel count per draft depth against a ceiling."""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.adapter import HybridEngine, _attention_inputs, gated_output
from replayssm.engine.attention import slot_attention, tree_attention
from replayssm.engine.device_drafters import DeviceMTPDrafter
from replayssm.engine.drafters import load_mtp_head
from replayssm.engine.fused_linear import fused_weight
from replayssm.engine.loading import embedded_model_dir, load_model
from replayssm.engine.norms import add_rms_norm, rms_norm
from replayssm.engine.sampling import SamplingParams
from replayssm.engine.trees import StaticTree
from replayssm.testing.op_count import count_ops

CAPACITY = 96


class GenericLayerDrafter(DeviceMTPDrafter):
    """The drafter with the head pass composed op by op (the drafter's code before its
    pass was cut to fewer kernels): transformers' rotary arithmetic
    (``_attention_inputs``), the residual adds apart from their norms, the engine's
    norm, output gate and MLP of a static step (each held against torch's ops in its own
    tests: tests/engine/test_activations_rotary.py, test_norms.py). The oracle; its
    matmuls are torch's (no normed linears)."""

    normed_linears = False

    def _layer(self, tokens, hidden, slot_idx, positions, rope, tree=None):
        eng, head = self.engine, self.head
        norm = eng.static_norm
        x = head.pair_input(eng, tokens.reshape(-1), hidden, norm)
        cos, sin = eng.rotary_cos_sin(x, positions.reshape(-1))
        layer = head.layers[0]
        attn = layer.self_attn
        b, t = positions.shape
        q, k, v, gate = _attention_inputs(attn, norm(layer.input_layernorm, x), cos, sin, norm)
        at = positions if tree is None else tree[0][:, None] + tree[1][None]
        where = (slot_idx[:, None].expand(b, t), slice(None), at)
        self.cache.k[0][where] = k.view(b, t, -1, attn.head_dim).to(self.cache.k.dtype)
        self.cache.v[0][where] = v.view(b, t, -1, attn.head_dim).to(self.cache.v.dtype)
        q = q.reshape(b, t, -1, attn.head_dim)
        if tree is None:
            o = slot_attention(q, self.cache.k[0], self.cache.v[0], slot_idx, positions[:, 0], attn.scaling,
                               backend=eng.backend)
        else:
            o = tree_attention(q, self.cache.k[0], self.cache.v[0], slot_idx, tree[0], tree[2], attn.scaling,
                               backend=eng.backend)
        heads = q.shape[2]
        x = x + attn.o_proj(gated_output(o.reshape(b * t, heads, -1), gate.view(b * t, heads, -1),
                                         fused=eng.fused_norms))
        y = norm(layer.post_attention_layernorm, x)
        x = x + eng.static_mlp(layer.mlp, y)
        return norm(head.norm, x)

    def _prompt_kv(self, layout, ids, hidden):
        """A join's keys and values of the prompts' pairs as :meth:`MTPHead.forward_layer`
        composes the head's pass (transformers' rotary and modules, the engine's norms),
        which writes them into the cache on its way."""
        self.head.forward_layer(self.engine, self.cache, layout, ids, hidden, norm=self.engine.static_norm)


@pytest.fixture(scope="module")
def model():
    return load_model(str(embedded_model_dir("embedded")), dtype="float32", device="cpu")


def _drafter(cls, model, backend, k, normed_linears=True, **kw):
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=k + 1, max_len=CAPACITY, backend=backend)
    d = cls(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))), **kw)
    d.normed_linears = normed_linears and cls.normed_linears
    d.bind(2, k, CAPACITY, eng.device)
    return d


def _rounds(rng, hidden_size, vocab, k, window, rounds=3):
    """A join of two requests and ``rounds`` steps, as random tensors: what
    :func:`_drive` feeds both drafters. The interpreter's tests take two steps: the
    first reads the join's pairs in the head's cache, the second the first's; a
    third would run the second's code again."""
    lengths = [5, 11]
    prompts = [torch.randint(0, vocab, (n,), generator=rng).tolist() for n in lengths]
    firsts = torch.randint(0, vocab, (2,), generator=rng).tolist()
    join_hidden = torch.randn(sum(lengths), hidden_size, generator=rng)
    steps = []
    starts = torch.tensor(lengths)
    for _ in range(rounds):
        accepted = torch.randint(1, window + 1, (2,), generator=rng)
        emitted = torch.randint(0, vocab, (2, window), generator=rng)
        emitted[torch.arange(window)[None] >= accepted[:, None]] = -1
        hidden = torch.randn(2 * window, hidden_size, generator=rng)
        steps.append((emitted, accepted, hidden, starts[:, None] + torch.arange(window)))
        starts = starts + accepted
    return prompts, firsts, join_hidden, steps


def _drive(d, rounds, seed):
    """Every output of ``d`` over ``rounds``: drafts (and sampled probabilities), head
    outputs, the head's cache. Sampled drafts draw from the global generator, seeded
    per call."""
    prompts, firsts, join_hidden, steps = rounds
    offsets = [0, len(prompts[0]), len(prompts[0]) + len(prompts[1])]
    dev, dtype = d.engine.device, d.engine.dtype
    slots = torch.tensor([0, 1], device=dev)
    outs = []
    with torch.inference_mode():
        torch.manual_seed(seed)
        outs.append(d.join([0, 1], prompts, firsts, [0, 1], hidden=join_hidden.to(dev, dtype), offsets=offsets))
        for i, (emitted, accepted, hidden, positions) in enumerate(steps):
            emitted, accepted, positions = emitted.to(dev), accepted.to(dev), positions.to(dev)
            d.observe(slots, emitted, accepted, hidden=hidden.to(dev, dtype), positions=positions)
            torch.manual_seed(seed + 1 + i)
            outs += [d.propose(slots), d._last_hidden]
            if d.q is not None:
                outs.append(d.draft_probs(slots))
    return outs + [d.cache.k, d.cache.v]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "tree"])
def test_head_pass_is_the_generic_layers_bit_for_bit(model, backend, mode, rng, seed):
    """The cut pass with torch's matmuls (``normed_linears`` off) against the generic
    layers: every output bit for bit (fp32, CPU), greedy, sampled and tree."""
    kw = {}
    if mode == "sampled":
        kw = dict(sampling=SamplingParams(temperature=0.8, top_k=50))
    elif mode == "tree":
        kw = dict(tree=StaticTree.from_branching((3, 2, 1)))
    k = kw["tree"].num_nodes - 1 if mode == "tree" else 3
    fast = _drafter(DeviceMTPDrafter, model, backend, k, normed_linears=False, **kw)
    assert fast._greedy_weights is None
    slow = _drafter(GenericLayerDrafter, model, backend, k, **kw)
    rounds = _rounds(rng, fast.engine.embed.weight.shape[1], fast.engine.vocab_size, k,
                     k + 1 if mode != "tree" else 4, rounds=2)
    got, want = _drive(fast, rounds, seed), _drive(slow, rounds, seed)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and torch.equal(g, w), f"output {i} differs"
    drafts = torch.cat([o for o in want if o.dtype == torch.int64])
    assert drafts.unique().numel() > 4  # varied drafts, not one repeated token


#: Kernel ceiling of a join's keys and values of two prompts of uneven lengths on the
#: fused (GPU) path under the interpreter: the head up to its attention, and the writes.
JOIN_KV_OPS = 12


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_join_prompt_pairs_are_forward_layers_keys_and_values(model, backend, rng):
    """The keys and values a join writes for the prompts' pairs (the step's head pass up
    to its attention, :meth:`DeviceMTPDrafter._prompt_kv`) against those
    :meth:`MTPHead.forward_layer` writes op by op: bit for bit in every slot and
    position, in at most :data:`JOIN_KV_OPS` kernels on the fused path (no attention,
    MLP or final norm: no output of these pairs is read)."""
    from replayssm.engine.kv_cache import WindowLayout

    fast, slow = (_drafter(DeviceMTPDrafter, model, backend, 3) for _ in range(2))
    lengths = [7, 13]
    layout = WindowLayout([1, 0], [0, 0], lengths, fast.engine.device)
    ids = torch.randint(0, fast.engine.vocab_size, (sum(lengths),), generator=rng)
    hidden = torch.randn(sum(lengths), fast.engine.embed.weight.shape[1], generator=rng)
    with torch.inference_mode():
        with count_ops() as ops:
            fast._prompt_kv(layout, ids, hidden)
        slow.head.forward_layer(slow.engine, slow.cache, layout, ids, hidden, norm=slow.engine.static_norm)
    for s, n in zip([1, 0], lengths):
        assert fast.cache.k[0, s, :, :n].abs().min() > 0  # every pair's entry written
    assert torch.equal(fast.cache.k, slow.cache.k) and torch.equal(fast.cache.v, slow.cache.v)
    if backend == "triton":
        assert ops.total <= JOIN_KV_OPS, ops.counts
        assert not set(ops.counts) & {"aten.cos", "aten.sin", "aten.cat", "aten._scaled_dot_product_flash_attention",
                                      "aten._scaled_dot_product_efficient_attention"}, ops.counts


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["greedy", "tree"])
def test_head_pass_on_cuda_in_bf16_is_the_generic_layers(mode, rng):
    """On the GPU path (bf16, fused norms, Triton attention) the cut pass computes the
    generic layers' values bit for bit too: its kernels do the same roundings."""
    model = load_model(str(embedded_model_dir("embedded")), dtype="bfloat16", device="cuda")
    kw = dict(tree=StaticTree.from_branching((3, 2, 1), "cuda")) if mode == "tree" else {}
    k = kw["tree"].num_nodes - 1 if kw else 3
    fast = _drafter(DeviceMTPDrafter, model, "auto", k, normed_linears=False, **kw)
    slow = _drafter(GenericLayerDrafter, model, "auto", k, **kw)
    assert fast.engine.fused_norms
    rounds = _rounds(rng, fast.engine.embed.weight.shape[1], fast.engine.vocab_size, k, 4)
    for i, (g, w) in enumerate(zip(_drive(fast, rounds, 0), _drive(slow, rounds, 0))):
        assert g.dtype == w.dtype and torch.equal(g, w), f"output {i} differs"


def _check_greedy_pass(model, backend, rng, rel: float, margin: float, starts=(5, 30), key_split=None) -> None:
    """:meth:`DeviceMTPDrafter._greedy_pass` against the generic layers' pass and torch's
    LM head and argmax on the same inputs (random pairs, a random context in both
    caches): an update of ``T = 4`` pairs a request picking one row each, then a depth of
    one pair. Head outputs and the cache entries written within ``rel`` of their scale;
    tokens equal wherever the oracle's best logit leads the next by more than
    ``margin`` (and that must be most rows, or the check says nothing). ``starts``: the
    two requests' context lengths; ``key_split``: the fast pass's
    :attr:`~DeviceMTPDrafter.attention_key_split`, if not its default."""
    fast = _drafter(DeviceMTPDrafter, model, backend, 3)
    slow = _drafter(GenericLayerDrafter, model, backend, 3)
    if key_split is not None:
        fast.attention_key_split = key_split
    assert fast._greedy_weights is not None and slow._greedy_weights is None
    dev, dtype, hid = fast.engine.device, fast.engine.dtype, fast.engine.embed.weight.shape[1]
    context = torch.randn(fast.cache.k.shape, generator=rng)
    for d in (fast, slow):
        d.cache.k.copy_(context)
        d.cache.v.copy_(context.flip(-1))
    slot, starts = torch.tensor([1, 0], device=dev), torch.tensor(starts, device=dev)
    checked = rows = 0
    for t, pick in ((4, torch.randint(0, 4, (2,), generator=rng).to(dev)), (1, None)):
        tokens = torch.randint(0, fast.engine.vocab_size, (2, t), generator=rng).to(dev)
        hidden = torch.randn(2 * t, hid, generator=rng).to(dev, dtype)
        positions = starts[:, None] + torch.arange(t, device=dev)
        with torch.inference_mode():
            h, tok = fast._greedy_pass(tokens, hidden, slot, positions, fast._rope_at(positions), pick)
            out = slow._layer(tokens, hidden, slot, positions, slow._rope_at(positions)).view(2, t, -1)
            want_h = out[:, 0] if pick is None else out[torch.arange(2, device=dev), pick]
            logits = slow.engine.lm_head(want_h).float()
        scale = want_h.float().abs().max()
        assert (h.float() - want_h.float()).abs().max() <= rel * scale, t
        for got, want in ((fast.cache.k, slow.cache.k), (fast.cache.v, slow.cache.v)):
            assert (got.float() - want.float()).abs().max() <= rel * want.float().abs().max(), t
        top2 = logits.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > margin
        assert torch.equal(tok[clear], logits.argmax(-1)[clear]), t
        checked, rows = checked + int(clear.sum()), rows + 2
    assert checked >= rows // 2, "too few rows with a clear best token to check"


def test_greedy_pass_is_the_generic_pass_to_rounding(model, rng):
    """fp32 under the interpreter: the normed linears' matmuls sum in another order than
    torch's, so values agree to 1e-5 of their scale (several fp32 ulps over 6 chained
    matmuls of K <= 512), not bit for bit."""
    _check_greedy_pass(model, "triton", rng, rel=1e-5, margin=1e-4)


def test_greedy_pass_with_its_keys_split_is_the_generic_pass_to_rounding(model, rng, monkeypatch):
    """The pass's attention with its keys in parts of 64 over contexts of 40 and 85
    keys (one part, and two merged by the last): the generic pass to the same
    rounding. And only passes of a few requests split: one of more requests than
    ``attention_key_split_rows`` walks its keys whole (the split each pass asks of the
    attention, read at its call; those two passes' kernels are not run: a pass's
    launches do not depend on what its kernels write)."""
    _check_greedy_pass(model, "triton", rng, rel=1e-5, margin=1e-4, starts=(40, 85), key_split=64)
    from replayssm.engine import adapter

    seen = []
    attend = adapter.slot_attention
    monkeypatch.setattr(adapter, "slot_attention", lambda *a, **kw: seen.append(kw["key_split"]) or attend(*a, **kw))
    d = _drafter(DeviceMTPDrafter, model, "triton", 2)
    hid = d.engine.embed.weight.shape[1]
    for b in (d.attention_key_split_rows, d.attention_key_split_rows + 1):
        positions = torch.full((b, 1), 3)
        with torch.inference_mode(), count_ops(run_triton=False):
            d._greedy_pass(torch.zeros((b, 1), dtype=torch.int64), torch.randn(b, hid, generator=rng),
                           torch.zeros(b, dtype=torch.int64), positions, d._rope_at(positions))
    assert seen == [d.attention_key_split, 0]


@pytest.mark.gpu
def test_greedy_pass_on_cuda_in_bf16_is_the_generic_pass_to_rounding(rng):
    """bf16 on the GPU: each matmul's result rounds to bf16 (2^-8 of its value) after a
    different summation order, and a differently rounded value feeds every later op:
    within 2^-5 of the scale (a few ulps through the pass); tokens where the best logit
    leads by more than a quarter (two bf16 ulps of logits up to 16)."""
    model = load_model(str(embedded_model_dir("embedded")), dtype="bfloat16", device="cuda")
    _check_greedy_pass(model, "auto", rng, rel=2 ** -5, margin=0.25)


def test_greedy_drafts_with_normed_linears_are_the_generic_drafts(model, rng, seed):
    """Joins, updates and drafts through :meth:`DeviceMTPDrafter._greedy_pass` (fp32,
    interpreter) against the generic layers: the same drafts (a flip needs two logits
    within the passes' ~1e-6 difference of each other), head outputs and caches to
    1e-5 of their scale. Two drafts a step: the second already chains a pass on the
    first's token, hidden state and cache row (a third would run that code again)."""
    fast = _drafter(DeviceMTPDrafter, model, "triton", 2)
    slow = _drafter(GenericLayerDrafter, model, "triton", 2)
    rounds = _rounds(rng, fast.engine.embed.weight.shape[1], fast.engine.vocab_size, 2, 3, rounds=2)
    got, want = _drive(fast, rounds, seed), _drive(slow, rounds, seed)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w.dtype == torch.int64:
            assert torch.equal(g, w), f"drafts {i} differ"
        else:
            assert (g - w).abs().max() <= 1e-5 * w.abs().max(), f"output {i} differs"


@pytest.mark.gpu
def test_chained_passes_are_the_passes_in_stream_order(rng):
    """The greedy passes launched as a chain (:attr:`DeviceMTPDrafter.chain_passes`:
    each kernel starts during the one before and waits before it reads its inputs)
    against the same passes launched in stream order, bf16, six rounds of updates and
    drafts at every accepted count: drafts, head outputs and caches bit for bit, each
    round replayed from a CUDA graph too. A wait missing or misplaced would read a
    buffer before the kernel writing it had finished: some value of the round would
    differ."""
    model = load_model(str(embedded_model_dir("embedded")), dtype="bfloat16", device="cuda")
    chained, ordered = (_drafter(DeviceMTPDrafter, model, "auto", 3) for _ in range(2))
    ordered.chain_passes = False
    assert chained._greedy(8) and chained.chain_passes
    rounds = _rounds(rng, chained.engine.embed.weight.shape[1], chained.engine.vocab_size, 3, 4, rounds=6)
    got, want = _drive(chained, rounds, 0), _drive(ordered, rounds, 0)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"output {i} differs"
    # one update and its drafts captured (the chain as programmatic edges), replayed
    emitted, accepted, hidden, positions = (x.to("cuda") for x in rounds[3][-1])
    hidden = hidden.to(torch.bfloat16)
    slots = torch.tensor([0, 1], device="cuda")
    outs = {}
    with torch.inference_mode():
        for d in (chained, ordered):
            d.observe(slots, emitted, accepted, hidden=hidden, positions=positions)
            d.propose(slots)  # warm-up outside the graph
        for name, d in (("chained", chained), ("ordered", ordered)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                d.observe(slots, emitted, accepted, hidden=hidden, positions=positions)
                drafts = d.propose(slots)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            outs[name] = (drafts.clone(), d._last_hidden.clone(), d.cache.k.clone(), d.cache.v.clone())
    for i, (g, w) in enumerate(zip(outs["chained"], outs["ordered"])):
        assert torch.equal(g, w), f"replayed output {i} differs"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["greedy", "tree"])
def test_join_drafts_in_a_graph_are_the_eager_ones(mode, rng):
    """A join's first drafts replayed from its captured graph
    (:meth:`DeviceMTPDrafter.capture_join`): bit for bit the eager drafts when the join
    fills the graph's rows (bf16), and the same tokens when sink rows pad it (fp32: the
    matmuls' shapes differ, so only the tokens are compared); every later output is the
    eager drafter's bit for bit either way."""
    for dtype, buckets in (("bfloat16", [1, 2]), ("float32", [4])):
        model = load_model(str(embedded_model_dir("embedded")), dtype=dtype, device="cuda")
        kw = dict(tree=StaticTree.from_branching((3, 2, 1), "cuda")) if mode == "tree" else {}
        k = kw["tree"].num_nodes - 1 if kw else 3
        graphed, eager = _drafter(DeviceMTPDrafter, model, "auto", k, **kw), _drafter(DeviceMTPDrafter, model, "auto", k, **kw)
        graphed.capture_join(buckets)
        assert sorted(graphed._join_graphs) == buckets
        rounds = _rounds(rng, graphed.engine.embed.weight.shape[1], graphed.engine.vocab_size, k, 4)
        got, want = _drive(graphed, rounds, 0), _drive(eager, rounds, 0)
        assert got[0].shape == want[0].shape == (2, k)
        assert torch.equal(got[0], want[0]), f"{dtype}: the join's drafts differ"
        for i, (g, w) in enumerate(zip(got[1:-2], want[1:-2]), 1):
            assert torch.equal(g, w), f"{dtype}: output {i} differs"
        # the caches differ only at the join drafts' tentative positions, which the first
        # step overwrote; the sink slot (padding rows) is not compared
        for g, w in zip(got[-2:], want[-2:]):
            assert torch.equal(g[:, :2], w[:, :2]), f"{dtype}: the head's cache differs"


# Kernel ceilings of the GPU path (fused norms, Triton attention; here under the
# interpreter), counted by replayssm.testing.op_count.
OBSERVE_OPS = 10
DEPTH_OPS = 9
FIRST_DRAFT_OPS = 1


def test_kernels_per_draft_depth(model, rng):
    """Kernels of the drafter's work per step on the fused (GPU) path, greedy chains
    (the head's passes as normed linears): ``observe`` (the head over the ``T`` emitted
    pairs, then the LM head and its argmax on each request's last accepted pair: the
    first drafts) at most 10, the first draft in ``propose`` 1 (the drafts' stack), each
    further draft depth at most 9.

    A depth is one head pass with its LM head and argmax: ``fc`` with the embedding
    lookup and the two input norms; ``q|gate|k|v`` with the input norm; the query and
    key norms (one kernel); the rotary of queries and keys with the cache writes of
    keys and values (one kernel); the attention with its output gate; ``o_proj`` with
    the residual add; ``gate|up`` with the post-attention norm and SiLU's product;
    ``down`` with the residual add; the LM head with the final norm and each column
    block's argmax, the blocks merged by the last to finish (11 and 10 with the merge
    a launch of its own). ``observe`` adds one kernel before its pass
    (:func:`~replayssm.engine.step_inputs.draft_inputs`: the tokens, the accepted rows'
    offsets, the next positions, and every depth's positions and rotary rows; 15 with
    seven torch ops in its place), so a chain of ``k`` drafts costs ``1 + 9 (k - 1)``
    in ``propose`` (3 more before). Before the normed linears (``normed_linears`` off, the modules'
    matmuls): 19 for ``observe``, 3 for the first draft, 15 a depth; 16 a depth and 20
    before the output gate joined the attention, 18 and 22 before the cache writes
    joined the rotary, 21 and 25 before the embedding and the paired norms, 25 and 29
    before the rotary and the output gate became one kernel each, 29 and 33 before SiLU
    and its product did, 28 and 32 before gate and up became one matmul, 27 and 31
    before q, k and v did: a count past the ceiling is a kernel added per draft."""
    counts = {}
    for k in (1, 2, 3):  # the first draft alone, then one and two depths after it (a depth: 3 less 2)
        d = _drafter(DeviceMTPDrafter, model, "triton", k)
        emitted = torch.randint(0, d.engine.vocab_size, (1, k + 1), generator=rng)
        hidden = torch.randn(k + 1, d.engine.embed.weight.shape[1], generator=rng)
        slots, accepted, positions = torch.tensor([0]), torch.tensor([2]), 7 + torch.arange(k + 1)[None]
        # counted without running the Triton kernels: the drafter's launches do not
        # depend on what they write (it runs in a captured step)
        with torch.inference_mode():
            with count_ops(run_triton=False) as observe:
                d.observe(slots, emitted, accepted, hidden=hidden, positions=positions)
            with count_ops(run_triton=False) as propose:
                d.propose(slots)
        counts[k] = (observe, propose)
    for k, (observe, _) in counts.items():
        assert observe.total <= OBSERVE_OPS, (k, observe.counts)
    assert counts[1][1].total <= FIRST_DRAFT_OPS, counts[1][1].counts
    depth = counts[3][1].total - counts[2][1].total
    assert depth <= DEPTH_OPS, (counts[2][1].counts, counts[3][1].counts)
    assert counts[3][1].total <= FIRST_DRAFT_OPS + 2 * DEPTH_OPS, counts[3][1].counts
    # the rotary embedding and the concatenations are gone from the passes, not moved
    names = set(counts[3][0].counts) | set(counts[3][1].counts)
    assert not names & {"aten.cos", "aten.sin", "aten.cat", "aten.copy_", "aten.clone"}, names


#: Kernel ceilings of a whole captured step on the embedded model at batch 1 (the GPU
#: path under the interpreter): a plain step, and fold's with 3 MTP drafts.
PLAIN_STEP_OPS = 91
MTP_STEP_OPS = 125


def test_kernels_per_step(model):
    """A static step's kernels at batch 1 on the fused (GPU) path: plain decoding at most
    91, fold verifying 3 MTP drafts at most 125 (8 layers, 2 of them full attention;
    the MTP head's observe pass and 2 further depths), counted on a step after its
    warm-up, as a capture takes it. 128 before the LM heads' argmax merged in their
    launch, 134 before the drafter's inputs became one kernel,
    150 before the head's passes became normed linears,
    151 before fold's commit kept its zero start
    positions, 92 and 152 before the step's
    output kernel wrote the next token into the next window, 96 and 156 before the step's
    inputs (windows, lengths, positions, embedding and rotary rows) became one kernel,
    98 and 161 before the output
    gate joined the attention, 102 and 171 before the cache writes joined the rotary,
    104 and 182 before the query and key norms and the head's input norms became one
    kernel each; 136 and 229 before the attention
    layers' rotary and output gate became a kernel each, the rotary rows a gather from a
    table (115 and 196) and the step's outputs after acceptance one kernel: a count past
    the ceiling is a kernel added to every step."""
    from replayssm.engine.graph_step import StaticStep

    counts = {}
    # one engine and prompt for both steps, each counted after its own warm-up (the
    # same kernels, by name and number, as on an engine of its own)
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=CAPACITY, backend="triton")
    slot = eng.alloc()
    with count_ops(run_triton=False):  # the steps read the prompt's length, not its state's values
        eng.extend([slot], [list(range(10, 14))], prompt=True)
    for mode in ("plain", "fold"):
        windows = torch.zeros((3, 4), dtype=torch.int64)
        drafter = None
        if mode == "fold":
            drafter = DeviceMTPDrafter(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))))
            drafter.bind(2, 3, CAPACITY + 4, eng.device)
        step = StaticStep(eng, windows if drafter else windows[:, :1], 1, drafter=drafter)
        step.set_rows([slot])
        # Neither step's Triton kernels are run: a step's launches do not depend on what
        # they write. The host's check of the accepted counts reads them from the output
        # buffer, which the (unrun) emit kernel would write: one token a row.
        step.out[:, 0] = 1
        with torch.inference_mode():
            with count_ops(run_triton=False):
                step.run()  # the warm-up a capture runs first (what it makes once is not in the graph)
            with count_ops(run_triton=False) as ops:
                step.run()
        counts[mode] = ops
    assert counts["plain"].total <= PLAIN_STEP_OPS, counts["plain"].counts
    assert counts["fold"].total <= MTP_STEP_OPS, counts["fold"].counts
    names = set(counts["plain"].counts) | set(counts["fold"].counts)
    assert not names & {"aten.cos", "aten.sin", "aten.neg"}, names  # no rotary evaluated in a step


@pytest.mark.parametrize("mode", ["greedy", "tree"])
def test_fused_attention_projections_give_the_unfused_heads_bits(model, mode, rng, seed):
    """The drafter with the head's (and the engine's) q_proj, k_proj, v_proj as one
    matmul against one on a fresh copy of the model with them unfused (three modules):
    drafts, head outputs and head caches bit for bit (fp32, CPU, fused norms)."""
    kw = dict(tree=StaticTree.from_branching((3, 2, 1))) if mode == "tree" else {}
    k = kw["tree"].num_nodes - 1 if mode == "tree" else 3
    fast = _drafter(DeviceMTPDrafter, model, "triton", k, normed_linears=False, **kw)
    slow = _drafter(DeviceMTPDrafter, load_model(str(embedded_model_dir("embedded")), dtype="float32", device="cpu"),
                    "triton", k, normed_linears=False, **kw)
    for d, fused in ((fast, True), (slow, False)):
        attns = [d.head.layers[0].self_attn] + [layer.self_attn for kind, layer in zip(d.engine.kinds, d.engine.layers)
                                                if kind == "attn"]
        for attn in attns:
            if not fused:  # k_proj's weight its own tensor again: the layout ends
                attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())
            assert (fused_weight((attn.q_proj, attn.k_proj, attn.v_proj)) is not None) == fused
    rounds = _rounds(rng, fast.engine.embed.weight.shape[1], fast.engine.vocab_size, k, k + 1 if mode != "tree" else 4,
                     rounds=2)
    got, want = _drive(fast, rounds, seed), _drive(slow, rounds, seed)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and torch.equal(g, w), f"output {i} differs"


def test_op_counter_counts_kernels_not_views(rng):
    x = torch.randn(4, 6, generator=rng)
    with count_ops() as ops:
        y = (x.t().contiguous() * 2).view(-1)[::2].sum()
        torch.empty(3)
    assert dict(ops.counts) == {"aten.clone": 1, "aten.mul": 1, "aten.sum": 1}, ops.counts
    assert torch.equal(y, (x.t() * 2).reshape(-1)[::2].sum())
    w = torch.randn(6, generator=rng)
    with count_ops() as ops:
        rms_norm(x, w, 1e-6, "offset")
    assert dict(ops.counts) == {"triton._rms_norm_kernel": 1}, ops.counts  # the interpreter's copies not counted


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_norm_into_slices_of_a_buffer(backend, rng):
    """``rms_norm(..., out=)`` writes what a fresh result holds, into column slices of a
    matrix and head slices of ``[N, heads, D]``, and nothing else of the buffer."""
    n, heads, d = 5, 3, 16
    w = 0.3 * torch.randn(d, generator=rng)
    x = 3 * torch.randn(n, heads, 2 * d, generator=rng)[..., :d]  # strided input, as q out of q_proj
    buf = torch.randn(n, heads + 2, d, generator=rng)
    keep = buf.clone()
    got = rms_norm(x, w, 1e-6, "offset", backend=backend, out=buf[:, 1:1 + heads])
    want = rms_norm(x, w, 1e-6, "offset", backend=backend)
    assert got.data_ptr() == buf[:, 1].data_ptr() and torch.equal(buf[:, 1:1 + heads], want)
    assert torch.equal(buf[:, 0], keep[:, 0]) and torch.equal(buf[:, -1], keep[:, -1])
    wide = torch.randn(n, 3 * d, generator=rng)
    rms_norm(x[:, 0], w, 1e-6, "offset", backend=backend, out=wide[:, d:2 * d])
    assert torch.equal(wide[:, d:2 * d], want[:, 0])
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(x, w, 1e-6, "offset", backend=backend, out=buf[:, :heads].transpose(1, 2))


def test_add_norm_kernel_is_the_add_then_the_norm(rng):
    """The fused kernel of ``add_rms_norm`` returns the sum and its norm, bit for bit
    what the add and the norm kernel give apart (fp32; the interpreter runs no bf16)."""
    x = 3 * torch.randn(6, 48, generator=rng)
    r = torch.randn(6, 2, 48, generator=rng)[:, 1]  # strided rows, as a slice passes them
    w = 0.3 * torch.randn(48, generator=rng)
    s, y = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(y, rms_norm(x + r, w, 1e-6, "offset"))
    with pytest.raises(ValueError, match="x and residual"):
        add_rms_norm(x, r[:, :5], w, 1e-6)


def test_a_key_split_with_a_tree_is_refused_before_the_cache_writes(model, rng):
    """``static_attention_forward`` splits the keys of causal windows only: with a tree
    it raises before the window's keys and values reach the cache."""
    from replayssm.engine.adapter import static_attention_forward

    d = _drafter(DeviceMTPDrafter, model, "triton", 2)
    attn, hid = d.head.layers[0].self_attn, d.engine.embed.weight.shape[1]
    d.cache.k.normal_(generator=rng)
    before = d.cache.k.clone(), d.cache.v.clone()
    from replayssm.engine.attention import visibility_bits

    positions = torch.full((1, 2), 5)
    visible = torch.tril(torch.ones(2, 2, dtype=torch.bool))  # a chain of two nodes, as a tree
    tree = (torch.tensor([5]), torch.arange(2), visible, visibility_bits(visible))
    with pytest.raises(ValueError, match="key_split is for causal windows"):
        static_attention_forward(attn, torch.randn(2, hid, generator=rng), d._rope_at(positions), d.cache, 0,
                                 torch.tensor([0]), positions, backend="triton", fused=True, tree=tree,
                                 key_split=64, arrivals=d.engine.arrivals)
    assert torch.equal(d.cache.k, before[0]) and torch.equal(d.cache.v, before[1])


def test_slot_attention_reads_strided_queries(rng):
    """Queries sliced out of a wider buffer (the MTP head's query/key buffer): the
    Triton kernel reads them in place and returns what contiguous queries give."""
    b, t, heads, kv_heads, d, cap = 2, 3, 4, 2, 16, 24
    kc, vc = torch.randn(3, kv_heads, cap, d, generator=rng), torch.randn(3, kv_heads, cap, d, generator=rng)
    qk = torch.randn(b, t, heads + kv_heads, d, generator=rng)
    slot, starts = torch.tensor([2, 0]), torch.tensor([5, 11])
    got = slot_attention(qk[:, :, :heads], kc, vc, slot, starts, 0.25, backend="triton")
    want = slot_attention(qk[:, :, :heads].contiguous(), kc, vc, slot, starts, 0.25, backend="triton")
    assert got.is_contiguous() and torch.equal(got, want)
    ref = slot_attention(qk[:, :, :heads], kc, vc, slot, starts, 0.25, backend="reference")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)  # fp32: the kernel's online softmax, a few ulp


def test_rope_table_rows_are_the_rotary_at_each_position(model, rng):
    """Each row of the drafter's rotary table equals the engine's rotary embedding
    evaluated at that position alone (and in a batch of random positions)."""
    d = _drafter(DeviceMTPDrafter, model, "reference", 3)
    eng = d.engine
    pos = torch.randint(0, CAPACITY, (7,), generator=rng)
    x = torch.randn(7, eng.embed.weight.shape[1], generator=rng)
    cos, sin = eng.rotary_cos_sin(x, pos)
    half = cos.shape[-1] // 2
    rows = d._rope_at(pos)
    assert torch.equal(rows[:, 0], cos) and torch.equal(rows[:, 1], torch.cat([sin[:, half:], -sin[:, :half]], -1))
    one = eng.rotary_cos_sin(x[:1], pos[:1])[0]
    assert torch.equal(rows[:1, 0], one)


def test_static_steps_gather_the_rotary_rows_they_would_evaluate(model, rng, monkeypatch):
    """The engine's static steps take their rotary rows from a table of every position up
    to ``max_len + window``, in one kernel: the rows of the embedding evaluated at those
    positions (bit for bit, fp32). An embedding whose frequencies follow the sequence
    length has no table, and its steps evaluate it."""
    from replayssm.engine.rotary import rope_rows

    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=CAPACITY, backend="reference")
    pos = torch.randint(0, CAPACITY + 4, (2, 3), generator=rng)
    h = torch.randn(6, eng.embed.weight.shape[1], generator=rng)
    want = rope_rows(*eng.rotary_cos_sin(h, pos.reshape(-1))).view(2, 3, 2, -1)
    with count_ops() as ops:
        got = eng.static_rope(h, pos)
    assert torch.equal(got, want) and ops.total == 1, ops.counts
    monkeypatch.setattr(eng.rotary, "rope_type", "dynamic", raising=False)
    evaluated = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=CAPACITY, backend="reference")
    assert evaluated._rope is None and torch.equal(evaluated.static_rope(h, pos), want)


def test_length_dependent_rotary_is_refused(model, monkeypatch):
    """A rotary embedding whose frequencies follow the sequence length (transformers'
    ``dynamic``) would not match the table built at bind: refused there, by name."""
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=CAPACITY, backend="reference")
    monkeypatch.setattr(eng.rotary, "rope_type", "dynamic", raising=False)
    d = DeviceMTPDrafter(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))))
    with pytest.raises(ValueError, match="dynamic"):
        d.bind(2, 3, CAPACITY, eng.device)


@pytest.mark.parametrize("cls", [DeviceMTPDrafter, "ngram"])
def test_a_tree_built_on_another_device_is_refused_at_bind(model, cls):
    """A static tree expands on the engine's device: one built elsewhere is refused with
    its device named, before the drafter allocates anything."""
    from replayssm.engine.device_drafters import DeviceNgramDrafter

    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=CAPACITY, backend="reference")
    tree = StaticTree.from_branching((2, 1), "meta")
    d = (DeviceMTPDrafter(eng, load_mtp_head(eng, str(embedded_model_dir("embedded"))), tree=tree)
         if cls is DeviceMTPDrafter else DeviceNgramDrafter(tree=tree))
    with pytest.raises(ValueError, match="tree is on meta, the engine on cpu"):
        d.bind(2, tree.num_nodes - 1, CAPACITY, eng.device)
    assert not hasattr(d, "cache") and not hasattr(d, "history")
