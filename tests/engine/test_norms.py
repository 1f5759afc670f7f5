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


@pytest.mark.parametrize("d,heads,kv_heads,rows", [(16, 4, 2, 7), (128, 3, 1, 6)])
@pytest.mark.parametrize("kind", ["offset", "gated"])
def test_norm_reads_heads_of_one_wide_output_in_place(rng, d, heads, kv_heads, rows, kind):
    """Queries and keys as views of one q|gate, k, v output ``[N, W]``: heads at two
    strides, ``(W, 2D, 1)`` and ``(W, D, 1)``, which no single row stride reaches. The
    kernel reads them there (and a gate so laid out, and writes into head slices of a
    buffer): the reference's values (fp32: only the sums' order differs, 2e-6), and the
    bits of the contiguous call (the layout only moves the loads). ``d = 128, heads =
    3``: a program's 16 rows cross heads and tokens at uneven points."""
    from replayssm.engine.norms import _row_strides

    width = 2 * heads * d + 2 * kv_heads * d
    wide = 2 * torch.randn(rows, width, generator=rng)
    q = wide[:, : 2 * heads * d].view(rows, heads, 2 * d)[..., :d]
    k = wide[:, 2 * heads * d : (2 * heads + kv_heads) * d].view(rows, kv_heads, d)
    gate = wide[:, : 2 * heads * d].view(rows, heads, 2 * d)[..., d:]  # gated norms take it as z
    assert _row_strides(q, "x") == (heads, width, 2 * d)
    assert _row_strides(k, "x") == ((kv_heads, width, d) if kv_heads > 1 else (rows, 0, width))
    w = 0.5 * torch.randn(d, generator=rng)
    for x in (q, k):
        z = gate[:, : x.shape[1]] if kind == "gated" else None
        got = rms_norm(x, w, 1e-6, kind, z)
        want = rms_norm(x, w, 1e-6, kind, z, backend="reference")
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        assert got.abs().max() > 0.1
        flat = rms_norm(x.contiguous(), w, 1e-6, kind, None if z is None else z.contiguous())
        assert torch.equal(got, flat)
        buf = torch.randn(rows, heads + kv_heads + 1, d, generator=rng)
        keep = buf.clone()
        rms_norm(x, w, 1e-6, kind, z, out=buf[:, 1 : 1 + x.shape[1]])
        assert torch.equal(buf[:, 1 : 1 + x.shape[1]], flat)
        assert torch.equal(buf[:, 0], keep[:, 0]) and torch.equal(buf[:, 1 + x.shape[1] :], keep[:, 1 + x.shape[1] :])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_norm_refuses_inputs_it_cannot_address(rng, backend):
    """A last axis not contiguous, or rows at three strides: a ValueError naming the
    argument, on either backend (the same contract), not a silent copy."""
    d = 16
    w = torch.randn(d, generator=rng)
    x = torch.randn(5, d, generator=rng)
    with pytest.raises(ValueError, match="x must be contiguous along its last axis"):
        rms_norm(torch.randn(d, 5, generator=rng).T, w, 1e-6, "offset", backend=backend)
    with pytest.raises(ValueError, match="gate must be contiguous along its last axis"):
        rms_norm(x, w, 1e-6, "gated", torch.randn(d, 5, generator=rng).T, backend=backend)
    with pytest.raises(ValueError, match="gate must be shaped like x"):
        rms_norm(x, w, 1e-6, "gated", x[:4], backend=backend)
    three = torch.randn(4, 3, 5, 2 * d, generator=rng)[:, :2, :4, :d]  # strides (30D, 10D, 2D): none merge
    with pytest.raises(ValueError, match="x's rows must have at most two strides"):
        rms_norm(three, w, 1e-6, "offset", backend=backend)
    with pytest.raises(ValueError, match="out's rows must have at most two strides"):
        rms_norm(three.contiguous(), w, 1e-6, "offset", backend=backend, out=torch.empty(4, 3, 5, 2 * d)[:, :2, :4, :d])
