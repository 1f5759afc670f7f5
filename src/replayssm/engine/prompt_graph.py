"""Prompt passes of fresh requests at static shapes, each shape captured once in a CUDA graph.

An eager prompt pass launches every layer's kernels from Python and builds its index
tensors on the host, so a short prompt costs host time, not GPU time (a 64-token prompt at
batch 1 on Qwen3.5 shapes: 16 ms of host time for 1.9 ms of GPU work); with several
requests, fla-core's varlen kernel also derives its chunk list on the host. A
:class:`PromptGraph` holds one shape, ``B`` requests in ``N`` token rows, and replays the
whole pass (embedding, every layer, the last tokens' logits, the KV lengths) from buffers
the host fills with one asynchronous copy.

Layout of a pass: the requests' prompt tokens packed in request order, then the ``N - n``
padding tokens, which form one more request with slot ``-1`` (the batch's index contract
wants every token in a request, of at least one token; the strategy's kernels give
padding requests zero outputs and leave every state alone). Shapes of several requests
always have one (``N > n``); a request alone that fills its shape (``n = N``, a prompt of
a power-of-two length, say) has its own shape without, so that it pays no padding.
Token-wise layers (projections, norms, MLP or MoE) run on the ``N`` packed rows. GDN
layers, when the engine has a chunked kernel, run it through
:meth:`~replayssm.strategies.Strategy.chunk_prefill_static`, with no offsets read on the
host:

* one request: the whole pass as one sequence ``[1, N]``, the padding tokens' gates zero;
* ``B`` requests: the packed tokens as ``B + 2`` sequences (the requests, the padding
  request, an empty one), with the pass's chunk list in the metadata at a length fixed
  by the shape (:func:`~replayssm.strategies.chunk_list`): the list's spare entries
  name the empty sequence, on which the kernel computes nothing, so its grids are the
  shape's and it computes the real tokens only (no gather into a padded layout).

Without a chunked kernel, GDN layers of several requests run the strategy's exact
:meth:`~replayssm.strategies.Strategy.prefill` (the recurrence, graph-safe). Attention
layers (:func:`~replayssm.engine.adapter.prompt_attention_forward`: queries and keys
normed into one buffer and rotated there, as a decode step's) run the fresh-request
attention of :func:`~replayssm.engine.kv_cache.cached_attention` over a padded ``[B + 1,
T]`` layout
(each request a row, the padding request the last; ``T = N - B`` without ``C``, else
``min(N - B, max(C, LONG_STEP))``, since the padding request holds at most
``LONG_STEP`` tokens: over ``[B + 1, N - B]``, ``B`` prompts of one length would cost
about ``B (B + 1)`` times their own causal attention, 272x at 16 x 2048; ``T`` also
bounds the causal conv's launch). One request: its own row, the padding after it, which
a causal mask keeps from every real query. Padding tokens write their keys and values
into the cache's sink slot.

:class:`PromptGraphs` picks the shape of a pass (``B`` exact; ``N`` and ``C`` a power of
two from ``MIN_TOKENS`` up to 512, then a multiple of ``LONG_STEP``: ``N`` above the
pass's tokens, or from them for one request, ``C`` from the longest prompt) and captures
it at its first use.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np
import torch

from .adapter import HybridEngine, StepOutput
from .graph_step import capture_graph
from .kv_cache import PromptLayout
from ..strategies import chunk_list, chunk_list_length

#: The smallest token capacity of a prompt shape (shorter passes share it).
MIN_TOKENS = 32
#: Capacities above 512 tokens are multiples of this (a power of two would pad a long
#: prompt's token-wise layers by up to 2x).
LONG_STEP = 256
#: Prompt heads whose shapes an engine keeps (:meth:`PromptGraphs.set_head`): a new head
#: past these drops the shapes of the head least recently set (and with them what their
#: graphs hold, the head and its drafter's buffers among it).
MAX_HEADS = 4
#: The default largest capacity of shapes through the chunked kernel: 16 prompts of 2048
#: tokens and the padding request that every shape of several requests has.
CHUNKED_TOKENS = 16 * 2048 + LONG_STEP


def capacity(n: int) -> int:
    """The smallest shape capacity ``>= n`` (``n >= 1``): a power of two from
    ``MIN_TOKENS`` up to 512, above that a multiple of ``LONG_STEP``."""
    if n <= 512:
        return max(MIN_TOKENS, 1 << (n - 1).bit_length())
    return -(-n // LONG_STEP) * LONG_STEP


def _previous_capacity(c: int) -> int:
    """The largest capacity below the capacity ``c`` (0 below ``MIN_TOKENS``)."""
    if c <= MIN_TOKENS:
        return 0
    return c // 2 if c <= 512 else c - LONG_STEP


class PromptShape(NamedTuple):
    """A prompt pass's static shape (:meth:`PromptGraphs.key`)."""

    #: ``B``, the pass's requests (exactly)
    requests: int
    #: ``N``, the packed token rows
    tokens: int
    #: ``C``, the longest prompt's capacity in a pass of several requests through the
    #: chunked kernel (the attention layout's width follows it); ``None``: one request,
    #: or the recurrence
    capacity: int | None
    #: the pass ends in a padding request (``False`` only for a request that fills ``N``)
    padded: bool


