"""``replayssm bench kernels``: the CPU smoke run end to end, and the pieces it is built
from (byte model, cursor cycle, timing, targets, the steps it times)."""

import json
import math
import random

import pytest
import torch

from replayssm import cli
from replayssm.bench import common, kernels
from replayssm.cli import bench_kernels as cli_kernels
from replayssm.ops import advance_cursors_reference, gdn_recurrence_reference

ALL = kernels.STRATEGY_NAMES + kernels.BASELINE_NAMES
ROW_FIELDS = (
    "strategy", "kind", "batch", "layers", "us_per_step", "us_per_layer_step", "floor_us", "floor_ratio",
    "achieved_GBps", "committed_tokens_per_us_per_layer", "state_bytes_per_layer", "bytes_per_layer_step", "timing",
)


@pytest.fixture(autouse=True)
def _seed_random(_seed):
    """Python's ``random`` follows the per-test torch seed, so failures reproduce."""
    random.seed(torch.initial_seed())


def parse(*argv):
    return cli.build_parser().parse_args(["bench", "kernels", *argv])


def tiny_args(*extra):
    return parse("--device", "cpu", "--layers", "2", "--ring-len", "16", "--repeats", "1", "--quiet", *extra)


# ---------------------------------------------------------------------- the command
def test_cpu_smoke_run_writes_one_row_per_strategy_and_batch(tmp_path, capsys):
    path = tmp_path / "kernels.json"
    rc = cli.main(["bench", "kernels", "--device", "cpu", "--batches", "1,3", "--layers", "2", "--ring-len", "16",
                   "--repeats", "1", "--quiet", "--json", str(path)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "SMOKE RUN" in printed
    data = json.loads(path.read_text())
    assert data["smoke"] is True and data["errors"] == []
    assert data["config"]["backend"] == "reference" and data["config"]["cuda_graph"] is False
    rows = data["rows"]
    keys = [(r["strategy"], r["batch"]) for r in rows]
    assert sorted(keys) == sorted((n, b) for n in ALL for b in (1, 3))
    cfg = cli_kernels.resolve_config(tiny_args("--batches", "1,3"))
    for r in rows:
        for f in ROW_FIELDS:
            assert f in r, f"row {r['strategy']}/{r['batch']} lacks {f}"
        assert r["floor_us"] is None and r["floor_ratio"] is None  # no floor claims without CUDA
        assert r["us_per_layer_step"] > 0 and r["us_per_step"] > 0 and r["achieved_GBps"] > 0
        assert math.isclose(r["us_per_step"], r["us_per_layer_step"] * r["layers"], rel_tol=1e-9)
        assert r["timing"]["method"] == "eager-wallclock" and r["timing"]["blocks"] == 1
        # the bytes in the row are the byte model's for this shape
        expected = common.step_bytes(r["strategy"], cfg.step_shape(r["batch"]),
                                     circular_replay=r.get("circular_method") == "replay")
        assert r["bytes_per_layer_step"]["total"] == pytest.approx(expected.total)
        assert r["achieved_GBps"] == pytest.approx(expected.total / (r["us_per_layer_step"] * 1e-6) / 1e9)
        if r["kind"] == "strategy":
            assert r["committed_tokens_per_us_per_layer"] == pytest.approx(r["batch"] * 3 / r["us_per_layer_step"])
        elif r["strategy"] in ("plain_decode", "plain_ring"):
            assert r["committed_tokens_per_us_per_layer"] == pytest.approx(r["batch"] / r["us_per_layer_step"])
        else:
            assert r["committed_tokens_per_us_per_layer"] is None
    circ = [r for r in rows if r["strategy"] == "circular"]
    assert all(r["ring_len"] == 16 and r["timing"]["steps_per_block"] == 3 for r in circ)  # a whole cursor cycle
    ring = [r for r in rows if r["strategy"] == "plain_ring"]  # one token a step: a flush every L - 2T + 1 = 9
    assert all(r["ring_len"] == 16 and r["cursor_cycle_steps"] == r["timing"]["steps_per_block"] == 9 for r in ring)
    assert all(r["window"] == 1 and r["accepted_per_request"] == 1 and r["exact_outputs"] is False for r in ring)


def test_subset_and_no_baselines(tmp_path):
    path = tmp_path / "k.json"
    rc = cli_kernels.main(tiny_args("--batches", "2", "--strategies", "fold", "--baselines", "none", "--json", str(path)))
    assert rc == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["strategy"], r["batch"]) for r in rows] == [("fold", 2)]


