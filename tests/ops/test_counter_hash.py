"""The counter hash behind the benchmark drafters: the Triton kernel (one launch) gives
the reference's bits exactly, on counters and seeds past 2**32 and on shapes that do not
fill its blocks; the reference is the documented lowbias32 chain, recomputed here on
Python ints with plain modular arithmetic; bad arguments fail before any launch."""

import pytest
import torch

from replayssm.ops import guards
from replayssm.ops.counter_hash import (
    counter_hash,
    counter_hash_reference,
    counter_hash_triton,
    hash_accept_counts,
    hash_accept_counts_reference,
    hash_accept_counts_triton,
    hash_tokens,
    hash_tokens_reference,
    hash_tokens_triton,
)
from replayssm.testing.hashes import M32, counter_hash_int
from replayssm.testing.op_count import count_ops


def _counters(n: int, g: torch.Generator) -> torch.Tensor:
    """Non-negative int64 counters, some past 2**32 (the hash takes them mod 2**32)."""
    small = torch.randint(0, 1 << 20, (n,), generator=g)
    big = torch.randint(0, 1 << 62, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.3, big, small)


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 3), (130, 6), (300, 17)])
def test_triton_kernel_gives_the_reference_bits(rows, cols):
    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    seed = int(torch.randint(0, 1 << 62, (1,), generator=g))
    a, b, c = _counters(rows, g), _counters(rows, g), _counters(cols, g)
    ref = counter_hash_reference(seed, a, b, c)
    out = counter_hash_triton(seed, a, b, c)
    assert out.dtype == torch.int64 and out.shape == (rows, cols)
    assert torch.equal(out, ref)
    assert int(ref.min()) >= 0 and int(ref.max()) <= M32
    assert ref.unique().numel() > 0.99 * ref.numel()  # a hash, not a constant


def test_reference_is_the_documented_chain():
    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    seed = int(torch.randint(0, 1 << 40, (1,), generator=g))
    a, b, c = _counters(9, g), _counters(9, g), _counters(4, g)
    got = counter_hash(seed, a, b, c, backend="reference").tolist()
    for i in range(9):
        assert got[i] == [counter_hash_int(seed, int(a[i]), int(b[i]), int(c[j])) for j in range(4)]


@pytest.mark.parametrize("fn", [counter_hash_reference, counter_hash_triton])
def test_bad_arguments_are_refused(fn):
    a, c = torch.arange(4), torch.arange(3)
    with pytest.raises(TypeError, match="seed"):
        fn(True, a, a, c)
    with pytest.raises(TypeError, match="seed"):
        fn(1.5, a, a, c)
    with pytest.raises(TypeError, match="^a must have dtype"):
        fn(0, a.int(), a, c)
    with pytest.raises(ValueError, match="^b must have shape"):
        fn(0, a, a[:3], c)
    with pytest.raises(ValueError, match="^c must have 1 dimensions"):
        fn(0, a, a, c[None])


def test_triton_refuses_too_many_columns():
    a = torch.arange(2)
    with pytest.raises(ValueError, match="at most 1024"):
        counter_hash_triton(0, a, a, torch.arange(1025))


# ------------------------------------------------------------- the forced drafter's draws


def _slot_case(g: torch.Generator, num_slots: int, rows: int, dtype=torch.int64):
    """Per-slot counters (some past 2**32) and rows naming slots: repeats, and padding
    rows (-1) among them."""
    request, step = _counters(num_slots, g), _counters(num_slots, g)
    slots = torch.randint(0, num_slots, (rows,), generator=g)
    slots[torch.rand(rows, generator=g) < 0.2] = -1
    return request, step, slots.to(dtype)


def _want_counts(seed, request, step, slots, k, p) -> list[int]:
    """The documented law on Python ints: the leading draws whose top 24 bits, as a
    fraction of 2**24, are below P (float32 P, compared exactly)."""
    threshold = float(p) * 2**24
    out = []
    for s in slots.tolist():
        n = 0
        while s >= 0 and n < k and (counter_hash_int(seed, int(request[s]), int(step[s]), n) >> 8) < threshold:
            n += 1
        out.append(n)
    return out