class _Meta:
    """The fields of a pass's metadata, views of ``buf`` (the device tensor or the host
    array that fills it): token ids ``[N]``; per token its attention row, column,
    position and cache slot ``[4, N]``; per request its last token, cache slot and
    length ``[B]`` each; the batch's slots ``[R]`` and offsets ``[R + 1]`` (``R`` rows:
    the requests, then the padding request if any); with a capacity, the chunked
    kernel's offsets ``[R + 2]`` (the batch's, then ``N`` again: they begin where the
    batch's do) and its chunk list ``[M, 2]`` (:func:`~replayssm.strategies.chunk_list`,
    ``M`` its fixed length)."""

    def __init__(self, buf, n: int, b: int, rows: int, capacity: int = 0):
        o = 5 * n
        self.ids, self.index = buf[:n], buf[n:o].reshape(4, n)
        self.last, self.kv_rows, self.kv_lengths = buf[o : o + b], buf[o + b : o + 2 * b], buf[o + 2 * b : o + 3 * b]
        o += 3 * b
        self.slots, self.offsets = buf[o : o + rows], buf[o + rows : o + 2 * rows + 1]
        o += rows
        m = chunk_list_length(n, rows) if capacity else 0
        self.chunk_offsets = buf[o : o + rows + 2] if capacity else None
        o += rows + 2
        self.chunk_indices = buf[o : o + 2 * m].reshape(m, 2)

    @staticmethod
    def size(n: int, b: int, rows: int, capacity: int = 0) -> int:
        return 5 * n + 3 * b + 2 * rows + 2 + (2 * chunk_list_length(n, rows) if capacity else 0)