@pytest.mark.parametrize("flag,chain", [((), True), (("--no-chain",), False)])
def test_each_timed_step_is_one_chained_block_unless_no_chain(tmp_path, monkeypatch, flag, chain):
    """The step runs inside ``chained_launches(device, chain)`` (``--no-chain``: off),
    one block a step, and the JSON says which."""
    from replayssm.bench import kernels as bench_kernels

    blocks = []
    real = bench_kernels.chained_launches

    def spy(device, enabled=True, **kw):
        blocks.append(enabled)
        return real(device, enabled, **kw)

    monkeypatch.setattr(bench_kernels, "chained_launches", spy)
    path = tmp_path / "k.json"
    rc = cli_kernels.main(tiny_args("--batches", "2", "--strategies", "fold", "--baselines", "none", "--no-graph",
                                    *flag, "--json", str(path)))
    assert rc == 0 and blocks and set(blocks) == {chain}
    assert json.loads(path.read_text())["config"]["chained_launches"] is chain


def test_tune_overrides_the_shape_table_for_the_run(tmp_path, monkeypatch):
    """--tune: the run sees the table row changed (here: circular's small-batch mode,
    which makes every commit flush), the JSON records it, the table is restored."""
    from replayssm.ops import chunked, tuning

    seen = []
    real = chunked.replays_window
    monkeypatch.setattr("replayssm.strategies.circular.replays_window",
                        lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    path = tmp_path / "k.json"
    rc = cli_kernels.main(tiny_args("--batches", "2", "--strategies", "circular", "--baselines", "none",
                                "--tune", "circular.replay_max_batch=4", "--json", str(path)))
    assert rc == 0 and seen and all(seen)
    assert json.loads(path.read_text())["config"]["tune"] == ["circular.replay_max_batch=4"]
    assert tuning.lookup("circular", K=16, V=16, state_dtype=torch.float32, batch=2, device="cpu")["replay_max_batch"] == 0


def test_conv_in_the_step_counts_its_bytes(tmp_path):
    path = tmp_path / "k.json"
    rc = cli_kernels.main(tiny_args("--batches", "1", "--strategies", "snapshot", "--baselines", "none", "--conv", "--json", str(path)))
    assert rc == 0
    row = json.loads(path.read_text())["rows"][0]
    cfg = cli_kernels.resolve_config(tiny_args("--conv"))
    with_conv = common.step_bytes("snapshot", cfg.step_shape(1)).total
    without = common.step_bytes("snapshot", cfg.step_shape(1, conv=False)).total
    assert with_conv > without
    assert row["bytes_per_layer_step"]["total"] == pytest.approx(with_conv)


@pytest.mark.parametrize(
    "argv, match",
    [
        (("--accept", "5"), "--accept"),
        (("--ring-len", "24"), "--ring-len"),
        (("--ring-len", "4"), "--ring-len"),
        (("--ring-len", "big"), "--ring-len"),
        (("--heads", "3", "--value-heads", "4"), "--value-heads"),
        (("--tune", "circular.replay_max_batch"), "--tune"),
        (("--tune", "circular=3"), "--tune"),
        (("--tune", "window.nope=3"), "--tune"),
        (("--tune", "nope.block_v=3"), "--tune"),
        (("--tune", "window.block_v=0"), "--tune"),
    ],
)
def test_bad_options_raise_naming_the_option(argv, match):
    """The checks that need several options; single-option ranges are argument types
    (tests/test_cli_errors.py runs both through the command line)."""
    with pytest.raises(ValueError, match=match):
        cli_kernels.resolve_config(tiny_args(*argv))


@pytest.mark.parametrize("argv", [("--batches", "1,x"), ("--batches", "0"), ("--batches", "2,2"), ("--strategies", "ring"), ("--baselines", "fold")])
def test_unparseable_lists_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)


# ---------------------------------------------------------------------- the timed steps
def _cfg(name_batches=(2,), **over):
    args = tiny_args("--batches", ",".join(map(str, name_batches)))
    for k, v in over.items():
        setattr(args, k, v)
    return cli_kernels.resolve_config(args)


