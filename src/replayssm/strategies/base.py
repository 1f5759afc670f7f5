"""The strategy interface: ``verify`` inside each GDN layer, ``commit`` once per step.

A step is: for every GDN layer, ``conv_verify`` (optional, the layer's causal conv) and
``verify`` (the window's outputs, no change to the committed state); then, after
sampling, one ``commit(batch, accepted)`` for all layers, or ``abort(batch)`` to drop
the step as if it never ran (a forward pass that failed halfway). Rejected tokens leave
no trace. Prefill and plain decoding use ``conv_prefill`` / ``prefill`` (or
``chunk_prefill`` with an external chunked kernel, or ``load_states``), which advance
the state. Strategies with a ring of committed records (``ring_decode``: ``circular``)
also decode plainly through it: a step of ``conv_verify`` and :meth:`Strategy.decode`
(one token per request) in every layer, then ``commit(batch)``; such steps mix freely
with speculative ones on the same requests.

Draft trees (DESIGN.md sections 2 and 3): a tree step is the same step with
:meth:`Strategy.conv_verify_tree` / :meth:`Strategy.verify_tree` in every layer and one
:meth:`Strategy.commit_tree` with the accepted node per request; the committed state
advances along that node's root path only.

Strategies build on :mod:`replayssm.state` (never the other way round): each declares
its buffers as :class:`~replayssm.state.BufferSpec` values and reads them back through
a frozen dataclass view (:class:`StrategyBuffers`), so buffers are typed attributes
instead of string keys shared across modules.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from ..ops import _checks, guards
from ..ops.conv import causal_conv_commit, causal_conv_verify, causal_conv_verify_tree, conv_ring_commit
from ..ops.checkpoints import write_checkpoints
from ..ops.prompt_gates import prompt_gates
from ..ops.recurrent import check_layer_inputs, gdn_recurrence
from ..ops.tree_ops import compact_path
from ..ops.trees import DeviceTrees, DraftTrees, accepted_paths
from ..state.batch import Batch
from ..state.layout import BufferSpec, StepProtocolError

if TYPE_CHECKING:
    from ..state.pool import StatePool

__all__ = ["KERNEL_CHUNK", "SavedStates", "StepProtocolError", "Strategy", "StrategyBuffers", "chunk_list",
           "chunk_list_length"]

#: The chunk length of fla-core's chunked kernel (``chunk_gated_delta_rule``'s default),
#: the unit of :func:`chunk_list`.
KERNEL_CHUNK = 64


def chunk_list_length(num_tokens: int, sequences: int) -> int:
    """The most chunks of :data:`KERNEL_CHUNK` tokens that ``sequences`` non-empty
    sequences of ``num_tokens`` tokens in all can have: each of length ``l`` has
    ``ceil(l / 64) <= (l + 63) / 64``, so ``(N + 63 S) // 64`` (the fixed length of a
    static pass's chunk list, :meth:`Strategy.chunk_prefill_static`)."""
    if num_tokens < sequences or sequences < 1:
        raise ValueError(f"need num_tokens >= sequences >= 1, got num_tokens={num_tokens}, sequences={sequences}")
    return (num_tokens + (KERNEL_CHUNK - 1) * sequences) // KERNEL_CHUNK


