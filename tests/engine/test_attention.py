"""The window attention's output gate in its launch (``slot_attention`` / ``tree_attention``
with ``gate=``): the bits of the attention followed by ``sigmoid_mul``, on both kernels'
masks, with the gate a strided view of a wider projection output. And the keys split
into parts when the programs are few (flash-decoding): the unsplit outputs to rounding."""

import pytest
import torch

from replayssm.engine import attention
from replayssm.engine.activations import sigmoid_mul
from replayssm.engine.attention import key_splits, slot_attention, tree_attention


def _case(gen, b=2, t=3, heads=4, kv_heads=2, d=32, slots=5, cap=16, device="cpu", dtype=torch.float32):
    r = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
    q, kc, vc = r(b, t, heads, d), r(slots, kv_heads, cap, d), r(slots, kv_heads, cap, d)
    gate = r(b * t, 2 * heads * d).view(b * t, heads, 2 * d)[..., d:]  # q|gate halves: the gate's rows strided
    rows = torch.randperm(slots, generator=gen)[:b].to(device)
    starts = torch.randint(0, cap - t + 1, (b,), generator=gen).to(device)
    return q, kc, vc, gate, rows, starts


def _both(q, kc, vc, rows, starts, backend, gate=None):
    """Slot attention and tree attention over the causal window (its tril mask)."""
    vis = torch.tril(torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device))
    return (slot_attention(q, kc, vc, rows, starts, 0.3, backend=backend, gate=gate),
            tree_attention(q, kc, vc, rows, starts, vis, 0.3, backend=backend, gate=gate))


def test_gate_in_the_attention_is_the_attention_then_sigmoid_mul(rng):
    """Each kernel's gated outputs equal its ungated outputs passed through
    ``sigmoid_mul`` bit for bit; the reference backend gates with torch's two ops."""
    q, kc, vc, gate, rows, starts = _case(rng)
    plain = _both(q, kc, vc, rows, starts, "triton")
    gated = _both(q, kc, vc, rows, starts, "triton", gate)
    for o, g in zip(plain, gated):
        want = sigmoid_mul(o.reshape(gate.shape), gate).view(o.shape)
        assert torch.equal(g, want)
        assert not torch.equal(g, o)
    for o, g in zip(_both(q, kc, vc, rows, starts, "reference"), _both(q, kc, vc, rows, starts, "reference", gate)):
        assert torch.equal(g, (o.reshape(gate.shape) * torch.sigmoid(gate)).view(o.shape))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_gate_that_does_not_fit_is_refused(rng, backend):
    """A gate of another shape or dtype, or not contiguous along its last axis: a
    ValueError naming it, on either backend."""
    q, kc, vc, gate, rows, starts = _case(rng)
    for bad in (gate[:-1], gate.double(), gate.transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match="gate must be a torch.float32 tensor"):
            slot_attention(q, kc, vc, rows, starts, 0.3, backend=backend, gate=bad)


@pytest.mark.gpu
def test_gate_in_the_attention_on_cuda_in_bf16():
    """The compiled kernel in bf16 (heads of 64, the embedded model's): the bits of the
    attention followed by ``sigmoid_mul``, one token and a window of 4, chain and tree."""
    gen = torch.Generator().manual_seed(4)
    for t in (1, 4):
        q, kc, vc, gate, rows, starts = _case(gen, t=t, d=64, cap=64, device="cuda", dtype=torch.bfloat16)
        for o, g in zip(_both(q, kc, vc, rows, starts, "triton"), _both(q, kc, vc, rows, starts, "triton", gate)):
            assert torch.equal(g, sigmoid_mul(o.reshape(gate.shape), gate).view(o.shape))


def test_a_tokens_attention_does_not_depend_on_its_window_or_batch(rng, monkeypatch):
    """What exact speculation rests on: a token's attention output is the same bits at
    any position of a verified window as alone in a plain step (``T = 1`` at its own
    position), and in a batch of one as in a batch of 12, with the default launch on a
    GPU's count of SMs. (A split of the keys, :data:`attention.KEY_SPLITS_MAX` above 1,
    fails here: its parts' bounds follow the window's end, a row at 958 keys ending a
    window of 4 past the 15th block of 64, and its count the batch's rows.)"""
    monkeypatch.setattr(attention, "sm_count", lambda device: 132)
    b = 12
    q, kc, vc, gate, rows, starts = _case(rng, b=b, t=4, slots=b, cap=1100)
    starts[:3] = torch.tensor([958, 17, 1090])
    window = slot_attention(q, kc, vc, rows, starts, 0.3, backend="triton", gate=gate)
    gate4 = gate.reshape(b, 4, *gate.shape[1:])
    for j in range(4):  # each window position, as a plain step takes that token
        alone = slot_attention(q[:, j:j + 1], kc, vc, rows, starts + j, 0.3, backend="triton",
                               gate=gate4[:, j].reshape(b, *gate.shape[1:]))
        assert torch.equal(alone[:, 0], window[:, j]), j
    one = slot_attention(q[:1], kc, vc, rows[:1], starts[:1], 0.3, backend="triton", gate=gate[:4])
    assert torch.equal(one[0], window[0])


