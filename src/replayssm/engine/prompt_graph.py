"""Prompt passes of fresh requests at static shapes, each shape captured once in a CUDA graph.

An eager prompt pass launches every layer's kernels from Python and builds its index
tensors on the host, so a short prompt costs host time, not GPU time (a 64-token prompt at
batch 1 on Qwen3.5 shapes: 16 ms of host time for 1.9 ms of GPU work). A
:class:`PromptGraph` holds one shape, ``B`` requests in ``N`` token rows, and replays the
whole pass (embedding, every layer, the last tokens' logits, the KV lengths) from buffers
the host fills with one asynchronous copy.

Layout of a pass: the requests' prompt tokens packed in request order, then the ``N - n``
padding tokens, which form one more request with slot ``-1`` (the batch's index contract
wants every token in a request, of at least one token; the strategy's kernels give
padding requests zero outputs and leave every state alone). Shapes of several requests
always have one (``N > n``); a request alone that fills its shape (``n = N``, a prompt of
a power-of-two length, say) has its own shape without, so that it pays no padding. GDN layers of several requests run the strategy's
exact :meth:`~replayssm.strategies.Strategy.prefill` (the recurrence, graph-safe); those
of one request the chunked kernel when the engine has one
(:meth:`~replayssm.strategies.Strategy.chunk_prefill_static`: the whole pass as one
sequence, the padding tokens' gates zero, so no offsets are read on the host). Attention
layers run the fresh-request attention of
:func:`~replayssm.engine.kv_cache.cached_attention` over a padded ``[B + 1, N - B]``
layout (one request: its own row, the padding after it, which a causal mask keeps from
every real query). Padding tokens write their keys and values into the cache's sink slot.

:class:`PromptGraphs` picks the shape of a pass (``B`` exact, ``N`` a power of two up to
512, then a multiple of 256: above the pass's tokens, or from them for one request) and
captures it at its first use.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch

from .adapter import HybridEngine, StepOutput
from .graph_step import capture_graph
from .kv_cache import PromptLayout

#: The smallest token capacity of a prompt shape (shorter passes share it).
MIN_TOKENS = 32
#: Capacities above 512 tokens are multiples of this (a power of two would pad a long
#: prompt's token-wise layers by up to 2x).
LONG_STEP = 256


class _Meta:
    """The fields of a pass's metadata, views of ``buf`` (the device tensor or the host
    array that fills it): token ids ``[N]``; per token its attention row, column,
    position and cache slot ``[4, N]``; per request its last token, cache slot and
    length ``[B]`` each; the batch's slots ``[R]`` and offsets ``[R + 1]`` (``R`` rows:
    the requests, then the padding request if any)."""

    def __init__(self, buf, n: int, b: int, rows: int):
        o = 5 * n
        self.ids, self.index = buf[:n], buf[n:o].reshape(4, n)
        self.last, self.kv_rows, self.kv_lengths = buf[o : o + b], buf[o + b : o + 2 * b], buf[o + 2 * b : o + 3 * b]
        self.slots, self.offsets = buf[o + 3 * b : o + 3 * b + rows], buf[o + 3 * b + rows : o + 3 * b + 2 * rows + 1]

    @staticmethod
    def size(n: int, b: int, rows: int) -> int:
        return 5 * n + 3 * b + 2 * rows + 1


class PromptGraph:
    """One prompt-pass shape: ``requests`` fresh requests with fewer than ``tokens``
    prompt tokens in all (``padded``), or one request of exactly ``tokens``.

    Args:
        engine: the engine whose states, KV cache and strategy the pass advances.
        requests: ``B``, the pass's requests (exactly).
        tokens: ``N``, the token rows (``B < N``; a request's own tokens stay within
            the engine's ``max_len``, padding tokens write at the sink's position 0).
        graph: capture a CUDA graph (CUDA only); else :meth:`run` runs the body eagerly
            (the CPU path, and what the graph is tested against).
        pool: a CUDA graph memory pool shared by the engine's prompt graphs.
        padded: the pass ends in a padding request; ``False`` (one request only): the
            request fills the ``N`` rows.
    """

    def __init__(self, engine: HybridEngine, requests: int, tokens: int, *, graph: bool, pool=None,
                 padded: bool = True):
        if padded and not 1 <= requests < tokens:
            raise ValueError(f"need 1 <= requests < tokens, got requests={requests}, tokens={tokens}")
        if not padded and (requests != 1 or tokens < 1):
            raise ValueError(f"a shape without padding is one request of >= 1 tokens, got requests={requests}, "
                             f"tokens={tokens}")
        if graph and engine.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA engine")
        self.engine, self.requests, self.tokens, self.padded = engine, requests, tokens, padded
        dev, b, n, sink = engine.device, requests, tokens, engine.kv.sink
        # Capture-time windows: every request padding, so warm-up and capture move no state.
        if padded:
            self.batch = engine.pool.batch([-1] * (b + 1), [1] * b + [n - b], prefill=True)
        else:
            self.batch = engine.pool.batch([-1], [n], prefill=True)
        # the pass's metadata (see _Meta), which the host fills and uploads in one copy
        rows = self.batch.size
        self.meta = torch.zeros(_Meta.size(n, b, rows), dtype=torch.int64, device=dev)
        m = self._fields = _Meta(self.meta, n, b, rows)
        m.index[3].fill_(sink)
        m.kv_rows.fill_(sink)
        m.slots.copy_(self.batch.slots)  # as captured: every row padding
        m.offsets.copy_(self.batch.cu_seqlens)
        self.layout = PromptLayout(1 if b == 1 else b + 1, n - b if b > 1 else n, m.index)
        # the host side of ``meta``, pinned, whose numpy view each pass fills (a few vector
        # operations: torch's per-call overhead cost ~0.1 ms a pass); the next pass
        # refills it once the copy is done
        self._host = torch.empty(self.meta.shape, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._host_fields = _Meta(self._host.numpy(), n, b, rows)
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        #: the chunked kernel of GDN layers (one request, an engine that has one), else the recurrence
        self.chunk_kernel = engine.chunk_kernel if b == 1 else None
        self.logits = self.hidden = None
        self.graph = None
        if graph:
            self._capture(pool)

    def run(self, slots: Sequence[int], windows: Sequence[Sequence[int]]) -> StepOutput:
        """Prefill ``windows`` (prompt tokens, checked by the caller: fresh, live,
        unique slots, token ids in range; fewer than ``tokens`` in all, or exactly
        ``tokens`` for a shape without padding) into ``slots``.

        Returns the eager pass's :class:`StepOutput` (last-token logits), in tensors of
        its own (the graph's buffers are copied out)."""
        eng, b, n = self.engine, self.requests, self.tokens
        lengths = [len(w) for w in windows]
        used = sum(lengths)
        if len(slots) != b or (used >= n if self.padded else used != n):
            room = f"fewer than {n}" if self.padded else f"exactly {n}"
            raise ValueError(f"this shape takes {b} requests of {room} tokens in all, got {len(slots)} "
                             f"requests of {used}")
        pad = n - used
        lens = np.fromiter(lengths, np.int64, b)
        ends = np.cumsum(lens)
        sl = np.fromiter(slots, np.int64, b)
        if self._copied is not None:
            self._copied.synchronize()  # the last pass's copy has left the pinned buffer
        h = self._host_fields
        row, col, pos, kv_slot = h.index
        h.ids[:used] = np.fromiter(itertools.chain.from_iterable(windows), np.int64, used)
        h.ids[used:] = 0
        row[:used] = np.repeat(np.arange(b), lens)
        col[:used] = np.arange(used) - np.repeat(ends - lens, lens)
        if b == 1:  # the padding follows the request in its own attention row
            row[used:] = 0
            col[used:] = np.arange(used, n)
        else:
            row[used:] = b
            col[used:] = np.arange(pad)
        pos[:used] = col[:used]
        pos[used:] = 0  # padding writes at the sink's first position (its rotary position does not matter)
        kv_slot[:used] = np.repeat(sl, lens)
        kv_slot[used:] = eng.kv.sink
        h.last[:] = ends - 1
        h.kv_rows[:], h.kv_lengths[:] = sl, lens
        h.slots[:b], h.offsets[0], h.offsets[1 : b + 1] = sl, 0, ends
        if self.padded:  # the padding request last
            h.slots[b], h.offsets[b + 1] = -1, n
            self.batch.set_windows(list(slots) + [-1], lengths + [pad], upload=False)
        else:
            self.batch.set_windows(slots, lengths, upload=False)
        self.meta.copy_(self._host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        eng.kv.advance_host(slots, lengths)
        return StepOutput(logits=self.logits.clone(), hidden=self.hidden[:used].clone(), lengths=lengths,
                          offsets=[0, *ends.tolist()])

    def _body(self) -> None:
        eng, m = self.engine, self._fields
        self.batch.load_windows(m.slots, m.offsets)
        positions = self.layout.positions
        self.logits, self.hidden = eng.forward_static(m.ids[None], positions[None], None, self.batch, verify=False,
                                                      prompt=self.layout, last=m.last,
                                                      chunk_kernel=self.chunk_kernel)
        kv_len = eng.kv.device_lengths
        kv_len[m.kv_rows] = m.kv_lengths  # fresh requests: the prompt is the whole history
        kv_len[eng.kv.sink:].zero_()

    def _capture(self, pool) -> None:
        # every request is padding while it warms up, so no state moves
        self.graph = capture_graph(self._body, self.engine.device, pool=pool)


class PromptGraphs:
    """The prompt shapes of one engine, each built (and on CUDA captured) at first use.

    A pass of ``B`` fresh requests with ``n`` prompt tokens in all takes the shape ``(B,
    N)`` with ``N > n`` (``N >= n`` for one request): the smallest power of two ``>=
    MIN_TOKENS`` up to 512, above that the smallest multiple of ``LONG_STEP``. Passes with
    ``N`` above the bound, and any pass with a request that holds tokens already (a
    prompt continued in chunks), run eagerly (:meth:`fits` says which).

    Args:
        engine: the engine.
        max_tokens: the largest token capacity of a shape of several requests (a power
            of two; their GDN layers run the token-serial recurrence).
        max_chunked_tokens: the same for one request when the engine has a chunked
            kernel (its GDN layers run that kernel).
        graph: capture CUDA graphs (default: on a CUDA engine).
    """

    def __init__(self, engine: HybridEngine, *, max_tokens: int = 512, max_chunked_tokens: int = 8192,
                 graph: bool | None = None):
        for name, v in (("max_tokens", max_tokens), ("max_chunked_tokens", max_chunked_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < MIN_TOKENS or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_TOKENS}, got {v!r}")
        self.engine = engine
        self.max_tokens = max_tokens
        self.max_chunked_tokens = max_chunked_tokens if engine.chunk_kernel else max_tokens
        self.graph = engine.device.type == "cuda" if graph is None else bool(graph)
        self._shapes: dict[tuple[int, int], PromptGraph] = {}
        self._pool = None

    def shape(self, num_tokens: int, requests: int = 1) -> int | None:
        """The token capacity ``N`` of a pass of ``num_tokens`` tokens of ``requests``
        requests (``None``: it runs eagerly)."""
        key = self.key(num_tokens, requests)
        return None if key is None else key[1]

    def key(self, num_tokens: int, requests: int = 1) -> tuple[int, int, bool] | None:
        """``(B, N, padded)``: the shape of such a pass (``None``: it runs eagerly)."""
        if num_tokens < 1 or not 1 <= requests <= num_tokens:
            return None
        below = num_tokens - 1 if requests == 1 else num_tokens  # the capacity must exceed this
        if below < 512:
            n = max(MIN_TOKENS, 1 << below.bit_length())  # the smallest power of two > below
        else:
            n = (below // LONG_STEP + 1) * LONG_STEP
        if n > (self.max_chunked_tokens if requests == 1 else self.max_tokens):
            return None
        return requests, n, n > num_tokens

    def fits(self, slots: Sequence[int], windows: Sequence[Sequence[int]]) -> bool:
        """Whether a prompt pass of ``windows`` into ``slots`` runs as a static shape:
        every request fresh (no committed token) and the tokens within the bound."""
        kv = self.engine.kv
        if not slots or any(not 0 <= s < kv.num_slots or kv.lengths[s] for s in slots):
            return False
        return self.shape(sum(len(w) for w in windows), len(slots)) is not None

    @torch.inference_mode()
    def prepare(self, requests: int, num_tokens: int) -> PromptGraph | None:
        """The shape of a pass of ``requests`` requests and ``num_tokens`` tokens, built
        (and captured) now if it was not; ``None`` if such a pass runs eagerly. A
        benchmark calls this before timing, so no capture lands inside a timed run."""
        key = self.key(num_tokens, requests)
        if key is None:
            return None
        if key not in self._shapes:
            if self.graph and self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            self._shapes[key] = PromptGraph(self.engine, requests, key[1], graph=self.graph, pool=self._pool,
                                            padded=key[2])
        return self._shapes[key]

    def prepare_joins(self, most: int, lo: int, hi: int) -> None:
        """:meth:`prepare` every shape a pass of ``1..most`` fresh requests whose prompts
        are ``lo..hi`` tokens each can take: the passes of requests joining a running
        batch as slots free up, built before a timed run."""
        for k in range(1, most + 1):
            top = min(k * hi, self.max_chunked_tokens if k == 1 else self.max_tokens)
            if k > 1 and k * lo > top:  # every pass of k or more such requests runs eagerly
                break
            shapes = {self.key(n, k): n for n in range(k * lo, top + 1)}
            shapes.pop(None, None)
            for n in shapes.values():
                self.prepare(k, n)

    @torch.inference_mode()  # as the eager pass: no autograd record inside a capture
    def run(self, slots: Sequence[int], windows: Sequence[Sequence[int]]) -> StepOutput:
        """The pass through its shape's :class:`PromptGraph` (``fits`` must hold)."""
        return self.prepare(len(slots), sum(len(w) for w in windows)).run(slots, windows)
