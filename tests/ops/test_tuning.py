"""The kernels' shape-keyed launch table (ops/tuning.py)."""

from __future__ import annotations

import pytest
import torch

from replayssm.ops import tuning

F32, BF16 = torch.float32, torch.bfloat16


def test_defaults_are_the_measured_values():
    at = dict(K=128, V=128, state_dtype=F32, batch=256)
    assert tuning.lookup("exact_write", **at) == {"block_v": 32, "records_ahead": 2, "num_warps": 2,
                                                       "load_ahead": 1}
    assert tuning.lookup("exact_read_only", **at) == {"block_v": 64, "num_warps": 2, "load_ahead": 0}
    assert tuning.lookup("exact_read_only", **dict(at, state_dtype=BF16)) == {"block_v": 64, "num_warps": 2, "load_ahead": 0}
    assert tuning.lookup("exact_snapshot", **at) == {"block_v": 8, "num_warps": 1, "load_ahead": 1}
    assert tuning.lookup("exact_snapshot", **dict(at, state_dtype=BF16)) == {"block_v": 16, "num_warps": 1, "load_ahead": 1}
    assert tuning.lookup("exact_snapshot", **dict(at, state_dtype=BF16, batch=8))["block_v"] == 8
    assert tuning.lookup("closed_form", **dict(at, batch=16))["heads_per_program"] == 1
    assert tuning.lookup("closed_form", **at) == {"block_v": 64, "k_chunk": 128, "num_stages": 2, "num_warps": 4, "tf32_coefficients": 1,
                                                        "coef_warps": 1, "heads_per_program": 8, "flush_block_v": 32,
                                                        "fuse_flush": 1, "flush_records_ahead": 1, "dependent_launch": 1,
                                                        "max_registers": 128, "early_tile": 0, "short_tail": 0,
                                                        "coef_max_registers": 0, "records_first": 1}
    assert [tuning.lookup("closed_form", **dict(at, batch=b, state_dtype=d))["records_first"]
            for d in (F32, BF16) for b in (16, 64)] == [1, 1, 1, 1]
    assert tuning.lookup("closed_form", **dict(at, batch=32))["max_registers"] == 0
    assert [tuning.lookup("closed_form", **dict(at, batch=b, state_dtype=d))["k_chunk"]
            for d in (F32, BF16) for b in (32, 33)] == [64, 128, 64, 128]
    assert [tuning.lookup("closed_form", **dict(at, batch=b, state_dtype=d))["short_tail"]
            for d in (F32, BF16) for b in (32, 33)] == [32, 0, 32, 0]
    assert tuning.lookup("closed_form", **dict(at, state_dtype=BF16))["max_registers"] == 128
    assert tuning.lookup("ring_decode", **at)["early_tile"] == 1
    assert tuning.lookup("ring_decode", **at)["split_flush"] == 0
    bf16_ring = tuning.lookup("ring_decode", **dict(at, state_dtype=BF16))
    assert (bf16_ring["split_flush"], bf16_ring["early_tile"], bf16_ring["token_block_v"]) == (2, 0, 128)
    assert [tuning.lookup("ring_decode", **dict(at, state_dtype=d, batch=b))["dot_products"]
            for d in (F32, BF16) for b in (1, 15, 16, 256)] == [0, 0, 0, 0, 0, 0, 1, 1]
    assert tuning.lookup("ring_decode", **dict(at, state_dtype=BF16, batch=15))["split_flush"] == 0
    assert tuning.lookup("ring_decode", **dict(at, state_dtype=BF16, batch=16))["split_flush"] == 2
    assert tuning.lookup("ring_decode", **dict(at, state_dtype=BF16, batch=15))["early_tile"] == 0
    assert tuning.lookup("ring_decode", **at)["max_registers"] == 0
    # fp32 ring decoding: 4 warps x 128 rows below batch 16; the flush rows apart on 2
    # warps x 32 rows at 16-32; one launch on 2 warps x 64 rows from 33
    assert [(r["split_flush"], r["num_warps"], r["flush_warps"], r["block_v"])
            for r in (tuning.lookup("ring_decode", **dict(at, batch=b)) for b in (1, 15, 16, 32, 33, 256))] == [
        (0, 4, 4, 128), (0, 4, 4, 128), (2, 4, 2, 32), (2, 4, 2, 32), (0, 2, 4, 64), (0, 2, 4, 64)]
    assert tuning.lookup("ring_decode", **dict(at, state_dtype=BF16))["num_warps"] == 4


@pytest.mark.parametrize("name,value", [("fuse_flush", 2), ("dependent_launch", 2), ("flush_records_ahead", 3), ("flush_records_ahead", 0),
                                        ("early_tile", 2)])
def test_closed_choices_are_checked(name, value):
    with pytest.raises(ValueError, match=name):
        tuning.check_row("closed_form", {}, {name: value})


