"""The fused RMS norms, a block of rows per program: every row as the modules compute it
(the reference, op by op) for head-sized and hidden-sized rows, gated and offset, with
row counts that leave a program's block part empty; and a row's result the same bits
whatever rows share its call (its lanes depend on the row length alone)."""

import pytest
import torch

from replayssm.engine.norms import _norm_blocks, add_rms_norm, rms_norm, rms_norm_pair


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


@pytest.mark.parametrize("d,heads,kv_heads,rows", [(16, 4, 2, 7), (64, 4, 2, 1), (128, 3, 1, 6)])
def test_norm_pair_gives_each_norm_its_own_launchs_bits(rng, d, heads, kv_heads, rows):
    """Queries and keys read in place from one wide projection output and written into
    slices of one buffer, as an attention layer norms them, each with its own weight and
    eps: one launch of the pair gives the bits of two :func:`rms_norm` calls (the same
    block code runs each row), and the reference's values (fp32: only the sums' order
    differs, 2e-6). One row (batch 1, one token) too: the programs after the first
    norm's must take the second's, whatever their count."""
    width = 2 * heads * d + 2 * kv_heads * d
    wide = 2 * torch.randn(rows, width, generator=rng)
    q = wide[:, : 2 * heads * d].view(rows, heads, 2 * d)[..., :d]
    k = wide[:, 2 * heads * d : (2 * heads + kv_heads) * d].view(rows, kv_heads, d)
    wq, wk = 0.5 * torch.randn(d, generator=rng), 0.5 * torch.randn(d, generator=rng)
    buf = torch.randn(rows, heads + kv_heads + 1, d, generator=rng)
    keep = buf.clone()
    rms_norm_pair(q, wq, 1e-6, buf[:, :heads], k, wk, 1e-5, buf[:, heads : heads + kv_heads])
    assert torch.equal(buf[:, :heads], rms_norm(q, wq, 1e-6, "offset"))
    assert torch.equal(buf[:, heads : heads + kv_heads], rms_norm(k, wk, 1e-5, "offset"))
    assert torch.equal(buf[:, -1], keep[:, -1])
    ref = torch.empty_like(buf)
    rms_norm_pair(q, wq, 1e-6, ref[:, :heads], k, wk, 1e-5, ref[:, heads : heads + kv_heads], backend="reference")
    torch.testing.assert_close(buf[:, :-1], ref[:, :-1], rtol=2e-6, atol=2e-6)
    assert buf[:, :-1].abs().max() > 0.1


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("strided_int32", [False, True], ids=["int64", "int32_strided"])
def test_norm_pair_looks_its_first_rows_up(rng, tokens, strided_int32):
    """With ``rows`` the first norm's rows are those of a table (an embedding lookup
    folded into the norm), written beside the second norm's into the two halves of one
    buffer (the MTP head's ``fc`` input): bits of the lookup followed by :func:`rms_norm`,
    repeated ids included, the ids int64 or a strided int32 view (a column of a wider
    token buffer)."""
    vocab, d = 50, 32
    table, hidden = torch.randn(vocab, d, generator=rng), 3 * torch.randn(tokens, d, generator=rng)
    ids = torch.randint(0, vocab, (tokens,), generator=rng)
    ids[-1] = ids[0]
    if strided_int32:
        ids = torch.stack([ids, vocab - 1 - ids], 1).int()[:, 0]
        assert ids.stride(0) == 2
    we, wh = torch.randn(d, generator=rng), torch.randn(d, generator=rng)
    pair = torch.full((tokens, 2 * d), float("nan"))
    rms_norm_pair(table, we, 1e-6, pair[:, :d], hidden, wh, 1e-6, pair[:, d:], rows=ids)
    assert torch.equal(pair[:, :d], rms_norm(table[ids], we, 1e-6, "offset"))
    assert torch.equal(pair[:, d:], rms_norm(hidden, wh, 1e-6, "offset"))
    # an index outside the table reads nothing: that row is zeros, the others as before
    bad = ids.clone()
    bad[0] = vocab
    rms_norm_pair(table, we, 1e-6, pair[:, :d], hidden, wh, 1e-6, pair[:, d:], rows=bad)
    assert torch.equal(pair[0, :d], torch.zeros(d))
    assert torch.equal(pair[1:, :d], rms_norm(table[ids[1:]], we, 1e-6, "offset"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_norm_pair_refuses_mismatched_norms_and_touches_nothing(rng, backend, refused):
    """Widths, dtypes, lookup indices and output shapes that do not pair: a ValueError
    naming the argument, before either output is written."""
    d = 16
    x, x2 = torch.randn(5, d, generator=rng), torch.randn(3, d, generator=rng)
    w = torch.randn(d, generator=rng)
    out, out2 = torch.randn(5, d, generator=rng), torch.randn(3, d, generator=rng)
    cases = [
        (dict(x2=torch.randn(3, 2 * d)), "x and x2 must share their width"),
        (dict(x2=x2.double()), "x2 must be torch.float32"),
        (dict(out=torch.empty(4, d)), "out must be a torch.float32 tensor of shape \\[5, 16\\]"),
        (dict(out2=out2.double()), "out2 must be a torch.float32 tensor"),
        (dict(out=torch.empty(2, d), rows=torch.tensor([0.0, 1.0])), "rows must be an int"),
        (dict(x=torch.randn(2, 5, d), out=torch.empty(2, d), rows=torch.tensor([0, 1])), "with rows, x must be"),
    ]
    args = dict(x=x, weight=w, eps=1e-6, out=out, x2=x2, weight2=w, eps2=1e-6, out2=out2, backend=backend)
    refused(rms_norm_pair, args, [(change, ValueError, message) for change, message in cases], out, out2)


@pytest.mark.gpu
def test_norm_pair_on_cuda_in_bf16_gives_each_norms_bits():
    """The compiled pair kernel (two copies of the block code in one kernel) in bf16 at
    the embedded model's batch-1 shapes and at 64 rows: each norm's bits are its own
    launch's, the lookup's too."""
    g = torch.Generator(device="cuda").manual_seed(5)
    for rows in (1, 64):
        wide = torch.randn(rows, 640, generator=g, device="cuda").to(torch.bfloat16)
        q, k = wide[:, :512].view(rows, 4, 128)[..., :64], wide[:, 512:].view(rows, 2, 64)
        wq, wk = (torch.randn(64, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
        qk = torch.empty(rows, 6, 64, dtype=torch.bfloat16, device="cuda")
        rms_norm_pair(q, wq, 1e-6, qk[:, :4], k, wk, 1e-6, qk[:, 4:])
        assert torch.equal(qk[:, :4], rms_norm(q, wq, 1e-6, "offset"))
        assert torch.equal(qk[:, 4:], rms_norm(k, wk, 1e-6, "offset"))
        table = torch.randn(4096, 256, generator=g, device="cuda").to(torch.bfloat16)
        hidden = torch.randn(rows, 256, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, 4096, (rows,), generator=g, device="cuda")
        we, wh = (torch.randn(256, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
        pair = torch.empty(rows, 512, dtype=torch.bfloat16, device="cuda")
        rms_norm_pair(table, we, 1e-6, pair[:, :256], hidden, wh, 1e-6, pair[:, 256:], rows=ids)
        assert torch.equal(pair[:, :256], rms_norm(table[ids], we, 1e-6, "offset"))
        assert torch.equal(pair[:, 256:], rms_norm(hidden, wh, 1e-6, "offset"))
