"""The engine's plain decoding through ``circular``'s ring (``plain_via_ring``, DESIGN.md
section 9), fp32 on the CPU.

Ring decoding computes each token's outputs from the checkpoint and the ring in closed
form, equal to the recurrence's to rounding (logits within ~1e-5 of the recurrence's on
these models), so greedy tokens agree unless a step meets a near-tie: the tests compare
tokens, and check that the ring path really ran (cursors moved, logits not bit-equal to
the recurrence's) so that agreement proves something.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.generator import SpeculativeGenerator, StepGenerator
from replayssm.engine.graph_step import StaticStep
from replayssm.engine.random_model import build_tiny_model
from replayssm.testing.ring_decoding import compare_plain_decoding

# The closed form against the recurrence on O(10) logits of these fp32 models: measured
# ~5e-6; a lost or repeated record moves logits by O(0.1).
LOGIT_TOL = 1e-4


def _prompts(rng, sizes):
    return [torch.randint(0, 256, (n,), generator=rng).tolist() for n in sizes]


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("qwen3_5", seed=4)


def engine(model, strategy="circular", **kw):
    kw = {"num_slots": 3, "window": 4, "max_len": 400, **kw}
    if strategy == "circular":
        kw.setdefault("ring_len", 16)
    return HybridEngine(model, strategy=strategy, **kw)


def test_option_defaults_and_checks(tiny):
    assert engine(tiny).ring_decoding and engine(tiny).plain_via_ring
    assert not engine(tiny, "fold").ring_decoding
    # L = 2T would flush at every plain step: the recurrence by default there; the engine's
    # default ring, 4T (16 here), decodes through the ring
    assert not engine(tiny, ring_len=8).ring_decoding
    assert engine(tiny, ring_len=None).ring_decoding and engine(tiny, ring_len=None).pool.ring_len == 16
    assert engine(tiny, ring_len=8, plain_via_ring=True).ring_decoding
    assert not engine(tiny, plain_via_ring=False).ring_decoding
    with pytest.raises(ValueError, match="plain_via_ring=True needs a strategy with a ring"):
        engine(tiny, "snapshot", plain_via_ring=True)
    with pytest.raises(TypeError, match="plain_via_ring must be a bool"):
        engine(tiny, plain_via_ring="yes")


def test_extend_decodes_through_the_ring_and_plain_via_ring_false_keeps_the_recurrence(tiny, rng):
    """One-token ``extend`` steps: through the ring, cursors move and the state is not
    written between flushes, logits within LOGIT_TOL of the recurrence's; with
    ``plain_via_ring=False`` the same steps are the recurrence, bit for bit (fold's)."""
    prompts = _prompts(rng, (7, 12))
    engines = {"ring": engine(tiny), "off": engine(tiny, plain_via_ring=False), "fold": engine(tiny, "fold")}
    slots = {name: [e.alloc() for _ in prompts] for name, e in engines.items()}
    with torch.inference_mode():
        last = {n: e.extend(slots[n], prompts, prompt=True).logits for n, e in engines.items()}
        differed = False
        for step in range(12):
            toks = [[int(t)] for t in last["fold"].argmax(-1)]
            last = {n: e.extend(slots[n], toks).logits for n, e in engines.items()}
            assert torch.equal(last["off"], last["fold"]), f"step {step}: recurrence logits differ"
            torch.testing.assert_close(last["ring"], last["fold"], rtol=0, atol=LOGIT_TOL)
            differed |= not torch.equal(last["ring"], last["fold"])
    assert differed, "ring logits bit-equal to the recurrence's at every step: did the ring path run?"
    wp = engines["ring"].pool.buffers["write_pos"][slots["ring"]]
    assert (wp > 0).all() and (wp <= 16).all()
    assert (engines["off"].pool.buffers["write_pos"][slots["off"]] == 0).all()


def test_plain_and_speculative_steps_mix_on_one_request(tiny, rng):
    """Each step is plain (``extend``, through the ring) or speculative (``verify`` +
    ``commit`` of drafts that are the reference's next tokens, some replaced by wrong
    ones): every emitted token equals recurrent plain decoding's."""
    prompts = _prompts(rng, (9, 5))
    budget = 80
    ref = SpeculativeGenerator(engine(tiny, "fold", window=1), None).generate(prompts, budget).tokens
    eng = engine(tiny)
    slots = [eng.alloc() for _ in prompts]
    out = [[] for _ in prompts]
    kinds = []
    with torch.inference_mode():
        first = eng.extend(slots, prompts, prompt=True).logits.argmax(-1).tolist()
        for i, t in enumerate(first):
            out[i].append(t)
        while min(len(o) for o in out) < budget:
            plain = bool(torch.rand((), generator=rng) < 0.5)
            kinds.append("plain" if plain else "spec")
            if plain:
                logits = eng.extend(slots, [[o[-1]] for o in out]).logits
                for o, t in zip(out, logits.argmax(-1).tolist()):
                    o.append(t)
                continue
            drafts = []
            for i, o in enumerate(out):
                d = ref[i][len(o):len(o) + 3]
                drafts.append([t if torch.rand((), generator=rng) < 0.7 else (t + 1) % 256 for t in d])
            step = eng.verify(slots, [[o[-1]] + d for o, d in zip(out, drafts)])
            accepted = []
            for i, (o, d) in enumerate(zip(out, drafts)):
                greedy = step.window_logits(i).argmax(-1).tolist()
                n = 0
                while n < len(d) and d[n] == greedy[n]:
                    n += 1
                o.extend(d[:n] + [greedy[n]])
                accepted.append(n + 1)
            eng.commit(accepted)
    for i, o in enumerate(out):
        first = next((j for j, (a, b) in enumerate(zip(o, ref[i])) if a != b), None)
        assert o[:budget] == ref[i], f"request {i}: first difference at token {first}"
    assert kinds.count("plain") > 10 and kinds.count("spec") > 5
    assert any(a != b for a, b in zip(kinds, kinds[1:]))


def test_a_failed_ring_step_leaves_no_trace(tiny, rng, monkeypatch):
    """A forward that raises in its last GDN layer's decode (the others already
    decoded) aborts the step: committed states and KV lengths as before (the flush rows'
    cursors move past the history their abort folded, DESIGN.md section 3), and the next
    step decodes as if the failed one never ran."""
    prompts = _prompts(rng, (6, 8))
    eng, ref = engine(tiny), engine(tiny)
    pairs = [(eng, [eng.alloc() for _ in prompts]), (ref, [ref.alloc() for _ in prompts])]
    with torch.inference_mode():
        for e, s in pairs:
            e.extend(s, prompts, prompt=True)
        for t in range(10):  # a flush within L - 2T + 1 = 9 tokens, whatever the slot's phase
            for e, s in pairs:
                e.extend(s, [[t + 1], [t + 2]])
            if bool(eng.pool.buffers["is_flush"][pairs[0][1]].any()):
                break
    slots = pairs[0][1]
    strat = eng.strategy
    before = [strat.committed_state(j, slots) for j in range(eng.pool.num_layers)]
    lengths = [eng.length(s) for s in slots]
    real, calls = strat.decode, []

    def failing(layer, *args):
        calls.append(layer)
        if len(calls) == eng.pool.num_layers:
            raise RuntimeError("boom")
        return real(layer, *args)

    assert eng.pool.num_layers > 1
    assert bool(eng.pool.buffers["is_flush"][slots].any()), "a flush row must be among the aborted ones"
    monkeypatch.setattr(strat, "decode", failing)
    with pytest.raises(RuntimeError, match="boom"), torch.inference_mode():
        eng.extend(slots, [[9], [9]])
    monkeypatch.setattr(strat, "decode", real)
    assert not strat.step_open
    assert [eng.length(s) for s in slots] == lengths
    for j, b in enumerate(before):
        assert torch.equal(strat.committed_state(j, slots), b), f"layer {j}"
    with torch.inference_mode():
        got = eng.extend(slots, [[9], [9]]).logits
        want = ref.extend(pairs[1][1], [[9], [9]]).logits
    assert torch.equal(got, want)
    # a plain step while a speculative one is pending is refused, and leaves it pending
    eng.verify(slots, [[1, 2], [3]])
    with pytest.raises(RuntimeError, match="pending"):
        eng.extend(slots, [[4], [5]])
    assert strat.step_open
    eng.commit([2, 1])


def test_static_plain_steps_go_through_the_ring(tiny, rng):
    """The static-shape plain step (what a CUDA graph replays) decodes through the ring
    when the engine does: the generator's tokens equal recurrent plain decoding's."""
    prompts = _prompts(rng, (11, 4, 7))
    ref = StepGenerator(engine(tiny, "fold", window=1), None).generate(prompts, 60).tokens
    eng = engine(tiny)
    gen = StepGenerator(eng, None)
    seen = []
    real = eng.strategy.decode
    eng.strategy.decode = lambda layer, *a: seen.append(layer) or real(layer, *a)
    got = gen.generate(prompts, 60).tokens
    assert got == ref
    assert seen, "the static plain step did not decode through the ring"
    assert all(s.ring for s in gen._steps.values())
    off = StaticStep(engine(tiny, plain_via_ring=False), gen.windows, 2, drafter=None)
    assert not off.ring


def test_greedy_ring_decoding_equals_recurrent_decoding_on_the_embedded_model():
    """The shipped checkpoint in fp32: 120 greedy tokens through the ring (a flush every
    9 tokens) equal the recurrence's, logits within LOGIT_TOL. The 8192-token run is
    ``scripts/ring_decode_check.py``."""
    from replayssm.engine.loading import load_model, load_tokenizer

    model = load_model("embedded", dtype=torch.float32, device="cpu")
    prompt = load_tokenizer("embedded")("import os\nimport sys\n\n\ndef main(argv):\n")["input_ids"]
    result = compare_plain_decoding(model, prompt, 120)
    assert result["equal"], result["first_difference"]
    assert result["tokens"] == 120 and result["flushes"] >= 12
    assert 0 < result["max_logit_error"] < LOGIT_TOL, result
