"""The counter hash's Triton kernel compiled for the GPU: the CPU reference's bits, and
the forced drafter's draws the same on CUDA as on the CPU (its coins and drafts come
from the kernel there).

Run on the GPU machine:  python -m pytest -q tests/gpu/test_counter_hash_gpu.py
"""

import pytest
import torch

from replayssm.engine.device_drafters import ForcedDrafter
from replayssm.ops.counter_hash import counter_hash, counter_hash_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows,cols", [(1, 3), (257, 4), (1000, 33)])
def test_cuda_kernel_gives_the_reference_bits(rows, cols):
    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    seed = int(torch.randint(0, 1 << 62, (1,), generator=g))
    a, b, c = (torch.randint(0, 1 << 62, (n,), generator=g) for n in (rows, rows, cols))
    ref = counter_hash_reference(seed, a, b, c)
    assert torch.equal(counter_hash(seed, a.cuda(), b.cuda(), c.cuda()).cpu(), ref)


def test_forced_drafter_draws_are_device_independent():
    requests = torch.randperm(1000)[:64].tolist()
    runs = []
    for dev in ("cpu", "cuda"):
        d = ForcedDrafter(0.7, 260, seed=12345)
        d.bind(len(requests), 3, 8, torch.device(dev))
        for slot, r in enumerate(requests):
            d.start(slot, [1, 2], r)
        idx = torch.arange(len(requests), device=dev)
        out = []
        for _ in range(4):
            n = d.forced_accepts(idx)
            d.observe(idx, torch.zeros(len(requests), 4, dtype=torch.long, device=dev), n + 1)
            out += [n.cpu(), d.propose(idx).cpu()]
        runs.append(out)
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    assert 0 < float(torch.stack(runs[0][::2]).float().mean()) < 3


@pytest.mark.parametrize("rows,k", [(1, 3), (257, 4), (1000, 7)])
def test_cuda_draws_give_the_reference_draws(rows, k):
    """The forced drafter's two draws (counts and tokens) on CUDA: the CPU reference's,
    padding rows and repeated slots included."""
    from replayssm.ops.counter_hash import (hash_accept_counts, hash_accept_counts_reference, hash_tokens,
                                            hash_tokens_reference)

    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    seed = int(torch.randint(0, 1 << 62, (1,), generator=g))
    request, step = (torch.randint(0, 1 << 62, (300,), generator=g) for _ in range(2))
    slots = torch.randint(-1, 300, (rows,), generator=g)
    p = torch.tensor(0.7)
    cuda = [t.cuda() for t in (request, step, slots, p)]
    assert torch.equal(hash_accept_counts(seed, *cuda[:3], k, cuda[3]).cpu(),
                       hash_accept_counts_reference(seed, request, step, slots, k, p))
    assert torch.equal(hash_tokens(seed, *cuda[:3], k, k, 151936).cpu(),
                       hash_tokens_reference(seed, request, step, slots, k, k, 151936))