def test_a_choice_can_belong_to_one_family():
    """The exact kernels and ring decoding take 1, 2, 4 or 8 warps (their states' bits
    are argued for those counts), the ring's flush kernel 2 or 4, and the closed form's
    outputs kernel, which folds flush rows beside tensor-core products, 2 or 4 (on 1
    warp its folded states changed bits on the GPU)."""
    with pytest.raises(ValueError, match=r"ring_decode.flush_warps must be one of \(2, 4\)"):
        tuning.check_row("ring_decode", {}, {"flush_warps": 1})
    for family in ("exact_write", "exact_snapshot", "exact_read_only", "ring_decode"):
        with pytest.raises(ValueError, match=rf"{family}.num_warps must be one of \(1, 2, 4, 8\)"):
            tuning.check_row(family, {}, {"num_warps": 3})
        for warps in (1, 2, 8):
            tuning.check_row(family, {}, {"num_warps": warps})
    for warps in (1, 8):
        with pytest.raises(ValueError, match=r"closed_form.num_warps must be one of \(2, 4\)"):
            tuning.check_row("closed_form", {}, {"num_warps": warps})
    for warps in (2, 4):
        tuning.check_row("closed_form", {}, {"num_warps": warps})


def test_first_matching_row_wins(monkeypatch):
    rows = [({"K": 128, "state_dtype": BF16, "max_batch": 4}, {"block_v": 16}),
            ({"min_batch": 64}, {"block_v": 32}),
            ({}, {"block_v": 64})]
    for key, params in rows:
        tuning.check_row("exact_write", key, params)
    monkeypatch.setitem(tuning.TABLE, "exact_write", rows)
    pick = lambda **kw: tuning.lookup("exact_write", **{"K": 128, "V": 128, "state_dtype": F32, "batch": 1, **kw})  # noqa: E731
    assert pick(state_dtype=BF16)["block_v"] == 16
    assert pick(state_dtype=BF16, K=64)["block_v"] == 64  # K does not match
    assert pick(state_dtype=BF16, batch=5)["block_v"] == 64  # above max_batch
    assert pick(batch=64)["block_v"] == 32
    assert pick(state_dtype=BF16, batch=64)["block_v"] == 32
    assert pick(batch=63)["block_v"] == 64


def test_lookup_returns_a_copy():
    at = dict(K=128, V=128, state_dtype=F32, batch=1)
    tuning.lookup("closed_form", **at)["block_v"] = 1
    assert tuning.lookup("closed_form", **at)["block_v"] == 64


def test_override_is_scoped():
    at = dict(K=32, V=32, state_dtype=BF16, batch=3)
    with tuning.override("closed_form", num_stages=3):
        assert tuning.lookup("closed_form", **at)["num_stages"] == 3
        assert tuning.lookup("closed_form", **at)["block_v"] == 64
    assert tuning.lookup("closed_form", **at)["num_stages"] == 2
    with pytest.raises(RuntimeError):
        with tuning.override("exact_write", block_v=16):
            raise RuntimeError
    assert tuning.lookup("exact_write", **at)["block_v"] == 32


def test_bad_rows_and_names_raise():
    at = dict(K=128, V=128, state_dtype=F32, batch=1)
    with pytest.raises(ValueError, match="unknown kernel family"):
        tuning.lookup("nope", **at)
    with pytest.raises(ValueError, match="unknown parameters"):
        with tuning.override("closed_form", overlap=2):
            pass
    with pytest.raises(ValueError, match="int >= 1"):
        tuning.check_row("closed_form", {}, {"num_stages": 0})
    with pytest.raises(ValueError, match="unknown key fields"):
        tuning.check_row("closed_form", {"batch": 1}, {})


def test_no_row_matches_raises(monkeypatch):
    monkeypatch.setitem(tuning.TABLE, "closed_form", [({"K": 64}, {"block_v": 16})])
    with pytest.raises(ValueError, match="no row"):
        tuning.lookup("closed_form", K=128, V=128, state_dtype=F32, batch=1)


def test_circular_small_batch_row_by_device():
    """circular's small-batch switch: on CUDA up to a batch, never on the CPU (the
    interpreter's tests cover the closed form unless they override it); 0 is allowed."""
    at = dict(K=128, V=128, state_dtype=F32)
    cuda = tuning.lookup("circular", **at, batch=1, device="cuda")["replay_max_batch"]
    assert cuda >= 1
    assert tuning.lookup("circular", **at, batch=1, device="cpu")["replay_max_batch"] == 0
    with tuning.override("circular", replay_max_batch=0):
        assert tuning.lookup("circular", **at, batch=1, device="cuda")["replay_max_batch"] == 0
    with tuning.override("circular", replay_max_batch=7):
        assert tuning.lookup("circular", **at, batch=1, device="cpu")["replay_max_batch"] == 7
    with pytest.raises(ValueError, match="int >= 0"):
        tuning.check_row("circular", {}, {"replay_max_batch": -1})


def test_exact_warps_give_each_warp_whole_row_groups():
    """A table's warps reach an exact kernel only where each warp gets whole 4-row groups
    of the tile (the states' bits depend on it, ops/triton_common.py); smaller tiles take
    the most warps they can split that way."""
    from replayssm.ops.triton_common import exact_warps

    assert [exact_warps(8, bv) for bv in (128, 64, 32, 16, 8)] == [8, 8, 4, 4, 2]
    assert [exact_warps(4, bv) for bv in (64, 16, 8, 4)] == [4, 4, 2, 1]
    assert [exact_warps(2, bv) for bv in (32, 8, 4)] == [2, 2, 1]
    assert [exact_warps(1, bv) for bv in (128, 4)] == [1, 1]
