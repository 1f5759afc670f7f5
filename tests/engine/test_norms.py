"""The fused RMS norms, a block of rows per program: every row as the modules compute it
(the reference, op by op) for head-sized and hidden-sized rows, gated and offset, with
row counts that leave a program's block part empty; and a row's result the same bits
whatever rows share its call (its lanes depend on the row length alone)."""

import pytest
import torch

from replayssm.engine.norms import _norm_blocks, add_rms_norm, rms_norm


@pytest.mark.parametrize("d,rows", [(128, 37), (48, 5), (256, 16), (2048, 3)])
@pytest.mark.parametrize("kind", ["offset", "gated"])
def test_blocked_norm_matches_the_modules_arithmetic(rng, d, rows, kind):
    x = 2 * torch.randn(rows, d, generator=rng)
    w = 0.5 * torch.randn(d, generator=rng)
    z = torch.randn(rows, d, generator=rng) if kind == "gated" else None
    got = rms_norm(x, w, 1e-6, kind, z)
    want = rms_norm(x, w, 1e-6, kind, z, backend="reference")
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)  # fp32: only the sums' order differs
    assert got.abs().max() > 0.1


def test_a_rows_bits_do_not_depend_on_its_neighbours(rng):
    """Value-head rows (16 a program): the same rows normalised in a call of 37 rows and
    in calls that start 5 rows later or hold them alone give the same bits, so no row
    reads or writes another's lanes at any position in a block, full or partial. (The
    interpreter sums without a layout; on the GPU, the graphed engine's test that a
    token's logits do not depend on its window position covers the lanes.)"""
    assert _norm_blocks(128, 37)[1] == 16  # several rows a program: the case in question
    x, z = torch.randn(37, 128, generator=rng), torch.randn(37, 128, generator=rng)
    w = torch.randn(128, generator=rng)
    full = rms_norm(x, w, 1e-6, "gated", z)
    assert torch.equal(rms_norm(x[5:], w, 1e-6, "gated", z[5:]), full[5:])
    assert torch.equal(rms_norm(x[9:10], w, 1e-6, "gated", z[9:10]), full[9:10])
    s, y = add_rms_norm(x[:20], x[17:], w, 1e-6)
    assert torch.equal(y[3:], add_rms_norm(x[3:20], x[20:], w, 1e-6)[1])
