"""``replayssm bench kernels``: one captured step per strategy against the one-read floor.

A step is what a speculative decode step asks of the GDN state: for every layer of the
graph, ``verify`` of a full window per request (optionally preceded by the causal conv),
then one ``commit`` of ``--accept`` tokens per request for all layers. The whole step is
captured in one CUDA graph and replayed; the reported time is per layer-step (step time
divided by ``--layers``). Next to it: the floor of DESIGN.md section 4 (one read of the
layer's states at the measured copy bandwidth), the ratio to that floor, the bandwidth
achieved on the bytes the strategy has to move (:func:`replayssm.bench.common.step_bytes`)
and the committed tokens per microsecond per layer.

Three reference steps are timed the same way: ``plain_decode`` (one token per request,
the recurrence updating the state in place), ``plain_ring`` (one token per request
through ``circular``'s ring: ``Strategy.decode`` in every layer, then one commit; the
state is read once a step and written at a flush, DESIGN.md section 9) and
``snapshot_verify`` (the ``snapshot`` strategy's verify alone: the plain recurrence
writing a snapshot per window position).

Each timed step is one block of
:func:`~replayssm.ops.triton_common.chained_launches`, as the engine's static steps run
their state kernels (on GPUs with programmatic launches; ``--no-chain``: in stream
order): a read-only verify loads its state tiles while the kernel before it finishes.

Small batches would find their states in L2 on the next replay (a Qwen3.5 layer holds
2 MiB per request), so there the step is built several times over independent pools
and the copies are replayed round-robin until their states exceed three times the L2
cache. ``circular``'s requests are first put at different phases of the cursor cycle
(eager steps with random accepted counts), and every timed block covers whole cycles, so
its flushes are timed at their natural rate; ``plain_ring``'s likewise (speculative
steps with random accepted counts on the same ring, then plain steps whose cycle is
``L - 2T + 1`` tokens).

Performance goals are not the library's business: ``scripts/check_kernel_targets.py``
checks the ``--json`` output against ``benchmarks/kernel_targets.json`` (issue 3's).

Without CUDA the command runs a tiny shape eagerly with the reference ops: a smoke run
that exercises the code path; it makes no floor claims (``floor_us`` is null).

JSON rows (one per strategy or reference step and batch): ``strategy``, ``kind``
(``strategy``/``baseline``), ``batch``, ``layers``, ``window``, ``accepted_per_request``,
``ring_len``, ``cursor_cycle_steps``, ``exact_outputs``, ``us_per_step`` (all layers),
``us_per_layer_step``, ``floor_us``, ``floor_ratio``, ``achieved_GBps`` (bytes of the model
per layer-step / time), ``committed_tokens_per_us_per_layer``, ``state_bytes_per_layer``
(``Sb``), ``bytes_per_layer_step`` (by kind, with ``total``) and ``timing`` (method,
median/min/max, blocks, steps per block, rotated copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import platform
import sys
import traceback
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from . import common
from ..ops import guards
from ..ops.triton_common import chained_launches
from ..strategies import STRATEGY_NAMES
from ..progress import ProgressBar
from .common import StepShape, Timing

BASELINE_NAMES = ("plain_decode", "plain_ring", "snapshot_verify")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# Qwen3.5-35B-A3B GDN layers at TP1 (DESIGN.md section 6) on CUDA; a tiny shape for the
# CPU smoke run, where the reference ops loop on the host.
CUDA_DEFAULTS = dict(heads=16, value_heads=32, head_k_dim=128, head_v_dim=128, layers=8, batches=(1, 16, 64, 256), repeats=30, act_dtype="bfloat16")
CPU_DEFAULTS = dict(heads=2, value_heads=4, head_k_dim=16, head_v_dim=16, layers=2, batches=(1, 2), repeats=3, act_dtype="float32")


# ---------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class BenchConfig:
    """The resolved, validated options of one run."""

    device: torch.device
    backend: str
    graph: bool
    heads: int
    value_heads: int
    head_k_dim: int
    head_v_dim: int
    layers: int
    batches: tuple[int, ...]
    strategies: tuple[str, ...]
    baselines: tuple[str, ...]
    window: int
    accept: int
    ring_len: int
    ring_len_source: str
    state_dtype: torch.dtype
    act_dtype: torch.dtype
    conv: bool
    repeats: int
    seed: int
    tune: tuple[tuple[str, str, int], ...] = ()
    #: draft-tree branching per depth (``--tree``); empty: chains only
    tree: tuple[int, ...] = ()
    #: the step's kernels launch as a chain (``--no-chain``: in stream order;
    #: :func:`~replayssm.ops.triton_common.chained_launches`, where the GPU allows it)
    chain: bool = True

    @property
    def smoke(self) -> bool:
        """No CUDA device: the run proves the code path and claims no floor."""
        return self.device.type != "cuda"

    def gdn_shape(self):
        from ..state import GDNShape

        return GDNShape(self.heads, self.value_heads, self.head_k_dim, self.head_v_dim)

    def step_shape(self, batch: int, *, conv: bool | None = None) -> StepShape:
        conv = self.conv if conv is None else conv
        return StepShape(
            batch=batch, num_heads=self.heads, num_value_heads=self.value_heads, head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim, window=self.window, accept=self.accept,
            state_elem=torch.empty((), dtype=self.state_dtype).element_size(),
            act_elem=torch.empty((), dtype=self.act_dtype).element_size(),
            ring_len=self.ring_len, conv_dim=self.gdn_shape().conv_dim if conv else 0,
        )


# ---------------------------------------------------------------------- steps
def _randn(gen, device, dtype, *shape, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    return (x * scale).to(dtype)


def _random_gates(gen, device, layers: int, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_log`` in [-3, -0.3] and ``dt_bias`` ~ N(0, 0.5^2) per layer: decays in the
    range trained models use, so states neither vanish nor blow up over many replays."""
    A_log = torch.rand(layers, hv, generator=gen, device=device) * 2.7 - 3.0
    dt_bias = torch.randn(layers, hv, generator=gen, device=device) * 0.5
    return A_log, dt_bias


