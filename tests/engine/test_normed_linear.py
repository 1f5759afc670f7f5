"""The normed linear (engine/normed_linear.py): a matmul with its input norm and its
output's next step in one launch, against torch's ops composed
(:func:`normed_linear_reference`).

The kernel sums each product over ``K`` in its own order, so fp32 values agree to a few
ulps of the products' scale, not bit for bit; the argmax is compared on rows whose best
logit leads clearly, and on exact ties and NaNs built so that both sides see the same
values."""

from __future__ import annotations

import pytest
import torch

from replayssm.engine import argmax as argmax_mod
from replayssm.engine import normed_linear as normed_linear_mod
from replayssm.ops.triton_common import arrival_counters
from replayssm.engine.normed_linear import normed_linear, normed_linear_reference

#: fp32 agreement, relative to the largest product: sums of up to 600 terms in
#: another order, through a norm (a few ulps, ~1e-7 each).
REL = 2e-6


def _close(got, want, rel=REL):
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= rel * scale, (got - want).abs().max() / scale


def _norm(rng, k, device="cpu"):
    return (0.3 * torch.randn(k, generator=rng)).to(device), 1e-6


@pytest.mark.parametrize("m", [1, 5, 17, 70])
@pytest.mark.parametrize("k, n", [(96, 200), (160, 40), (600, 40)])
def test_each_output_against_the_reference(m, k, n, rng):
    """Plain, normed, residual and gated outputs, at row counts below, at and past a
    tile's height and widths that leave ragged tiles in ``K`` and ``N``; ``K`` in one
    tile and, past :data:`~replayssm.engine.normed_linear.ONE_TILE_BYTES` of a
    program's tiles (600 columns, or 70 rows of 160), in a loop."""
    x = torch.randn(m, k, generator=rng)
    w = torch.randn(n, k, generator=rng) / k ** 0.5
    norm = _norm(rng, k)
    r = torch.randn(m, n, generator=rng)
    w2 = torch.randn(2 * n, k, generator=rng) / k ** 0.5
    cases = [(w, {}), (w, dict(norm=norm)), (w, dict(norm=norm, output="residual", residual=r)),
             (w, dict(output="residual", residual=r)), (w2, dict(norm=norm, output="glu"))]
    for weight, kw in cases:
        _close(normed_linear(x, weight, **kw), normed_linear_reference(x, weight, **kw))


def test_reference_in_float64_is_the_fp32_kernel_to_fp32_rounding(rng):
    """The reference runs in float64 (an oracle for the kernel's fp32): a normed gated
    unit and a residual output agree to fp32 rounding of their scale."""
    x, w = torch.randn(7, 200, generator=rng), torch.randn(80, 200, generator=rng) / 14
    r = torch.randn(7, 40, generator=rng)
    g = _norm(rng, 200)
    for weight, kw, kw64 in ((w, dict(norm=g, output="glu"), dict(norm=(g[0].double(), g[1]), output="glu")),
                             (w[:40], dict(output="residual", residual=r), dict(output="residual",
                                                                                residual=r.double()))):
        got = normed_linear(x, weight, **kw)
        want = normed_linear(x.double(), weight.double(), backend="reference", **kw64)
        assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


def test_pair_of_norms_with_a_lookup_and_the_operand_kept(rng):
    """``fc`` of the MTP head: the first half looked up in a table (an id outside it
    reads zeros), both halves normed; ``normed_out`` holds the operand."""
    k, m = 64, 9
    table = torch.randn(30, k, generator=rng)
    ids = torch.randint(0, 30, (m,), generator=rng)
    ids[3] = 30  # past the table
    x2 = torch.randn(m, k, generator=rng)
    w = torch.randn(48, 2 * k, generator=rng) / k
    kw = dict(norm=_norm(rng, k), pair=(x2, *_norm(rng, k)), rows=ids)
    got_a, want_a = torch.full((m, 2 * k), 7.0), torch.full((m, 2 * k), 7.0)
    _close(normed_linear(table, w, normed_out=got_a, **kw), normed_linear_reference(table, w, normed_out=want_a, **kw))
    _close(got_a, want_a)
    assert torch.equal(got_a[3, :k], torch.zeros(k)) and got_a[3, k:].abs().min() > 0


