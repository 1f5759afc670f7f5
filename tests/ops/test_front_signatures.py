"""The dispatching ops show their real parameters (help, IDEs, the API reference): each
front takes exactly its reference's parameters plus ``backend``, and forwards them."""

import inspect

import pytest
import torch

from replayssm import ops

FRONTS = ["gdn_recurrence", "gdn_chunked_window", "gdn_fold", "causal_conv_verify", "causal_conv_commit",
          "snapshot_commit", "advance_cursors", "reset_cursors", "prompt_gates", "write_checkpoints"]


@pytest.mark.parametrize("name", FRONTS)
def test_front_signature_is_the_reference_plus_backend(name):
    front = inspect.signature(getattr(ops, name)).parameters
    ref = inspect.signature(getattr(ops, f"{name}_reference")).parameters
    assert list(front)[:-1] == list(ref) and list(front)[-1] == "backend"
    assert front["backend"].kind is inspect.Parameter.KEYWORD_ONLY and front["backend"].default == "auto"
    for p, r in zip(front.values(), ref.values()):
        assert (p.kind, p.default) == (r.kind, r.default), p.name
    assert "*args" not in str(inspect.signature(getattr(ops, name)))


def test_front_forwards_keywords():
    """A keyword the reference takes reaches it through the front (snapshots of every
    window position, equal to the reference's own)."""
    h, hv, k, v, n = 1, 2, 4, 4, 3
    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    q, kk = (torch.randn(n, h, k, generator=g) for _ in range(2))
    vv = torch.randn(n, hv, v, generator=g)
    a, b = (torch.randn(n, hv, generator=g) for _ in range(2))
    A_log, dt_bias = torch.randn(hv, generator=g) - 2, torch.randn(hv, generator=g)
    state = torch.randn(2, hv, v, k, generator=g)
    slots, cu = torch.tensor([1], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    snaps = [torch.zeros(2, n, hv, v, k) for _ in range(2)]
    o1 = ops.gdn_recurrence(q, kk, vv, a, b, A_log, dt_bias, state, slots, cu, snapshots=snaps[0], backend="reference")
    o2 = ops.gdn_recurrence_reference(q, kk, vv, a, b, A_log, dt_bias, state, slots, cu, snapshots=snaps[1])
    assert torch.equal(o1, o2) and torch.equal(snaps[0], snaps[1]) and snaps[0][1].abs().sum() > 0
    with pytest.raises(TypeError):
        ops.gdn_recurrence(q, kk, vv, a, b, A_log, dt_bias, state, slots, cu, snapshot=snaps[0])
