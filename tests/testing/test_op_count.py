"""``count_ops``: ATen operators and Triton launches counted, and with
``run_triton=False`` the launches counted without running them."""

import torch

from replayssm.engine.norms import rms_norm
from replayssm.testing.op_count import count_ops


def test_a_launch_counts_once_and_a_dry_count_leaves_its_output_alone():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    out = torch.randn(3, 32, generator=g)
    before = out.clone()
    with count_ops(run_triton=False) as dry:
        y = (x + 1.0).sum()  # an ATen operator runs and counts either way
        rms_norm(x, w, 1e-6, "offset", out=out)
    assert y == (x + 1.0).sum()
    assert torch.equal(out, before)  # the kernel did not run
    with count_ops() as ops:
        (x + 1.0).sum()
        rms_norm(x, w, 1e-6, "offset", out=out)
    assert not torch.equal(out, before)  # now it did
    assert dry.counts == ops.counts and ops.counts["triton._rms_norm_kernel"] == 1, ops.counts
    assert ops.counts["aten.add"] == 1 and ops.counts["aten.sum"] == 1