@pytest.mark.parametrize("strategy", kernels.STRATEGY_NAMES)
def test_strategy_step_verifies_every_layer_and_commits_accept_tokens(strategy):
    """The timed step is the real thing: after it, every layer's committed state is the
    recurrence's over the first ``accept`` tokens of each window."""
    cfg = _cfg(accept=random.randint(1, 4))
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    st = kernels.StrategyStep(cfg, strategy, 3, gen)
    slots = st.batch.slots.tolist()
    before = st.pool.buffers["checkpoints"].clone()
    assert before.abs().min() > 0  # random states, not zeros
    st.step()
    n, T = cfg.accept, cfg.window
    keep = torch.cat([torch.arange(i * T, i * T + n) for i in range(len(slots))])
    cu = torch.arange(0, len(slots) * n + 1, n, dtype=torch.int32)
    x = st.inputs
    for layer in range(cfg.layers):
        ref = before[layer].clone()
        p = st.pool.layer_params(layer)
        gdn_recurrence_reference(
            x.q[layer][keep], x.k[layer][keep], x.v[layer][keep], x.a[layer][keep], x.b[layer][keep],
            p["A_log"], p["dt_bias"], ref, torch.tensor(slots, dtype=torch.int32), cu, update_state=True,
        )
        got = st.pool.strategy.committed_state(layer, slots)
        assert torch.equal(got, ref[slots]), f"{strategy} layer {layer}: max err {(got - ref[slots]).abs().max()}"
        assert st.outputs[layer].shape == (len(slots) * T, cfg.value_heads, cfg.head_v_dim)
        assert st.outputs[layer].abs().sum() > 0


def test_circular_prepare_staggers_the_cursor_phases():
    cfg = _cfg(accept=3)
    st = kernels.StrategyStep(cfg, "circular", 16, torch.Generator().manual_seed(random.randrange(2**31)))
    st.prepare()
    wp = st.pool.buffers["write_pos"].tolist()
    assert len(set(wp)) > 1, f"all requests at the same phase: {wp}"


def test_ring_decode_step_commits_one_token_per_request_through_the_ring():
    """``plain_ring``'s timed step: after prepare (speculative steps on the same ring:
    staggered cursor phases), one step commits one token per request, the committed
    state the recurrence's from the one before, bit for bit; the cursors advanced."""
    cfg = _cfg()
    st = kernels.RingDecodeStep(cfg, "plain_ring", 16, torch.Generator().manual_seed(random.randrange(2**31)))
    st.prepare()
    buf = st.pool.buffers
    slots = list(st.plain_batch.host_slots)
    assert len(set(buf["write_pos"][slots].tolist())) > 1, "all requests at the same phase"
    before = [st.pool.strategy.committed_state(layer, slots) for layer in range(cfg.layers)]
    wp, flush = buf["write_pos"][slots].clone(), buf["is_flush"][slots].clone()
    st.step()
    x, rows = st.plain_inputs, torch.arange(len(slots), dtype=torch.int32)
    for layer in range(cfg.layers):
        ref = before[layer].clone()
        p = st.pool.layer_params(layer)
        gdn_recurrence_reference(x.q[layer], x.k[layer], x.v[layer], x.a[layer], x.b[layer], p["A_log"], p["dt_bias"],
                                 ref, rows, torch.arange(len(slots) + 1, dtype=torch.int32), update_state=True)
        assert torch.equal(st.pool.strategy.committed_state(layer, slots), ref), f"layer {layer}"
        assert st.outputs[layer].shape == (len(slots), cfg.value_heads, cfg.head_v_dim)
    assert torch.equal(buf["write_pos"][slots], torch.where(flush != 0, 1, wp + 1))
    with pytest.raises(ValueError, match="plain_ring"):
        kernels.RingDecodeStep(cfg, "circular", 2, torch.Generator())


