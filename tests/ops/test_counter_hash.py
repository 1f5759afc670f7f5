"""The counter hash behind the benchmark drafters: the Triton kernel (one launch) gives
the reference's bits exactly, on counters and seeds past 2**32 and on shapes that do not
fill its blocks; the reference is the documented lowbias32 chain, recomputed here on
Python ints with plain modular arithmetic; bad arguments fail before any launch."""

import pytest
import torch

from replayssm.ops.counter_hash import counter_hash, counter_hash_reference, counter_hash_triton
from replayssm.testing.hashes import M32, counter_hash_int


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
