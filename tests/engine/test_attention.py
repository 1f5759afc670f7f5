"""The window attention's output gate in its launch (``slot_attention`` / ``tree_attention``
with ``gate=``): the bits of the attention followed by ``sigmoid_mul``, on both kernels'
masks, with the gate a strided view of a wider projection output; starts read at their
stride; a token's output the same bits at any window position and batch; a tree's
visibility bits built once."""

import pytest
import torch

from replayssm.engine.activations import sigmoid_mul
from replayssm.ops.triton_common import arrival_counters
from replayssm.engine.attention import slot_attention, tree_attention


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


@pytest.mark.parametrize("key_split", [0, 64, 256])
def test_a_tokens_attention_does_not_depend_on_its_window_or_batch(rng, key_split, entry_independent_dots):
    """What exact speculation rests on: a token's attention output is the same bits at
    any position of a verified window as alone in a plain step (``T = 1`` at its own
    position), and in a batch of one as in a batch of 6, with the keys in one walk or
    split into parts at fixed positions. (A split of the keys whose parts follow the
    window's end or the batch's size fails here: a row at 958 keys ends a window of 4
    past the 15th block of 64; at 254 a window of 4 crosses the parts' bound at 256.)
    Six rows: the four fixed starts and two random ones (each row is its own programs;
    more rows repeat them)."""
    b = 6
    q, kc, vc, gate, rows, starts = _case(rng, b=b, t=4, slots=b, cap=1100)
    starts[:4] = torch.tensor([958, 17, 1090, 254])
    split = dict(key_split=key_split, arrivals=arrival_counters("cpu")) if key_split else {}
    window = slot_attention(q, kc, vc, rows, starts, 0.3, backend="triton", gate=gate, **split)
    gate4 = gate.reshape(b, 4, *gate.shape[1:])
    for j in range(4):  # each window position, as a plain step takes that token
        alone = slot_attention(q[:, j:j + 1], kc, vc, rows, starts + j, 0.3, backend="triton",
                               gate=gate4[:, j].reshape(b, *gate.shape[1:]), **split)
        assert torch.equal(alone[:, 0], window[:, j]), j
    one = slot_attention(q[:1], kc, vc, rows[:1], starts[:1], 0.3, backend="triton", gate=gate[:4], **split)
    assert torch.equal(one[0], window[0])
    if split:
        assert not split["arrivals"].any()  # each row's last part set its counter back


def test_split_keys_are_the_attention_to_rounding(rng):
    """Keys split into parts merged in the launch: the float64 reference's outputs to
    fp32 rounding (a few ulps of outputs of order 1: a merge rescales each part's sums
    once more), rows of one part and of several, every counter back at zero."""
    q, kc, vc, gate, rows, starts = _case(rng, b=4, t=4, slots=6, cap=700)
    starts[:] = torch.tensor([3, 150, 500, 690])
    want = slot_attention(q.double(), kc.double(), vc.double(), rows, starts, 0.3, backend="reference")
    arrivals = arrival_counters("cpu")
    for key_split in (64, 128, 1024):
        got = slot_attention(q, kc, vc, rows, starts, 0.3, backend="triton", key_split=key_split, arrivals=arrivals)
        assert (got.double() - want).abs().max() < 2e-6, key_split
        assert not arrivals.any()


def test_a_key_split_that_does_not_fit_is_refused(rng):
    q, kc, vc, gate, rows, starts = _case(rng)
    arrivals = arrival_counters("cpu")
    for bad in (32, 100, -64, True, 64.0):
        with pytest.raises(ValueError, match="key_split must be 0 or a power of two >= 64"):
            slot_attention(q, kc, vc, rows, starts, 0.3, backend="triton", key_split=bad, arrivals=arrivals)
    with pytest.raises(ValueError, match="key_split needs arrivals"):
        slot_attention(q, kc, vc, rows, starts, 0.3, backend="triton", key_split=64)
    with pytest.raises(ValueError, match="arrivals must be"):
        slot_attention(q, kc, vc, rows, starts, 0.3, backend="triton", key_split=64, arrivals=arrivals[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_split_keys_on_cuda_in_bf16(t):
    """The compiled split (heads of 64, the embedded model's, over 1000-2000 keys):
    about as far from the float64 attention as the unsplit kernel is (each part's
    probabilities round to bf16 against its own max, so the two differ by that
    rounding, a few bf16 ulps of outputs that average many values), and a token's bits
    the same in its window as alone, over 50 calls whose parts finish in any order (a
    part merged before its stores landed would show)."""
    gen = torch.Generator().manual_seed(5)
    arrivals = arrival_counters("cuda")
    for _ in range(50):
        q, kc, vc, gate, rows, starts = _case(gen, b=3, t=t, d=64, cap=2048, device="cuda", dtype=torch.bfloat16)
        starts[:] = torch.randint(1000, 2048 - t, (3,), generator=gen).to("cuda")
        split = slot_attention(q, kc, vc, rows, starts, 0.125, gate=gate, key_split=256, arrivals=arrivals)
        whole = slot_attention(q, kc, vc, rows, starts, 0.125, gate=gate)
        exact = slot_attention(q.double(), kc.double(), vc.double(), rows, starts, 0.125, backend="reference",
                               gate=gate.double())
        ulp = 2 ** -8 * exact.abs().max()
        assert (split - exact).abs().max() <= 2 * (whole - exact).abs().max() + ulp
        alone = slot_attention(q[:, -1:], kc, vc, rows, starts + t - 1, 0.125, gate=gate.view(3, t, -1, 64)[:, -1],
                               key_split=256, arrivals=arrivals)
        assert torch.equal(alone[:, 0], split[:, -1])
    assert not arrivals.any()


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


def test_starts_are_read_at_their_stride(rng):
    """``starts`` as a column of a ``[B, T]`` positions tensor (the step's ``positions[:,
    0]``, read in place instead of copied): the outputs of contiguous starts, bit for
    bit, on both kernels; and not those of the other column, so the stride is used."""
    q, kc, vc, gate, rows, starts = _case(rng, b=3)
    starts = starts.clamp(max=kc.shape[2] - q.shape[1] - 1)  # the shifted column's windows stay in the cache
    positions = starts[:, None] + torch.arange(2)
    assert positions[:, 0].stride(0) == 2
    for got, want in zip(_both(q, kc, vc, rows, positions[:, 0], "triton", gate),
                         _both(q, kc, vc, rows, starts.clone(), "triton", gate)):
        assert torch.equal(got, want)
    shifted = _both(q, kc, vc, rows, positions[:, 1], "triton", gate)
    assert not torch.equal(shifted[0], _both(q, kc, vc, rows, starts, "triton", gate)[0])
