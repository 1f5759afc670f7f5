"""A step's inputs in one kernel (``gather_step_inputs``) against the torch ops it
replaces: the rows' windows, committed lengths, positions (a chain's, a draft tree's
depths), embedding and rotary rows."""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.step_inputs import gather_step_inputs


def _case(rng, slots=6, t=4, vocab=50, hidden=1100, positions=40, r=8, dtype=torch.float32, device="cpu"):
    windows = torch.randint(0, vocab, (slots + 1, t), generator=rng)
    kv_len = torch.randint(0, positions - t, (slots + 1,), generator=rng)
    slot_idx = torch.tensor([3, 0, slots, 5])  # the sink (padding) third
    embed = torch.randn(vocab, hidden, generator=rng).to(dtype)
    table = torch.randn(positions, 2, r, generator=rng).to(dtype)
    return [x.to(device) for x in (windows, kv_len, slot_idx, embed, table)]


@pytest.mark.parametrize("t", [1, 4])
def test_step_inputs_are_the_torch_ops(rng, t):
    """Bit for bit the reference's indexings, sum and gathers (an embedding wider than
    one block of columns), with and without the rotary table, and with the windows the
    first column of a wider buffer (a plain step's view of a speculative step's windows)."""
    windows, kv_len, slot_idx, embed, table = _case(rng)
    if t == 1:
        windows = windows[:, :1]
        assert not windows.is_contiguous()
    depths = torch.tensor([0, 1, 1, 2])[: windows.shape[1]]  # a draft tree's nodes (t = 4)
    for rope, offsets in ((table, None), (None, None), (table, depths)):
        got = gather_step_inputs(windows, kv_len, slot_idx, embed, rope, offsets)
        want = gather_step_inputs(windows, kv_len, slot_idx, embed, rope, offsets, backend="reference")
        assert (got[4] is None) == (rope is None)
        for g, w in zip(got, want):
            if w is not None:
                assert g.dtype == w.dtype and torch.equal(g, w)
    assert torch.equal(got[2], kv_len[slot_idx][:, None] + depths)


def test_step_inputs_out_of_range_ids_read_zero_rows(rng):
    """A token id outside the vocabulary and a position past the table get zero rows
    (the device's guard), the other rows theirs."""
    windows, kv_len, slot_idx, embed, table = _case(rng)
    windows[3, 1] = embed.shape[0]  # row 0's token 1
    kv_len[0] = table.shape[0] - 2  # row 1's tokens 2 and 3 fall past the table
    ids, _, positions, h, rope = gather_step_inputs(windows, kv_len, slot_idx, embed, table)
    assert ids[0, 1] == embed.shape[0] and not h[1].any() and h[0].abs().sum() > 0
    assert torch.equal(positions[1], table.shape[0] - 2 + torch.arange(4))
    assert not rope[1, 2:].any() and torch.equal(rope[1, :2], table[table.shape[0] - 2 :])


def test_step_inputs_refuse_bad_arguments(rng, refused):
    windows, kv_len, slot_idx, embed, table = _case(rng)
    cases = [
        (dict(windows=windows.int()), TypeError, "windows must be an int64"),
        (dict(kv_len=kv_len[:-1]), ValueError, "kv_len"),
        (dict(embed=embed[0]), ValueError, "embed must be"),
        (dict(rope_table=table[:, :1]), ValueError, "rope_table must be"),
        (dict(offsets=torch.arange(5)), ValueError, "offsets must be"),
        (dict(offsets=torch.arange(4).int()), TypeError, "offsets must be an int64"),
        (dict(windows=windows.T.contiguous().T), ValueError, "along its last axis"),
    ]
    args = dict(windows=windows, kv_len=kv_len, slot_idx=slot_idx, embed=embed, rope_table=table)
    refused(gather_step_inputs, args, cases)
    with pytest.raises(ValueError, match="backend"):
        gather_step_inputs(windows, kv_len, slot_idx, embed, backend="cuda")


@pytest.mark.gpu
def test_step_inputs_on_cuda_in_bf16_are_the_torch_ops():
    g = torch.Generator().manual_seed(5)
    windows, kv_len, slot_idx, embed, table = _case(g, hidden=2048, r=64, dtype=torch.bfloat16, device="cuda")
    got = gather_step_inputs(windows, kv_len, slot_idx, embed, table)
    want = gather_step_inputs(windows, kv_len, slot_idx, embed, table, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
