"""The state kernels launched as a chain (``triton_common.chained_launches``) give the
numbers of launches in stream order, bit for bit: outputs and committed states of every
layer, eager and replayed from a CUDA graph, over several steps (so the rings and
cursors that one step leaves feed the next).

Run on the GPU machine:  python -m pytest -q -m gpu tests/gpu/test_chained_state_gpu.py

A chained verify, or ring decoding in one launch, loads its slot and its state tile
before it waits for the kernel before it; a coefficient, fold, commit or conv kernel
waits first. A missing or
misplaced wait can show here as a step that read a state, a ring record or an
activation the kernel before had not finished writing; whether it does depends on the
kernels' timing, so a pass is evidence, not proof (the launch rules themselves are
checked on the CPU: tests/strategies/test_chained_launches.py).
"""

from __future__ import annotations

import pytest
import torch

from replayssm.bench import kernels as bk
from replayssm.ops.triton_common import dependent_launch

pytestmark = pytest.mark.gpu

CASES = [
    ("snapshot", 16, torch.float32),
    ("fold", 16, torch.bfloat16),
    ("circular", 16, torch.float32),
    ("circular", 64, torch.bfloat16),
    ("circular", 64, torch.float32),
    ("plain_decode", 16, torch.float32),
    ("plain_ring", 64, torch.float32),  # one launch, chained
    ("plain_ring", 64, torch.bfloat16),  # the flush rows apart, in stream order; the commit chained
]


def _config(name: str, batch: int, state_dtype: torch.dtype, chain: bool) -> bk.BenchConfig:
    strategy = name in bk.STRATEGY_NAMES
    return bk.BenchConfig(
        device=torch.device("cuda", torch.cuda.current_device()), backend="triton", graph=True, heads=16,
        value_heads=32, head_k_dim=128, head_v_dim=128, layers=3, batches=(batch,),
        strategies=(name,) if strategy else (), baselines=() if strategy else (name,), window=4, accept=3,
        ring_len=16, ring_len_source="given", state_dtype=state_dtype, act_dtype=torch.bfloat16, conv=strategy,
        repeats=1, seed=7, chain=chain,
    )


def _runner(cfg: bk.BenchConfig, name: str, batch: int):
    cls = bk.StrategyStep if name in bk.STRATEGY_NAMES else (bk.RingDecodeStep if name == "plain_ring"
                                                             else bk.RecurrenceStep)
    gen = torch.Generator(device=cfg.device)
    gen.manual_seed(1234)
    r = cls(cfg, name, batch, gen)
    r.prepare()
    return r


def _results(r) -> list[torch.Tensor]:
    torch.cuda.synchronize()
    outs = [o.clone() for o in r.outputs]
    if isinstance(r, bk.StrategyStep):
        s = r.pool.strategy
        return outs + [s.committed_state(layer, list(r.batch.host_slots)) for layer in range(r.cfg.layers)]
    return outs + [r.state.clone()]


@pytest.mark.parametrize("name,batch,state_dtype", CASES)
def test_chained_state_kernels_are_stream_order_bit_for_bit(name, batch, state_dtype):
    if not torch.cuda.is_available() or not dependent_launch(torch.device("cuda")):
        pytest.skip("needs a GPU with programmatic dependent launches (sm_90+)")
    ordered_cfg, chained_cfg = (_config(name, batch, state_dtype, chain) for chain in (False, True))
    ordered, chained = _runner(ordered_cfg, name, batch), _runner(chained_cfg, name, batch)
    assert all(torch.equal(a, b) for a, b in zip(_results(ordered), _results(chained)))  # the same start
    ordered_step, chained_step = bk._chained(ordered_cfg, ordered.step), bk._chained(chained_cfg, chained.step)
    for i in range(3):  # eager
        ordered_step()
        chained_step()
        for j, (a, b) in enumerate(zip(_results(ordered), _results(chained))):
            assert torch.equal(a, b), f"eager step {i}: result {j} differs"
    # capture runs three eager warm-up steps on each, then the replays
    graphs = [bk.common.capture_graph(ordered_step), bk.common.capture_graph(chained_step)]
    for i in range(4):
        for g in graphs:
            g.replay()
        for j, (a, b) in enumerate(zip(_results(ordered), _results(chained))):
            assert torch.equal(a, b), f"replay {i}: result {j} differs"