class _LayerInputs:
    """Fresh random post-conv inputs of every layer for ``tokens`` packed tokens."""

    def __init__(self, cfg: BenchConfig, tokens: int, gen, *, conv: bool):
        dev, dt, L = cfg.device, cfg.act_dtype, cfg.layers
        h, hv, kd, vd = cfg.heads, cfg.value_heads, cfg.head_k_dim, cfg.head_v_dim
        if conv:  # pre-conv channels q|k|v, split after the conv
            self.x = [_randn(gen, dev, dt, tokens, 2 * h * kd + hv * vd) for _ in range(L)]
        else:
            self.q = [_randn(gen, dev, dt, tokens, h, kd) for _ in range(L)]
            self.k = [_randn(gen, dev, dt, tokens, h, kd) for _ in range(L)]
            self.v = [_randn(gen, dev, dt, tokens, hv, vd) for _ in range(L)]
        self.a = [_randn(gen, dev, dt, tokens, hv) for _ in range(L)]
        self.b = [_randn(gen, dev, dt, tokens, hv, scale=2.0) for _ in range(L)]


class StrategyStep:
    """One copy of a strategy's step: its own :class:`StatePool`, random checkpoints and
    inputs, ``batch`` live requests with full windows and ``accept`` tokens committed.

    :meth:`step` is what gets captured: every layer's verify (and conv, if enabled),
    then one commit. Only the public API is used, so whatever ops the pool's backend
    dispatches to are what is timed.
    """

    kind = "strategy"

    def __init__(self, cfg: BenchConfig, name: str, batch: int, gen: torch.Generator):
        from ..state import StatePool

        self.cfg, self.name, self.gen = cfg, name, gen
        shape = cfg.gdn_shape()
        self.pool = StatePool(
            shape, cfg.layers, batch, strategy=name, window=cfg.window, ring_len=cfg.ring_len,
            state_dtype=cfg.state_dtype, act_dtype=cfg.act_dtype, device=cfg.device, backend=cfg.backend,
        )
        A_log, dt_bias = _random_gates(gen, cfg.device, cfg.layers, shape.num_value_heads)
        for layer in range(cfg.layers):
            self.pool.set_layer_params(
                layer, A_log=A_log[layer], dt_bias=dt_bias[layer],
                conv_weight=_randn(gen, cfg.device, torch.float32, shape.conv_dim, shape.conv_kernel, scale=0.5),
                conv_bias=_randn(gen, cfg.device, torch.float32, shape.conv_dim, scale=0.1),
            )
        slots = [self.pool.alloc() for _ in range(batch)]
        # Random committed states through the strategy API (alloc zeroed them): random
        # recurrent states, and conv states advanced over a few random tokens.
        s, w = self.pool.shape, shape.conv_kernel
        idx = torch.tensor(slots, dtype=torch.int64, device=cfg.device)
        prompt = self.pool.batch(slots, w - 1, prefill=True)
        act = self.pool.act_dtype
        for layer in range(cfg.layers):
            states = 0.1 * torch.randn((batch, s.num_value_heads, s.head_v_dim, s.head_k_dim), generator=gen,
                                       device=cfg.device)
            self.pool.strategy.load_states(layer, idx, states)
            x = torch.randn((batch * (w - 1), s.conv_dim), generator=gen, device=cfg.device).to(act)
            self.pool.strategy.conv_prefill(layer, x, prompt)
        self.batch = self.pool.batch(slots, cfg.window)
        self.inputs = _LayerInputs(cfg, batch * cfg.window, gen, conv=cfg.conv)
        self.accepted = torch.full((batch,), cfg.accept, dtype=torch.int32, device=cfg.device)
        self.outputs: list[torch.Tensor | None] = [None] * cfg.layers

    def _split(self, y: torch.Tensor):
        c = self.cfg
        n, hk = y.shape[0], c.heads * c.head_k_dim
        q = y[:, :hk].reshape(n, c.heads, c.head_k_dim).contiguous()
        k = y[:, hk:2 * hk].reshape(n, c.heads, c.head_k_dim).contiguous()
        v = y[:, 2 * hk:].reshape(n, c.value_heads, c.head_v_dim).contiguous()
        return q, k, v

    def step(self, accepted: torch.Tensor | None = None) -> None:
        s, x = self.pool.strategy, self.inputs
        for layer in range(self.cfg.layers):
            if self.cfg.conv:
                q, k, v = self._split(s.conv_verify(layer, x.x[layer], self.batch))
            else:
                q, k, v = x.q[layer], x.k[layer], x.v[layer]
            self.outputs[layer] = s.verify(layer, q, k, v, x.a[layer], x.b[layer], self.batch)
        s.commit(self.batch, self.accepted if accepted is None else accepted)

    def prepare(self) -> None:
        """Eager steps with random accepted counts before timing, so that requests sit
        at different phases of the cursor cycle (``circular``) as they do in serving;
        they also compile the kernels for every accepted count."""
        steps = max(4, self.cfg.ring_len // 2) if self.name == "circular" else 2
        for _ in range(steps):
            acc = torch.randint(1, self.cfg.window + 1, self.accepted.shape, generator=self.gen, device=self.cfg.device, dtype=torch.int32)
            self.step(acc)


class TreeStep(StrategyStep):
    """A tree step of a strategy (``--tree``): every layer's ``conv_verify_tree`` (with
    ``--conv``) and ``verify_tree`` of the static tree ``DraftTrees.from_branching(
    cfg.tree)`` per request (the pool's window is its ``N`` nodes), then one
    ``commit_tree`` of its last node (one of the deepest: ``depth + 1`` tokens, the
    step's ``accept``), from a device tensor as an engine's acceptance leaves it."""

    def __init__(self, cfg: BenchConfig, name: str, batch: int, gen: torch.Generator):
        from ..ops.trees import DraftTrees

        super().__init__(cfg, name, batch, gen)
        self.trees = DraftTrees.from_branching(cfg.tree, batch=batch)
        if self.trees.max_nodes != cfg.window:
            raise ValueError(f"a tree step's pool window must be the tree's {self.trees.max_nodes} nodes, got {cfg.window}")
        self.node = torch.full((batch,), self.trees.max_nodes - 1, dtype=torch.int32, device=cfg.device)

    def step(self, accepted: torch.Tensor | None = None) -> None:
        s, x, t = self.pool.strategy, self.inputs, self.trees
        for layer in range(self.cfg.layers):
            if self.cfg.conv:
                q, k, v = self._split(s.conv_verify_tree(layer, x.x[layer], self.batch, t))
            else:
                q, k, v = x.q[layer], x.k[layer], x.v[layer]
            self.outputs[layer] = s.verify_tree(layer, q, k, v, x.a[layer], x.b[layer], self.batch, t)
        s.commit_tree(self.batch, t, self.node if accepted is None else accepted)

    def prepare(self) -> None:
        """Eager steps with random accepted nodes (requests at different cursor phases)."""
        steps = max(4, self.cfg.ring_len // 2) if self.name == "circular" else 2
        for _ in range(steps):
            node = torch.randint(0, self.trees.max_nodes, self.node.shape, generator=self.gen, device=self.cfg.device,
                                 dtype=torch.int32)
            self.step(node)


#: The rows of a ``--tree`` run per strategy and batch: the tree of ``N`` nodes, a chain of
#: ``N`` tokens, and a chain of the tree's depth (``depth + 1`` tokens, root included); each
#: commits ``depth + 1`` tokens per request.
TREE_ROWS = ("tree", "chain_nodes", "chain_depth")


def tree_config(cfg: BenchConfig, kind: str) -> BenchConfig:
    """``cfg`` for one row of a ``--tree`` run: the pool window (``N`` nodes, or the
    depth's ``depth + 1`` tokens), ``accept = depth + 1`` and a ring of at least two
    windows."""
    from ..ops.trees import DraftTrees

    if kind not in TREE_ROWS:
        raise ValueError(f"kind must be one of {TREE_ROWS}, got {kind!r}")
    t = DraftTrees.from_branching(cfg.tree)
    depth = len(cfg.tree)
    window = depth + 1 if kind == "chain_depth" else t.max_nodes
    ring_len = max(cfg.ring_len, 1 << (2 * window - 1).bit_length())
    return dataclasses.replace(cfg, window=window, accept=depth + 1, ring_len=ring_len)


class RingDecodeStep(StrategyStep):
    """``plain_ring``: plain decoding through ``circular``'s ring on the pool its
    speculative step uses (window ``T``, ring ``L``): every layer's
    :meth:`~replayssm.strategies.Strategy.decode` of one token per request, then one
    ``commit``. No causal conv, as in ``plain_decode``.

    :meth:`prepare` first takes speculative steps with random accepted counts on the same
    ring, so that the requests sit at different phases of the cursor cycle (plain and
    speculative steps share the ring), then plain steps (compiling their kernels).
    """

    kind = "baseline"

    def __init__(self, cfg: BenchConfig, name: str, batch: int, gen: torch.Generator):
        if name != "plain_ring":
            raise ValueError(f"name must be 'plain_ring', got {name!r}")
        super().__init__(cfg, "circular", batch, gen)
        self.name = name
        self.plain_batch = self.pool.batch(list(self.batch.host_slots), 1)
        self.plain_inputs = _LayerInputs(cfg, batch, gen, conv=False)

    def step(self, accepted: torch.Tensor | None = None) -> None:
        s, x = self.pool.strategy, self.plain_inputs
        for layer in range(self.cfg.layers):
            self.outputs[layer] = s.decode(layer, x.q[layer], x.k[layer], x.v[layer], x.a[layer], x.b[layer],
                                           self.plain_batch)
        s.commit(self.plain_batch)

    def prepare(self) -> None:
        for _ in range(max(4, self.cfg.ring_len // 2)):
            acc = torch.randint(1, self.cfg.window + 1, self.accepted.shape, generator=self.gen, device=self.cfg.device,
                                dtype=torch.int32)
            super().step(acc)
        for _ in range(2):
            self.step()


class RecurrenceStep:
    """A reference step built on the plain recurrence op, every layer of the graph.

    ``plain_decode``: one token per request, the state updated in place (what plain
    decoding costs per token). ``snapshot_verify``: a full window per request from the
    state, writing the state after every position to a ``[T, HV, V, K]`` scratch per
    request (the ``snapshot`` strategy's verify, without its commit).
    """

    kind = "baseline"

    def __init__(self, cfg: BenchConfig, name: str, batch: int, gen: torch.Generator):
        if name not in BASELINE_NAMES:
            raise ValueError(f"name must be one of {BASELINE_NAMES}, got {name!r}")
        self.cfg, self.name = cfg, name
        dev, L, hv, vd, kd = cfg.device, cfg.layers, cfg.value_heads, cfg.head_v_dim, cfg.head_k_dim
        per_request = self.per_request = 1 if name == "plain_decode" else cfg.window
        self.state = torch.empty(L, batch, hv, vd, kd, dtype=cfg.state_dtype, device=dev).normal_(0.0, 0.1, generator=gen)
        self.snapshots = (
            torch.empty(L, batch, cfg.window, hv, vd, kd, dtype=cfg.state_dtype, device=dev) if name == "snapshot_verify" else None
        )
        self.A_log, self.dt_bias = _random_gates(gen, dev, L, hv)
        # Index tensors built from host lists, as a pool's batches are: the launchers' guards
        # check their recorded values on the host and add nothing to the captured step
        # (a caller's own device indices are checked by tensor ops inside the graph).
        self.slots = guards.host_index(list(range(batch)), dev)
        self.cu_seqlens = guards.host_index(list(range(0, batch * per_request + 1, per_request)), dev)
        self.inputs = _LayerInputs(cfg, batch * per_request, gen, conv=False)
        self.outputs: list[torch.Tensor | None] = [None] * L

    def step(self) -> None:
        from ..ops import gdn_recurrence

        x = self.inputs
        for layer in range(self.cfg.layers):
            self.outputs[layer] = gdn_recurrence(
                x.q[layer], x.k[layer], x.v[layer], x.a[layer], x.b[layer], self.A_log[layer], self.dt_bias[layer],
                self.state[layer], self.slots, self.cu_seqlens,
                snapshots=None if self.snapshots is None else self.snapshots[layer],
                update_state=self.name == "plain_decode", max_len=self.per_request, backend=self.cfg.backend,
            )

    def prepare(self) -> None:
        self.step()


# ---------------------------------------------------------------------- measuring
def _generator(cfg: BenchConfig, *key) -> torch.Generator:
    gen = torch.Generator(device=cfg.device)
    gen.manual_seed(cfg.seed * 1_000_003 + zlib.crc32(repr(key).encode()))
    return gen


def circular_replays(cfg: BenchConfig, batch: int) -> bool:
    """Whether ``circular`` at ``batch`` runs its small-batch path (one launch, a flush
    at every step) under the shape table as it stands (``--tune`` included)."""
    from ..ops.chunked import replays_window

    return replays_window(batch, kd=cfg.head_k_dim, vd=cfg.head_v_dim, state_dtype=cfg.state_dtype,
                          device=cfg.device)


def _chained(cfg: BenchConfig, step):
    """``step`` with its kernels launched as one chain (``cfg.chain``): each step is a
    block of its own, whose first kernel starts in stream order."""
    def chained_step():
        with chained_launches(cfg.device, cfg.chain):
            step()
    return chained_step


def measure(cfg: BenchConfig, name: str, batch: int, *, copy_bw: float | None, l2_bytes: int | None,
            progress: ProgressBar | None = None, tree_kind: str | None = None) -> dict:
    """Time one (strategy or baseline, batch) configuration and return its JSON row;
    ``tree_kind``: one of :data:`TREE_ROWS` (``cfg`` from :func:`tree_config`)."""
    is_strategy = name in STRATEGY_NAMES
    if not is_strategy and name not in BASELINE_NAMES:
        raise ValueError(f"name must be one of {STRATEGY_NAMES + BASELINE_NAMES}, got {name!r}")
    shape = cfg.step_shape(batch, conv=cfg.conv and is_strategy)
    ring = name in common.RING_KINDS
    replay = ring and circular_replays(cfg, batch)
    nbytes = common.step_bytes(name, shape, circular_replay=replay)
    cycle = common.cursor_cycle(cfg.window, cfg.ring_len, committed_per_request(cfg, name)).steps if ring and not replay else 1
    copies = 1
    if cfg.graph and l2_bytes:
        copies = common.rotation_copies(shape.state_bytes * cfg.layers, l2_bytes)
    cls = StrategyStep if is_strategy else (RingDecodeStep if name == "plain_ring" else RecurrenceStep)
    if tree_kind == "tree":
        cls = TreeStep
    runners = [cls(cfg, name, batch, _generator(cfg, name, batch, i)) for i in range(copies)]
    steps = [_chained(cfg, r.step) for r in runners]
    graphs = []
    try:
        for r in runners:
            r.prepare()
        if cfg.graph:
            if progress:
                progress.write(f"  capturing {copies} graph(s) of {cfg.layers} layers")
            graphs = [common.capture_graph(step) for step in steps]
            probe = common.time_graphs(graphs, steps_per_block=cycle, blocks=1, warmup_blocks=1)
            spb = common.plan_steps_per_block(probe.us_per_step, cycle, copies)
            timing = common.time_graphs(graphs, steps_per_block=spb, blocks=cfg.repeats)
        else:
            timing = common.time_eager(steps, steps_per_block=cycle, blocks=cfg.repeats)
    finally:
        del graphs, runners, steps
        gc.collect()
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    row = make_row(cfg, name, batch, timing, nbytes, shape, copy_bw, cycle, replay)
    if tree_kind is not None:
        # Bytes: a tree moves what a chain of its N nodes does (one read of the state,
        # N records written); circular's tree verify always takes the closed form.
        row.update(step_kind=tree_kind, tree=",".join(map(str, cfg.tree)))
        if name == "circular" and tree_kind == "tree":
            row["circular_method"] = "closed_form"
    return row


def committed_per_request(cfg: BenchConfig, name: str) -> int | None:
    """Tokens a step of ``name`` commits per request (``None``: it commits nothing)."""
    if name in STRATEGY_NAMES:
        return cfg.accept
    return 1 if name in ("plain_decode", "plain_ring") else None


def make_row(cfg: BenchConfig, name: str, batch: int, timing: Timing, nbytes: common.StepBytes, shape: StepShape,
             copy_bw: float | None, cycle: int, replay: bool = False) -> dict:
    """The JSON row of one configuration (fields: see the module docstring)."""
    from ..strategies import STRATEGIES

    us = timing.us_per_step / cfg.layers
    floor_us = None if copy_bw is None else shape.state_bytes / copy_bw * 1e6
    committed = committed_per_request(cfg, name)
    ring = name in common.RING_KINDS
    exact = STRATEGIES["circular" if ring else name].exact_outputs if ring or name in STRATEGY_NAMES else True
    return {
        "strategy": name,
        "kind": "strategy" if name in STRATEGY_NAMES else "baseline",
        "batch": batch,
        "layers": cfg.layers,
        "window": 1 if name in ("plain_decode", "plain_ring") else cfg.window,
        "accepted_per_request": committed,
        "ring_len": cfg.ring_len if ring else None,
        "cursor_cycle_steps": cycle if ring else None,
        "circular_method": ("replay" if replay else "closed_form") if ring else None,
        "exact_outputs": exact,
        "us_per_step": timing.us_per_step,
        "us_per_layer_step": us,
        "floor_us": floor_us,
        "floor_ratio": None if floor_us is None else us / floor_us,
        "achieved_GBps": nbytes.total / (us * 1e-6) / 1e9,
        "committed_tokens_per_us_per_layer": None if committed is None else batch * committed / us,
        "state_bytes_per_layer": shape.state_bytes,
        "bytes_per_layer_step": nbytes.as_dict(),
        "timing": timing.summary(),
    }


# ---------------------------------------------------------------------- output
def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict]) -> str:
    head = f"{'strategy':<16} {'batch':>5} {'us/layer-step':>13} {'floor_us':>9} {'ratio':>6} {'GB/s':>8} {'tok/us/layer':>12} {'MB/layer-step':>13}"
    lines = [head, "-" * len(head)]
    order = {n: i for i, n in enumerate(STRATEGY_NAMES + BASELINE_NAMES)}
    kinds = {k: i for i, k in enumerate(TREE_ROWS)}
    for r in sorted(rows, key=lambda r: (r["batch"], order[r["strategy"]], kinds.get(r.get("step_kind"), -1))):
        label = r["strategy"] if r.get("step_kind") is None else f"{r['strategy']}:{r['step_kind'][:5]}{r['window']}"
        lines.append(
            f"{label:<16} {r['batch']:>5} {r['us_per_layer_step']:>13.2f} {_fmt(r['floor_us'], '9.2f'):>9} "
            f"{_fmt(r['floor_ratio'], '6.2f'):>6} {r['achieved_GBps']:>8.4g} "
            f"{_fmt(r['committed_tokens_per_us_per_layer'], '12.3f'):>12} {r['bytes_per_layer_step']['total'] / 1e6:>13.2f}"
        )
    return "\n".join(lines)


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    from ..version import __version__

    out["replayssm"] = __version__
    return out


BYTE_MODEL = (
    "bytes per layer-step, whole batch: states (snapshot: 2 Sb read + (T+1) Sb written; fold: 2 Sb read + Sb "
    "written; circular: Sb read + Sb written per flush, averaged over the cursor cycle; plain_ring: circular's for "
    "one token per request, averaged over its cycle of L - 2T + 1 tokens), raw-record ring traffic "
    "(k, v in the activation dtype, fp32 g, beta; circular also fp32 u and the history's k, g, u read by the "
    "closed form), activations (q, k, v, a, b read, o written; the conv when enabled). Not counted: cursors, "
    "slot tables, gate parameters, conv taps. A flush is counted fused with the verify's read (its minimum)."
)


def device_facts(cfg: BenchConfig) -> tuple[dict, float | None, int | None]:
    """``(device info, copy bandwidth in B/s, L2 bytes)`` of ``cfg``'s device (the last
    two ``None`` without CUDA: no floor is claimed there)."""
    if cfg.device.type != "cuda":
        return {"type": cfg.device.type, "name": platform.processor() or platform.machine()}, None, None
    props = torch.cuda.get_device_properties(cfg.device)
    l2 = common.l2_cache_bytes(cfg.device)
    copy_bw = common.copy_bandwidth(cfg.device)
    info = {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_bytes": props.total_memory, "l2_bytes": l2, "copy_GBps": copy_bw / 1e9}
    return info, copy_bw, l2


def run_configs(cfg: BenchConfig, *, copy_bw: float | None, l2_bytes: int | None,
                progress: ProgressBar | None = None) -> tuple[list[dict], list[dict]]:
    """Every (batch, strategy or reference step) of ``cfg`` under its shape-table
    overrides: ``(rows, errors)``. A configuration that fails is recorded (and its
    traceback printed on stderr) and the others still run."""
    from ..ops import tuning

    rows, errors = [], []
    overrides = contextlib.ExitStack()
    for family, param, value in cfg.tune:
        overrides.enter_context(tuning.override(family, **{param: value}))
    with overrides:
        for batch in cfg.batches:
            todo = [(name, None) for name in list(cfg.strategies) + list(cfg.baselines)]
            if cfg.tree:  # a tree run: per strategy the tree and its two chains
                todo = [(name, kind) for name in cfg.strategies for kind in TREE_ROWS]
                todo += [(name, None) for name in cfg.baselines]
            for name, kind in todo:
                label = f"{name} batch {batch}" + (f" ({kind})" if kind else "")
                if progress:
                    progress.set_description(label)
                try:
                    run_cfg = cfg if kind is None else tree_config(cfg, kind)
                    row = measure(run_cfg, name, batch, copy_bw=copy_bw, l2_bytes=l2_bytes, progress=progress,
                                  tree_kind=kind)
                except Exception as e:  # keep going: one broken configuration must not hide the others
                    errors.append({"strategy": name, "batch": batch, "error": f"{type(e).__name__}: {e}"})
                    if progress:
                        progress.write(f"{label}: FAILED {type(e).__name__}: {e}")
                    traceback.print_exc(file=sys.stderr)
                else:
                    rows.append(row)
                    ratio = "" if row["floor_ratio"] is None else f", {row['floor_ratio']:.2f}x floor"
                    if progress:
                        progress.write(f"{label}: {row['us_per_layer_step']:.2f} us/layer-step{ratio}")
                if progress:
                    progress.update(1)
    return rows, errors


def result_payload(cfg: BenchConfig, backend: str, device_info: dict, rows: list[dict], errors: list[dict]) -> dict:
    """The ``--json`` document of a run (schema 1)."""
    return {
        "benchmark": "kernels",
        "schema": 1,
        "smoke": cfg.smoke,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "device": device_info,
        "config": {
            "backend": backend, "cuda_graph": cfg.graph, "heads": cfg.heads, "value_heads": cfg.value_heads,
            "head_k_dim": cfg.head_k_dim, "head_v_dim": cfg.head_v_dim, "layers_per_step": cfg.layers,
            "batches": list(cfg.batches), "window": cfg.window, "accepted_per_request": cfg.accept,
            "ring_len": cfg.ring_len, "ring_len_source": cfg.ring_len_source,
            "state_dtype": str(cfg.state_dtype)[6:], "act_dtype": str(cfg.act_dtype)[6:], "conv": cfg.conv,
            "repeats": cfg.repeats, "seed": cfg.seed, "l2_rotation_factor": common.L2_ROTATION_FACTOR,
            "tune": [f"{f}.{p}={v}" for f, p, v in cfg.tune],
            "tree": list(cfg.tree) or None, "chained_launches": cfg.chain,
        },
        "byte_model": BYTE_MODEL,
        "rows": rows,
        "errors": errors,
    }
