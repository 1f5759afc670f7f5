"""The overlapped decode loop of :class:`StepGenerator`: launching the next step before
the host's bookkeeping of the current one changes nothing but when the host works.

Each case runs the same requests with ``overlap=True`` and ``overlap=False`` and
compares everything the loop produces, plus a timeline of what reached the engine: every
step launched (its rows' slots and their allocation generations) and every prompt pass.
A step launched ahead when it should not have been (a request stopped at the step
before, a queued request could take a slot, a prompt is half prefilled) shows there as
an extra step, a step on stale rows or a step before a prompt pass. Those cases turn
joins ahead off (``join_ahead=False``) and runs ahead off (``run_ahead=False``); the
join and run-ahead tests compare the default, whose joiners decode a step later and
whose steps may hold dead rows, with the loop without overlap request by request.
"""

from __future__ import annotations

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import DeviceNgramDrafter
from replayssm.engine.generator import StepGenerator
from replayssm.engine.graph_step import StaticStep
from replayssm.engine.random_model import build_tiny_model
from replayssm.engine.sampling import SamplingParams
from replayssm.state.pool import StepProtocolError

SAMPLED = SamplingParams(temperature=0.8)


def _prompts(rng, n, lo=3, hi=12):
    return [torch.randint(0, 256, (int(torch.randint(lo, hi, (1,), generator=rng)),), generator=rng).tolist()
            for _ in range(n)]


def _run(model, mode, slots, prompts, budgets, *, overlap, seed, sampling=SamplingParams(), **kwargs):
    """One ``generate`` on a fresh engine; returns ``(result, timeline, streamed)``:
    the engine's steps and prompt passes in order, and every ``on_tokens`` call."""
    window = 1 if mode == "plain" else 4
    eng = HybridEngine(model, strategy="fold", num_slots=slots, window=window, max_len=160)
    drafter = None if mode == "plain" else DeviceNgramDrafter()
    gen = StepGenerator(eng, drafter, num_draft=3, sampling=sampling, overlap=overlap, **kwargs)
    timeline, streamed = [], []
    extend = eng.extend

    def logged_extend(slots, windows, **kw):
        timeline.append(("prefill", tuple(slots), tuple(len(w) for w in windows)))
        return extend(slots, windows, **kw)

    eng.extend = logged_extend
    step_run = StaticStep.run

    def logged_run(step):
        timeline.append(("step", step.batch.host_slots, step.batch.generations))
        return step_run(step)

    StaticStep.run = logged_run
    try:
        torch.manual_seed(seed)  # the sampled steps draw from the global generator
        res = gen.generate(prompts, budgets, on_tokens=lambda i, toks: streamed.append((i, list(toks))))
    finally:
        StaticStep.run = step_run
    return res, timeline, streamed


def _check_same(model, mode, slots, prompts, budgets, seed, run_ahead=False, **kwargs):
    """Overlap on and off give the same everything; returns the overlapped run. (Joins
    ahead of a step change when the joiners decode, and runs ahead when a request meets
    an end-of-sequence token: see the join and run-ahead tests below.)"""
    on = _run(model, mode, slots, prompts, budgets, overlap=True, seed=seed, join_ahead=False, run_ahead=run_ahead,
              **kwargs)
    off = _run(model, mode, slots, prompts, budgets, overlap=False, seed=seed, **kwargs)
    (a, a_line, a_stream), (b, b_line, b_stream) = on, off
    assert a.tokens == b.tokens
    assert a.finish_reasons == b.finish_reasons
    assert (a.steps, a.accept_lengths, a.drafted, a.accepted) == (b.steps, b.accept_lengths, b.drafted, b.accepted)
    assert (a.stats.rows, a.stats.emitted) == (b.stats.rows, b.stats.emitted)
    assert [(p.after_step, p.requests, p.tokens, p.completed) for p in a.stats.prefills] == \
        [(p.after_step, p.requests, p.tokens, p.completed) for p in b.stats.prefills]
    assert a_stream == b_stream
    assert a_line == b_line
    assert sum(e[0] == "step" for e in a_line) == a.steps == len(a.stats.seconds) == len(a.stats.ahead)
    assert not any(b.stats.ahead)
    assert all(t > 0 for t in a.stats.seconds)
    return a