def output_buffers(engine: HybridEngine, requests: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for the outputs of prompt passes of up to ``requests`` requests in
    ``tokens`` rows: ``(logits [requests, vocab] float32, hidden [tokens, hidden])`` in
    the model's dtype, on the engine's device."""
    return (torch.empty(requests, engine.vocab_size, dtype=torch.float32, device=engine.device),
            torch.empty(tokens, engine.embed.weight.shape[1], dtype=engine.dtype, device=engine.device))


def _spread(total: int, rows: int, width: int) -> list[int]:
    """``rows`` lengths in ``1..width`` that sum to ``total``, the first ones filled to
    ``width`` (so that the longest is ``width`` when ``total >= rows - 1 + width``)."""
    out, left = [1] * rows, total - rows
    for i in range(rows):
        add = min(left, width - 1)
        out[i] += add
        left -= add
    if left:
        raise ValueError(f"{rows} rows of at most {width} tokens cannot hold {total}")
    return out


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
        capacity: ``C``, for ``B >= 2`` requests on an engine with a chunked kernel:
            its GDN layers run the kernel on the packed tokens with a chunk list, each
            request of at most ``C`` tokens and the padding request of at most ``T =
            min(N - B, max(C, LONG_STEP))``. ``None``: several requests' GDN layers run
            the recurrence; one request's the chunked kernel over all ``N`` rows when
            the engine has one.
        outputs: ``(logits [>= B, vocab] float32, hidden [>= N, hidden])`` in the
            model's dtype, buffers outside every graph's memory pool that the pass
            writes its outputs into (:class:`PromptGraphs` shares one pair among an
            engine's shapes, which run one at a time); default: its own.
        head: a prompt head run at the end of the pass, inside its graph
            (:meth:`~replayssm.engine.adapter.HybridEngine.set_prompt_head`), or ``None``.
    """

    def __init__(self, engine: HybridEngine, requests: int, tokens: int, *, graph: bool, pool=None,
                 padded: bool = True, capacity: int | None = None,
                 outputs: tuple[torch.Tensor, torch.Tensor] | None = None, head=None):
        if padded and not 1 <= requests < tokens:
            raise ValueError(f"need 1 <= requests < tokens, got requests={requests}, tokens={tokens}")
        if not padded and (requests != 1 or tokens < 1):
            raise ValueError(f"a shape without padding is one request of >= 1 tokens, got requests={requests}, "
                             f"tokens={tokens}")
        if capacity is not None:
            if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
                raise ValueError(f"capacity must be None or an int >= 1, got {capacity!r}")
            if requests < 2 or not padded:
                raise ValueError(f"capacity is for shapes of several requests (with padding), got "
                                 f"requests={requests}, padded={padded}")
            if engine.chunk_kernel is None:
                raise ValueError("capacity needs an engine with a chunked kernel (prefill='chunk' or fla-core)")
        if graph and engine.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA engine")
        if outputs is not None and (outputs[0].shape[0] < requests or outputs[1].shape[0] < tokens):
            raise ValueError(f"outputs hold {outputs[0].shape[0]} requests' logits and {outputs[1].shape[0]} rows' "
                             f"hidden states, this shape needs {requests} and {tokens}")
        self.engine, self.requests, self.tokens, self.padded = engine, requests, tokens, padded
        self.capacity = capacity
        self.head = head
        dev, b, n, sink = engine.device, requests, tokens, engine.kv.sink
        #: the longest a row of the batch may be: its requests' and its padding's bound
        #: (the conv's launch bound and the attention layout's columns)
        self.width = n if b == 1 else n - b if capacity is None else min(n - b, max(capacity, LONG_STEP))
        if capacity is not None and b * capacity + self.width < n:
            raise ValueError(f"capacity={capacity}: {b} requests of at most {capacity} tokens and at most "
                             f"{self.width} padding tokens cannot fill {n} rows")
        # Capture-time windows: every request padding, so warm-up and capture move no state.
        if not padded:
            self.batch = engine.pool.batch([-1], [n], prefill=True)
        elif capacity is None:
            self.batch = engine.pool.batch([-1] * (b + 1), [1] * b + [n - b], prefill=True)
        else:
            self.batch = engine.pool.batch([-1] * (b + 1), _spread(n, b + 1, self.width), prefill=True)
        # the pass's metadata (see _Meta), which the host fills and uploads in one copy
        rows, c = self.batch.size, capacity or 0
        self.meta = torch.zeros(_Meta.size(n, b, rows, c), dtype=torch.int64, device=dev)
        m = self._fields = _Meta(self.meta, n, b, rows, c)
        m.index[3].fill_(sink)
        m.kv_rows.fill_(sink)
        m.slots.copy_(self.batch.slots)  # as captured: every row padding
        m.offsets.copy_(self.batch.cu_seqlens)
        if capacity is not None:  # the capture's padding rows as a chunk list (the warm-ups run the kernel)
            cu, chunks = chunk_list(self.batch.lengths, m.chunk_indices.shape[0])
            m.chunk_offsets.copy_(torch.from_numpy(cu))
            m.chunk_indices.copy_(torch.from_numpy(chunks))
        self.layout = PromptLayout(1 if b == 1 else b + 1, self.width, m.index)
        # the host side of ``meta``, pinned, whose numpy view each pass fills (a few vector
        # operations: torch's per-call overhead cost ~0.1 ms a pass); the next pass
        # refills it once the copy is done
        self._host = torch.empty(self.meta.shape, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._host_fields = _Meta(self._host.numpy(), n, b, rows, c)
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        #: the chunked kernel of GDN layers (one request, or a capacity, on an engine
        #: that has one), else ``None``: the recurrence
        self.chunk_kernel = engine.chunk_kernel if b == 1 or capacity is not None else None
        if outputs is None:
            outputs = output_buffers(engine, b, n)
        #: the requests' last-token logits ``[B, vocab]`` and every row's hidden state
        #: ``[N, hidden]``, views of ``outputs``
        self.logits, self.hidden = outputs[0][:b], outputs[1][:n]
        self.graph = None
        if graph:
            self._capture(pool)

    def run(self, slots: Sequence[int], windows: Sequence[Sequence[int]], *,
            ids: np.ndarray | None = None) -> StepOutput:
        """Prefill ``windows`` (prompt tokens, checked by the caller: fresh, live,
        unique slots, token ids in range; fewer than ``tokens`` in all, or exactly
        ``tokens`` for a shape without padding; with a capacity, each prompt at most
        ``capacity`` tokens and the padding at most :attr:`width`) into ``slots``.
        ``ids``: the windows' token ids already packed in one int64 array (the engine's
        checks build it), else packed here.

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
        if self.capacity is not None and (max(lengths) > self.capacity or pad > self.width):
            raise ValueError(f"this shape takes prompts of at most {self.capacity} tokens and at most "
                             f"{self.width} padding tokens, got a prompt of {max(lengths)} and {pad} padding")
        if ids is not None and (not isinstance(ids, np.ndarray) or ids.shape != (used,)):
            raise ValueError(f"ids must be the windows' {used} token ids packed in one array, got "
                             f"{getattr(ids, 'shape', type(ids).__name__)}")
        lens = np.fromiter(lengths, np.int64, b)
        ends = np.cumsum(lens)
        sl = np.fromiter(slots, np.int64, b)
        if self._copied is not None:
            self._copied.synchronize()  # the last pass's copy has left the pinned buffer
        h = self._host_fields
        row, col, pos, kv_slot = h.index
        h.ids[:used] = ids if ids is not None else np.fromiter(itertools.chain.from_iterable(windows), np.int64, used)
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
        if self.capacity is not None:
            # the chunked kernel's offsets begin where the batch's do: only the empty
            # sequence's entry and the chunk list are its own
            h.chunk_offsets[-1] = n
            h.chunk_indices[:] = chunk_list(np.append(lens, pad), h.chunk_indices.shape[0])[1]
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
                          offsets=[0, *ends.tolist()], prompt_head=self.head)

    def _body(self) -> None:
        eng, m = self.engine, self._fields
        self.batch.load_windows(m.slots, m.offsets)
        positions = self.layout.positions
        chunks = None if self.capacity is None else (m.chunk_offsets, m.chunk_indices)
        logits, hidden = eng.forward_static(m.ids[None], positions[None], None, self.batch, verify=False,
                                            prompt=self.layout, last=m.last, chunk_kernel=self.chunk_kernel,
                                            chunks=chunks)
        # into buffers outside the pool: the pass's own outputs die with the capture, so
        # their memory goes back to the pool for the next shape
        self.logits.copy_(logits)
        self.hidden.copy_(hidden)
        kv_len = eng.kv.device_lengths
        kv_len[m.kv_rows] = m.kv_lengths  # fresh requests: the prompt is the whole history
        kv_len[eng.kv.sink:].zero_()
        if self.head is not None:
            self.head(self.layout, m.ids, self.hidden, m.kv_rows, m.kv_lengths)

    def _capture(self, pool) -> None:
        # every request is padding while it warms up, so no state moves
        self.graph = capture_graph(self._body, self.engine.device, pool=pool)


class PromptGraphs:
    """The prompt shapes of one engine, each built (and on CUDA captured) at first use.

    A pass of ``B`` fresh requests with ``n`` prompt tokens in all, the longest of
    ``L``, takes the shape :class:`PromptShape` ``(B, N, C, padded)`` (:meth:`key`):

    * ``N = capacity(n + 1) > n`` (:func:`capacity`: a power of two ``>= MIN_TOKENS`` up
      to 512, above that a multiple of ``LONG_STEP``), or ``capacity(n)`` for one
      request (``n = N``: a shape without padding);
    * on an engine with a chunked kernel, several requests: ``C = capacity(L)`` while
      ``N`` and ``B C`` (about the attention layout's rows) are both within
      ``max_chunked_tokens``; past that, or without a chunked kernel, ``C = None`` (the
      recurrence) while ``N`` is within ``max_tokens``;
    * one request: ``C = None``, ``N`` within ``max_chunked_tokens`` (with a chunked
      kernel) or ``max_tokens``.

    Passes that take no shape, and any pass with a request that holds tokens already (a
    prompt continued in chunks), run eagerly (:meth:`fits` says which; the engine counts
    both in :attr:`~replayssm.engine.adapter.HybridEngine.prompt_passes`).

    A prompt head (:meth:`set_head`: a drafter's work on the prompt, such as the MTP
    head's keys and values) runs at the end of every static pass, inside its graph;
    shapes are built per head.

    What a shape costs. Its capture allocates, in the one memory pool the engine's
    prompt graphs share, the pass's intermediate tensors at their peak, which scale
    with ``N`` for the token-wise layers (the widest: a dense MLP's ``gate|up`` output
    ``[N, 2 I]``, an MoE block's expert inputs ``[N top_k, hidden]``), with the chunk
    list's length ``M <= N / 64 + B + 1`` for the chunked kernel's per-chunk states
    (``M`` of ``HV x K x V``) and with ``B C`` for the attention layout. At ``N =
    33024``, ``M = 532`` on ``bench e2e --random qwen3.5-shapes`` (bf16, hidden 2048,
    ``I = 4096``, ``HV = 32``, ``K = V = 128``; sizes from the shapes, not measured):
    0.54 GB for ``gate|up``, 0.56 GB for fla-core's chunk states. The shapes replay one at a time,
    so the pool serves them at about the largest one's peak when the largest is
    captured first (a capture that finds no free block large enough adds segments to
    the pool, so shapes captured in growing order add up): :meth:`prepare_joins` builds
    the largest first. The outputs go to one pair of buffers the shapes share
    (``logits [num_slots, vocab]`` fp32 and ``hidden [R, hidden]``, ``R`` the largest
    ``N`` the engine's slots can fill: 135 MB at ``R = 33024`` with 2048 hidden in
    bf16), so a shape keeps only its metadata (``5 N + 5 B + 4`` int64, plus ``2 M``
    with a capacity, and a pinned host copy) and its graph. Its capture runs the pass
    three times (two warm-ups, then the capture).

    How many shapes: ``B`` is exact and ``N``, ``C`` are bucketed, so passes of the
    same number of prompts of about the same lengths share a shape (16 prompts of 2048
    tokens: one). A pass of a new ``(B, N, C)`` is captured at its first use; traffic
    of many request counts and widely spread lengths meets many shapes
    (:meth:`join_shapes` counts them for joins).

    Args:
        engine: the engine.
        max_tokens: the largest token capacity of a shape whose GDN layers run the
            token-serial recurrence (a power of two): several requests without a
            chunked kernel (or beyond ``max_chunked_tokens``), and one request
            without one.
        max_chunked_tokens: the largest ``N``, and the largest ``B C``, of a shape
            through the chunked kernel (a capacity, :func:`capacity`; default 16
            prompts of 2048 tokens and their padding). Ignored without a chunked
            kernel.
        graph: capture CUDA graphs (default: on a CUDA engine).
    """

    def __init__(self, engine: HybridEngine, *, max_tokens: int = 512, max_chunked_tokens: int = CHUNKED_TOKENS,
                 graph: bool | None = None):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < MIN_TOKENS \
                or max_tokens & (max_tokens - 1):
            raise ValueError(f"max_tokens must be a power of two >= {MIN_TOKENS}, got {max_tokens!r}")
        if (isinstance(max_chunked_tokens, bool) or not isinstance(max_chunked_tokens, int)
                or max_chunked_tokens < MIN_TOKENS or capacity(max_chunked_tokens) != max_chunked_tokens):
            raise ValueError(f"max_chunked_tokens must be a shape capacity (a power of two from {MIN_TOKENS} to 512, "
                             f"or a multiple of {LONG_STEP} above), got {max_chunked_tokens!r}")
        self.engine = engine
        self.max_tokens = max_tokens
        self.max_chunked_tokens = max_chunked_tokens if engine.chunk_kernel else max_tokens
        self.graph = engine.device.type == "cuda" if graph is None else bool(graph)
        #: built shapes per prompt head (:meth:`set_head`), and the current head's
        self._by_head: dict[object, dict[PromptShape, PromptGraph]] = {None: {}}
        self._shapes = self._by_head[None]
        #: the prompt head every pass runs now (``None``: none)
        self.head = None
        self._pool = None
        #: the shapes' shared outputs, for the largest pass the engine's slots can hold
        #: (allocated with the first shape)
        self._outputs = None
        #: Whether a pass of a shape not built yet builds (captures) it now. ``False``:
        #: such passes run eagerly (:meth:`fits` says no), so that a timed run holds no
        #: capture; a benchmark sets it after :meth:`prepare` / :meth:`prepare_joins`.
        self.capture_new = True

    def set_head(self, head) -> None:
        """The prompt head the next passes run
        (:meth:`~replayssm.engine.adapter.HybridEngine.set_prompt_head`). Shapes are
        built per head: a shape built for another head is kept for it, and a pass under
        this one builds its own (or, while :attr:`capture_new` is off, runs eagerly). The
        shapes of at most :data:`MAX_HEADS` heads are kept."""
        shapes = self._by_head.pop(head, None)  # re-inserted last: the most recently set
        if shapes is None:
            while len(self._by_head) >= MAX_HEADS:
                del self._by_head[next(iter(self._by_head))]
            shapes = {}
        self._by_head[head] = shapes
        self.head, self._shapes = head, shapes

    def shape(self, num_tokens: int, requests: int = 1, longest: int | None = None) -> int | None:
        """The token capacity ``N`` of a pass of ``num_tokens`` tokens of ``requests``
        requests, the longest of ``longest`` (``None``: it runs eagerly)."""
        key = self.key(num_tokens, requests, longest)
        return None if key is None else key.tokens

    def key(self, num_tokens: int, requests: int = 1, longest: int | None = None) -> PromptShape | None:
        """The shape of such a pass (``None``: it runs eagerly).

        ``longest``, the pass's longest prompt, is needed for several requests on an
        engine with a chunked kernel (it sets ``C``); a ``ValueError`` names it when it
        is missing or no such pass has it."""
        if num_tokens < 1 or not 1 <= requests <= num_tokens:
            return None
        if requests == 1:
            if longest is not None and longest != num_tokens:
                raise ValueError(f"longest must be the pass's tokens for one request, got longest={longest}, "
                                 f"num_tokens={num_tokens}")
            n = capacity(num_tokens)
            if n > (self.max_chunked_tokens if self.engine.chunk_kernel else self.max_tokens):
                return None
            return PromptShape(1, n, None, n > num_tokens)
        n = capacity(num_tokens + 1)  # several requests: a padding request of >= 1 token
        if self.engine.chunk_kernel is not None:
            if longest is None:
                raise ValueError("longest (the pass's longest prompt) is needed for a pass of several requests on an "
                                 "engine with a chunked kernel")
            if not -(-num_tokens // requests) <= longest <= num_tokens - (requests - 1):
                raise ValueError(f"no pass of {requests} requests of {num_tokens} tokens has a longest prompt of "
                                 f"{longest}")
            c = capacity(longest)
            if n <= self.max_chunked_tokens and requests * c <= self.max_chunked_tokens:
                return PromptShape(requests, n, c, True)
        return PromptShape(requests, n, None, True) if n <= self.max_tokens else None

    def fits(self, slots: Sequence[int], windows: Sequence[Sequence[int]]) -> bool:
        """Whether a prompt pass of ``windows`` into ``slots`` runs as a static shape:
        every request fresh (no committed token) and the tokens within the bounds."""
        kv = self.engine.kv
        if not slots or any(not 0 <= s < kv.num_slots or kv.lengths[s] for s in slots):
            return False
        lengths = [len(w) for w in windows]
        key = self.key(sum(lengths), len(slots), max(lengths))
        return key is not None and (self.capture_new or key in self._shapes)

    def prepare(self, requests: int, num_tokens: int, longest: int | None = None) -> PromptGraph | None:
        """The shape of a pass of ``requests`` requests and ``num_tokens`` tokens, the
        longest prompt of ``longest`` (see :meth:`key`), built (and captured) now if it
        was not; ``None`` if such a pass runs eagerly. A benchmark calls this before
        timing, so no capture lands inside a timed run."""
        key = self.key(num_tokens, requests, longest)
        return None if key is None else self._build(key)

    @torch.inference_mode()  # as the eager pass: no autograd record inside a capture
    def _build(self, key: PromptShape) -> PromptGraph:
        if key not in self._shapes:
            eng = self.engine
            if self.graph and self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            if self._outputs is None:
                slots = eng.kv.num_slots
                rows = min(max(self.max_tokens, self.max_chunked_tokens), capacity(slots * eng.max_len + 1))
                self._outputs = output_buffers(eng, slots, rows)
            fits = key.requests <= self._outputs[0].shape[0] and key.tokens <= self._outputs[1].shape[0]
            # a shape past the largest pass of the engine's slots (built on request only) gets its own
            self._shapes[key] = PromptGraph(eng, key.requests, key.tokens, graph=self.graph, pool=self._pool,
                                            padded=key.padded, capacity=key.capacity,
                                            outputs=self._outputs if fits else None, head=self.head)
        return self._shapes[key]

    def join_shapes(self, most: int, lo: int, hi: int) -> set[PromptShape]:
        """Every shape a pass of ``1..most`` fresh requests whose prompts are ``lo..hi``
        tokens each can take (``1 <= lo <= hi``).

        How many: for ``k`` requests, one per ``N`` bucket of ``k lo .. k hi`` tokens
        and, through the chunked kernel, per ``C`` bucket of the longest prompts those
        passes can have. Prompts of one length (``lo = hi``) take one shape per ``k``:
        ``most`` shapes (16 at 16 prompts of 2048 tokens). A range takes about ``k (hi -
        lo) / LONG_STEP`` buckets of ``N`` times up to ``(hi - lo) / LONG_STEP`` of
        ``C`` per ``k`` above 512 tokens: thousands at ``most = 16`` and 512..4096
        tokens."""
        out = {self.key(n) for n in range(lo, min(hi, self.max_chunked_tokens) + 1)} if most >= 1 else set()
        top = max(self.max_tokens, self.max_chunked_tokens)
        for k in range(2, most + 1):
            if capacity(k * lo + 1) > top:  # every pass of k or more such requests runs eagerly
                break
            out |= self._join_shapes(k, lo, hi, top)
        out.discard(None)
        return out

    def _join_shapes(self, k: int, lo: int, hi: int, top: int) -> set[PromptShape | None]:
        """:meth:`join_shapes` of passes of exactly ``k >= 2`` requests, one pass per
        shape: per ``N`` bucket (its passes' tokens ``n in [a, b]``) and, with a chunked
        kernel, per bucket ``C`` of the longest prompts ``L``. A pass of ``k`` prompts
        of ``lo..hi`` tokens, ``n`` in all, can have ``L`` from ``max(lo, ceil(n / k))``
        to ``min(hi, n - (k - 1) lo)``; one with ``L`` in ``[c0, c1]`` has ``n`` from
        ``c0 + (k - 1) lo`` to ``k c1``."""
        out = set()
        n_bucket = capacity(k * lo + 1)
        while n_bucket <= top:
            a, b = max(k * lo, _previous_capacity(n_bucket)), min(k * hi, n_bucket - 1)
            if a > b:
                break
            if self.engine.chunk_kernel is None:
                out.add(self.key(a, k))
            else:
                l_lo, l_hi = max(lo, -(-a // k)), min(hi, b - (k - 1) * lo)
                c_bucket = capacity(l_lo)
                while True:
                    c0, c1 = max(l_lo, _previous_capacity(c_bucket) + 1), min(l_hi, c_bucket)
                    if c0 > c1:
                        break
                    n = max(a, c0 + (k - 1) * lo)
                    if n <= min(b, k * c1):
                        out.add(self.key(n, k, max(c0, -(-n // k))))
                    c_bucket = capacity(c_bucket + 1)
            n_bucket = capacity(n_bucket + 1)
        return out

    def prepare_joins(self, most: int, lo: int, hi: int, *, max_shapes: int = 512) -> None:
        """:meth:`prepare` every shape of :meth:`join_shapes`: the passes of requests
        joining a running batch as slots free up, built before a timed run, the largest
        first (see the class: the pool then holds about the largest one's peak).

        ``max_shapes``: raise ``ValueError`` (building nothing) if there are more (each
        capture runs a pass three times): a wide range of prompt lengths at a large
        ``most`` runs to thousands."""
        shapes = self.join_shapes(most, lo, hi)
        if len(shapes) > max_shapes:
            raise ValueError(f"joins of 1..{most} requests of {lo}..{hi} tokens take {len(shapes)} prompt shapes, more "
                             f"than max_shapes={max_shapes}")
        for key in sorted(shapes, key=lambda s: (s.tokens, s.requests * (s.capacity or 0), s.requests), reverse=True):
            self._build(key)

    @torch.inference_mode()  # as the eager pass: no autograd record inside a capture
    def run(self, slots: Sequence[int], windows: Sequence[Sequence[int]], *,
            ids: np.ndarray | None = None) -> StepOutput:
        """The pass through its shape's :class:`PromptGraph` (``fits`` must hold; ``ids``
        as :meth:`PromptGraph.run` takes them)."""
        lengths = [len(w) for w in windows]
        return self.prepare(len(slots), sum(lengths), max(lengths)).run(slots, windows, ids=ids)