@pytest.mark.parametrize("name", ["plain_decode", "snapshot_verify"])
def test_recurrence_baselines(name):
    cfg = _cfg()
    st = kernels.RecurrenceStep(cfg, name, 3, torch.Generator().manual_seed(random.randrange(2**31)))
    before = st.state.clone()
    st.step()
    T = 1 if name == "plain_decode" else cfg.window
    x = st.inputs
    for layer in range(cfg.layers):
        ref = before[layer].clone()
        snaps = torch.empty_like(st.snapshots[layer]) if st.snapshots is not None else None
        o = gdn_recurrence_reference(
            x.q[layer], x.k[layer], x.v[layer], x.a[layer], x.b[layer], st.A_log[layer], st.dt_bias[layer], ref,
            st.slots, st.cu_seqlens, snapshots=snaps, update_state=name == "plain_decode",
        )
        assert x.q[layer].shape[0] == 3 * T
        assert torch.equal(o, st.outputs[layer])
        assert torch.equal(st.state[layer], ref)
        if name == "plain_decode":
            assert not torch.equal(st.state[layer], before[layer])  # the decode step advanced the state
        else:
            assert torch.equal(st.state[layer], before[layer])  # verify alone leaves it
            assert torch.equal(st.snapshots[layer], snaps)


# ---------------------------------------------------------------------- byte model
def _shape(**over):
    base = dict(
        batch=random.randint(1, 64), num_heads=2, num_value_heads=4 * random.randint(1, 4), head_k_dim=random.choice([16, 64, 128]),
        head_v_dim=random.choice([16, 64, 128]), window=4, accept=random.randint(1, 4), state_elem=4, act_elem=2, ring_len=32,
    )
    base.update(over)
    return common.StepShape(**base)


def test_state_traffic_matches_design_section_4():
    s = _shape()
    sb, t = s.state_bytes, s.window
    assert sb == s.batch * s.num_value_heads * s.head_v_dim * s.head_k_dim * 4
    snap, fold, circ = (common.step_bytes(k, s) for k in ("snapshot", "fold", "circular"))
    assert snap.state_read == 2 * sb and snap.state_write == (t + 1) * sb  # 1 read + T writes + 1 read + 1 write
    assert fold.state_read == 2 * sb and fold.state_write == sb  # 1 read + 1 read + 1 write
    cyc = common.cursor_cycle(t, s.ring_len, s.accept)
    assert circ.state_read == sb and circ.state_write == pytest.approx(sb / cyc.steps)  # 1 read + a flush share
    pd, sv = common.step_bytes("plain_decode", s), common.step_bytes("snapshot_verify", s)
    assert pd.state == 2 * sb and sv.state == (t + 1) * sb
    # records: fold writes T and replays n raw records per request
    assert fold.records_write == s.batch * t * s.raw_record_bytes
    assert fold.records_read == s.batch * s.accept * s.raw_record_bytes
    # activations scale with tokens: T per request for a window, 1 for plain decoding
    assert snap.activations == pytest.approx(t * pd.activations)
    for k in common.STEP_KINDS:
        b = common.step_bytes(k, s)
        assert b.total == pytest.approx(b.state + b.records_read + b.records_write + b.activations)
        assert b.as_dict()["total"] == b.total


def test_circular_replay_moves_two_state_passes_and_one_steps_records():
    """circular's small-batch path flushes every step: its verify reads and writes every
    row's state, and its history is the last step's n raw records."""
    s = _shape()
    sb, t, n, b = s.state_bytes, s.window, s.accept, s.batch
    closed, replay = common.step_bytes("circular", s), common.step_bytes("circular", s, circular_replay=True)
    assert replay.state_read == sb and replay.state_write == sb
    assert replay.records_read == b * n * s.raw_record_bytes
    assert replay.records_write == closed.records_write == b * t * (s.raw_record_bytes + s.u_record_bytes)
    assert replay.state > closed.state  # a closed-form flush comes once per cursor cycle only
    with pytest.raises(ValueError, match="circular_replay"):
        common.step_bytes("fold", s, circular_replay=True)


def test_plain_ring_bytes_are_one_read_and_a_share_of_a_flush():
    """A plain step through the ring reads every state and writes it once per plain
    cursor cycle (L - 2T + 1 tokens from a fresh ring), plus one record per request; at
    small batches (replay: a flush every step) two state passes, as plain decoding."""
    s = _shape()
    sb, b, t = s.state_bytes, s.batch, s.window
    ring, replay = common.step_bytes("plain_ring", s), common.step_bytes("plain_ring", s, circular_replay=True)
    plain = common.step_bytes("plain_decode", s)
    assert common.cursor_cycle(t, s.ring_len, 1).steps == s.ring_len - 2 * t + 1
    assert ring.state_read == sb and ring.state_write == pytest.approx(sb / (s.ring_len - 2 * t + 1))
    assert ring.records_write == b * (s.raw_record_bytes + s.u_record_bytes)
    assert ring.activations == plain.activations  # one token per request, no conv
    assert replay.state == plain.state == 2 * sb and replay.records_read == b * s.raw_record_bytes
    assert ring.state < plain.state
    with pytest.raises(ValueError, match="ring_len"):
        common.step_bytes("plain_ring", _shape(ring_len=0))


