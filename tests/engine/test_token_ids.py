"""Token ids as the engine and the generators take them: lists of ints, or 1-D integer
arrays and CPU tensors, each checked once (``engine.adapter.token_ids``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replayssm.engine.adapter import HybridEngine, token_ids
from replayssm.engine.device_drafters import DeviceNgramDrafter
from replayssm.engine.generator import StepGenerator, check_requests
from replayssm.engine.random_model import build_tiny_model

VOCAB = 300


def test_every_form_packs_to_the_same_int64_ids(rng):
    ids = torch.randint(0, VOCAB, (37,), generator=rng)
    want = ids.numpy().astype(np.int64)
    for form in (ids.tolist(), tuple(ids.tolist()), ids.numpy().astype(np.int32), ids.numpy().astype(np.uint16),
                 ids.to(torch.int16), list(ids.numpy())):  # the last: a list of NumPy ints
        got = token_ids(form, "w", VOCAB)
        assert got.dtype == np.int64 and np.array_equal(got, want), type(form)


def test_an_array_is_copied(rng):
    w = torch.randint(0, VOCAB, (9,), generator=rng).numpy()
    got = token_ids(w, "w", VOCAB)
    w[0] = (w[0] + 1) % VOCAB  # the caller's later change does not reach the checked ids
    assert got[0] != w[0]


@pytest.mark.parametrize("bad, err", [
    ([1, 2.0, 3], "holds 2.0"),
    ([1, True], "holds True"),
    ([1, np.True_], "holds np.True_|holds True"),
    (["7"], "holds '7'"),
    ([1, VOCAB], f"holds {VOCAB}"),
    ([-1, 2], "holds -1"),
    (np.array([1.0, 2.0]), "integer token ids"),
    (np.array([[1, 2]]), "1-D"),
    (np.array([3, VOCAB + 5, 4]), f"holds {VOCAB + 5}"),
    (np.array([3, -2], dtype=np.int64), "holds -2"),
    (torch.tensor([1.5]), "integer token ids"),
    ([], "is empty"),
    (np.zeros(0, dtype=np.int64), "is empty"),
])
def test_bad_ids_are_named(bad, err):
    with pytest.raises(ValueError, match=rf"^windows\[3\] .*{err}|^windows\[3\] {err}"):
        token_ids(bad, "windows[3]", VOCAB)


def test_the_engine_takes_arrays_and_tensors_as_windows(rng, seed):
    model = build_tiny_model("qwen3_5", seed=seed)
    prompt = torch.randint(0, 256, (21,), generator=rng)
    logits = []
    for form in (prompt.tolist(), prompt.numpy(), prompt.to(torch.int32)):
        eng = HybridEngine(model, strategy="circular", num_slots=2, window=3, max_len=40)
        s = eng.alloc()
        out = eng.extend([s], [form], prompt=True)
        step = eng.verify([s], [np.array([5, 9, 11])])
        eng.commit([2])
        logits.append((out.logits, step.logits))
    assert logits[0][0].abs().max() > 0.1  # logits with some spread
    for a, b in logits[1:]:  # the same ids, the same computation: the same bits
        assert torch.equal(a, logits[0][0]) and torch.equal(b, logits[0][1])
    with pytest.raises(ValueError, match=r"windows\[1\] must be a 1-D array of integer"):
        eng.extend([0, 1], [[1], np.array([1.0])])


def test_the_generator_takes_array_prompts(rng, seed):
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = [torch.randint(0, 256, (n,), generator=rng) for n in (13, 30, 7)]
    outs = []
    for form in ([p.tolist() for p in prompts], [p.numpy() for p in prompts], prompts):
        eng = HybridEngine(model, strategy="fold", num_slots=3, window=4, max_len=64)
        res = StepGenerator(eng, DeviceNgramDrafter(), num_draft=3).generate(form, 8)
        outs.append(res.tokens)
    assert outs[0] == outs[1] == outs[2]
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a 1-D array of integer"):
        StepGenerator(eng, DeviceNgramDrafter(), num_draft=3).generate([[1, 2], np.array([0.5])], 4)


def test_check_requests_gives_plain_int_prompts_and_their_arrays(rng, seed):
    eng = HybridEngine(build_tiny_model("qwen3_5", seed=seed), strategy="fold", num_slots=2, window=4, max_len=64)
    a = torch.randint(0, 256, (11,), generator=rng)
    prompts, budgets, ids = check_requests(eng, [a.numpy().astype(np.int32), list(a.numpy())], 5)
    assert budgets == [5, 5]
    for p, x in zip(prompts, ids):
        assert p == a.tolist() and all(type(t) is int for t in p)  # the drafters' histories take plain ints
        assert x.dtype == np.int64 and np.array_equal(x, a.numpy())
