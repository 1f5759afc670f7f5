"""Tensor parallelism: a rank's shard is a pool of a smaller shape (DESIGN.md section 8).

Two processes (``torch.distributed`` with gloo on the CPU) each hold half the heads:
``GDNShape.tp_shard`` key and value heads, ``GDNShape.tp_conv_channels`` of the conv,
and the matching slices of ``a``, ``b``, ``A_log`` and ``dt_bias``. They run the same
verify -> accept -> commit steps (conv included) on their shards; the outputs and
committed states, gathered along the head axis, equal those of one unsharded pool bit
for bit (every head's arithmetic is independent of how many heads a pool holds).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replayssm.state import GDNShape, StatePool

FULL = GDNShape(num_heads=2, num_value_heads=4, head_k_dim=8, head_v_dim=8)
WORLD, LAYERS, SLOTS, WINDOW, STEPS = 2, 2, 3, 3, 3
ROWS = [2, -1, 0]


def make_steps(seed: int):
    """Full-width inputs of every step and layer, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    hv, c, w = FULL.num_value_heads, FULL.conv_dim, FULL.conv_kernel
    params = [dict(A_log=torch.rand(hv, generator=gen) * -2, dt_bias=torch.randn(hv, generator=gen) * 0.5,
                   conv_weight=torch.randn(c, w, generator=gen) * 0.5, conv_bias=torch.randn(c, generator=gen) * 0.1)
              for _ in range(LAYERS)]
    steps = []
    for _ in range(STEPS):
        lengths = torch.randint(1, WINDOW + 1, (len(ROWS),), generator=gen).tolist()
        accepted = [int(torch.randint(1, n + 1, (), generator=gen)) for n in lengths]
        n = sum(lengths)
        layers = [dict(x=torch.randn(n, c, generator=gen), a=torch.randn(n, hv, generator=gen),
                       b=torch.randn(n, hv, generator=gen)) for _ in range(LAYERS)]
        steps.append((lengths, accepted, layers))
    return params, steps


def run_pool(shape: GDNShape, strategy: str, params, steps, channels, heads):
    """Run a pool of ``shape`` on the ``channels`` / ``heads`` slices of the inputs;
    return the outputs of every (step, layer) and committed states after every step."""
    pool = StatePool(shape, LAYERS, SLOTS, strategy=strategy, window=WINDOW, ring_len=8, backend="reference")
    for layer, p in enumerate(params):
        pool.set_layer_params(layer, A_log=p["A_log"][heads], dt_bias=p["dt_bias"][heads],
                              conv_weight=p["conv_weight"][channels], conv_bias=p["conv_bias"][channels])
    for s in sorted(s for s in ROWS if s >= 0):
        pool.alloc(s)
    hk = shape.num_heads * shape.head_k_dim
    outputs, states = [], []
    for lengths, accepted, layers in steps:
        batch = pool.batch(ROWS, lengths)
        for layer, inp in enumerate(layers):
            y = pool.strategy.conv_verify(layer, inp["x"][:, channels].contiguous(), batch)
            n = y.shape[0]
            q = y[:, :hk].view(n, shape.num_heads, shape.head_k_dim)
            k = y[:, hk:2 * hk].view(n, shape.num_heads, shape.head_k_dim)
            v = y[:, 2 * hk:].view(n, shape.num_value_heads, shape.head_v_dim)
            outputs.append(pool.strategy.verify(layer, q, k, v, inp["a"][:, heads], inp["b"][:, heads], batch))
        pool.strategy.commit(batch, accepted)
        live = [s for s in ROWS if s >= 0]
        states += [pool.strategy.committed_state(layer, live) for layer in range(LAYERS)]
    return outputs, states


def gather_heads(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, 1)  # rank r holds value heads [r * HV / world, (r + 1) * HV / world)


def worker(rank: int, port: int, strategies: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        part = FULL.tp_shard(WORLD)
        heads = torch.arange(rank * part.num_value_heads, (rank + 1) * part.num_value_heads)
        channels = torch.tensor(FULL.tp_conv_channels(rank, WORLD))
        everything = torch.arange(FULL.conv_dim), torch.arange(FULL.num_value_heads)
        for i, strategy in enumerate(strategies):
            params, steps = make_steps(seed=100 + i)
            out_full, st_full = run_pool(FULL, strategy, params, steps, *everything)
            out_part, st_part = run_pool(part, strategy, params, steps, channels, heads)
            for j, (o, o_full) in enumerate(zip(out_part, out_full)):
                assert torch.equal(gather_heads(o), o_full), f"{strategy}: outputs of step/layer {j} differ"
            for j, (s, s_full) in enumerate(zip(st_part, st_full)):
                assert torch.equal(gather_heads(s), s_full), f"{strategy}: committed state {j} differs"
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shard_shapes_and_channels():
    part = FULL.tp_shard(2)
    assert (part.num_heads, part.num_value_heads, part.conv_dim) == (1, 2, FULL.conv_dim // 2)
    hk = FULL.num_heads * FULL.head_k_dim
    assert FULL.tp_conv_channels(1, 2)[:8] == list(range(8, 16))  # key head 1 of the q block
    assert FULL.tp_conv_channels(1, 2)[8:16] == list(range(hk + 8, hk + 16))  # ... of the k block
    assert sorted(FULL.tp_conv_channels(0, 2) + FULL.tp_conv_channels(1, 2)) == list(range(FULL.conv_dim))
    with pytest.raises(ValueError, match="do not split"):
        FULL.tp_shard(4)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_two_ranks_equal_one_unsharded_pool():
    mp.spawn(worker, args=(free_port(), ["circular", "fold"]), nprocs=WORLD, join=True)
