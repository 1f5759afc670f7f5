"""Attention of a static-shape step over the slot-indexed KV cache.

A decode or verify step has ``B`` rows (requests or padding) of ``T`` query tokens
each. Row ``b`` reads the keys of cache slot ``slot_idx[b]``; its query ``t`` sits at
position ``starts[b] + t`` and sees keys ``0 .. starts[b] + t`` (its history and the
window up to itself). Nothing here depends on the lengths' values on the host, so the
same launch serves every step of a CUDA graph: the kernel reads ``starts`` on the
device and stops at the last key a row can see, and its cost follows the real lengths,
not the cache's capacity.

Two implementations of :func:`slot_attention`:

* ``reference``: the cache rows gathered and padded to the cache capacity, then
  ``scaled_dot_product_attention`` with a length mask. Runs anywhere; cost follows the
  capacity. The CPU path and the oracle of the tests.
* ``triton``: one program per (row, key head) holds the ``G x T`` queries that share
  that key head (grouped-query attention) as one tile and streams the slot's keys in
  blocks with an online softmax. By default without a split along keys: a split whose
  parts follow a row's length or the batch's size would give a token other bits at
  another window position or batch, and exact speculation needs the same bits (one
  measured on an H100 saved ~2 µs a step at batch 1 and broke it, BENCHMARKS.md).
  With ``key_split = C`` the keys are split at fixed positions (``0, C, 2C, ...``), a
  program a part, and the row's last part to finish merges the parts in the same
  launch (flash-decoding; arrival counters as the split argmax's,
  :func:`~replayssm.ops.triton_common.arrival_counters`): a token's parts then depend on
  its own position alone, so its bits are the same at every window position and batch
  too, though not those of the unsplit kernel (to rounding). For a few rows over long
  slots, where the unsplit kernel is a handful of programs each walking every key.

:func:`tree_attention` is the same attention for a draft tree's window (DESIGN.md
section 2, "Trees"): window entry ``j`` of a row sits at cache position ``starts[b] +
j`` (node ``j``), and a query sees the whole prefix before ``starts[b]`` plus the window
entries its row of ``visible`` marks (its ancestors and itself), the ancestor mask in
place of the causal one. Both backends take it: the Triton kernel reads each query's
visible entries as a bitmask.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..ops.dispatch import resolve
from .activations import sigmoid_mul_reference
from ..ops.triton_common import ARRIVAL_COUNTERS, INTERPRETER, chain_launch, check_arrivals, triton

if triton is not None:
    import triton.language as tl

    from ..ops.triton_common import chain_wait, expf, last_to_arrive, to_rtne


def _check(q, k_cache, v_cache, slot_idx, starts, gate=None):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, heads, D], got shape {list(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [slots, kv_heads, L, D] alike, got {list(k_cache.shape)} "
                         f"and {list(v_cache.shape)}")
    b, _, heads, d = q.shape
    if k_cache.shape[-1] != d or heads % k_cache.shape[1]:
        raise ValueError(f"q has {heads} heads of {d}; the cache {k_cache.shape[1]} key heads of {k_cache.shape[-1]}")
    for name, x in (("slot_idx", slot_idx), ("starts", starts)):
        if x.shape != (b,) or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int tensor [{b}], got {x.dtype} {list(x.shape)}")
    if gate is not None:
        want = (b * q.shape[1], heads, d)
        if gate.shape != want or gate.dtype != q.dtype or gate.device != q.device or gate.stride(-1) != 1:
            raise ValueError(f"gate must be a {q.dtype} tensor {list(want)} on {q.device}, contiguous along its last "
                             f"axis, got {gate.dtype} {list(gate.shape)} strides {list(gate.stride())} on {gate.device}")


def _visible_mask(starts: torch.Tensor, visible: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[B, M, L]`` bool: query ``m`` of row ``b`` sees key position ``l`` when ``l <
    starts[b]`` or ``l = starts[b] + j`` with ``visible[m, j]``."""
    m, w = visible.shape
    rel = torch.arange(capacity, device=starts.device)[None] - starts.long()[:, None]  # [B, L]
    in_window = (rel >= 0) & (rel < w)
    vis = visible[None].expand(starts.shape[0], m, w).gather(2, rel.clamp(0, w - 1)[:, None].expand(-1, m, -1))
    return (rel < 0)[:, None] | (in_window[:, None] & vis)