@pytest.mark.parametrize("t", [1, 4])
def test_keys_split_into_parts_give_the_whole_pass(rng, monkeypatch, t):
    """Few programs (3 rows x 2 key heads) split their keys into parts (5 here: some
    past a row's last key, empty) and a second launch merges them: the outputs of the
    unsplit pass to fp32 rounding, the gate applied after the merge as in one pass,
    and a tree's ancestor mask kept. Row lengths from 1 key to the cache's end."""
    q, kc, vc, gate, rows, starts = _case(rng, b=3, t=t, cap=300)
    starts[0], starts[1] = 0, 300 - t  # one key (t = 1), and the whole cache
    assert key_splits(6, 300, 64, q.device) == 1  # the interpreter's one "SM": no split by default
    whole = [_both(q, kc, vc, rows, starts, "triton", g) for g in (None, gate)]
    monkeypatch.setattr(attention, "KEY_SPLIT_PROGRAMS_PER_SM", 64)
    monkeypatch.setattr(attention, "KEY_SPLITS_MAX", 16)
    assert key_splits(6, 300, 64, q.device) == 5  # one key block of 64 a part at most
    merges = []
    kernel = attention._merge_key_parts_kernel

    class Counted:  # the merge launch, counted: the split path must have run
        def __getitem__(self, grid):
            merges.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attention, "_merge_key_parts_kernel", Counted())
    for want, g in zip(whole, (None, gate)):
        for got, ref in zip(_both(q, kc, vc, rows, starts, "triton", g), want):
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-6 * float(ref.abs().max()))
    assert merges == [(3, 2)] * 4


def test_keys_merged_by_their_last_part(rng, monkeypatch):
    """``KEY_MERGE = "last_part"``: the part that arrives last merges the row's parts
    (no second launch), giving the merge launch's outputs bit for bit; its counters are
    back at zero after each call, so a second call merges again."""
    q, kc, vc, gate, rows, starts = _case(rng, b=3, t=4, cap=300)
    monkeypatch.setattr(attention, "KEY_SPLIT_PROGRAMS_PER_SM", 64)
    monkeypatch.setattr(attention, "KEY_SPLITS_MAX", 16)
    by_launch = _both(q, kc, vc, rows, starts, "triton", gate)
    monkeypatch.setattr(attention, "KEY_MERGE", "last_part")
    monkeypatch.setattr(attention, "_merge_key_parts_kernel", None)  # a merge launch would fail
    for _ in range(2):
        for got, want in zip(_both(q, kc, vc, rows, starts, "triton", gate), by_launch):
            assert torch.equal(got, want)
        assert not attention._ARRIVALS[q.device].any()
    monkeypatch.setattr(attention, "KEY_MERGE", "later")
    with pytest.raises(ValueError, match="KEY_MERGE"):
        _both(q, kc, vc, rows, starts, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_keys_merged_by_their_last_part_on_cuda(t, monkeypatch):
    """On the card, where the parts run at once: the last part to arrive reads every
    other part's state (a missed store would show as garbage), 30 calls in a row at
    batch 1 and 2 with 2000-key contexts; the outputs of the merge launch to fp32
    rounding, the counters back at zero."""
    gen = torch.Generator().manual_seed(6)
    monkeypatch.setattr(attention, "KEY_SPLITS_MAX", 16)
    for b in (1, 2):
        q, kc, vc, gate, rows, starts = _case(gen, b=b, t=t, d=64, cap=2048, device="cuda", dtype=torch.bfloat16)
        starts.fill_(2048 - t)
        assert attention.key_splits(b * 2, 2048, 64, q.device) > 1
        want = _both(q, kc, vc, rows, starts, "triton", gate)
        monkeypatch.setattr(attention, "KEY_MERGE", "last_part")
        for _ in range(30):
            for got, ref in zip(_both(q, kc, vc, rows, starts, "triton", gate), want):
                torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=1e-2 * float(ref.abs().max()))
        monkeypatch.setattr(attention, "KEY_MERGE", "launch")
        torch.cuda.synchronize()
        assert not attention._ARRIVALS[q.device].any()


def test_tree_attention_takes_its_visibility_bits_built_once(rng):
    """A tree's ancestor rows as bit sets, built once (``StaticTree.ancestor_bits`` and
    its levels'): the same outputs as bits built per call; bits that do not fit are
    refused, and the kernel reads them (a wrong set changes the outputs)."""
    from replayssm.engine.attention import visibility_bits
    from replayssm.engine.trees import StaticTree

    tree = StaticTree.from_branching((2, 2))
    n = tree.num_nodes
    q, kc, vc, gate, rows, starts = _case(rng, t=n, cap=40)
    assert torch.equal(tree.ancestor_bits, visibility_bits(tree.ancestors))
    assert tree.ancestor_bits[n - 1] == sum(1 << j for j in range(n) if tree.ancestors[n - 1, j])
    for depth, level in enumerate(tree.levels):
        assert torch.equal(tree.level_bits[depth], tree.ancestor_bits[level])
    per_call = tree_attention(q, kc, vc, rows, starts, tree.ancestors, 0.3, backend="triton", gate=gate)
    once = tree_attention(q, kc, vc, rows, starts, tree.ancestors, 0.3, backend="triton", gate=gate,
                          visible_bits=tree.ancestor_bits)
    assert torch.equal(once, per_call)
    causal = visibility_bits(torch.tril(torch.ones(n, n, dtype=torch.bool)))
    other = tree_attention(q, kc, vc, rows, starts, tree.ancestors, 0.3, backend="triton", visible_bits=causal)
    assert not torch.equal(other, tree_attention(q, kc, vc, rows, starts, tree.ancestors, 0.3, backend="triton"))
    for bad in (tree.ancestor_bits[:-1], tree.ancestor_bits.int()):
        with pytest.raises(ValueError, match="visible_bits must be"):
            tree_attention(q, kc, vc, rows, starts, tree.ancestors, 0.3, backend="triton", visible_bits=bad)
