"""``replayssm closed-loop`` on the CPU (the tiny random model, and the trained default
for the command's outputs): the exact strategies never leave plain decoding's tokens
over 192 greedy tokens (the command's default is 2048; 192 wrap the ring 12 times),
their committed state stays at fp32 rounding from a float64 run of the same tokens,
the control is a real departure from the exact fold and its divergence is reported,
and the outputs are written."""

import json
import random

import torch

from replayssm import cli
from replayssm.bench.closed_loop import CONTROL, OpenLoopCircular, first_divergence, run_closed_loop
from replayssm.cli.closed_loop import config_from_args


def test_exact_strategies_never_diverge_over_192_tokens():
    seed = random.randrange(10**6)
    args = cli.parse(["closed-loop", "--model", "tiny", "--tokens", "192", "--requests", "2", "--every", "48", "--seed", str(seed),
                      "--device", "cpu", "--quiet"])
    cli.set_cpu_threads(args)
    result = run_closed_loop(config_from_args(args), progress_enabled=False)
    v = result["variants"]
    assert list(v) == ["plain", "snapshot", "fold", "circular", CONTROL]
    plain = v["plain"]["tokens"]
    assert [len(t) for t in plain] == [192, 192]
    for name in ("snapshot", "fold"):
        assert v[name]["tokens"] == plain, (name, seed, v[name]["diverged_at"])
        assert v[name]["diverged_at"] == [None, None] and not v[name]["diverged"]
    assert result["failed"] == [] and result["exit_code"] == 0
    # Sampled along the way (prompt at 16, then past each multiple of 48), and at fp32
    # rounding from the float64 run of the same tokens.
    for name in ("plain", "snapshot", "fold", "circular"):
        for per in v[name]["samples"]:
            positions = [p for p, _ in per]
            assert positions[0] == 16 and positions[-1] >= 192 and len(positions) >= 5, (name, positions)
            assert all(0 <= e < 1e-5 for _, e in per), (name, per)
    # The control's divergence is reported per request (it may or may not diverge on
    # a random model in fp32, where rounding u changes nothing).
    c = v[CONTROL]
    assert len(c["diverged_at"]) == 2 and all(d is None or 0 <= d < 192 for d in c["diverged_at"])
    assert result["control_diverged"] == c["diverged"]


def test_the_control_departs_from_the_exact_fold():
    """Same windows, same accepted counts: in bf16 the control's committed state
    differs from circular's (exact) once the ring has flushed, but stays near it."""
    from replayssm.engine.adapter import HybridEngine
    from replayssm.engine.random_model import build_tiny_model

    model = build_tiny_model(seed=random.randrange(10**6), dtype=torch.bfloat16)
    engines = [HybridEngine(model, strategy="circular", num_slots=1, window=4, max_len=512) for _ in range(2)]
    OpenLoopCircular.install(engines[1])
    assert engines[1].strategy.name == CONTROL and engines[0].strategy.name == "circular"
    slots = [e.alloc() for e in engines]
    prompt = torch.randint(0, 256, (8,)).tolist()
    for e, s in zip(engines, slots):
        e.extend([s], [prompt], prompt=True)
    g = torch.Generator().manual_seed(random.randrange(10**6))
    for _ in range(40):
        window = torch.randint(0, 256, (4,), generator=g).tolist()
        n = int(torch.randint(1, 5, (1,), generator=g))
        for e, s in zip(engines, slots):
            e.verify([s], [window])
            e.commit([n])
    layers = engines[0].pool.num_layers
    exact = torch.stack([engines[0].strategy.committed_state(j, [slots[0]]) for j in range(layers)]).double()
    ctrl = torch.stack([engines[1].strategy.committed_state(j, [slots[1]]) for j in range(layers)]).double()
    rel = float((ctrl - exact).norm() / exact.norm())
    assert 0 < rel < 0.1, rel


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_command_writes_table_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "cl.json", tmp_path / "cl.png"
    rc = cli.main(["closed-loop", "--tokens", "96", "--every", "32", "--requests", "1", "--strategies", "fold",
                   "--generator", "eager", "--device", "cpu", "--quiet", "--json", str(js), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "result: no strategy with exact outputs diverges" in out and CONTROL in out
    data = json.loads(js.read_text())
    assert set(data["variants"]) == {"plain", "fold", CONTROL}
    assert data["variants"]["fold"]["diverged_at"] == [None] and "control_diverged" in data
    assert png.stat().st_size > 0