@pytest.mark.parametrize("rows,k", [(1, 1), (37, 3), (300, 7), (5, 0)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_accept_counts_follow_the_law_on_both_backends(rows, k, slot_dtype):
    """Both backends give the counts of the law recomputed on Python ints, for P across
    (0, 1) and at its ends; padding rows count 0."""
    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    seed = int(torch.randint(0, 1 << 62, (1,), generator=g))
    request, step, slots = _slot_case(g, 50, rows, slot_dtype)
    for pv in (0.0, float(torch.rand(1, generator=g)), 0.9, 1.0):
        p = torch.tensor(pv, dtype=torch.float32)
        want = _want_counts(seed, request, step, slots, k, p)
        for fn in (hash_accept_counts_reference, hash_accept_counts_triton):
            got = fn(seed, request, step, slots, k, p)
            assert got.dtype == torch.int64 and got.tolist() == want, (fn.__name__, pv)
    if rows > 100 and k > 0:
        assert 0 < sum(want) < rows * k  # P = 0.9 draws a mix of counts, not a constant


@pytest.mark.parametrize("rows,num,first", [(1, 1, 0), (37, 3, 3), (300, 17, 5), (4, 0, 2)])
def test_tokens_are_the_hash_mod_vocab_on_both_backends(rows, num, first):
    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    seed = int(torch.randint(0, 1 << 62, (1,), generator=g))
    vocab = int(torch.randint(2, 300000, (1,), generator=g))
    request, step, slots = _slot_case(g, 40, rows)
    want = [[0] * num if s < 0 else
            [counter_hash_int(seed, int(request[s]), int(step[s]), first + j) % vocab for j in range(num)]
            for s in slots.tolist()]
    for fn in (hash_tokens_reference, hash_tokens_triton):
        got = fn(seed, request, step, slots, first, num, vocab)
        assert got.dtype == torch.int64 and list(got.shape) == [rows, num] and got.tolist() == want, fn.__name__


def test_draws_are_one_launch_each():
    """The Triton path is one kernel a call: no gathers, thresholds or prefix counts of
    its own (a captured step pays a launch for each)."""
    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    request, step, slots = _slot_case(g, 20, 9)
    p = torch.tensor(0.7)
    for call in (lambda: hash_accept_counts(3, request, step, slots, 3, p, backend="triton"),
                 lambda: hash_tokens(3, request, step, slots, 3, 3, 1000, backend="triton")):
        with count_ops(run_triton=False) as ops:
            call()
        assert ops.total == 1 and next(iter(ops.counts)).startswith("triton."), ops.counts


@pytest.mark.parametrize("fns", [(hash_accept_counts_reference, hash_tokens_reference),
                                 (hash_accept_counts_triton, hash_tokens_triton)])
def test_bad_draw_arguments_are_refused(fns):
    counts, tokens = fns
    request, slots, p = torch.arange(6), torch.tensor([0, 5, -1]), torch.tensor(0.5)
    with pytest.raises(ValueError, match=r"slots\[1\] = 6 is outside \[-1, 6\)"):
        counts(0, request, request, torch.tensor([0, 6]), 3, p)
    with pytest.raises(ValueError, match=r"slots\[0\] = -2"):
        tokens(0, request, request, torch.tensor([-2]), 0, 3, 10)
    with pytest.raises(TypeError, match="^p must have dtype"):
        counts(0, request, request, slots, 3, p.double())
    with pytest.raises(ValueError, match="^p must have 0 dimensions"):
        counts(0, request, request, slots, 3, p[None])
    with pytest.raises(ValueError, match="^num_draft must be an int"):
        counts(0, request, request, slots, 1025, p)
    with pytest.raises(ValueError, match="^step must have shape"):
        counts(0, request, request[:5], slots, 3, p)
    with pytest.raises(TypeError, match="^slots must have dtype"):
        tokens(0, request, request, slots.float(), 0, 3, 10)
    with pytest.raises(ValueError, match="^vocab must be an int"):
        tokens(0, request, request, slots, 0, 3, 0)
    with pytest.raises(ValueError, match="^first must be an int"):
        tokens(0, request, request, slots, -1, 3, 10)
    with pytest.raises(TypeError, match="seed"):
        tokens(0.5, request, request, slots, 0, 3, 10)


@pytest.mark.parametrize("fns", [(hash_accept_counts_reference, hash_tokens_reference),
                                 (hash_accept_counts_triton, hash_tokens_triton)])
def test_slots_out_of_range_inside_a_capture_give_zeros(fns):
    """Where nothing may be read on the host (a graph capture, forced here), a row whose
    slot is outside the counters gets zeros and reads nothing; its neighbours keep
    their draws."""
    counts, tokens = fns
    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    request, step, _ = _slot_case(g, 6, 1)
    p, good = torch.tensor(1.0), torch.tensor([0, 3, 5])
    bad = torch.tensor([0, 6, 5])
    with guards.device_checks():
        assert counts(1, request, step, bad, 3, p).tolist() == [3, 0, 3]
        got = tokens(1, request, step, bad, 3, 2, 1000)
    want = tokens(1, request, step, good, 3, 2, 1000)
    assert got[1].tolist() == [0, 0] and torch.equal(got[[0, 2]], want[[0, 2]])
