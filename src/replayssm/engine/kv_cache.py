"""Key/value cache of the full-attention layers, rolled back by length.

Hybrid models interleave GDN layers with a few full-attention layers. Those keep the
keys and values of every committed token. A verify step writes the window's keys and
values after each request's committed length (tentatively); commit moves the length
forward by the accepted count, so rejected entries fall outside the valid prefix and the
next window overwrites them (DESIGN.md section 3, "Full-attention layers of hybrid
models roll back by truncating each request's KV length").
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..ops.guards import to_device

GIB = 2**30

_BACKEND_ENABLED = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
                    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
                    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled}


def kv_cache_nbytes(num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, max_len: int,
                    dtype: torch.dtype) -> int:
    """Bytes of a :class:`KVCache` of these dimensions: keys and values of ``num_slots
    + 1`` slots (the sink included) and the device lengths."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * (num_slots + 1) * num_kv_heads * max_len * head_dim * elem + (num_slots + 1) * 8


def free_memory(device: str | torch.device) -> int | None:
    """Bytes that can be allocated on ``device`` now: CUDA's free memory, or the host's
    available memory (``MemAvailable`` of ``/proc/meminfo``, else free pages) for the
    CPU; ``None`` where it cannot be known (the ``meta`` device, other platforms)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_fits(nbytes: int, device: str | torch.device, what: str) -> None:
    """``ValueError`` when ``nbytes`` exceed what ``device`` has free: it names the
    figure (``what``, e.g. "the KV cache (2 slots x 4096 tokens)") and the free memory,
    so that a too-large request fails before the allocation, not inside it."""
    free = free_memory(device)
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {nbytes / GIB:.2f} GiB but {torch.device(device)} has "
                         f"{free / GIB:.2f} GiB free")


def check_kv_cache_fits(num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, max_len: int,
                        dtype: torch.dtype, device: str | torch.device) -> None:
    """:func:`check_fits` for a :class:`KVCache` of these dimensions (what its
    constructor checks before it allocates)."""
    nbytes = kv_cache_nbytes(num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype)
    check_fits(nbytes, device, f"the KV cache ({num_slots} slots x {max_len} tokens x {num_layers} attention "
                               f"layers x {num_kv_heads} KV heads x {head_dim}, {str(dtype).replace('torch.', '')})")


class KVCache:
    """Keys and values ``[layers, slots + 1, kv_heads, max_len, head_dim]`` plus lengths.

    Args:
        num_layers: number of full-attention layers (may be 0).
        num_slots: concurrent requests; slot numbers are shared with the state pool.
        num_kv_heads, head_dim: geometry of the attention layers.
        max_len: most tokens a request may hold (prompt + generated + one window).
        dtype, device: storage of keys and values.

    ``lengths[s]`` (host ints) is the committed token count of slot ``s``; it is also
    the position of the request's next token. ``device_lengths`` (``[slots + 1]`` int64)
    holds the same counts on the device for static-shape steps, which read and advance
    them without the host; :meth:`advance`, :meth:`reset` and :meth:`truncate` keep both
    in step, and a graphed step's driver calls :meth:`advance_host` after it read the
    accepted counts. The extra slot :attr:`sink` takes the writes of padding rows.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, max_len: int,
                 *, dtype: torch.dtype, device: str | torch.device):
        for name, value in (("num_slots", num_slots), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("max_len", max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 0:
            raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_len = max_len
        self.device = torch.device(device)
        check_kv_cache_fits(num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, self.device)
        shape = (num_layers, num_slots + 1, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.lengths = [0] * num_slots
        self.device_lengths = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)

    @property
    def sink(self) -> int:
        """The storage slot that padding rows of a static step write to."""
        return self.num_slots

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2 + self.device_lengths.numel() * 8

    def _sync_device(self, slots: Sequence[int]) -> None:
        """Copy the host lengths of ``slots`` to the device: one host-to-device copy of
        the slots and their lengths together, one scatter."""
        slots = list(slots)
        both = to_device(slots + [self.lengths[s] for s in slots], self.device)
        self.device_lengths[both[: len(slots)]] = both[len(slots) :]

    def reset(self, slot: int) -> None:
        """Empty ``slot`` (no committed tokens)."""
        self.reset_many((slot,))

    def reset_many(self, slots: Sequence[int]) -> None:
        """Empty every slot of ``slots``, with one device write for all of them."""
        slots = list(slots)
        for s in slots:
            self.lengths[s] = 0
        if slots:
            self.device_lengths.index_fill_(0, to_device(slots, self.device), 0)  # as pool._reset_slots

    def set_host_lengths(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Set the host lengths of ``slots`` to ``lengths``: the device holds them already
        (fresh requests whose lengths a graphed prompt pass wrote)."""
        for s, n in zip(slots, lengths):
            self.lengths[s] = int(n)

    def advance_host(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Advance the host lengths only: the device already did (a graphed step)."""
        lengths = self.lengths
        for s, n in zip(slots, counts):
            lengths[s] += int(n)

    def check_room(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Raise ``ValueError`` if a window would run past ``max_len``."""
        for s, n in zip(slots, lengths):
            if self.lengths[s] + n > self.max_len:
                raise ValueError(
                    f"slot {s} holds {self.lengths[s]} tokens; {n} more exceed max_len {self.max_len}"
                )

    def advance(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Commit ``counts[i]`` more tokens of slot ``slots[i]``."""
        self.advance_host(slots, counts)
        self._sync_device(slots)

    def truncate(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Roll slots back to the given committed lengths (never forward)."""
        for s, n in zip(slots, lengths):
            if not 0 <= n <= self.lengths[s]:
                raise ValueError(f"cannot truncate slot {s} from {self.lengths[s]} to {n} tokens")
            self.lengths[s] = int(n)
        self._sync_device(slots)


class WindowLayout:
    """Index tensors that move a packed batch of windows in and out of the padded
    ``[B, Tmax]`` layout the attention uses, built once per forward and shared by all
    attention layers.

    Args:
        slots: slot per request; starts: committed length per request (position of the
            window's first token); lengths: window length per request.
        t_max, l_max: pad queries / keys to these sizes instead of the longest window /
            longest history (fixed shapes, see ``HybridEngine(fixed_shape=...)``).
    """

    #: the SDPA backend of its fresh-request attention: flash, which serves any shape
    #: with no per-shape setup (an eager pass's shapes are the prompts')
    attention_backend = SDPBackend.FLASH_ATTENTION

    def __init__(self, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int], device,
                 *, t_max: int | None = None, l_max: int | None = None):
        self.slots = list(slots)
        self.starts = list(starts)
        self.lengths = list(lengths)
        self.batch = len(self.slots)
        self.t_max = max(self.lengths)
        self.l_max = max(s + n for s, n in zip(self.starts, self.lengths))
        if t_max is not None:
            if t_max < self.t_max:
                raise ValueError(f"t_max {t_max} is shorter than the longest window {self.t_max}")
            self.t_max = t_max
        if l_max is not None:
            if l_max < self.l_max:
                raise ValueError(f"l_max {l_max} is shorter than the longest history {self.l_max}")
            self.l_max = l_max
        # per token, in numpy (a pass of many long prompts has tens of thousands), then
        # one upload: request, index inside its window, absolute position, cache slot
        lengths = np.asarray(self.lengths, dtype=np.int64)
        rows = np.repeat(np.arange(self.batch, dtype=np.int64), lengths)
        cols = np.arange(rows.size, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        pos = cols + np.repeat(np.asarray(self.starts, dtype=np.int64), lengths)
        slots_of = np.repeat(np.asarray(self.slots, dtype=np.int64), lengths)
        index = to_device(np.concatenate([rows, cols, pos, slots_of]), device).view(4, rows.size)
        self.row, self.col, self.positions, self.slot_of_token = index  # each [N]
        self.slot_index = to_device(self.slots, device)
        #: every request without history and no padding past the longest window: the
        #: attention needs no cache read and no explicit mask (see cached_attention)
        self.fresh = not any(self.starts) and t_max is None
        #: every window as long as the longest: the packed tokens are the padded layout
        self.uniform = all(n == self.t_max for n in self.lengths)
        self.device = device

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """``[B, 1, Tmax, Lmax]`` bool: query ``t`` of request ``b`` sees keys ``0 ..
        start_b + t`` (causal across history + window). Built at its first use (a pass
        of fresh requests never needs it)."""
        key_pos = torch.arange(self.l_max, device=self.device)
        q_pos = (torch.tensor(self.starts, device=self.device)[:, None]
                 + torch.arange(self.t_max, device=self.device)[None])
        return (key_pos[None, None, :] <= q_pos[:, :, None])[:, None]


class PromptLayout:
    """:class:`WindowLayout`'s device tensors for a prompt pass of fresh requests at a
    static shape (a CUDA-graphed prompt pass, :mod:`replayssm.engine.prompt_graph`):
    the index tensors are buffers the caller rewrites before each replay, so the shapes
    stay fixed while the requests change.

    Args:
        rows: requests of the padded attention layout ``[rows, t_max]`` (the pass's
            requests, plus one row that collects the padding tokens when there are
            several requests: with one request its padding follows it in its own row,
            which a causal mask keeps out of every real query).
        t_max: columns of that layout.
        index: ``[4, N]`` int64 buffer: each token's row, column, absolute position
            (rotary and cache position) and cache slot (the sink for padding tokens).
    """

    fresh = True  # every request starts at position 0: no cache read, a causal mask
    uniform = False  # the requests differ in length and the padding has a row of its own

    def __init__(self, rows: int, t_max: int, index: torch.Tensor):
        self.batch, self.t_max = rows, t_max
        self.row, self.col, self.positions, self.slot_of_token = index
        self.attention_backend = static_attention_backend(index.device)


def static_attention_backend(device: torch.device) -> SDPBackend:
    """The SDPA backend of a static prompt pass's attention on ``device``: cuDNN's on an
    sm_90 card (where torch enables it), else flash. cuDNN builds an execution plan per
    shape at its first call, which a static shape pays once, in the warm-up before its
    capture; at Qwen3.5's head dim of 256 its causal products then run at about twice
    flash's rate (BENCHMARKS.md, "The prompt attention through cuDNN, graphed")."""
    if (device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(device) == (9, 0)):
        return SDPBackend.CUDNN_ATTENTION
    return SDPBackend.FLASH_ATTENTION


def write_window_kv(cache: KVCache, layer: int, layout: WindowLayout, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write a packed window's keys and values ``k, v [N, kv_heads, D]`` (``k``
    rotated) into layer ``layer`` of ``cache``, each token at its slot and position
    (``layout``: a :class:`WindowLayout` or :class:`PromptLayout`; padding tokens name
    the sink). The cache lengths are not changed."""
    cache.k[layer][layout.slot_of_token, :, layout.positions] = k.to(cache.k.dtype)
    cache.v[layer][layout.slot_of_token, :, layout.positions] = v.to(cache.v.dtype)


def cached_attention(cache: KVCache, layer: int, layout: WindowLayout, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, scale: float) -> torch.Tensor:
    """Write the window's keys/values after each request's history and attend.

    Args:
        cache: the cache; ``layer`` indexes its attention layers.
        layout: the step's :class:`WindowLayout`.
        q: ``[N, heads, D]`` rotated queries; k, v: ``[N, kv_heads, D]`` (k rotated).
        scale: softmax scale.

    Returns:
        ``[N, heads, D]`` attention outputs. The cache lengths are not changed.
    """
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    write_window_kv(cache, layer, layout, k, v)
    if layout.fresh:
        return _fresh_attention(layout, q, k, v, scale)
    keys = cache.k[layer][layout.slot_index, :, : layout.l_max]  # [B, kvH, Lmax, D]
    values = cache.v[layer][layout.slot_index, :, : layout.l_max]
    if heads != kv_heads:
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
    q_pad = q.new_zeros(layout.batch, layout.t_max, heads, d)
    q_pad[layout.row, layout.col] = q
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=layout.mask, scale=scale
    )  # [B, heads, Tmax, D]
    return out.transpose(1, 2)[layout.row, layout.col]


def _fresh_attention(layout: WindowLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """:func:`cached_attention` of requests without history (a prompt pass of fresh
    requests): each window attends to itself, so its keys need no gather from the
    cache and the padded windows ``[B, Tmax]`` take a plain causal mask, which SDPA's
    flash kernels serve (an explicit mask rules them out). Right padding is exact: a
    real query's causal window ends at itself, before its row's padding."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    # SDPA's flash and cuDNN kernels take grouped keys and values as they are (16-bit
    # inputs on an sm_80+ card, head dims up to 256), and the call below asks for the
    # layout's backend alone, so that an input it refuses raises instead of falling to
    # the math kernel; elsewhere the keys and values are repeated per query head.
    backend = layout.attention_backend
    gqa = (heads != kv_heads and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d <= 256
           and _BACKEND_ENABLED[backend]() and torch.cuda.get_device_capability(q.device)[0] >= 8)
    if heads != kv_heads and not gqa:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    kv_heads = k.shape[1]
    packed = layout.batch == 1 or layout.uniform  # the packed tokens already are [B, Tmax]
    if packed:
        qs = q.reshape(layout.batch, layout.t_max, heads, d)
        ks, vs = (x.reshape(layout.batch, layout.t_max, kv_heads, d) for x in (k, v))
    else:
        # Each padded position reads a packed token (a gather at the copy rate, where
        # writing into zeroed buffers runs torch's element-wise index kernel, a sixth
        # of it): a real one's own, a padding position's some real token's, which no
        # real query sees (each row's padding follows its last token).
        flat = layout.row * layout.t_max + layout.col  # [N] padded position of each token
        src = torch.zeros(layout.batch * layout.t_max, dtype=flat.dtype, device=flat.device)
        src.index_put_((flat,), torch.arange(n, device=flat.device))
        qs = q.index_select(0, src).view(layout.batch, layout.t_max, heads, d)
        ks, vs = (x.to(q.dtype).index_select(0, src).view(layout.batch, layout.t_max, kv_heads, d) for x in (k, v))
    extra = {"enable_gqa": True} if gqa else {}
    with sdpa_kernel(backend) if gqa else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(qs.transpose(1, 2), ks.transpose(1, 2).to(q.dtype),
                                             vs.transpose(1, 2).to(q.dtype), is_causal=True, scale=scale, **extra)
    out = out.transpose(1, 2)  # [B, Tmax, heads, D]
    return out.reshape(n, heads, d) if packed else out.reshape(-1, heads, d).index_select(0, flat)


def compact_kv_path(cache: KVCache, slot_idx: torch.Tensor, starts: torch.Tensor, path: torch.Tensor) -> None:
    """KV compaction after a tree step: move each row's accepted root path to the front
    of its window, in every layer, in place (graph-safe, no host read).

    A tree step writes node ``i``'s key and value at position ``start + i``; the
    accepted path ``path[b] = (0, n_1, ..., n_d)`` (node per depth) must end at
    positions ``start .. start + d`` as if its tokens had been decoded one by one. All
    ``D + 1`` entries are read before any is written, so overlapping moves are safe.

    Args:
        cache: the cache (all its layers move).
        slot_idx: ``[B]`` cache slot per row (the sink for padding rows).
        starts: ``[B]`` int64 window start (committed length before the step).
        path: ``[B, D + 1]`` int64 node at each depth of the accepted path, ``-1`` past
            its depth (those positions, past the new length, get the root's entry).
    """
    if cache.num_layers == 0:
        return
    src = starts[:, None] + path.clamp(min=0)
    dst = starts[:, None] + torch.arange(path.shape[1], device=path.device)
    slots = slot_idx[:, None].expand_as(src)
    for buf in (cache.k, cache.v):
        buf[:, slots, :, dst] = buf[:, slots, :, src]  # [B, D + 1, layers, kv_heads, head_dim], a copy
