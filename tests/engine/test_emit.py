"""A static step's outputs after its acceptance in one kernel (``emit_step``) against the
torch ops a step ran: accepted counts, next tokens, emitted tokens, the output buffer
and the KV lengths, equal (integers), greedy from the target's argmax and from counts
chosen elsewhere, with padding rows in the sink."""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.emit import emit_step

SLOTS = 6  # the sink is slot 6


def _case(rng, b: int, t: int):
    """Rows on distinct live slots, the last one padding (the sink); row ``i``'s drafts
    agree with the target for its first ``i mod T`` positions, then not (every count
    from 0 to ``T - 1`` among the rows when ``b >= T``)."""
    slot_idx = torch.cat([torch.randperm(SLOTS, generator=rng)[: b - 1], torch.tensor([SLOTS])])
    ids = torch.randint(0, 50, (b, t), generator=rng)
    argmax = torch.randint(50, 100, (b, t), generator=rng)  # disagrees everywhere...
    agree = torch.arange(b) % t
    for i in range(b):  # ...but on each row's first agree[i] drafts
        argmax[i, : agree[i]] = ids[i, 1 : agree[i] + 1]
    starts = torch.randint(0, 40, (b,), generator=rng)
    starts[-1] = 0
    kv_len = torch.randint(0, 40, (SLOTS + 1,), generator=rng)
    return ids, argmax, agree, starts, slot_idx, kv_len


@pytest.mark.parametrize("t", [1, 2, 4, 5])
@pytest.mark.parametrize("greedy", [True, False])
def test_emit_step_is_the_torch_ops(rng, t, greedy):
    b = 5
    ids, argmax, agree, starts, slot_idx, kv_len = _case(rng, b, t)
    if greedy:
        choice = dict(argmax=argmax)
    else:  # counts and tokens chosen elsewhere (rejection sampling, a forced drafter)
        choice = dict(n=torch.randint(0, t, (b,), generator=rng), nxt=torch.randint(0, 100, (b,), generator=rng))
    runs = []
    windows = torch.randint(200, 300, (SLOTS + 1, t + 2), generator=rng)  # the next windows, wider than T
    for backend in ("reference", "triton"):
        kv, out, win = kv_len.clone(), torch.full((b, 1 + t), 7, dtype=torch.int64), windows.clone()
        got = emit_step(ids, starts, slot_idx, kv, SLOTS, out, backend=backend, next_windows=win[:, 1:], **choice)
        runs.append((*got, kv, out, win))
    for want, got in zip(*runs):
        assert torch.equal(got, want), (want, got)
    accepted, nxt, emitted, kv, out, win = runs[1]
    # each row's next token opens its slot's next window; nothing else of the windows moves
    assert torch.equal(win[slot_idx, 1], nxt)
    moved = torch.zeros_like(win, dtype=torch.bool)
    moved[slot_idx, 1] = True
    assert torch.equal(win[~moved], windows[~moved])
    if greedy:  # the agreed drafts, then the target's token after them, then -1
        assert torch.equal(accepted, agree + 1)
        for i, a in enumerate(agree.tolist()):
            assert emitted[i, :a].tolist() == ids[i, 1 : a + 1].tolist() and emitted[i, a] == argmax[i, a] == nxt[i]
    assert kv[SLOTS] == 0 and torch.equal(kv[slot_idx[:-1]], starts[:-1] + accepted[:-1])
    untouched = torch.ones(SLOTS + 1, dtype=torch.bool)
    untouched[slot_idx] = False
    assert torch.equal(kv[untouched], kv_len[untouched])
    assert ((emitted == -1).sum(1) == t - accepted).all()


def test_emit_step_refuses_bad_arguments(rng):
    ids, argmax, _, starts, slot_idx, kv_len = _case(rng, 3, 4)
    out = torch.zeros(3, 5, dtype=torch.int64)
    args = (ids, starts, slot_idx, kv_len, SLOTS, out)
    with pytest.raises(ValueError, match="argmax .* or both n and nxt"):
        emit_step(*args)
    with pytest.raises(ValueError, match="argmax .* or both n and nxt"):
        emit_step(*args, argmax=argmax, n=starts)
    with pytest.raises(TypeError, match="argmax must be an int64"):
        emit_step(*args, argmax=argmax.int())
    with pytest.raises(ValueError, match="out must have shape"):
        emit_step(ids, starts, slot_idx, kv_len, SLOTS, out[:, :4], argmax=argmax)
    with pytest.raises(ValueError, match="the sink 2 its last entry"):
        emit_step(ids, starts, slot_idx, kv_len, 2, out, argmax=argmax)
    with pytest.raises(ValueError, match="backend"):
        emit_step(*args, argmax=argmax, backend="cuda")
    for bad in (torch.zeros(SLOTS, 4, dtype=torch.int64), torch.zeros(SLOTS + 1, 4),
                torch.zeros(4, SLOTS + 1, dtype=torch.int64).T):
        with pytest.raises(ValueError, match="next_windows must be"):
            emit_step(*args, argmax=argmax, next_windows=bad)