def test_rows_name_circulars_method_by_the_table(tmp_path):
    path = tmp_path / "kernels.json"
    rc = cli.main(["bench", "kernels", "--device", "cpu", "--batches", "1,3", "--layers", "2", "--ring-len", "16",
                   "--repeats", "1", "--quiet", "--strategies", "circular", "--baselines", "none",
                   "--tune", "circular.replay_max_batch=2", "--json", str(path)])
    assert rc == 0
    by_batch = {r["batch"]: r for r in json.loads(path.read_text())["rows"]}
    assert by_batch[1]["circular_method"] == "replay" and by_batch[3]["circular_method"] == "closed_form"
    assert by_batch[1]["cursor_cycle_steps"] == 1 and by_batch[3]["cursor_cycle_steps"] > 1


def test_bytes_scale_linearly_with_batch():
    s1 = _shape(batch=1)
    sb = _shape(batch=37, **{f: getattr(s1, f) for f in ("num_value_heads", "head_k_dim", "head_v_dim", "accept")})
    for k in common.STEP_KINDS:
        assert common.step_bytes(k, sb).total == pytest.approx(37 * common.step_bytes(k, s1).total)


def test_step_bytes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        common.step_bytes("ring", _shape())
    with pytest.raises(TypeError, match="shape"):
        common.step_bytes("fold", {"batch": 1})
    with pytest.raises(ValueError, match="ring_len"):
        common.step_bytes("circular", _shape(ring_len=0))


@pytest.mark.parametrize("window, ring_len", [(1, 2), (2, 8), (3, 8), (4, 16), (4, 32), (4, 64), (8, 16), (8, 128)])
def test_cursor_cycle_matches_the_cursor_op(window, ring_len):
    """The simulated cycle equals what the real cursor op does over many commits."""
    for accept in range(1, window + 1):
        cyc = common.cursor_cycle(window, ring_len, accept)
        wp, base, flush = (torch.zeros(1, dtype=torch.int32) for _ in range(3))
        slots = torch.zeros(1, dtype=torch.int32)
        acc = torch.full((1,), accept, dtype=torch.int32)
        trace = []
        for _ in range(4 * ring_len + 10 * cyc.steps):
            f, w = bool(flush[0]), int(wp[0])
            assert w + window <= ring_len  # a window always fits after the history
            trace.append((0 if f else w, w if f else 0, f))
            advance_cursors_reference(wp, base, flush, slots, acc, window, ring_len)
        tail = trace[-10 * cyc.steps:]
        assert cyc.mean_history == pytest.approx(sum(t[0] for t in tail) / len(tail))
        assert cyc.mean_folded == pytest.approx(sum(t[1] for t in tail) / len(tail))
        assert cyc.flushes_per_step == pytest.approx(sum(t[2] for t in tail) / len(tail))
        assert cyc.flushes_per_step == pytest.approx(1 / cyc.steps)
        assert cyc.mean_folded == pytest.approx(accept)  # every committed record is folded exactly once


def test_cursor_cycle_rejects_illegal_rings():
    with pytest.raises(ValueError, match="ring_len"):
        common.cursor_cycle(4, 24, 3)
    with pytest.raises(ValueError, match="ring_len"):
        common.cursor_cycle(4, 4, 3)
    with pytest.raises(ValueError, match="accept"):
        common.cursor_cycle(4, 16, 5)


def test_best_ring_len_is_the_byte_minimum():
    s = _shape(ring_len=0)
    best = common.best_ring_len(s, max_len=256)
    legal = [L for L in (8, 16, 32, 64, 128, 256)]
    totals = {L: common.step_bytes("circular", common.StepShape(**{**s.__dict__, "ring_len": L})).total for L in legal}
    assert best in legal and totals[best] == min(totals.values())
    # at the Qwen3.5 shape the model prefers a ring longer than the minimum 2T
    qwen = common.StepShape(1, 16, 32, 128, 128, 4, 3, 4, 2)
    assert common.best_ring_len(qwen) > 8


