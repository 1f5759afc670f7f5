"""A step's inputs in one kernel (``gather_step_inputs``) against the torch ops it
replaces: the rows' windows, committed lengths, positions (a chain's, a draft tree's
depths), embedding and rotary rows; and the MTP drafter's inputs after a step
(``draft_inputs``) likewise."""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.step_inputs import draft_inputs, gather_step_inputs


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


def _draft_case(rng, b=5, t=4, cap=40, r=8):
    """A step's output as the engine leaves it: ``[B, 1 + T]`` (accepted counts, then
    the emitted tokens, ``-1`` past them), positions from random committed lengths."""
    accepted = torch.randint(1, t + 1, (b,), generator=rng)
    out = torch.randint(0, 99, (b, 1 + t), generator=rng)
    out[:, 0] = accepted
    out[:, 1:][torch.arange(t)[None] >= accepted[:, None]] = -1
    starts = torch.randint(0, cap - 2 * t, (b,), generator=rng)
    positions = (starts[:, None] + torch.arange(t)).t().contiguous().t()  # strided along T
    return out[:, 1:], out[:, 0], positions, torch.randn(cap, 2, r, generator=rng)


@pytest.mark.parametrize("depths", [0, 1, 3])
def test_draft_inputs_are_the_torch_ops(rng, depths):
    """Bit for bit the drafter's seven torch ops (two clamps, a subtraction, two sums,
    two row gathers) with the accepted counts and emitted tokens as columns of the
    step's output buffer and the positions strided; at 0, 1 and 3 later depths."""
    emitted, accepted, positions, table = _draft_case(rng)
    assert accepted.stride(0) == 5 and positions.stride(1) != 1
    got = draft_inputs(emitted, accepted, positions, table, depths)
    want = draft_inputs(emitted, accepted, positions, table, depths, backend="reference")
    assert len(got) == len(want) == 6
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), i
    assert (got[0] >= 0).all() and (got[1] == accepted - 1).all()
    if depths:
        assert torch.equal(got[4][-1], positions[:, 0] + accepted + depths - 1)


def test_draft_inputs_out_of_range_positions_read_zero_rows(rng):
    """A position past the rotary table gets zero rows on the device (no read outside
    the table), where the reference's indexing would raise."""
    emitted, accepted, positions, table = _draft_case(rng, b=2, t=2, cap=12)
    positions = positions.clone()
    positions[1] = torch.tensor([11, 12])
    accepted = torch.tensor([1, 2])
    _, _, _, rope, depth_pos, depth_rope = draft_inputs(emitted, accepted, positions, table, 1)
    assert torch.equal(rope[1, 0], table[11]) and (rope[1, 1] == 0).all()
    assert depth_pos[0, 1] == 13 and (depth_rope[0, 1] == 0).all()
    assert torch.equal(depth_rope[0, 0], table[positions[0, 0] + 1])


@pytest.mark.gpu
def test_draft_inputs_on_cuda_in_bf16_are_the_torch_ops():
    """The drafter's inputs on the GPU, a bf16 rotary table of 64 columns, batch 64:
    bit for bit the torch ops (copies and integer sums)."""
    g = torch.Generator().manual_seed(7)
    emitted, accepted, positions, table = _draft_case(g, b=64, cap=300, r=64)
    args = [x.to("cuda") for x in (emitted, accepted, positions, table.to(torch.bfloat16))]
    got = draft_inputs(*args, 2)
    want = draft_inputs(*args, 2, backend="reference")
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("refused", ["depths", "emitted dtype", "no tokens", "accepted shape", "positions shape",
                                     "table"])
def test_draft_inputs_refuse_bad_arguments(rng, refused):
    emitted, accepted, positions, table = _draft_case(rng)
    kw = dict(emitted=emitted, accepted=accepted, positions=positions, rope_table=table, depths=2)
    if refused == "depths":
        kw["depths"] = -1
    elif refused == "emitted dtype":
        kw["emitted"] = emitted.to(torch.int32)
    elif refused == "no tokens":
        kw["emitted"], kw["positions"] = emitted[:, :0], positions[:, :0]
    elif refused == "accepted shape":
        kw["accepted"] = accepted[:-1]
    elif refused == "positions shape":
        kw["positions"] = positions[:, :-1]
    else:
        kw["rope_table"] = table[:, :1]
    word = {"depths": "depths", "emitted dtype": "emitted", "no tokens": "emitted", "accepted shape": "accepted",
            "positions shape": "positions", "table": "rope_table"}[refused]
    with pytest.raises((ValueError, TypeError), match=word):
        draft_inputs(**kw)