def _attend_masked(q, k_cache, v_cache, slot_idx, mask, scale):
    """SDPA of ``q [B, T, heads, D]`` over each row's whole cache slot under ``mask [B, T, L]``."""
    idx = slot_idx.long()
    keys, values = k_cache[idx].to(q.dtype), v_cache[idx].to(q.dtype)  # [B, kvH, L, D]
    groups = q.shape[2] // k_cache.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)


def slot_attention_reference(q, k_cache, v_cache, slot_idx, starts, scale: float) -> torch.Tensor:
    """See :func:`slot_attention`."""
    t, cap = q.shape[1], k_cache.shape[2]
    q_pos = starts.long()[:, None] + torch.arange(t, device=q.device)  # [B, T]
    mask = torch.arange(cap, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, T, L]
    return _attend_masked(q, k_cache, v_cache, slot_idx, mask, scale)


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_idx: torch.Tensor,
                   starts: torch.Tensor, scale: float, *, backend: str = "auto",
                   gate: torch.Tensor | None = None, key_split: int = 0,
                   arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``T`` query tokens per row over each row's cache slot.

    Args:
        q: ``[B, T, heads, D]`` rotated queries.
        k_cache, v_cache: ``[slots, kv_heads, L, D]`` one layer's cache, the window's
            keys and values already written at positions ``starts[b] + t``.
        slot_idx: ``[B]`` cache slot of each row (padding rows point at any slot whose
            entries are finite; their outputs are meaningless).
        starts: ``[B]`` committed length of each row (position of its first query), any
            stride (a column of a ``[B, T]`` positions tensor, read in place).
        scale: softmax scale.
        backend: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton on CUDA).
        gate: ``None``, or the output gate ``[B * T, heads, D]`` (``q``'s dtype, last
            axis contiguous; a strided view of the query projection): the outputs times
            ``sigmoid(gate)``, the bits of
            :func:`~replayssm.engine.activations.sigmoid_mul` after the attention, in
            the attention's launch on the Triton backend.
        key_split: ``0``, or ``C``: the Triton kernel splits each row's keys into parts
            of ``C`` from position 0 (a power of two, at least the kernel's key block of
            64), merged by the last part to finish (module docstring); the reference
            ignores it. Needs ``arrivals``.
        arrivals: with ``key_split``, counters from
            :func:`~replayssm.ops.triton_common.arrival_counters`, one per (row, key head).

    Returns:
        ``[B, T, heads, D]`` in the dtype of ``q``.
    """
    _check(q, k_cache, v_cache, slot_idx, starts, gate)
    _check_split(key_split, arrivals, q.shape[0] * k_cache.shape[1], q.device)
    if resolve(backend, q.device) == "reference":
        return _gated(slot_attention_reference(q, k_cache, v_cache, slot_idx, starts, scale), gate)
    if triton is None:
        raise RuntimeError("backend='triton' for slot attention needs the triton package")
    if q.device.type != "cuda" and not INTERPRETER:
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 before importing replayssm")
    return _slot_attention_triton(q, k_cache, v_cache, slot_idx, starts, scale, gate=gate, key_split=key_split,
                                  arrivals=arrivals)


#: The least part of a key split: the kernel's key block.
KEY_SPLIT_MIN = 64


def _check_split(key_split, arrivals, counters: int, device: torch.device) -> None:
    """A ``ValueError`` unless ``key_split`` is 0, or a power of two of at least
    :data:`KEY_SPLIT_MIN` with ``arrivals`` counters for ``counters`` (row, key head) pairs."""
    if isinstance(key_split, bool) or not isinstance(key_split, int) or key_split < 0 \
            or key_split and (key_split < KEY_SPLIT_MIN or key_split & (key_split - 1)):
        raise ValueError(f"key_split must be 0 or a power of two >= {KEY_SPLIT_MIN}, got {key_split!r}")
    if not key_split:
        return
    if arrivals is None:
        raise ValueError("key_split needs arrivals (arrival_counters): the last part merges the row's parts")
    check_arrivals(arrivals, device)
    if counters > ARRIVAL_COUNTERS:
        raise ValueError(f"key_split counts on one counter per (row, key head): {counters} rows x key heads, more "
                         f"than the {ARRIVAL_COUNTERS} arrival counters")


def _gated(o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``o [B, T, heads, D]`` times ``sigmoid(gate [B * T, heads, D])`` (torch's two ops), or ``o``."""
    return o if gate is None else sigmoid_mul_reference(o.reshape(gate.shape), gate).view(o.shape)


