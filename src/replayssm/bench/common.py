"""Shared pieces of the benchmarks: bandwidth, timing, byte counting, progress, JSON.

The performance model is DESIGN.md section 4. Reading one layer's states once,

    Sb = B * HV * V * K * (bytes per state element),

at the device's measured copy bandwidth (bytes read + bytes written per second of a
large device-to-device copy) is the floor of any verify step. Every timing is reported
next to that floor and next to the bandwidth it achieved on the bytes the strategy has
to move (:func:`step_bytes`).

Timing on CUDA replays captured CUDA graphs and times them with CUDA events; a block of
replays is timed as a whole and the median over blocks is reported, so strategies whose
cost varies from step to step (``circular``'s flushes) are averaged over whole cursor
cycles (:func:`cursor_cycle`). Without CUDA the same steps run eagerly and are timed with
the wall clock: a smoke run that proves the code path, not a measurement.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

# Bytes per element of the ring's float32 fields (``ring_g``, ``ring_beta``, ``ring_u``);
# see replayssm.strategies.fold.record_specs and replayssm.strategies.circular.
_F32 = 4

#: strategies of replayssm.strategies plus the reference steps they are compared to
#: (``plain_ring``: plain decoding through circular's ring)
STEP_KINDS = ("snapshot", "fold", "circular", "plain_decode", "plain_ring", "snapshot_verify")
#: the kinds that run circular's ring (and its small-batch path)
RING_KINDS = ("circular", "plain_ring")

#: the rotated working set is made this many times larger than the L2 cache, so that a
#: replay never finds the previous replay's states in L2
L2_ROTATION_FACTOR = 3


# ---------------------------------------------------------------------- device facts
_COPY_BANDWIDTH: dict[str, float] = {}


def copy_bandwidth(device: torch.device | str, *, nbytes: int = 1 << 31, repeats: int = 15) -> float:
    """Measured device-to-device copy bandwidth in bytes per second, read + write counted.

    Copies a ``nbytes`` buffer into another ``repeats`` times (after two warm-up copies),
    times each copy with CUDA events and returns ``2 * nbytes / median time``. The result
    is cached per device for the life of the process.

    Args:
        device: a CUDA device.
        nbytes: size of the copied buffer; large enough that L2 plays no part.
        repeats: timed copies.

    Raises:
        ValueError: ``device`` is not a CUDA device, or ``nbytes``/``repeats`` < 1.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device to measure copy bandwidth, got {device}")
    if not isinstance(nbytes, int) or nbytes < 1 << 20:
        raise ValueError(f"nbytes must be an int of at least 1 MiB, got {nbytes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = f"{device}:{nbytes}"
    if key not in _COPY_BANDWIDTH:
        n = nbytes // 4
        src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        for _ in range(2):
            dst.copy_(src)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            dst.copy_(src)
            end.record()
        torch.cuda.synchronize(device)
        ms = statistics.median(s.elapsed_time(e) for s, e in events)
        _COPY_BANDWIDTH[key] = 2 * n * 4 / (ms * 1e-3)
        del src, dst
        torch.cuda.empty_cache()
    return _COPY_BANDWIDTH[key]


def l2_cache_bytes(device: torch.device | str) -> int:
    """The L2 cache size of a CUDA device in bytes (from the device properties)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    props = torch.cuda.get_device_properties(device)
    size = getattr(props, "L2_cache_size", None)
    if not size:
        raise RuntimeError(f"torch {torch.__version__} does not report the L2 cache size of {props.name}")
    return int(size)


def rotation_copies(bytes_per_copy: int, l2_bytes: int, *, factor: int = L2_ROTATION_FACTOR, max_copies: int = 64) -> int:
    """How many independent copies of a step to replay round-robin so that the states
    they touch together exceed ``factor`` times the L2 cache.

    At batch 1 a Qwen3.5 layer's state is 2 MiB, so a graph of a few layers would be
    served from L2 on the next replay and beat the DRAM floor; rotating among copies
    (each with its own pool) makes every replay read its states from DRAM.
    """
    if bytes_per_copy < 1:
        raise ValueError(f"bytes_per_copy must be positive, got {bytes_per_copy}")
    if l2_bytes < 0:
        raise ValueError(f"l2_bytes must be non-negative, got {l2_bytes}")
    return max(1, min(max_copies, math.ceil(factor * l2_bytes / bytes_per_copy)))


# ---------------------------------------------------------------------- byte model
@dataclass(frozen=True)
class StepShape:
    """What one layer-step moves: geometry, batch, window and element sizes.

    Attributes:
        batch: ``B`` live requests, each with a full window of ``window`` tokens.
        num_heads, num_value_heads, head_k_dim, head_v_dim: ``H, HV, K, V``.
        window: ``T`` tokens verified per request.
        accept: ``n`` tokens committed per request (bonus included).
        state_elem: bytes per state element (4 for float32).
        act_elem: bytes per activation element (2 for bfloat16).
        ring_len: ``L`` for ``circular`` (ignored by the other kinds).
        conv_dim: ``C`` channels of the causal conv, or 0 when the conv is not part of
            the step.
        conv_kernel: ``W``.
    """

    batch: int
    num_heads: int
    num_value_heads: int
    head_k_dim: int
    head_v_dim: int
    window: int
    accept: int
    state_elem: int = 4
    act_elem: int = 2
    ring_len: int = 0
    conv_dim: int = 0
    conv_kernel: int = 4

    @property
    def state_bytes(self) -> int:
        """``Sb``: one layer's states for the whole batch."""
        return self.batch * self.num_value_heads * self.head_v_dim * self.head_k_dim * self.state_elem

    @property
    def raw_record_bytes(self) -> int:
        """One token's raw record: pre-norm ``k`` (``H K``) and ``v`` (``HV V``) in the
        activation dtype plus float32 ``g`` and ``beta`` (``HV`` each)."""
        h, hv, kd, vd = self.num_heads, self.num_value_heads, self.head_k_dim, self.head_v_dim
        return (h * kd + hv * vd) * self.act_elem + 2 * hv * _F32

    @property
    def u_record_bytes(self) -> int:
        """One token's float32 corrected delta ``u`` (``HV V``), stored by ``circular``."""
        return self.num_value_heads * self.head_v_dim * _F32

    @property
    def history_record_bytes(self) -> int:
        """What the closed form reads per committed history record: ``k`` (for ``k^``),
        ``g`` and ``u``; ``v`` and ``beta`` are only needed to fold."""
        return self.num_heads * self.head_k_dim * self.act_elem + self.num_value_heads * _F32 + self.u_record_bytes

    def activation_bytes(self, tokens: int) -> int:
        """Inputs ``q, k`` (``H K``), ``v`` (``HV V``), ``a, b`` (``HV``) read and the output
        ``o`` (``HV V``) written, for ``tokens`` tokens."""
        h, hv, kd, vd = self.num_heads, self.num_value_heads, self.head_k_dim, self.head_v_dim
        return tokens * (2 * h * kd + hv * vd + 2 * hv + hv * vd) * self.act_elem

    def conv_bytes(self, ring: bool = False) -> int:
        """The causal conv of a verify + commit, when it is part of the step: ``x`` read,
        ``y`` written, the conv state read, the window buffer written at verify and the
        accepted part read back plus the state rewritten at commit. On a conv ring
        (``ring``) the commit moves a position: no bytes of its own."""
        if not self.conv_dim:
            return 0
        c, t, w, e = self.conv_dim, self.window, self.conv_kernel, self.act_elem
        per_request = (2 * t * c + (w - 1) * c + t * c) * e
        if not ring:
            per_request += (self.accept * c + (w - 1) * c) * e
        return self.batch * per_request


@dataclass(frozen=True)
class CursorCycle:
    """The periodic regime of ``circular``'s cursors when every step commits ``accept``.

    Attributes:
        steps: steps between two flushes of a request (the cycle length).
        mean_history: committed records the closed form reads per verify, on average.
        flushes_per_step: folds into the checkpoint per verify (``1 / steps``).
        mean_folded: raw records folded per verify, on average.
    """

    steps: int
    mean_history: float
    flushes_per_step: float
    mean_folded: float


def cursor_cycle(window: int, ring_len: int, accept: int) -> CursorCycle:
    """Simulate one request's cursors (DESIGN.md section 3) until they repeat.

    At verify a flush row folds its ``write_pos`` records and then sees an empty
    history; any other row reads ``write_pos`` history records. Commit then applies

        if is_flush: write_pos = n   else: write_pos += n
        is_flush = write_pos + 2 T > L

    Only ``write_pos`` and ``is_flush`` decide the costs (``cache_base`` just rotates),
    so the cycle is found as the first repeated ``(write_pos, is_flush)``.
    """
    for name, value in (("window", window), ("ring_len", ring_len), ("accept", accept)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if ring_len & (ring_len - 1) or ring_len < 2 * window:
        raise ValueError(f"ring_len must be a power of two >= 2 * window = {2 * window}, got {ring_len}")
    if accept > window:
        raise ValueError(f"accept must be in [1, window = {window}], got {accept}")
    write_pos, is_flush = 0, False
    seen: dict[tuple[int, bool], int] = {}
    trace: list[tuple[int, int, bool]] = []  # (history read, records folded, flushed)
    while (write_pos, is_flush) not in seen:
        seen[(write_pos, is_flush)] = len(trace)
        trace.append((0, write_pos, True) if is_flush else (write_pos, 0, False))
        write_pos = accept if is_flush else write_pos + accept
        is_flush = write_pos + 2 * window > ring_len
    cycle = trace[seen[(write_pos, is_flush)]:]
    n = len(cycle)
    return CursorCycle(
        steps=n,
        mean_history=sum(c[0] for c in cycle) / n,
        flushes_per_step=sum(c[2] for c in cycle) / n,
        mean_folded=sum(c[1] for c in cycle) / n,
    )


@dataclass(frozen=True)
class StepBytes:
    """Bytes one layer-step moves, by kind (all per layer, whole batch).

    ``state_*`` are the recurrent states (checkpoints, snapshots); ``records_*`` the
    raw-record ring (and ``circular``'s ``u``); ``activations`` the layer's inputs and
    outputs (and the conv, when it is part of the step). Cursors, slot tables, gate
    parameters and the conv taps are not counted (a few bytes per request).
    """

    state_read: float
    state_write: float
    records_read: float = 0.0
    records_write: float = 0.0
    activations: float = 0.0

    @property
    def state(self) -> float:
        return self.state_read + self.state_write

    @property
    def total(self) -> float:
        return self.state_read + self.state_write + self.records_read + self.records_write + self.activations

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total"] = self.total
        return d


def step_bytes(kind: str, shape: StepShape, *, circular_replay: bool = False) -> StepBytes:
    """The bytes a layer-step of ``kind`` has to move, DESIGN.md section 4.

    With ``Sb`` = :attr:`StepShape.state_bytes`, ``T`` the window and ``n`` accepted:

    - ``snapshot``: verify reads ``Sb`` and writes ``T Sb`` snapshots; commit reads the
      accepted snapshot and writes the checkpoint (``Sb`` each).
    - ``fold``: verify reads ``Sb`` and writes ``T`` raw records per request; commit
      reads ``n`` records, reads ``Sb`` and writes ``Sb``.
    - ``circular``: verify reads ``Sb`` and the committed history (``k``, ``g``, ``u`` per
      record) and writes ``T`` records with their ``u``; a flush, once per cursor cycle,
      reads the folded raw records and writes ``Sb`` (counted as fused with the verify's
      read, the least a flush can cost). Averaged over :func:`cursor_cycle`.
      With ``circular_replay`` (its small-batch path, ``ops.chunked.replays_window``):
      a flush at every step, so verify reads ``Sb`` and the last step's ``n`` raw
      records, writes ``Sb`` and ``T`` records with their ``u``.
    - ``plain_decode``: one token: reads ``Sb``, writes ``Sb``.
    - ``plain_ring``: one token through circular's ring (DESIGN.md section 9):
      ``circular``'s count for a window of one token with one accepted, its flushes
      averaged over the plain cursor cycle (the pool's window ``T`` in the cursor rule:
      a flush every ``L - 2T + 1`` tokens), or with ``circular_replay`` one at every step.
    - ``snapshot_verify``: the snapshot strategy's verify alone: reads ``Sb``, writes
      ``T Sb``.

    Activations (and the conv, if ``shape.conv_dim``, except for the reference steps)
    are added for every kind; the plain steps have one token per request, the others ``T``.
    """
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {STEP_KINDS}, got {kind!r}")
    if not isinstance(shape, StepShape):
        raise TypeError(f"shape must be a StepShape, got {type(shape).__name__}")
    if circular_replay and kind not in RING_KINDS:
        raise ValueError(f"circular_replay applies to the kinds {RING_KINDS} only, got {kind!r}")
    sb, b, t, n = shape.state_bytes, shape.batch, shape.window, shape.accept
    plain = kind in ("plain_decode", "plain_ring")
    tokens = b if plain else b * t
    act = shape.activation_bytes(tokens) + (0 if plain or kind == "snapshot_verify" else shape.conv_bytes())
    raw = shape.raw_record_bytes
    if kind == "snapshot":
        return StepBytes(state_read=2 * sb, state_write=(t + 1) * sb, activations=act)
    if kind == "fold":
        return StepBytes(state_read=2 * sb, state_write=sb, records_read=b * n * raw, records_write=b * t * raw, activations=act)
    if kind in RING_KINDS:
        if not shape.ring_len:
            raise ValueError(f"shape.ring_len must be set for {kind}")
        # per request: tokens verified (records written) and accepted
        m, n = (1, 1) if plain else (t, n)
        if circular_replay:
            return StepBytes(state_read=sb, state_write=sb, records_read=b * n * raw,
                             records_write=b * m * (raw + shape.u_record_bytes), activations=act)
        cyc = cursor_cycle(t, shape.ring_len, n)
        return StepBytes(
            state_read=sb,
            state_write=cyc.flushes_per_step * sb,
            records_read=b * (cyc.mean_history * shape.history_record_bytes + cyc.mean_folded * raw),
            records_write=b * m * (raw + shape.u_record_bytes),
            activations=act,
        )
    if kind == "plain_decode":
        return StepBytes(state_read=sb, state_write=sb, activations=act)
    return StepBytes(state_read=sb, state_write=t * sb, activations=act)  # snapshot_verify


def best_ring_len(shape: StepShape, *, max_len: int = 256) -> int:
    """The ring length (a power of two in ``[2 T, max_len]``) that moves the fewest
    bytes per ``circular`` layer-step under :func:`step_bytes`.

    Longer rings flush less often (fewer checkpoint writes) but make every verify read a
    longer history; the byte model weighs the two.
    """
    t = shape.window
    first = 1 << max(0, (2 * t - 1).bit_length())
    candidates = [first << i for i in range(16) if first << i <= max_len]
    if not candidates:
        raise ValueError(f"max_len {max_len} is below the smallest legal ring length {first}")
    return min(candidates, key=lambda L: (step_bytes("circular", _replace_ring(shape, L)).total, L))


def _replace_ring(shape: StepShape, ring_len: int) -> StepShape:
    from dataclasses import replace

    return replace(shape, ring_len=ring_len)


# ---------------------------------------------------------------------- timing
@dataclass
class Timing:
    """Per-step timings of one benchmark configuration.

    Attributes:
        us_per_step: median over the timed blocks of the mean step time in a block.
        samples_us: the per-block mean step times.
        steps_per_block: steps (of every rotated copy) in one timed block.
        copies: rotated copies (graphs or eager steps) per block round.
        method: ``"cuda-graph"`` (CUDA events around graph replays) or ``"eager-wallclock"``.
    """

    us_per_step: float
    samples_us: list[float] = field(default_factory=list)
    steps_per_block: int = 1
    copies: int = 1
    method: str = "cuda-graph"

    def summary(self) -> dict:
        s = self.samples_us
        return {
            "method": self.method,
            "median_us_per_step": self.us_per_step,
            "min_us_per_step": min(s),
            "max_us_per_step": max(s),
            "blocks": len(s),
            "steps_per_block": self.steps_per_block,
            "rotated_copies": self.copies,
        }


def _check_timing_args(steps_per_block: int, blocks: int, warmup_blocks: int) -> None:
    for name, value, low in (("steps_per_block", steps_per_block, 1), ("blocks", blocks, 1), ("warmup_blocks", warmup_blocks, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def capture_graph(step: Callable[[], object], *, warmup_steps: int = 3) -> "torch.cuda.CUDAGraph":
    """Capture one call of ``step`` in a CUDA graph on the current device
    (:func:`replayssm.engine.graph_step.capture_graph`: ``warmup_steps`` eager calls on
    a side stream first, which really execute and advance whatever state ``step``
    changes)."""
    from ..engine.graph_step import capture_graph as capture

    return capture(step, warmup_steps=warmup_steps)


def time_graphs(
    graphs: Sequence["torch.cuda.CUDAGraph"], *, steps_per_block: int, blocks: int, warmup_blocks: int = 2
) -> Timing:
    """Time replays of captured steps with CUDA events.

    A block replays every graph ``steps_per_block`` times, round-robin (so consecutive
    replays of one copy are separated by the others, see :func:`rotation_copies`), and
    is timed by one pair of events. Returns the median over ``blocks`` of the mean time
    per step (one replay of one graph).
    """
    if not graphs:
        raise ValueError("graphs must not be empty")
    _check_timing_args(steps_per_block, blocks, warmup_blocks)

    def block():
        for _ in range(steps_per_block):
            for g in graphs:
                g.replay()

    for _ in range(warmup_blocks):
        block()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(blocks)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        block()
        end.record()
    torch.cuda.synchronize()
    per_step = steps_per_block * len(graphs)
    samples = [s.elapsed_time(e) * 1e3 / per_step for s, e in events]
    return Timing(statistics.median(samples), samples, steps_per_block, len(graphs), "cuda-graph")


def time_eager(steps: Sequence[Callable[[], object]], *, steps_per_block: int, blocks: int, warmup_blocks: int = 1) -> Timing:
    """Wall-clock timing of eager steps (no CUDA graph), same blocking as :func:`time_graphs`.

    Used for the CPU smoke run; on a CUDA device it synchronises around every block.
    """
    if not steps:
        raise ValueError("steps must not be empty")
    _check_timing_args(steps_per_block, blocks, warmup_blocks)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def block():
        for _ in range(steps_per_block):
            for s in steps:
                s()

    for _ in range(warmup_blocks):
        block()
    samples = []
    for _ in range(blocks):
        sync()
        t0 = time.perf_counter()
        block()
        sync()
        samples.append((time.perf_counter() - t0) * 1e6 / (steps_per_block * len(steps)))
    return Timing(statistics.median(samples), samples, steps_per_block, len(steps), "eager-wallclock")


def time_cuda(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` on the current CUDA device, each call
    timed alone by a pair of CUDA events, after ``warmup`` untimed calls: for one op or
    kernel of a millisecond or so, where a wall clock would count the host's launch."""
    for name, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not torch.cuda.is_available():
        raise ValueError("time_cuda needs a CUDA device")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_prompt_pass(engine, batch: int, length: int, generator: torch.Generator, *, vocab: int = 256,
                     around=None, arrays: bool = False) -> float:
    """Seconds of one ``engine.extend(..., prompt=True)`` of ``batch`` fresh requests of
    ``length`` random token ids below ``vocab``, as Python lists, or with ``arrays`` as
    int64 arrays (what the generators pass, their prompts checked and packed once): the
    slots are taken before the clock and freed after it, and on a CUDA engine the device
    is synchronised on both sides of the call. ``around``: a context manager entered
    just around the timed call (a profiler, so that it records the pass and not the
    slots' allocation)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    slots = [engine.alloc() for _ in range(batch)]
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    prompts = list(ids.numpy()) if arrays else ids.tolist()
    sync()
    with around if around is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        engine.extend(slots, prompts, prompt=True)
        sync()
        dt = time.perf_counter() - t0
    for s in slots:
        engine.free(s)
    return dt


def plan_steps_per_block(est_us_per_step: float, cycle: int, copies: int, *, target_block_us: float = 2000.0) -> int:
    """Steps per timed block: a whole number of cursor cycles, long enough (about
    ``target_block_us``) that event resolution and launch jitter do not matter."""
    if cycle < 1 or copies < 1:
        raise ValueError(f"cycle and copies must be positive, got {cycle}, {copies}")
    if not est_us_per_step > 0:
        raise ValueError(f"est_us_per_step must be positive, got {est_us_per_step}")
    cycles = max(1, math.ceil(target_block_us / (est_us_per_step * cycle * copies)))
    return cycles * cycle


def environment(device: torch.device, backend: str) -> dict:
    """What a result depends on besides its config: Python, torch, Triton and
    transformers versions (and those of fla-core and causal-conv1d, whose kernels
    Hugging Face's GDN layers run when installed), the device (and its name on CUDA),
    the resolved backend."""
    import platform

    from ..ops.dispatch import resolve

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
           "backend": resolve(backend, device)}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    for name in ("triton", "transformers", "fla", "causal_conv1d"):
        try:
            env[name] = getattr(__import__(name), "__version__", "installed")
        except ImportError:
            env[name] = None
    return env