def test_argmax_of_picked_rows(rng):
    """The LM head's argmax on one row of each request's group (``rows`` offsets in
    groups of ``row_group``) over a vocabulary of many column blocks."""
    k, t, b, vocab = 64, 4, 6, 3000
    x = torch.randn(b * t, k, generator=rng)
    w = torch.randn(vocab, k, generator=rng)
    pick = torch.randint(0, t, (b,), generator=rng)
    kw = dict(norm=_norm(rng, k), rows=pick, row_group=t)
    h_got, h_want = torch.empty(b, k), torch.empty(b, k)
    got = normed_linear(x, w, output="argmax", normed_out=h_got, **kw)
    logits = normed_linear_reference(x, w, normed_out=h_want, **kw)
    _close(h_got, h_want)
    top2 = logits.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > 1e-3 * top2[:, 0].abs()
    assert clear.sum() >= b - 1
    assert torch.equal(got[clear], logits.argmax(-1)[clear])


def _one_launch(monkeypatch):
    """Fail any second launch: with arrival counters the last block merges the blocks."""
    def second_launch(*args, **kwargs):
        raise AssertionError("the column blocks were merged in a second launch")
    monkeypatch.setattr(normed_linear_mod, "merge_argmax_parts", second_launch)


@pytest.mark.parametrize("merge", ["second launch", "last block"])
def test_argmax_ties_and_nans_follow_torch(rng, merge, monkeypatch, entry_independent_dots):
    """Columns with one weight row give bit-equal logits: the first wins, within a block
    and across blocks; a NaN row of weights makes a NaN logit, which wins (torch's
    rule). Row 2's input is zero: every logit is zero, column 0 wins. The column blocks
    are merged by a second launch, or by the last block to finish (the counters then
    back at zero, or the next call would merge too early)."""
    kw = {}
    if merge == "last block":
        kw["arrivals"] = arrivals = arrival_counters("cpu")
        _one_launch(monkeypatch)
    k, vocab = 32, 700
    w = torch.randn(vocab, k, generator=rng)
    x = torch.randn(3, k, generator=rng)
    x[2] = 0
    best = (w @ x[0]).argmax()
    w[[5, 40, 650]] = w[best].clone()  # equal to the best in three other places: earlier and later blocks
    first = min(5, int(best))
    got = normed_linear(x, w, output="argmax", **kw)
    assert got[0] == first and got[2] == 0
    w[600] = float("nan")
    got = normed_linear(x[:2], w, output="argmax", **kw)
    assert torch.equal(got, torch.tensor([600, 600]))
    if kw:
        assert not arrivals.any()


def test_argmax_merged_by_the_last_block_where_the_blocks_fit_one_read(rng, monkeypatch):
    """More column blocks than one merge reads (a large vocabulary) take the second
    launch even with counters; the answer is torch's either way."""
    calls = []
    monkeypatch.setattr(normed_linear_mod, "merge_argmax_parts",
                        lambda *a: (calls.append(1), argmax_mod.merge_argmax_parts(*a)))
    arrivals = arrival_counters("cpu")
    k = 16
    x = torch.randn(3, k, generator=rng)
    for vocab, launches in ((64 * 60, 0), (64 * 70, 1)):  # 60 and 70 blocks: 64 and 128 parts a merge reads
        w = torch.randn(vocab, k, generator=rng)
        got = normed_linear(x, w, output="argmax", arrivals=arrivals)
        assert torch.equal(got, normed_linear_reference(x, w).argmax(-1)) and len(calls) == launches