def chunk_list(lengths: Sequence[int], size: int) -> tuple[np.ndarray, np.ndarray]:
    """The offsets and chunk list of a static pass of several requests
    (:meth:`Strategy.chunk_prefill_static`'s ``chunks``), on the host.

    Args:
        lengths: the ``S`` sequences' token counts, each ``>= 1`` (the requests, then
            the padding request).
        size: the list's length ``M`` (:func:`chunk_list_length` of the pass's shape).

    Returns:
        ``cu_seqlens [S + 2]`` (the sequences' offsets, then ``N`` again: an empty
        sequence ``S``) and ``chunk_indices [M, 2]`` int64: the ``(sequence, chunk)`` of
        every chunk of :data:`KERNEL_CHUNK` tokens in order, then ``(S, 0)`` entries of
        the empty sequence up to ``M``.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.ndim != 1 or lens.size < 1 or (lens < 1).any():
        raise ValueError(f"lengths must be >= 1 tokens each, got {list(lengths)}")
    counts = -(-lens // KERNEL_CHUNK)
    total = int(counts.sum())
    if total > size:
        raise ValueError(f"sequences of {list(lengths)} tokens have {total} chunks, more than size={size}")
    ends = np.cumsum(lens)
    cu_seqlens = np.concatenate([[0], ends, ends[-1:]])
    chunks = np.empty((size, 2), dtype=np.int64)
    chunks[:total, 0] = np.repeat(np.arange(lens.size), counts)
    chunks[:total, 1] = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    chunks[total:] = (lens.size, 0)
    return cu_seqlens, chunks


@dataclass(frozen=True)
class StrategyBuffers:
    """Typed view of a strategy's buffers in the pool; subclasses list them as fields
    (each field's name is the name of its :class:`BufferSpec`)."""

    @classmethod
    def from_pool(cls, pool: "StatePool"):
        return cls(**{f.name: pool.buffers[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class SavedStates:
    """What :meth:`Strategy.save_states` returns: copies of the committed buffers of
    ``slots`` (per buffer name, slot axis in ``slots`` order), for the pool and the
    allocation generations they were taken from."""

    owner: int
    slots: tuple[int, ...]
    generations: tuple[int, ...]
    tensors: dict[str, torch.Tensor]


class Strategy:
    """How a :class:`~replayssm.state.StatePool` verifies draft windows and rolls back:
    the interface every strategy answers (``pool.strategy``), with the validation, the
    step bookkeeping and the causal conv shared here.

    A speculative step, for a :class:`~replayssm.state.Batch` from ``pool.batch``:
    in each GDN layer's forward, :meth:`conv_verify` then :meth:`verify` (outputs of
    every window position; the committed state is not changed); after sampling, one
    :meth:`commit` with the accepted count per request for all layers, or
    :meth:`abort`. Prompts and plain decoding go through :meth:`conv_prefill` and
    :meth:`prefill` (the exact recurrence, advancing the state); a strategy with
    :attr:`ring_decode` decodes plainly through its ring instead (:meth:`decode`, a step
    like a speculative one). :meth:`committed_state` reads a layer's committed states.
    Bad input raises before anything is written.

    Subclasses set :attr:`name`, :attr:`Buffers` and :meth:`buffer_specs`, implement
    :meth:`_verify`, :meth:`_commit_states` and, where the checkpoint alone is not the
    committed state, :meth:`committed_state` and :meth:`_abort_states`; a subclass with a
    new name registers with :func:`replayssm.state.register_strategy`.
    """

    name: str = ""
    #: whether verify outputs equal the recurrence's bit for bit
    exact_outputs: bool = True
    #: whether plain decoding can run through the strategy's ring of committed records
    #: (:meth:`decode`) instead of the recurrence (:meth:`prefill`)
    ring_decode: bool = False
    #: the typed view of the buffers that :meth:`buffer_specs` declares
    Buffers: type[StrategyBuffers] = StrategyBuffers

    def __init__(self, pool: "StatePool"):
        self.pool = pool
        self.buf = self.Buffers.from_pool(pool)
        self._step_batch: Batch | None = None
        self._step_trees: DraftTrees | None = None  # the open step's trees (None: a chain step)
        self._verified: set[int] = set()
        self._conv_verified: set[int] = set()
        self._checked_inputs: tuple | None = None  # see _check_inputs
        self._index_memo: tuple | None = None  # see _device_index

    # ------------------------------------------------------------------ config
    #: how many trailing axes of ``checkpoints`` its kernels need packed (3: each state
    #: ``[HV, V, K]``; any layer and slot strides), and why, if more
    checkpoint_packed: int = 3
    packed_reason: str = ""

    @classmethod
    def check_config(cls, *, window: int, ring_len: int, backend: str = "reference") -> None:
        """Raise ``ValueError`` if ``window`` / ``ring_len`` do not suit the strategy on
        ``backend`` (the concrete one, ``"reference"`` or ``"triton"``)."""

    @classmethod
    def buffer_specs(cls, pool) -> dict[str, BufferSpec]:
        """The extra buffers the strategy needs, by name (the fields of :attr:`Buffers`);
        ``pool`` is a :class:`~replayssm.state.layout.PoolConfig` (or the pool)."""
        return {}

    # ------------------------------------------------------------------ helpers
    @property
    def buffers(self):
        """Read-only name -> tensor view of every pool buffer (see ``pool.buffers``)."""
        return self.pool.buffers

    @property
    def step_open(self) -> bool:
        """Whether a step is open (verified or conv-verified, not yet committed/aborted)."""
        return self._step_batch is not None

    def _check_batch(self, batch: Batch, *, step: bool) -> None:
        if not isinstance(batch, Batch):
            raise TypeError(f"batch must be a Batch (from StatePool.batch), got {type(batch).__name__}")
        if batch.slots.device != self.pool.device:
            raise ValueError(f"batch is on {batch.slots.device}, the pool on {self.pool.device}")
        if step:
            if batch.max_len > self.pool.window:
                raise ValueError(f"batch windows reach {batch.max_len} tokens, the pool's window is {self.pool.window}")
            if self._step_batch is not None and batch is not self._step_batch:
                raise StepProtocolError("every layer of a step must use the same batch; commit or abort before a new one")
        elif self._step_batch is not None:
            busy = sorted(set(batch.live_slots) & self.pool.step_slots)
            if busy:
                raise StepProtocolError(f"slots {busy} belong to the open step: commit or abort it first")

    def _open_step(self, batch: Batch, trees: DraftTrees | None = None) -> None:
        """Called by a step's first verify / conv_verify after validation, before any
        write: from here until commit / abort the pool guards the batch's slots."""
        if self._step_batch is None:
            self.pool.check_errors(wait=False)
            self.pool.open_step(batch)
            self._step_batch = batch
            self._step_trees = trees

    def _check_step_kind(self, trees: DraftTrees | None) -> None:
        """Every layer of a step verifies the same way: all chains, or all the same trees."""
        if self._step_batch is None or trees is self._step_trees:
            return
        if trees is None:
            raise StepProtocolError("this step verifies draft trees: use verify_tree / conv_verify_tree / commit_tree")
        if self._step_trees is None:
            raise StepProtocolError("this step verifies chains: use verify / conv_verify / commit, or commit first")
        raise StepProtocolError("every layer of a tree step must use the same DraftTrees object")

    def _close_step(self) -> None:
        self._step_batch = None
        self._step_trees = None
        self._verified.clear()
        self._conv_verified.clear()
        self.pool.close_step()

    def _check_act_dtype(self, **named: torch.Tensor) -> None:
        want = self.pool.act_dtype
        for name, x in named.items():
            if x.dtype != want:
                raise TypeError(
                    f"{name} has dtype {str(x.dtype).replace('torch.', '')}, the pool's act_dtype is "
                    f"{str(want).replace('torch.', '')}"
                )

    def _check_inputs(self, layer: int, q, k, v, a, b, batch: Batch) -> None:
        """Validate a layer's inputs, once per step: every GDN layer of a step gets
        inputs of the same shapes, dtypes, strides and device, so a later layer whose
        inputs match the last validated ones (same batch) skips the checks."""
        self.pool.check_layer(layer)
        sig = (batch, batch.num_tokens) + tuple(
            (tuple(x.shape), tuple(x.stride()), x.dtype, x.device) if isinstance(x, torch.Tensor) else None
            for x in (q, k, v, a, b))
        if sig == self._checked_inputs:
            return
        self._check_inputs_now(layer, q, k, v, a, b, batch)
        self._checked_inputs = sig

    def _check_inputs_now(self, layer: int, q, k, v, a, b, batch: Batch) -> None:
        n, h, kd, hv, vd = check_layer_inputs(q, k, v, a, b, self.pool.params["A_log"][layer], self.pool.params["dt_bias"][layer])
        s = self.pool.shape
        for name, x, want in (("q", q, [n, s.num_heads, s.head_k_dim]), ("k", k, [n, s.num_heads, s.head_k_dim]),
                              ("v", v, [n, s.num_value_heads, s.head_v_dim])):
            _checks.shape(name, x, want)
        if n != batch.num_tokens:
            raise ValueError(f"inputs have {n} tokens, the batch {batch.num_tokens}")
        self._check_act_dtype(q=q, k=k, v=v, a=a, b=b)
        _checks.same_device(batch.slots, q=q)

    def _check_conv_input(self, layer: int, x) -> None:
        self.pool.check_layer(layer)
        _checks.tensor("x (mixed_qkv)", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("x (mixed_qkv)", x, [None, self.pool.shape.conv_dim])
        self._check_act_dtype(**{"x (mixed_qkv)": x})

    def _gates(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.pool.layer_params(layer)
        return p["A_log"], p["dt_bias"]

    # ------------------------------------------------------------------ conv
    def _conv_window(self, layer: int) -> dict:
        """Where a verify keeps the layer's window inputs for the commit: the pool's
        window buffer, or its conv ring at the slots' positions."""
        if self.pool.conv_ring:
            return {"ring_pos": self.pool.conv_pos}
        return {"window_buf": self.pool.conv_window[layer]}

    def _commit_conv(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """Keep the first ``accepted`` inputs of every window, all layers: move each
        ring's position past them, or shift them into the conv state."""
        pool = self.pool
        if pool.conv_ring:
            conv_ring_commit(pool.conv_pos, slots, accepted, backend=pool.backend)
        else:
            causal_conv_commit(pool.conv_state, pool.conv_window, slots, accepted, backend=pool.backend)

    def conv_verify(self, layer: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The layer's causal conv over the window, ``x [N, C] -> [N, C]``; the conv
        state advances only at :meth:`commit`."""
        self._check_batch(batch, step=True)
        self._check_conv_input(layer, x)
        self._check_step_kind(None)
        if layer in self._conv_verified:
            raise StepProtocolError(f"layer {layer}'s conv was already verified this step; commit first")
        p = self.pool.layer_params(layer)
        self._open_step(batch)
        y = causal_conv_verify(
            x, self.pool.conv_state[layer], p["conv_weight"], p["conv_bias"], batch.slots, batch.cu_seqlens,
            max_len=batch.max_len or None, backend=self.pool.backend, **self._conv_window(layer),
        )
        self._conv_verified.add(layer)
        return y

    def conv_prefill(self, layer: int, x: torch.Tensor, batch: Batch, *, parts: tuple[int, int, int] | None = None):
        """The layer's causal conv over prompt tokens, advancing the conv state:
        ``x [N, C] -> [N, C]``, or with ``parts = (C_q, C_k, C_v)`` three contiguous
        parts (:func:`~replayssm.ops.causal_conv_verify`'s ``parts``), as a chunked
        kernel wants ``q``, ``k`` and ``v``."""
        self._check_batch(batch, step=False)
        self._check_conv_input(layer, x)
        p = self.pool.layer_params(layer)
        return causal_conv_verify(
            x, self.pool.conv_state[layer], p["conv_weight"], p["conv_bias"], batch.slots, batch.cu_seqlens,
            update_state=True, max_len=batch.max_len or None, parts=parts, backend=self.pool.backend,
            ring_pos=self.pool.conv_pos,
        )

    # ------------------------------------------------------------------ state
    def verify(self, layer: int, q, k, v, a, b, batch: Batch) -> torch.Tensor:
        """Outputs of every window position, without changing the committed state.

        Args:
            layer: GDN layer index.
            q, k: ``[N, H, K]`` post-conv; v: ``[N, HV, V]``; a, b: ``[N, HV]`` raw gates;
                all in the pool's ``act_dtype``.
            batch: the step's :class:`Batch` (windows of ``1..window`` tokens).

        Returns:
            ``o``: ``[N, HV, V]`` in the dtype of ``v``; padding rows are zero.
        """
        self._check_batch(batch, step=True)
        self._check_inputs(layer, q, k, v, a, b, batch)
        self._check_step_kind(None)
        if layer in self._verified:
            raise StepProtocolError(f"layer {layer} was already verified this step; commit first")
        A_log, dt_bias = self._gates(layer)
        self._open_step(batch)
        o = self._verify(layer, q, k, v, a, b, A_log, dt_bias, batch)
        self._verified.add(layer)
        return o

    # ------------------------------------------------------------------ trees
    def _check_trees(self, batch: Batch, trees) -> None:
        """A tree step's batch: one request per tree, every window ``N = trees.max_nodes``
        tokens (node ``i`` of request ``b`` at row ``b * N + i``), ``N <= window``."""
        if not isinstance(trees, DraftTrees):
            raise TypeError(f"trees must be a DraftTrees, got {type(trees).__name__}")
        if trees.batch != batch.size:
            raise ValueError(f"trees.batch = {trees.batch} must equal the batch's {batch.size} requests")
        nn = trees.max_nodes
        if any(n != nn for n in batch.lengths):
            raise ValueError(
                f"batch: every window of a tree step must hold trees.max_nodes = {nn} tokens (node i of request b at "
                f"row b * {nn} + i; padded nodes included), got {sorted(set(batch.lengths))}"
            )
        self._check_step_kind(trees)

    def conv_verify_tree(self, layer: int, x: torch.Tensor, batch: Batch, trees: DraftTrees) -> torch.Tensor:
        """The layer's causal conv over draft trees, ``x [B * N, C] -> [B * N, C]``: each
        node's taps read its own root path, then the conv state before the root. The
        conv state advances only at :meth:`commit_tree` (by the accepted path).

        Args:
            layer: GDN layer index.
            x: ``[B * N, C]`` pre-conv channels, node ``i`` of request ``b`` at row
                ``b * N + i`` (``N = trees.max_nodes``); padded nodes' rows are read by
                nothing and give zeros.
            batch: the step's :class:`Batch`, every window ``N`` tokens.
            trees: the step's :class:`~replayssm.ops.trees.DraftTrees` (the same object in
                every layer of the step).

        A chain-shaped tree (:attr:`DraftTrees.is_chain`) runs :meth:`conv_verify`'s op.
        """
        self._check_batch(batch, step=True)
        self._check_conv_input(layer, x)
        self._check_trees(batch, trees)
        if layer in self._conv_verified:
            raise StepProtocolError(f"layer {layer}'s conv was already verified this step; commit first")
        p = self.pool.layer_params(layer)
        self._open_step(batch, trees)
        if trees.is_chain:
            y = causal_conv_verify(
                x, self.pool.conv_state[layer], p["conv_weight"], p["conv_bias"], batch.slots, batch.cu_seqlens,
                backend=self.pool.backend, **self._conv_window(layer),
            )
        else:
            y = causal_conv_verify_tree(
                x, self.pool.conv_state[layer], p["conv_weight"], p["conv_bias"], batch.slots, trees,
                backend=self.pool.backend, **self._conv_window(layer),
            )
        self._conv_verified.add(layer)
        return y

    def verify_tree(self, layer: int, q, k, v, a, b, batch: Batch, trees: DraftTrees) -> torch.Tensor:
        """Outputs of every node of the requests' draft trees, without changing the
        committed state: node ``i``'s output is the recurrence's along its root path
        (DESIGN.md section 2, "Trees").

        Args:
            layer: GDN layer index.
            q, k: ``[B * N, H, K]`` post-conv; v: ``[B * N, HV, V]``; a, b: ``[B * N, HV]``;
                node ``i`` of request ``b`` at row ``b * N + i``, ``N = trees.max_nodes``.
                Padded nodes (``i >= trees.num_nodes[b]``) are on no path: their inputs
                are read by nothing (they may hold anything) and their outputs are zero.
            batch: the step's :class:`Batch`: ``B`` requests, every window ``N`` tokens
                (so step shapes stay static), ``N <= window``.
            trees: the step's :class:`~replayssm.ops.trees.DraftTrees`, the same object in
                every layer of the step.

        Returns:
            ``o``: ``[B * N, HV, V]`` in the dtype of ``v``.

        A chain-shaped tree (:attr:`DraftTrees.is_chain`: parents ``i - 1``, no padding)
        runs :meth:`verify`'s kernels, bit for bit.
        """
        self._check_batch(batch, step=True)
        self._check_inputs(layer, q, k, v, a, b, batch)
        self._check_trees(batch, trees)
        if layer in self._verified:
            raise StepProtocolError(f"layer {layer} was already verified this step; commit first")
        A_log, dt_bias = self._gates(layer)
        self._open_step(batch, trees)
        if trees.is_chain:
            o = self._verify(layer, q, k, v, a, b, A_log, dt_bias, batch)
        else:
            o = self._verify_tree(layer, q, k, v, a, b, A_log, dt_bias, batch, trees)
        self._verified.add(layer)
        return o

    def commit_tree(self, batch: Batch, trees: DraftTrees, accepted) -> None:
        """Keep the root path of each request's accepted node, for all layers.

        Args:
            batch: the batch every layer verified this step.
            trees: the step's trees (the object every layer verified with).
            accepted: ``[B]`` the deepest accepted node per request (the last node whose
                root path the target accepted; the bonus token comes next step), ``0 <=
                accepted[b] < trees.num_nodes[b]`` for live rows, ignored for padding
                rows. Its root path, ``depth + 1`` tokens, is committed. A host value
                (a sequence, a CPU tensor) is checked on the host: a bad node raises
                before anything changes. A tensor on an accelerator is not read: a bad
                node is clamped into range and raises the error flag (as for
                :meth:`commit`), so the commit can run inside a CUDA graph.
        """
        self._check_batch(batch, step=True)
        self.pool.check_errors(wait=False)
        if self._step_batch is None or trees is not self._step_trees:
            raise StepProtocolError("commit_tree needs a step verified with these trees (verify_tree in every layer)")
        self._check_all_verified()
        node = self._check_accepted_nodes(batch, trees, accepted)
        if trees.is_chain:  # the chain's commit: node i is i + 1 tokens
            self._commit_counts(batch, node + 1)
            return
        dev = trees.on(self.pool.device)
        path, count = accepted_paths(dev, node)
        if self._conv_verified:
            pool = self.pool
            if pool.conv_ring:  # the path's inputs where the history continues
                compact_path([pool.conv_state.transpose(-1, -2)], batch.slots, path, count, pool.conv_pos,
                             backend=pool.backend)
            else:
                compact_path([pool.conv_window], batch.slots, path, count, backend=pool.backend)
            self._commit_conv(batch.slots, count)
        self._commit_tree_states(batch, dev, node, path, count)
        self._close_step()

    def _check_accepted_nodes(self, batch: Batch, trees: DraftTrees, accepted) -> torch.Tensor:
        """``accepted`` nodes as int32 on the pool's device (see :meth:`commit_tree`)."""
        accepted = self._accepted_tensor(batch, accepted)
        if accepted.device.type != "cpu":
            counts = trees.on(accepted.device).num_nodes
            return guards.clamp_accepted(batch.slots, accepted.to(torch.int32) + 1, counts) - 1
        slots = batch.host_slots if batch.host_slots is not None else batch.slots.tolist()
        for i, (s, node, m) in enumerate(zip(slots, accepted.tolist(), trees.num_nodes.tolist())):
            if s >= 0 and not 0 <= node < m:
                raise ValueError(f"accepted[{i}] = {node} must be a node in [0, {m}) (trees.num_nodes[{i}])")
        return accepted.to(device=self.pool.device, dtype=torch.int32)

    def decode(self, layer: int, q, k, v, a, b, batch: Batch) -> torch.Tensor:
        """Plain decoding of one token per request through the ring (strategies with
        :attr:`ring_decode`): this token's output from the frozen checkpoint and the
        committed records, and its record appended after them; the state is written only
        when the ring flushes.

        A decode step is a speculative step whose windows hold one token each (DESIGN.md
        section 9): :meth:`conv_verify` (optional) and ``decode`` in every GDN layer,
        then :meth:`commit` (``commit(batch)`` keeps every window's token) or
        :meth:`abort`. Plain and speculative steps share the ring and its cursors, so a
        request may switch between them at any step.

        Args:
            layer, q, k, v, a, b: as for :meth:`verify` (``N = B`` tokens).
            batch: the step's :class:`Batch`, every window one token.

        Returns:
            ``o``: ``[B, HV, V]`` in the dtype of ``v``; padding rows are zero.
        """
        if not self.ring_decode:
            raise TypeError(
                f"strategy {self.name!r} keeps no ring to decode through (ring_decode is False): plain decoding "
                "goes through prefill"
            )
        self._check_batch(batch, step=True)
        if any(n != 1 for n in batch.lengths):
            raise ValueError(f"batch: decode takes one token per request, got windows of {sorted(set(batch.lengths))}")
        return self.verify(layer, q, k, v, a, b, batch)

    def commit(self, batch: Batch, accepted: torch.Tensor | Sequence[int] | None = None) -> None:
        """Keep the first ``accepted[i]`` tokens of each window, for all layers.

        Args:
            batch: the batch every layer verified this step.
            accepted: ``[B]`` accepted tokens per request (bonus included),
                ``1 <= n <= length`` for live rows; ignored for padding rows. ``None``
                keeps every window's tokens (a :meth:`decode` step: one per request).
        """
        self._check_batch(batch, step=True)
        self.pool.check_errors(wait=False)
        if self._step_trees is not None:
            raise StepProtocolError("this step verified draft trees: commit it with commit_tree")
        self._check_all_verified()
        # Whole windows need no check: the batch's lengths were validated when it was built.
        accepted = batch.device_lengths if accepted is None else self._check_accepted(batch, accepted)
        self._commit_counts(batch, accepted)

    def _check_all_verified(self) -> None:
        if self._step_batch is None or self._verified != set(range(self.pool.num_layers)):
            missing = sorted(set(range(self.pool.num_layers)) - self._verified)
            raise StepProtocolError(f"commit needs every layer verified first; missing layers {missing}")
        if self._conv_verified and self._conv_verified != self._verified:
            raise StepProtocolError("conv_verify ran for some layers but not all")

    def _commit_counts(self, batch: Batch, accepted: torch.Tensor) -> None:
        """Commit the first ``accepted`` (checked, on the device) tokens of every window."""
        if self._conv_verified:
            self._commit_conv(batch.slots, accepted)
        self._commit_states(batch, accepted)
        self._close_step()

    def abort(self, batch: Batch) -> None:
        """End the open step as if it never ran: the committed state of every slot is
        what it was before the step's first verify (rejecting every token).

        For a forward pass that failed halfway, or a step the engine decides to drop.
        Without an open step this does nothing (safe in an error handler); with one,
        ``batch`` must be the step's batch.
        """
        self._check_batch(batch, step=True)
        if self._step_batch is None:
            return
        self._abort_states(batch)
        self._close_step()

    @staticmethod
    def _accepted_tensor(batch: Batch, accepted) -> torch.Tensor:
        """``accepted`` (a sequence or a tensor) as a ``[B]`` integer tensor, metadata
        checked: on the host, or on the batch's device."""
        if not isinstance(accepted, torch.Tensor):
            accepted = torch.tensor([int(n) for n in accepted], dtype=torch.int32)
        _checks.tensor("accepted", accepted, ndim=1, dtypes=_checks.INDEX_DTYPES)
        _checks.shape("accepted", accepted, [batch.size])
        if accepted.device.type != "cpu" or batch.slots.device.type == "cpu":
            _checks.same_device(batch.slots, accepted=accepted)
        return accepted

    def _check_accepted(self, batch: Batch, accepted) -> torch.Tensor:
        """``accepted`` as an int32 tensor on the pool's device, checked once per step.

        Host values (a sequence, a CPU tensor) are checked on the host: a bad count
        raises before anything changes. A tensor on an accelerator is checked there, so
        commit does not synchronise: a live row's count outside ``[1, length]`` is
        clamped into it and raises the error flag, which the next step's first call
        (or :meth:`StatePool.check_errors`) reports.
        """
        accepted = self._accepted_tensor(batch, accepted)
        if accepted.device.type != "cpu":
            return guards.clamp_accepted(batch.slots, accepted, batch.device_lengths)
        slots = batch.host_slots if batch.host_slots is not None else batch.slots.tolist()
        for i, (s, n, m) in enumerate(zip(slots, accepted.tolist(), batch.lengths)):
            if s >= 0 and not 1 <= n <= m:
                raise ValueError(f"accepted[{i}] = {n} must be in [1, {m}] (the window length)")
        return accepted.to(device=self.pool.device, dtype=torch.int32)

    def prefill(self, layer: int, q, k, v, a, b, batch: Batch) -> torch.Tensor:
        """Run prompt (or plain decode) tokens and advance the committed state.

        Requests must have no pending history (true right after ``alloc``); a strategy
        with :attr:`ring_decode` decodes requests that have history with :meth:`decode`.
        """
        self._check_batch(batch, step=False)
        self._check_inputs(layer, q, k, v, a, b, batch)
        self._check_prefill_rows(batch)
        A_log, dt_bias = self._gates(layer)
        return gdn_recurrence(
            q, k, v, a, b, A_log, dt_bias, self.pool.checkpoints[layer], batch.slots, batch.cu_seqlens,
            update_state=True, max_len=batch.max_len or None, backend=self.pool.backend,
        )

    def chunk_prefill(self, layer: int, q, k, v, a, b, batch: Batch, kernel: Callable) -> torch.Tensor:
        """Prompt tokens of fresh requests through an external chunked kernel.

        Computes ``g`` (fp32) and ``beta`` from the raw gates (:func:`prompt_gates`, one
        launch) and calls ``kernel`` with the signature of fla-core's (>= 0.6)
        ``chunk_gated_delta_rule``: ``kernel(q [1, N, H, K], k [1, N, H, K],
        v [1, N, HV, V], g [1, N, HV], beta [1, N, HV] (v's dtype), initial_state=None,
        output_final_state=True, cu_seqlens=[B + 1] int64, use_qk_l2norm_in_kernel=True,
        state_v_first=True) -> (o [1, N, HV, V], final [B, HV, V, K])``. Key heads are
        shared by value heads (value head ``h`` reads key head ``h // (HV / H)``, fla's
        grouped value attention), and the states are in the pool's ``[V, K]`` layout.
        The final states become the committed states of the batch's live slots
        (:meth:`load_states`).

        Args:
            layer, q, k, v, a, b, batch: as for :meth:`prefill` (every live row fresh:
                no committed history, e.g. right after ``alloc``).
            kernel: the chunked kernel.

        Returns:
            ``o``: ``[N, HV, V]`` in the dtype of ``v``; padding rows are zero.
        """
        self._check_batch(batch, step=False)
        self._check_inputs(layer, q, k, v, a, b, batch)
        if not callable(kernel):
            raise TypeError(f"kernel must be callable, got {type(kernel).__name__}")
        self._check_prefill_rows(batch)
        o, final = self._run_chunk_kernel(layer, q, k, v, a, b, kernel, batch.num_tokens, batch.size,
                                          cu_seqlens=batch.cu_seqlens.long())
        slots = batch.host_slots if batch.host_slots is not None else tuple(batch.slots.tolist())
        self._load_states(layer, slots, final)
        o = o[0].to(v.dtype)
        if any(sl < 0 for sl in slots):  # padding rows: zero outputs, as prefill gives
            pad = [t for i, sl in enumerate(slots) if sl < 0 for t in range(*_token_range(batch, i))]
            o[torch.tensor(pad, dtype=torch.long, device=o.device)] = 0
        return o

    def chunk_prefill_static(self, layer: int, q, k, v, a, b, batch: Batch, kernel: Callable, *,
                             chunks: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """:meth:`chunk_prefill` of a static prompt batch (a CUDA-graphed prompt pass,
        :mod:`replayssm.engine.prompt_graph`) whose rows are rewritten on the device
        between replays. Nothing is read on the host, and every launch's grid is fixed
        by the shapes; the final states go to the requests' slots through the batch's
        device slots (``-1``, as at capture, writes nothing).

        * One request (``chunks is None``): the batch is the request, then (unless it
          fills the batch) a padding request (slot ``-1``) over the rest of the tokens.
          The kernel sees all ``N`` tokens as one sequence ``[1, N]`` without offsets;
          the padding's gates are ``g = 0, beta = 0`` (``exp(0) S = S`` and a zero
          write: the state passes on unchanged).
        * ``B`` requests (``chunks``): the batch is ``B`` requests, then a padding
          request. The kernel runs on the packed tokens ``[1, N]`` as ``B + 2``
          sequences, the requests, the padding request and an empty one, with its
          chunk list given (fla-core reads it from the device instead of deriving it
          on the host): the list's real chunks, then entries of the empty sequence up
          to the list's fixed length :func:`chunk_list_length`, which compute nothing
          (their every load and store is past the empty sequence's end). So the grids
          do not depend on the prompts' lengths, and the kernel computes the real
          tokens only.

        Args:
            layer, q, k, v, a, b, kernel: as for :meth:`chunk_prefill` (``q, k [N, H,
                K]``, ``v [N, HV, V]``, ``a, b [N, HV]``, packed in request order);
                with ``chunks``, the kernel also takes ``chunk_indices``.
            batch: one row, or ``B + 1`` rows with the last one padding.
            chunks: ``(cu_seqlens [B + 3] int64, chunk_indices [M, 2] int64)`` on the
                batch's device, as :func:`chunk_list` fills them: the batch's offsets
                then ``N`` again (the empty sequence), and per chunk of
                :data:`KERNEL_CHUNK` tokens its sequence and its index in it.

        Returns:
            ``o``: ``[N, HV, V]`` in the dtype of ``v``; the padding tokens' rows are
            whatever the kernel gives them (their state is dropped or never moved).
        """
        self._check_batch(batch, step=False)
        self._check_inputs(layer, q, k, v, a, b, batch)
        if not callable(kernel):
            raise TypeError(f"kernel must be callable, got {type(kernel).__name__}")
        if chunks is None:
            requests = 1
            if batch.size not in (1, 2) or (batch.size == 2 and batch.host_slots is not None
                                            and batch.host_slots[1] != -1):
                raise ValueError(f"a static chunked prompt batch is one request (and a padding row), got "
                                 f"{batch.size} rows with slots {batch.host_slots}")
        else:
            if not isinstance(chunks, tuple) or len(chunks) != 2:
                raise TypeError(f"chunks must be a (cu_seqlens, chunk_indices) tuple, got {type(chunks).__name__}")
            cu_seqlens, chunk_indices = chunks
            _checks.tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int64,))
            _checks.tensor("chunk_indices", chunk_indices, ndim=2, dtypes=(torch.int64,))
            requests = cu_seqlens.shape[0] - 3
            if requests < 1:
                raise ValueError(f"cu_seqlens must have B + 3 >= 4 entries (B requests, a padding request and an "
                                 f"empty sequence), got {cu_seqlens.shape[0]}")
            if chunk_indices.shape[1] != 2 or chunk_indices.shape[0] < requests + 1:
                raise ValueError(f"chunk_indices must have shape [M, 2] with M >= {requests + 1} (a chunk per "
                                 f"sequence at least), got {list(chunk_indices.shape)}")
            _checks.same_device(batch.slots, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
            _checks.contiguous(chunk_indices=chunk_indices)  # the kernel reads it as (sequence, chunk) pairs
            if batch.size != requests + 1 or (batch.host_slots is not None and batch.host_slots[requests] != -1):
                raise ValueError(f"cu_seqlens holds {requests} requests: the batch must be those requests, then a "
                                 f"padding row, got {batch.size} rows with slots {batch.host_slots}")
        self._check_prefill_rows(batch)
        if chunks is None:
            real = batch.cu_seqlens[requests : requests + 1]  # the request's tokens; the padding's gates zero
            o, final = self._run_chunk_kernel(layer, q, k, v, a, b, kernel, batch.num_tokens, 1, cu_seqlens=None,
                                              real=real)
        else:
            # A fresh view of the offsets at every call: fla-core memoizes what it derives
            # from them (its chunk offsets) by tensor identity, and a replayed graph must
            # derive it again from the offsets of the pass at hand.
            o, final = self._run_chunk_kernel(layer, q, k, v, a, b, kernel, batch.num_tokens, requests + 2,
                                              cu_seqlens=chunks[0][:], chunk_indices=chunks[1])
        write_checkpoints(self.pool.checkpoints[layer], batch.slots[:requests], final[:requests],
                          backend=self.pool.backend)
        return o[0].to(v.dtype)

    def _run_chunk_kernel(self, layer: int, q, k, v, a, b, kernel: Callable, num_tokens: int, num_seqs: int, *,
                          cu_seqlens, real=None, chunk_indices=None):
        """Gates, the chunked kernel's call on the packed tokens ``[1, N]`` and the check
        of what it returns; ``real [1]`` (a device count) zeroes the gates of tokens from
        ``real[0]`` on; ``chunk_indices`` goes to the kernel where given."""
        s = self.pool.shape
        hv = s.num_value_heads
        A_log, dt_bias = self._gates(layer)
        g, beta = prompt_gates(a, b, A_log, dt_bias, real, beta_dtype=v.dtype, backend=self.pool.backend)
        extra = {} if chunk_indices is None else {"chunk_indices": chunk_indices}
        o, final = kernel(
            *(x[None] for x in (q, k, v, g, beta)), initial_state=None, output_final_state=True,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, state_v_first=True, **extra,
        )
        _checks.tensor("kernel's o", o, ndim=4, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("kernel's o", o, [1, num_tokens, hv, s.head_v_dim])
        _checks.tensor("kernel's final state", final, ndim=4, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("kernel's final state", final, [num_seqs, hv, s.head_v_dim, s.head_k_dim])
        return o, final

    def load_states(self, layer: int, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Set the committed recurrent state of fresh slots of one layer.

        For a prompt prefilled by an external kernel. The conv state is not touched
        (``conv_prefill`` advances it).

        Args:
            layer: GDN layer index.
            slots: ``[n]`` int32/int64 live slots, each fresh (no committed history:
                right after ``alloc``/``reset``, or after prefill); ``-1`` entries are
                skipped. Not part of an open step.
            states: ``[n, HV, V, K]`` float states (cast to the pool's state dtype).

        Validation reads ``slots`` (and, for ``circular``, the rows' cursors) once on the
        host; the copy itself does not synchronise.
        """
        self.pool.check_layer(layer)
        _checks.tensor("slots", slots, ndim=1, dtypes=_checks.INDEX_DTYPES)
        s = self.pool.shape
        _checks.tensor("states", states, ndim=4, dtypes=_checks.FLOAT_DTYPES)
        _checks.shape("states", states, [slots.shape[0], s.num_value_heads, s.head_v_dim, s.head_k_dim])
        _checks.same_device(self.pool.checkpoints, slots=slots, states=states)
        self._load_states(layer, tuple(slots.tolist()), states)

    def _load_states(self, layer: int, slots: tuple[int, ...], states: torch.Tensor) -> None:
        rows, live = [], []
        for i, sl in enumerate(slots):
            if sl == -1:
                continue
            self.pool.check_live(sl)
            rows.append(i)
            live.append(sl)
        if len(set(live)) != len(live):
            raise ValueError(f"slots must be unique (apart from -1), got {list(slots)}")
        busy = sorted(set(live) & self.pool.step_slots)
        if busy:
            raise StepProtocolError(f"slots {busy} belong to the open step: commit or abort it first")
        self._check_fresh(live)
        if not live:
            return
        src = states if len(rows) == len(slots) else states[self._device_index(tuple(rows))]
        self.pool.checkpoints[layer, self._device_index(tuple(live))] = src.to(self.pool.state_dtype)

    def _device_index(self, values: tuple[int, ...]) -> torch.Tensor:
        """``values`` as an int64 index on the pool's device, the last one kept: every
        layer of a prompt pass asks for the same slots, and a new copy from host memory
        to the device waits for the work queued before it (a synchronisation per layer)."""
        if self._index_memo is None or self._index_memo[0] != values:
            self._index_memo = (values, torch.tensor(values, dtype=torch.long, device=self.pool.device))
        return self._index_memo[1]

    def fold_history(self, slots: Sequence[int]) -> None:
        """Make the checkpoints of ``slots`` (every layer) their committed state: a
        strategy that keeps committed history outside the checkpoint (``circular``'s
        ring, after :meth:`decode` or speculative steps) folds it in exactly, as a flush
        would, and empties it; the committed state does not change. :meth:`prefill` and
        :meth:`load_states` need fresh requests; this makes a request fresh without
        losing its state. A no-op for strategies whose checkpoint is always the
        committed state. Only for slots outside an open step."""
        slots = [self.pool.check_live(s) for s in slots]
        busy = sorted(set(slots) & self.pool.step_slots)
        if busy:
            raise StepProtocolError(f"slots {busy} belong to the open step: commit or abort it first")
        self._fold_history(slots)

    def _fold_history(self, slots: list[int]) -> None:
        """Fold the committed history of live, validated ``slots`` into their checkpoints."""

    def _check_fresh(self, slots: list[int]) -> None:
        """Raise if a slot has committed history beyond its checkpoint (none between
        steps for strategies whose checkpoint is the committed state)."""

    def _check_prefill_rows(self, batch: Batch) -> None:
        self._check_fresh(batch.live_slots)

    # ------------------------------------------------------------------ save / restore
    def save_states(self, slots: Sequence[int]) -> SavedStates:
        """A copy of the committed state of ``slots`` (checkpoints and conv states of
        every layer, plus any strategy buffer that holds committed data, e.g.
        ``circular``'s ring and cursors), to undo scratch decoding with
        :meth:`restore_states`. Only between steps."""
        if self.step_open:
            raise StepProtocolError("save_states between verify and commit: commit or abort the step first")
        slots = tuple(self.pool.check_live(sl) for sl in slots)
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be unique, got {list(slots)}")
        idx = torch.tensor(slots, dtype=torch.long, device=self.pool.device)
        tensors = {}
        for name, spec in self.pool.specs.items():
            if not spec.committed:
                continue
            buf = self.pool.buffers[name]
            tensors[name] = (buf[:, idx] if spec.per_layer else buf[idx]).clone()
        gens = tuple(self.pool.generation(sl) for sl in slots)
        return SavedStates(owner=id(self.pool), slots=slots, generations=gens, tensors=tensors)

    def restore_states(self, saved: SavedStates) -> None:
        """Put back what :meth:`save_states` copied. Only between steps, and only while
        every saved slot still holds the request it held when saved."""
        if not isinstance(saved, SavedStates) or saved.owner != id(self.pool):
            raise TypeError("saved must come from save_states of this pool's strategy")
        if self.step_open:
            raise StepProtocolError("restore_states between verify and commit: commit or abort the step first")
        for sl, gen in zip(saved.slots, saved.generations):
            self.pool.check_live(sl)
            if self.pool.generation(sl) != gen:
                raise ValueError(f"slot {sl} changed hands (freed / re-allocated) since save_states")
        idx = torch.tensor(saved.slots, dtype=torch.long, device=self.pool.device)
        for name, copy in saved.tensors.items():
            buf = self.pool.buffers[name]
            if self.pool.specs[name].per_layer:
                buf[:, idx] = copy
            else:
                buf[idx] = copy

    # ------------------------------------------------------------------ committed state
    def committed_state(self, layer: int, slots: Sequence[int]) -> torch.Tensor:
        """A copy of the committed states ``[len(slots), HV, V, K]``, at any time
        (between steps, or between a step's verify and its commit / abort)."""
        self.pool.check_layer(layer)
        slots = tuple(self.pool.check_live(s) for s in slots)
        return self.pool.checkpoints[layer, self._device_index(slots)].clone()

    # ------------------------------------------------------------------ subclass hooks
    def _verify(self, layer, q, k, v, a, b, A_log, dt_bias, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def _commit_states(self, batch: Batch, accepted: torch.Tensor) -> None:
        raise NotImplementedError

    def _verify_tree(self, layer, q, k, v, a, b, A_log, dt_bias, batch: Batch, trees: DraftTrees) -> torch.Tensor:
        """Tree verify of a tree that is not a chain (validated; the step is open)."""
        raise NotImplementedError

    def _commit_tree_states(self, batch: Batch, trees: DeviceTrees, accepted: torch.Tensor, path: torch.Tensor,
                            count: torch.Tensor) -> None:
        """Commit the accepted root paths: ``accepted [B]`` nodes (checked), ``path [B, N]``
        and ``count [B]`` from :func:`~replayssm.ops.trees.accepted_paths`, all on the
        pool's device."""
        raise NotImplementedError

    def _abort_states(self, batch: Batch) -> None:
        """Undo whatever the open step did to committed state (scratch may stay)."""


def _token_range(batch: Batch, i: int) -> tuple[int, int]:
    start = sum(batch.lengths[:i])
    return start, start + batch.lengths[i]