def tree_attention_reference(q, k_cache, v_cache, slot_idx, starts, visible, scale: float) -> torch.Tensor:
    """See :func:`tree_attention`."""
    return _attend_masked(q, k_cache, v_cache, slot_idx, _visible_mask(starts, visible, k_cache.shape[2]), scale)


def visibility_bits(visible: torch.Tensor) -> torch.Tensor:
    """``[M]`` int64: row ``m`` of a bool mask ``visible [M, W]`` (``W <= 64``) as a bit
    set, bit ``j`` set where the row sees window entry ``j`` (what the Triton kernel
    reads). Four kernels; a static tree's are built once
    (:attr:`~replayssm.engine.trees.StaticTree.ancestor_bits`)."""
    w = visible.shape[1]
    return (visible.long() << torch.arange(w, device=visible.device)).sum(1)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_idx: torch.Tensor,
                   starts: torch.Tensor, visible: torch.Tensor, scale: float, *, backend: str = "auto",
                   gate: torch.Tensor | None = None, visible_bits: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``M`` query nodes per row over the prefix and the ancestors in a tree window.

    Args:
        q: ``[B, M, heads, D]`` rotated queries (rotary position ``start + depth``).
        k_cache, v_cache: ``[slots, kv_heads, L, D]``, window entry ``j`` (tree node
            ``j``) already written at position ``starts[b] + j``.
        slot_idx, starts: ``[B]`` cache slot and window start (committed length) per row.
        visible: ``[M, W]`` bool, the window entries each query sees (its ancestors and
            itself: a row of :attr:`StaticTree.ancestors`), ``W <= 64``; shared by the rows.
        scale: softmax scale.
        backend: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton on CUDA).
        gate: as :func:`slot_attention`'s (``[B * M, heads, D]``).
        visible_bits: ``None``, or ``visible``'s rows as bit sets, ``[M]`` int64, as
            :func:`visibility_bits` gives them (built once per tree instead of per call;
            the Triton kernel reads them, the reference ``visible``).

    Returns:
        ``[B, M, heads, D]`` in the dtype of ``q``. No host read: graph-safe.
    """
    _check(q, k_cache, v_cache, slot_idx, starts, gate)
    m = q.shape[1]
    if visible.dim() != 2 or visible.dtype != torch.bool or visible.shape[0] != m or not 1 <= visible.shape[1] <= 64:
        raise ValueError(f"visible must be a bool [{m}, W] mask with 1 <= W <= 64, got {visible.dtype} "
                         f"{list(visible.shape)}")
    if visible_bits is not None and (visible_bits.shape != (m,) or visible_bits.dtype != torch.int64
                                     or visible_bits.device != visible.device):
        raise ValueError(f"visible_bits must be an int64 [{m}] tensor on {visible.device}, got {visible_bits.dtype} "
                         f"{list(visible_bits.shape)} on {visible_bits.device}")
    if resolve(backend, q.device) == "reference":
        return _gated(tree_attention_reference(q, k_cache, v_cache, slot_idx, starts, visible, scale), gate)
    if triton is None:
        raise RuntimeError("backend='triton' for tree attention needs the triton package")
    if q.device.type != "cuda" and not INTERPRETER:
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 before importing replayssm")
    bits = visibility_bits(visible) if visible_bits is None else visible_bits.contiguous()
    return _slot_attention_triton(q, k_cache, v_cache, slot_idx, starts, scale, tree_bits=bits,
                                  window=visible.shape[1], gate=gate)


#: Software-pipeline stages of the Triton kernel's pass over a slot's keys: the next
#: blocks of keys and values are in flight while this one is multiplied. A step's
#: programs are few (requests x key heads) and each walks its keys in order, so other
#: programs do not hide a load's latency. Three stages measured 1.3-1.5x faster than
#: one on the H200 at Qwen3.5 shapes, verify (T = 4) and decoding (T = 1), batch 64 and
#: 256 (BENCHMARKS.md, "The window attention pipelined"). An upper bound: a launch
#: takes fewer where the stages' key and value blocks would not fit the device's
#: shared memory (:func:`kv_stages`).
KV_STAGES = 3


def attention_warps(block_m: int, d: int, itemsize: int) -> int:
    """Warps of the Triton kernel for a query tile of ``block_m`` rows at head dim ``d``
    of ``itemsize``-byte queries: 4 up to 32 x 128 elements, and for up to 32 rows of
    16-bit queries at head dim 256 (a verify window of 4 tokens over the 8 query heads
    of a key head, Qwen3.5's attention), else 8. At that tile 4 warps measured 7% and
    10% faster than 8 on an H100 at batch 256 and 64 in bf16, with the same bits (a GPU
    test compares them; BENCHMARKS.md, "Where a closed batch's decode time goes");
    fp32 tiles of that size were not measured."""
    return 4 if block_m * d <= 32 * 128 or (d == 256 and block_m <= 32 and itemsize <= 2) else 8


@functools.lru_cache(maxsize=None)
def _shared_memory(index: int) -> int:
    """Shared memory a block of CUDA device ``index`` may opt in to, in bytes."""
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def kv_stages(device: torch.device, block_m: int, block_n: int, d: int, itemsize: int) -> int:
    """Pipeline stages of the key pass for a launch: :data:`KV_STAGES`, or fewer, at
    least 1, so that the stages' key and value blocks (``2 x block_n x d`` elements
    each) beside the query tile and the probabilities fit the device's shared memory
    per block (fp32 heads of 256 on an H200 take 2; smaller cards fewer)."""
    if device.type != "cuda":
        return KV_STAGES  # the interpreter ignores stages
    room = _shared_memory(device.index if device.index is not None else torch.cuda.current_device())
    fixed = (block_m * d + block_m * block_n) * itemsize + 8 * 1024  # the dots' other operands, and slack
    per_stage = 2 * block_n * d * itemsize
    return max(1, min(KV_STAGES, (room - fixed) // per_stage))


def _slot_attention_triton(q, k_cache, v_cache, slot_idx, starts, scale, tree_bits=None, window=0, gate=None,
                           key_split=0, arrivals=None):
    b, t, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    groups = heads // kv_heads
    if d != triton.next_power_of_2(d) or d < 16:
        raise ValueError(f"the Triton slot attention needs a power-of-two head_dim >= 16, got {d}")
    if q.stride(-1) != 1:  # rows, tokens and heads may have any strides (a slice of a q/k buffer)
        q = q.contiguous()
    slot_idx = slot_idx.contiguous()  # read as a flat array; starts at its stride (a column of positions)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m = max(16, triton.next_power_of_2(groups * t))
    block_n = 64 if d <= 128 else 32
    tree = tree_bits is not None
    gated = gate is not None
    parts = 1
    part_m = part_acc = out  # (unused without a split)
    if key_split:  # (causal windows: tree_attention takes no split)
        parts = triton.cdiv(k_cache.shape[2], key_split)
        # each part's running max and sum, then its unnormalised outputs, per (row, key head)
        part_m = torch.empty((b, kv_heads, parts, 2, block_m), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((b, kv_heads, parts, block_m, d), dtype=torch.float32, device=q.device)
    chained, launch = chain_launch()
    _slot_attention_kernel[(b, kv_heads, parts)](
        q, k_cache, v_cache, slot_idx, starts, starts.stride(0), out, tree_bits if tree else starts, scale,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        gate if gated else out, gate.stride(0) if gated else 0, gate.stride(1) if gated else 0,
        part_m, part_acc, arrivals if key_split else out, parts,
        T=t, G=groups, D=d, BLOCK_M=block_m, BLOCK_N=block_n, TREE=tree, W=window if tree else t, GATE=gated,
        SPLIT=key_split,
        STAGES=kv_stages(q.device, block_m, block_n, d, max(q.element_size(), k_cache.element_size())),
        # fp32 models get fp32 products (tl.dot would round fp32 operands to tf32 on
        # CUDA); 16-bit operands are exact in either.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        CHAINED=chained, num_warps=attention_warps(block_m, d, q.element_size()), **launch,
    )
    return out


if triton is not None:

    @triton.jit
    def _attend_keys(q, k_ptr, v_ptr, base, stride_kl, lo, hi, last, bits, start, scale, offs_d,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, TREE: tl.constexpr,
                     W: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
        """The online softmax of the tile's queries ``q`` over keys ``[lo, hi)`` (``lo`` a
        multiple of ``BLOCK_N``), each row up to its ``last`` key (``TREE``: the window's
        entries by its visibility ``bits``): ``(m, l, acc)``, the rows' running max, sum
        of ``exp(s - m)`` and unnormalised outputs. A block past a row's last key leaves
        its three unchanged, bit for bit (``p = 0``, ``alpha = 1``)."""
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            kv_ok = offs_n < hi
            kv_off = base + offs_n[:, None] * stride_kl + offs_d[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PRECISION) * scale
            if TREE:
                rel = offs_n - start
                in_win = (rel >= 0) & (rel < W)
                seen = ((bits[:, None] >> tl.where(in_win, rel, 0)[None, :]) & 1) != 0
                s = tl.where((rel < 0)[None, :] | (in_win[None, :] & seen), s, float("-inf"))
            else:
                s = tl.where(offs_n[None, :] <= last[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet (a later part of the split, past its last
            # key) keeps m = -inf: its exponents are taken from 0 so that they are 0,
            # not NaN. Any other row's m is finite (every row sees key 0), unchanged.
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_exp)
            p = tl.exp(s - m_exp[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=kv_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _merge_key_parts(pm_at, pacc_at, parts, offs_m, offs_d, BLOCK_M: tl.constexpr, D: tl.constexpr):
        """The rows' ``(l, acc)`` over their ``parts`` parts, merged in part order from
        the parts' stored max and sum (``pm_at``, ``[parts, 2, BLOCK_M]``) and
        unnormalised outputs (``pacc_at``, ``[parts, BLOCK_M, D]``), written by other
        programs of this launch (read past L1). A part wholly past a row's last key
        (max -inf, sum and outputs 0) leaves the row's bits unchanged, and part 0 holds
        key 0, which every row sees, so a row's result depends on the parts up to its
        own last key alone."""
        m_i = tl.load(pm_at + offs_m, cache_modifier=".cg")
        l_i = tl.load(pm_at + BLOCK_M + offs_m, cache_modifier=".cg")
        acc = tl.load(pacc_at + offs_m[:, None] * D + offs_d[None, :], cache_modifier=".cg")
        for c in range(1, parts):
            m_c = tl.load(pm_at + c * 2 * BLOCK_M + offs_m, cache_modifier=".cg")
            l_c = tl.load(pm_at + (c * 2 + 1) * BLOCK_M + offs_m, cache_modifier=".cg")
            acc_c = tl.load(pacc_at + c * BLOCK_M * D + offs_m[:, None] * D + offs_d[None, :], cache_modifier=".cg")
            m_new = tl.maximum(m_i, m_c)
            alpha = tl.exp(m_i - m_new)
            beta = tl.exp(m_c - m_new)
            l_i = l_i * alpha + l_c * beta
            acc = acc * alpha[:, None] + acc_c * beta[:, None]
            m_i = m_new
        return l_i, acc

    @triton.jit
    def _finish_rows(acc, l_i, o_ptr, g_ptr, i_b, tok, head, row_ok, offs_d, stride_ob, stride_ot, stride_oh,
                     stride_gn, stride_gh, T: tl.constexpr, GATE: tl.constexpr):
        """The rows' outputs ``acc / l``, rounded, gated where ``GATE``, stored."""
        acc = acc / l_i[:, None]
        o = acc.to(o_ptr.dtype.element_ty)
        if GATE:
            # The output gate as activations.sigmoid_mul computes it on the rounded
            # outputs: torch's sigmoid (expf, an IEEE division) rounded to the dtype,
            # then the product rounded.
            g_off = (i_b * T + tok).to(tl.int64) * stride_gn + head * stride_gh
            gv = tl.load(g_ptr + g_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            sg = to_rtne(tl.div_rn(1.0, 1.0 + expf(-gv.to(tl.float32))), gv.dtype).to(tl.float32)
            o = to_rtne(o.to(tl.float32) * sg, o_ptr.dtype.element_ty)
        o_off = i_b * stride_ob + tok * stride_ot + head * stride_oh
        tl.store(o_ptr + o_off[:, None] + offs_d[None, :], o, mask=row_ok[:, None])

    @triton.jit
    def _slot_attention_kernel(
        q_ptr, k_ptr, v_ptr, slot_ptr, start_ptr, stride_start, o_ptr, bits_ptr, scale,
        stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh, stride_ks, stride_kh, stride_kl,
        g_ptr, stride_gn, stride_gh, pm_ptr, pacc_ptr, arrivals_ptr, n_parts,
        T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        TREE: tl.constexpr, W: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr = 1,
        GATE: tl.constexpr = False, SPLIT: tl.constexpr = 0, CHAINED: tl.constexpr = False,
    ):
        """Row ``program_id(0)``'s queries of key head ``program_id(1)`` over its slot's
        keys ``0 .. starts + W`` (``TREE``: the window's entries by its visibility bits),
        normalised, gated where ``GATE``, stored. With ``SPLIT``: only keys ``[c SPLIT,
        (c + 1) SPLIT)`` for part ``c = program_id(2)`` (of ``n_parts``, the cache's),
        the row's last part to finish merging them (``arrivals_ptr``, one counter per
        row and key head). ``CHAINED``: launched by
        :func:`~replayssm.ops.triton_common.chain_launch`."""
        chain_wait(CHAINED)
        i_b = tl.program_id(0)
        i_kh = tl.program_id(1)
        slot = tl.load(slot_ptr + i_b).to(tl.int64)
        start = tl.load(start_ptr + i_b * stride_start).to(tl.int64)
        # Tile row m holds query token m // G of head i_kh * G + m % G.
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        tok = offs_m // G
        head = i_kh * G + offs_m % G
        row_ok = offs_m < T * G
        last = start + tok  # the last key each row sees (causal window)
        bits = last
        if TREE:  # bit j of a query's mask: it sees window entry j (an ancestor, or itself)
            bits = tl.load(bits_ptr + tok, mask=row_ok, other=0).to(tl.int64)
        base = slot * stride_ks + i_kh * stride_kh
        hi = start + W
        lo = 0
        if SPLIT:
            lo = tl.program_id(2).to(tl.int64) * SPLIT
        if lo < hi:  # (a part past the window's last key has nothing to do)
            q_off = i_b * stride_qb + tok * stride_qt + head * stride_qh
            q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            if SPLIT:
                m_i, l_i, acc = _attend_keys(q, k_ptr, v_ptr, base, stride_kl, lo, tl.minimum(lo + SPLIT, hi), last,
                                             bits, start, scale, offs_d, BLOCK_M, BLOCK_N, D, TREE, W, PRECISION,
                                             STAGES)
                parts = (hi + SPLIT - 1) // SPLIT
                if parts == 1:
                    _finish_rows(acc, l_i, o_ptr, g_ptr, i_b, tok, head, row_ok, offs_d, stride_ob, stride_ot,
                                 stride_oh, stride_gn, stride_gh, T, GATE)
                else:
                    pair = i_b * tl.num_programs(1) + i_kh
                    pm_at = pm_ptr + pair.to(tl.int64) * n_parts * 2 * BLOCK_M
                    pacc_at = pacc_ptr + pair.to(tl.int64) * n_parts * BLOCK_M * D
                    part = tl.program_id(2)
                    tl.store(pm_at + part * 2 * BLOCK_M + offs_m, m_i)
                    tl.store(pm_at + (part * 2 + 1) * BLOCK_M + offs_m, l_i)
                    tl.store(pacc_at + part * BLOCK_M * D + offs_m[:, None] * D + offs_d[None, :], acc)
                    if last_to_arrive(arrivals_ptr + pair, parts):
                        l_i, acc = _merge_key_parts(pm_at, pacc_at, parts, offs_m, offs_d, BLOCK_M, D)
                        _finish_rows(acc, l_i, o_ptr, g_ptr, i_b, tok, head, row_ok, offs_d, stride_ob, stride_ot,
                                     stride_oh, stride_gn, stride_gh, T, GATE)
                        tl.store(arrivals_ptr + pair, 0)
            else:
                m_i, l_i, acc = _attend_keys(q, k_ptr, v_ptr, base, stride_kl, 0, hi, last, bits, start, scale,
                                             offs_d, BLOCK_M, BLOCK_N, D, TREE, W, PRECISION, STAGES)
                _finish_rows(acc, l_i, o_ptr, g_ptr, i_b, tok, head, row_ok, offs_d, stride_ob, stride_ot,
                             stride_oh, stride_gn, stride_gh, T, GATE)