@pytest.mark.parametrize("mode", ["plain", "spec"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_overlap_changes_no_output_with_stops_budgets_and_a_queue(mode, sampling, seed, rng):
    """Six requests on three slots (three wait in the queue), budgets ending at different
    steps, one of a single token (its request stops at its prompt pass, and the slot it
    frees is the next queued request's), and an end-of-sequence token that the run meets
    (in the middle of a window when speculating): the overlapped loop gives the plain
    loop's tokens, stops, accept counts and engine timeline, and it did launch steps
    ahead."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = _prompts(rng, 6)
    budgets = [40, 11, 27, 1, 40, 18]
    probe, _, _ = _run(model, mode, 3, prompts, budgets, overlap=False, seed=seed, sampling=sampling)
    # a token the first request generates in its middle: as an EOS it ends that request there
    eos = probe.tokens[0][len(probe.tokens[0]) // 2]
    res = _check_same(model, mode, 3, prompts, budgets, seed, sampling=sampling, eos_token_ids=[eos])
    assert "eos" in res.finish_reasons and "length" in res.finish_reasons
    assert any(res.stats.ahead)
    # a step right after one at which a request stopped is never launched ahead
    assert not all(res.stats.ahead[1:])


@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_steps_on_the_rows_left_are_launched_ahead_when_no_request_waits(mode, seed, rng):
    """Five requests on eight slots (none queued), budgets ending at different steps and
    an end-of-sequence token: when requests stop, the next step runs on the others'
    rows, in a smaller bucket as the batch shrinks (8, 4, 2, 1 rows), launched before
    the stopped requests' bookkeeping, and everything matches the loop without
    overlap."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = _prompts(rng, 5)
    budgets = [45, 9, 30, 16, 22]
    probe, _, _ = _run(model, mode, 8, prompts, budgets, overlap=False, seed=seed)
    eos = probe.tokens[2][len(probe.tokens[2]) // 2]
    res = _check_same(model, mode, 8, prompts, budgets, seed, eos_token_ids=[eos])
    rows, ahead = res.stats.rows, res.stats.ahead
    shrunk = [i for i in range(1, len(rows)) if rows[i] < rows[i - 1]]
    assert len(shrunk) >= 3 and rows[-1] == 1
    assert all(ahead[i] for i in shrunk)  # a step on fewer rows than the one before: launched ahead
    assert all(ahead[1:])  # no request waits: every step after the first one is


@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_joins_ahead_of_a_step_keep_every_greedy_token(mode, seed, rng):
    """Seven requests on three slots, budgets ending at different steps, one of a single
    token, an end-of-sequence token: with joins ahead, each later prompt pass runs
    while a step of the other rows is in flight (after it, never on a slot it holds),
    its requests decode from the next step, and every request's greedy tokens, stop
    and stream are those of the loop without overlap; more steps are launched ahead
    than with overlap alone."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = _prompts(rng, 7)
    budgets = [40, 11, 27, 1, 40, 18, 23]
    probe, _, _ = _run(model, mode, 3, prompts, budgets, overlap=False, seed=seed)
    eos = probe.tokens[0][len(probe.tokens[0]) // 2]
    off, _, off_stream = _run(model, mode, 3, prompts, budgets, overlap=False, seed=seed, eos_token_ids=[eos])
    alone, _, _ = _run(model, mode, 3, prompts, budgets, overlap=True, join_ahead=False, run_ahead=False, seed=seed,
                       eos_token_ids=[eos])
    on, line, on_stream = _run(model, mode, 3, prompts, budgets, overlap=True, run_ahead=False, seed=seed,
                               eos_token_ids=[eos])
    assert on.tokens == off.tokens and on.finish_reasons == off.finish_reasons
    for i in range(len(prompts)):
        assert [t for j, t in on_stream if j == i] == [t for j, t in off_stream if j == i]
    passes = [k for k, e in enumerate(line) if e[0] == "prefill"]
    assert len(passes) >= 3
    for k, p in zip(passes[1:], on.stats.prefills[1:]):
        before, after = line[k - 1], next(e for e in line[k + 1 :] if e[0] == "step")
        joined = set(line[k][1])
        assert before[0] == "step" and not joined & set(before[1])  # behind a step of the other rows
        # and in the next one, but for a request that its first token ended
        assert len(joined & set(after[1])) == sum(len(on.tokens[i]) > 1 for i in p.requests)
    assert [p.after_step for p in on.stats.prefills[1:]] == [
        sum(e[0] == "step" for e in line[:k]) for k in passes[1:]]
    assert sum(on.stats.ahead) > sum(alone.stats.ahead)


def _logging_dead_rows(monkeypatch) -> list[list[int]]:
    """Per step read by a ``StepGenerator`` (in launch order: every step is read, in
    order), the slots of its dead rows: rows whose request had already stopped when the
    step was read. Filled as the test runs."""
    dead = []
    decode_step = StepGenerator._decode_step

    def logged(self, running, *args, **kwargs):
        dead.append([s for r, s in zip(running.reqs, running.step.batch.host_slots) if r.finish is not None])
        return decode_step(self, running, *args, **kwargs)

    monkeypatch.setattr(StepGenerator, "_decode_step", logged)
    return dead


@pytest.mark.parametrize("mode", ["plain", "spec"])
@pytest.mark.parametrize("slots", [3, 8], ids=["queue", "no-queue"])
def test_run_ahead_keeps_every_greedy_token_and_drops_dead_rows(mode, slots, seed, rng, monkeypatch):
    """Seven requests (on three slots: four wait in the queue; on eight: none), budgets
    ending at different steps, one of a single token, and an end-of-sequence token that
    several requests meet: steps run ahead of the read of the one before give every
    request the greedy tokens, stop and stream of the loop without overlap. A request
    that the token stops leaves a dead row in the step run ahead (there is one; each such
    request at most one; a step emits only for its other rows); with a queue, a joiner
    takes the slot of such a row right after that step (the step's work on the dead row
    is dropped before the joiner's prompt pass) and still decodes its own tokens. No step
    is run ahead of a step at which a budget could end: the steps beyond those of the
    overlapped loop that reads each step before it launches the next are at most the
    steps with dead rows."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = _prompts(rng, 7)
    budgets = [40, 11, 27, 1, 40, 18, 23]
    probe, _, _ = _run(model, mode, slots, prompts, budgets, overlap=False, seed=seed)
    # the commonest token of the first request's second half: an end-of-sequence token there
    half = probe.tokens[0][len(probe.tokens[0]) // 2:]
    eos = max(set(half), key=half.count)
    dead = _logging_dead_rows(monkeypatch)
    off, _, off_stream = _run(model, mode, slots, prompts, budgets, overlap=False, seed=seed, eos_token_ids=[eos])
    assert not any(dead) and len(dead) == off.steps
    dead.clear()
    on, line, on_stream = _run(model, mode, slots, prompts, budgets, overlap=True, seed=seed, eos_token_ids=[eos])
    assert on.tokens == off.tokens and on.finish_reasons == off.finish_reasons
    for i in range(len(prompts)):
        assert [t for j, t in on_stream if j == i] == [t for j, t in off_stream if j == i]
    # each request emitted at as many steps and as many tokens a step: dead rows count nowhere
    assert sum(on.stats.rows) == sum(off.stats.rows) and sum(on.stats.emitted) == sum(off.stats.emitted)
    assert sorted(on.accept_lengths) == sorted(off.accept_lengths)
    steps = [e for e in line if e[0] == "step"]
    assert len(steps) == len(dead) == on.steps == len(on.stats.rows)
    for (_, step_slots, _), d, live in zip(steps, dead, on.stats.rows):
        assert live == sum(s >= 0 for s in step_slots) - len(d)
    with_dead = [j for j, d in enumerate(dead) if d]
    assert with_dead and sum(map(len, dead)) <= on.finish_reasons.count("eos")
    # against the overlapped loop that reads before it launches (joins go ahead in both)
    base, _, _ = _run(model, mode, slots, prompts, budgets, overlap=True, run_ahead=False, seed=seed,
                      eos_token_ids=[eos])
    assert base.tokens == on.tokens and 0 <= on.steps - base.steps <= len(with_dead)
    if slots == 3:  # a joiner's prompt pass on the slot of a dead row, right after its step
        at = [k for k, e in enumerate(line) if e[0] == "step"]  # each step's place in the timeline
        after = {j: line[at[j] + 1] for j in with_dead if at[j] + 1 < len(line)}
        assert any(e[0] == "prefill" and set(e[1]) & set(dead[j]) for j, e in after.items())


def test_a_step_a_join_went_ahead_of_does_not_count_the_join(seed, rng, monkeypatch):
    """A step's time ends before the prompt pass that a join ran behind it: a pass made
    slow (0.2 s) shows in the passes' times and in no step's."""
    import time

    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=160)
    gen = StepGenerator(eng, DeviceNgramDrafter(), num_draft=3)
    extend = eng.extend

    def slow_extend(*args, **kw):
        time.sleep(0.2)
        return extend(*args, **kw)

    monkeypatch.setattr(eng, "extend", slow_extend)
    res = gen.generate(_prompts(rng, 4), [6, 3, 5, 4])
    late = [p for p in res.stats.prefills if p.after_step > 0]
    assert late and all(p.seconds >= 0.2 for p in late)
    assert max(res.stats.seconds) < 0.2


def test_joins_ahead_with_sampling_emit_every_budget(seed, rng):
    """Sampled decoding with joins ahead: every request gets its budget (its draws
    differ from the loop without overlap's, since a step's rows do)."""
    model = build_tiny_model("qwen3_5", seed=seed)
    budgets = [int(torch.randint(2, 30, (1,), generator=rng)) for _ in range(6)]
    res, _, _ = _run(model, "spec", 2, _prompts(rng, 6), budgets, overlap=True, seed=seed, sampling=SAMPLED)
    assert [len(t) for t in res.tokens] == budgets and any(res.stats.ahead)


def test_no_step_is_launched_ahead_while_a_prompt_is_prefilled_in_chunks(seed, rng):
    """A long prompt joins in chunks beside a running request: every chunk pass runs
    between two steps exactly as without overlap."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = [_prompts(rng, 1)[0], _prompts(rng, 1, 3, 5)[0], _prompts(rng, 1, 40, 50)[0]]
    res = _check_same(model, "spec", 2, prompts, [60, 4, 20], seed, prefill_chunk=7)
    passes = [p.after_step for p in res.stats.prefills if p.after_step > 0]
    assert len(passes) >= 5  # the long prompt went through several chunk passes between steps
    assert not any(res.stats.ahead[s] for s in passes if s < len(res.stats.ahead))
    assert any(res.stats.ahead)


def test_set_rows_refuses_a_slot_that_changed_hands(seed, rng):
    """A step whose rows carry the generation a slot had when its request took it is
    refused once the slot was freed and taken again (eager steps check on the host)."""
    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=1, window=4, max_len=64)
    step = StepGenerator(eng, DeviceNgramDrafter(), num_draft=3, buckets=[2])._step(1)
    slot = eng.alloc()
    old = eng.pool.generation(slot)
    with torch.inference_mode():
        eng.extend([slot], _prompts(rng, 1), prompt=True)
        step.set_rows([slot, -1], [old, 0])
        step.run()  # the request holds its slot: the step runs
        eng.free(slot)
        assert eng.alloc() == slot
        step.set_rows([slot, -1], [old, 0])
        with pytest.raises(StepProtocolError, match="re-allocated"):
            step.run()
        step.set_rows([slot, -1])  # the pool's current generation: runs
        step.run()
    with pytest.raises(ValueError, match="row generations"):
        step.set_rows([slot, -1], [old])
    with pytest.raises(ValueError, match="row slots"):
        step.set_rows([slot])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_graph_replays_launched_ahead_change_no_output(mode, seed, rng):
    """On a GPU the step launched ahead is a graph replay that runs while the host books
    the step before (and rewrites the output buffer the host has just copied): the
    tokens, stops and timeline are still those of the loop without overlap (bf16)."""
    model = build_tiny_model("qwen3_5", seed=seed, dtype=torch.bfloat16, device="cuda")
    prompts = _prompts(rng, 6)
    budgets = [60, 11, 37, 1, 60, 18]
    probe, _, _ = _run(model, mode, 3, prompts, budgets, overlap=False, seed=seed, graphs=True)
    eos = probe.tokens[0][len(probe.tokens[0]) // 2]
    res = _check_same(model, mode, 3, prompts, budgets, seed, eos_token_ids=[eos], graphs=True)
    assert any(res.stats.ahead) and "eos" in res.finish_reasons


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_steps_run_ahead_of_the_read_change_nothing_without_an_end_token(device, mode, seed, rng, read_flags):
    """With budgets alone ending the requests (no end-of-sequence token: no dead row),
    steps run ahead of the read of the one before change nothing: tokens, stops, accept
    counts and engine timeline are those of the loop without overlap, and steps did run
    ahead. On a GPU each is a graph replay queued behind the pinned copy of the output
    of the step before and before the host waits for that copy (bf16)."""
    kw = {} if device == "cpu" else {"dtype": torch.bfloat16, "device": "cuda"}
    model = build_tiny_model("qwen3_5", seed=seed, **kw)
    _check_same(model, mode, 3, _prompts(rng, 6), [60, 11, 37, 1, 60, 18], seed, run_ahead=True,
                graphs=device == "cuda")
    assert sum(read_flags) >= 10
