"""Greedy tokens in one launch (``argmax_rows``) against torch's ``argmax``: random rows,
ties across blocks and parts, NaNs and infinities, rows split into parts."""

from __future__ import annotations

import pytest
import torch

from replayssm.engine import argmax as argmax_mod
from replayssm.engine.argmax import ARGMAX_BLOCK, argmax_rows
from replayssm.ops.triton_common import arrival_counters


@pytest.mark.parametrize("shape", [(16, 4096), (3, 5), (2, 3, 1000), (2, ARGMAX_BLOCK * 2 + 7), (7,)])
def test_argmax_rows_is_torchs(rng, shape):
    x = 3 * torch.randn(shape, generator=rng)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == shape[:-1]
    assert torch.equal(got, x.argmax(-1))


def _hard_rows(rng, cols: int) -> torch.Tensor:
    """Rows whose answer a careless reduction gets wrong: a tie between the first and a
    later block, a row of -inf, two NaNs (the first wins over +inf), +inf after a tie,
    a tie inside one block, and a plain random row."""
    x = torch.randn(6, cols, generator=rng)
    late = cols - 3
    x[0, 5], x[0, late] = 50.0, 50.0
    x[1] = float("-inf")
    x[2, 9], x[2, late], x[2, 2] = float("nan"), float("nan"), float("inf")
    x[3, 1], x[3, late] = float("inf"), float("inf")
    x[4, 7], x[4, 8] = 40.0, 40.0
    return x


def test_argmax_rows_keeps_torchs_ties_and_nans(rng):
    x = _hard_rows(rng, 3 * ARGMAX_BLOCK + 11)
    want = torch.tensor([5, 0, 9, 1, 7, int(x[5].argmax())])
    assert torch.equal(x.argmax(-1), want)  # the rows say what they are meant to
    assert torch.equal(argmax_rows(x), want)


def test_argmax_rows_split_into_parts_is_torchs(rng, monkeypatch):
    """Few rows of a long vocabulary are split into parts (each part's best, then the
    parts' best in a second launch); a tie or NaN in a later part must not win."""
    x = _hard_rows(rng, 5 * ARGMAX_BLOCK + 11)
    monkeypatch.setattr(argmax_mod, "_PROGRAMS_PER_SM", 16)  # one SM off the GPU: 16 programs wanted
    parts, _ = argmax_mod._split(x.shape[0], x.shape[1], ARGMAX_BLOCK, x.device)
    assert parts == 3
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    for part_len in (1, 2):  # every other row count splits differently
        y = x[:part_len]
        assert torch.equal(argmax_rows(y), y.argmax(-1))


def _one_launch(monkeypatch):
    """Fail any second launch: with arrival counters a split row is merged by its last part."""
    def second_launch(*args, **kwargs):
        raise AssertionError("the parts were merged in a second launch")
    monkeypatch.setattr(argmax_mod, "merge_argmax_parts", second_launch)


def test_argmax_rows_split_and_merged_by_the_last_part(rng, monkeypatch):
    """With arrival counters the last part of each row to finish merges the row's parts
    in the same launch: torch's answer on the hard rows, and every counter back at zero
    for the next call (which would merge too early otherwise: the second and third
    calls check that)."""
    monkeypatch.setattr(argmax_mod, "_PROGRAMS_PER_SM", 16)
    arrivals = arrival_counters("cpu")
    _one_launch(monkeypatch)
    for cols in (5 * ARGMAX_BLOCK + 11, 3 * ARGMAX_BLOCK + 11, 5 * ARGMAX_BLOCK + 11):
        x = _hard_rows(rng, cols)
        assert argmax_mod._split(x.shape[0], cols, ARGMAX_BLOCK, x.device)[0] > 1
        assert torch.equal(argmax_rows(x, arrivals=arrivals), x.argmax(-1))
        assert not arrivals.any()


def test_arrival_counters_are_checked(rng):
    x = torch.randn(2, 300, generator=rng)
    for bad in (torch.zeros(4096, dtype=torch.int64), torch.zeros(100, dtype=torch.int32),
                torch.zeros(2, 4096, dtype=torch.int32)[:, 0], "counters"):
        with pytest.raises(ValueError, match="arrivals must be"):
            argmax_rows(x, arrivals=bad)


def test_argmax_rows_reads_a_view_of_rows_in_place(rng):
    """A row-strided view (every other row of a wider buffer) is read where it lies;
    a last axis that is not contiguous is refused rather than copied."""
    wide = torch.randn(8, 2 * 700, generator=rng)
    view = wide[:, :700]
    assert torch.equal(argmax_rows(view), view.argmax(-1))
    three = torch.randn(4, 3, 700, generator=rng)[:, :2]  # rows 700 apart, then 2100
    for bad, error, message in [
        (wide.T, ValueError, "contiguous"),
        (three, ValueError, "one stride apart"),
        (wide.to(torch.int32), TypeError, "one of"),
        (wide[:, :0], ValueError, "V > 0"),
        ([1.0, 2.0], TypeError, "tensor"),
    ]:
        with pytest.raises(error, match=message):
            argmax_rows(bad)
    with pytest.raises(ValueError, match="backend"):
        argmax_rows(view, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(16, 4096), (64, 4096), (4, 248320), (256, 4096)])
def test_argmax_rows_on_cuda_is_torchs(dtype, shape):
    """The compiled kernel at a step's shapes (the embedded model's vocabulary, and a
    Qwen3.5 one at batch 1, split into parts), with ties from 16-bit rounding."""
    g = torch.Generator().manual_seed(7)
    x = (4 * torch.randn(shape, generator=g)).to("cuda", dtype)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    hard = _hard_rows(g, 3 * ARGMAX_BLOCK + 11).to("cuda", dtype)
    assert torch.equal(argmax_rows(hard), hard.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 248320), (4, 248320), (16, 248320)])
def test_argmax_rows_merged_by_the_last_part_on_cuda(shape):
    """The last part's merge on the card, where the parts finish in any order: 200 calls
    on fresh rows (a part read before its store landed would show as a wrong index in
    some of them), a tie planted across parts in each, the counters back at zero."""
    g = torch.Generator().manual_seed(11)
    arrivals = arrival_counters("cuda")
    rows, cols = shape
    assert argmax_mod._split(rows, cols, ARGMAX_BLOCK, torch.device("cuda"))[0] > 1
    for _ in range(200):
        x = (4 * torch.randn(shape, generator=g)).to("cuda", torch.bfloat16)
        first, late = torch.randint(0, cols // 2, (2,), generator=g).tolist()
        x[:, first] = x[:, cols // 2 + late] = x.max() + 1  # the first one wins
        assert torch.equal(argmax_rows(x, arrivals=arrivals), x.argmax(-1))
    assert not arrivals.any()