def test_bad_arguments_are_refused_untouched(refused, rng):
    x = torch.randn(4, 32, generator=rng)
    w = torch.randn(16, 32, generator=rng)
    keep = torch.randn(4, 32, generator=rng)
    norm = _norm(rng, 32)
    args = dict(x=x, weight=w, norm=norm, normed_out=keep)
    refused(normed_linear, args, [
        (dict(weight=torch.randn(16, 31)), ValueError, "weight must be"),
        (dict(weight=w.double()), ValueError, "weight must be"),
        (dict(x=x.t()), ValueError, "x must be"),
        (dict(x=x.long()), TypeError, "x must be a floating-point"),
        (dict(x=x.double(), weight=w.double(), norm=(norm[0].double(), 1e-6), normed_out=keep.double()), TypeError,
         "for the Triton normed linear"),
        (dict(norm=(torch.randn(31), 1e-6)), ValueError, "norm's weight"),
        (dict(norm=(norm[0], 0.0)), ValueError, "eps must be positive"),
        (dict(output="relu"), ValueError, "output must be one of"),
        (dict(output="residual"), ValueError, "needs residual"),
        (dict(output="residual", residual=torch.randn(4, 15)), ValueError, "residual must be"),
        (dict(output="glu", weight=torch.randn(15, 32)), ValueError, "even number of rows"),
        (dict(pair=(torch.randn(4, 32), *norm), norm=None), ValueError, "pair needs norm"),
        (dict(pair=(torch.randn(4, 32), *norm)), ValueError, r"weight must be .*\[N, 64\]"),
        (dict(pair=(torch.randn(3, 32), *norm), weight=torch.randn(16, 64)), ValueError, "pair's x2"),
        (dict(rows=torch.tensor([0.5])), ValueError, "rows must be"),
        (dict(row_group=2), ValueError, "row_group needs rows"),
        (dict(normed_out=torch.empty(4, 31)), ValueError, "normed_out must be"),
        (dict(arrivals=arrival_counters("cpu")), ValueError, "arrivals are for output='argmax'"),
        (dict(output="argmax", normed_out=None, arrivals=torch.zeros(4096)), ValueError, "arrivals must be"),
        (dict(backend="cuda"), ValueError, "backend must be"),
    ], keep)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_bf16_on_cuda_against_the_reference(m, rng):
    """bf16 at the embedded MTP head's shapes: each result rounds to bf16 after another
    summation order than cuBLAS's, so within 2 bf16 ulps (2^-7) of the scale; the
    argmax where the best logit leads by more than 2 ulps of it."""
    dev, dt, h = "cuda", torch.bfloat16, 256
    x = torch.randn(m, h, generator=rng).to(dev, dt)
    norm = (_norm(rng, h)[0].to(dev, dt), 1e-6)
    for n, kw in ((768, dict(norm=norm)), (256, dict(output="residual", residual=x)),
                  (512, dict(norm=norm, output="glu"))):
        w = (torch.randn(2 * n if kw.get("output") == "glu" else n, h, generator=rng) / h ** 0.5).to(dev, dt)
        _close(normed_linear(x, w, **kw), normed_linear_reference(x, w, **kw), rel=2 ** -7)
    w = torch.randn(4096, h, generator=rng).to(dev, dt) / 4
    logits = normed_linear_reference(x, w, norm=norm).float()
    top2 = logits.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > 2 ** -6 * top2[:, 0].abs()
    got = normed_linear(x, w, norm=norm, output="argmax")
    assert torch.equal(got[clear], logits.argmax(-1)[clear]) and clear.float().mean() > 0.5
    # the last block merges (the blocks of a row block in any order): 100 calls
    arrivals = arrival_counters(dev)
    for _ in range(100):
        x = torch.randn(m, h, generator=rng).to(dev, dt)
        logits = normed_linear_reference(x, w, norm=norm).float()
        top2 = logits.topk(2, -1).values
        clear = top2[:, 0] - top2[:, 1] > 2 ** -6 * top2[:, 0].abs()
        got = normed_linear(x, w, norm=norm, output="argmax", arrivals=arrivals)
        assert torch.equal(got[clear], logits.argmax(-1)[clear])
    assert not arrivals.any()


def test_chained_launches_stay_in_stream_order_off_sm90_and_end_with_their_block(monkeypatch):
    """:func:`chained_launches` chains only where programmatic launches exist (here, on
    the CPU and under the interpreter, never), asks nothing of a launch outside its
    block, starts a block in stream order unless told otherwise, and restores the
    enclosing block's choice after its own, even on an error."""
    from replayssm.ops import triton_common

    pdl = (True, {"launch_pdl": True})
    assert triton_common.chain_launch() == (False, {})
    with triton_common.chained_launches(torch.device("cpu")):
        assert triton_common.chain_launch() == (False, {}) and not triton_common.chain_active()
    monkeypatch.setattr(triton_common, "dependent_launch", lambda device: True)  # as on an sm_90 card
    with triton_common.chained_launches(torch.device("cuda")):
        # the block's first kernel in stream order (it still lets the next one start)
        assert triton_common.chain_launch() == (True, {}) and triton_common.chain_active()
        assert triton_common.chain_launch() == pdl
        with pytest.raises(RuntimeError):
            with triton_common.chained_launches(torch.device("cuda"), enabled=False):
                assert triton_common.chain_launch() == (False, {})
                raise RuntimeError
        assert triton_common.chain_launch() == pdl
    assert triton_common.chain_launch() == (False, {})
    with triton_common.chained_launches(torch.device("cuda"), ordered_start=False):
        assert triton_common.chain_launch() == pdl
    with triton_common.chained_launches(torch.device("cuda")):
        with triton_common.chained_launches(torch.device("cuda"), ordered_start=False):
            assert triton_common.chain_launch() == pdl
        assert triton_common.chain_launch() == (True, {})  # the outer block's start is still its own