# ---------------------------------------------------------------------- rotation, timing, output
def test_rotation_copies_exceed_l2():
    l2 = random.randint(1 << 20, 64 << 20)
    per = random.randint(1 << 16, 32 << 20)
    n = common.rotation_copies(per, l2, max_copies=10_000)
    assert n * per >= common.L2_ROTATION_FACTOR * l2 and (n - 1) * per < common.L2_ROTATION_FACTOR * l2 or n == 1
    assert common.rotation_copies(10 * l2, l2) == 1
    assert common.rotation_copies(1, l2, max_copies=7) == 7
    with pytest.raises(ValueError, match="bytes_per_copy"):
        common.rotation_copies(0, l2)


def test_plan_steps_per_block_is_whole_cycles():
    cycle = random.randint(1, 20)
    spb = common.plan_steps_per_block(random.uniform(1, 500), cycle, random.randint(1, 8), target_block_us=3000)
    assert spb % cycle == 0 and spb >= cycle
    assert common.plan_steps_per_block(10.0, 3, 1, target_block_us=1000) == 102
    with pytest.raises(ValueError, match="est_us_per_step"):
        common.plan_steps_per_block(0.0, 3, 1)


def test_time_eager_runs_every_step_of_every_block():
    calls = [0, 0]

    def s0():
        calls[0] += 1

    def s1():
        calls[1] += 1

    spb, blocks, warm = random.randint(1, 4), random.randint(1, 4), random.randint(0, 2)
    t = common.time_eager([s0, s1], steps_per_block=spb, blocks=blocks, warmup_blocks=warm)
    assert calls == [spb * (blocks + warm)] * 2
    assert len(t.samples_us) == blocks and t.us_per_step > 0 and t.copies == 2
    assert t.summary()["blocks"] == blocks
    with pytest.raises(ValueError, match="blocks"):
        common.time_eager([s0], steps_per_block=1, blocks=0)
    with pytest.raises(ValueError, match="steps"):
        common.time_eager([], steps_per_block=1, blocks=1)


def test_time_cuda_checks_its_counts_and_needs_cuda():
    calls = []
    for kw, match in (({"repeats": 0}, "repeats"), ({"warmup": -1}, "warmup"), ({"repeats": True}, "repeats")):
        with pytest.raises(ValueError, match=match):
            common.time_cuda(lambda: calls.append(1), **kw)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            common.time_cuda(lambda: calls.append(1))
    assert not calls, "a refused call ran its function"


def test_time_prompt_pass_runs_one_pass_and_gives_its_slots_back():
    from replayssm.engine.adapter import HybridEngine
    from replayssm.engine.random_model import build_tiny_model

    eng = HybridEngine(build_tiny_model("qwen3_5", seed=0), num_slots=2, window=1, max_len=64)
    passes = dict(eng.prompt_passes)
    dt = common.time_prompt_pass(eng, 2, 9, torch.Generator().manual_seed(0))
    assert dt > 0 and sum(eng.prompt_passes.values()) == sum(passes.values()) + 1
    assert sorted([eng.alloc(), eng.alloc()]) == [0, 1]  # both slots free again
    eng.free_many([0, 1])

    # ``around`` is entered after the slots are taken and left before they are freed,
    # with the pass inside it
    seen = []

    class Around:
        def __enter__(self):
            seen.append((eng.pool.num_free, sum(eng.prompt_passes.values())))

        def __exit__(self, *exc):
            seen.append((eng.pool.num_free, sum(eng.prompt_passes.values())))

    common.time_prompt_pass(eng, 2, 9, torch.Generator().manual_seed(1), around=Around())
    (free_in, passes_in), (free_out, passes_out) = seen
    assert free_in == free_out == 0 and passes_out == passes_in + 1
    assert eng.pool.num_free == 2


def test_copy_bandwidth_and_l2_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        common.copy_bandwidth("cpu")
    with pytest.raises(ValueError, match="CUDA"):
        common.l2_cache_bytes("cpu")
