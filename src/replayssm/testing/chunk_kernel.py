"""A stand-in for fla-core's chunked prompt kernel that runs on the CPU.

:func:`chunk_kernel_on_cpu` keeps the contract the strategies call the chunked kernel
with (:meth:`~replayssm.strategies.Strategy.chunk_prefill`: fla-core's
``chunk_gated_delta_rule`` from 0.6, grouped value heads, states ``[V, K]`` with
``state_v_first=True``) and computes it with transformers' chunked PyTorch
implementation, one sequence at a time. It is another implementation than the
library's recurrence, so the engine's chunked paths can be tested against it on the CPU.
"""

from __future__ import annotations

import torch


def chunk_kernel_on_cpu(q, k, v, g, beta, *, initial_state=None, output_final_state=False, cu_seqlens=None,
                        chunk_indices=None, use_qk_l2norm_in_kernel=False, state_v_first=False,
                        chunk_size: int = 8):
    """fla-core's ``chunk_gated_delta_rule`` (the arguments the strategies pass).

    Args:
        q, k: ``[1, N, H, K]`` (``B`` sequences packed by ``cu_seqlens``), or ``[B, T, H,
            K]`` without it (fla's batch mode: ``B`` sequences of ``T`` tokens); value
            head ``h`` reads key head ``h // (HV / H)``.
        v: ``[1, N, HV, V]`` or ``[B, T, HV, V]``.
        g, beta: ``[1, N, HV]`` or ``[B, T, HV]`` log decays and write strengths.
        initial_state: ``[B, HV, V, K]`` (``state_v_first``) or ``[B, HV, K, V]``;
            ``None``: zero.
        cu_seqlens: ``[B + 1]`` int64 offsets (``q`` of batch 1); ``None``: each batch
            row one sequence. A sequence may be empty (no outputs; its final state is
            its initial one, as fla-core's).
        chunk_indices: with ``cu_seqlens``, the chunk list fla-core would otherwise
            derive, ``[M, 2]`` (sequence, chunk) per chunk of 64 tokens; checked, since
            fla-core trusts it: the sequences' chunks in order, then only entries
            ``(s, 0)`` of an empty sequence ``s`` (which compute nothing there), else
            ``ValueError``. The computation does not use it.
        chunk_size: transformers' chunk length (small, so short test prompts span
            several chunks).

    Returns:
        ``(o shaped like v, final [B, HV, V, K] or [B, HV, K, V], or None)``.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    if ((cu_seqlens is not None and q.shape[0] != 1) or k.shape != q.shape or v.shape[:2] != q.shape[:2]
            or v.shape[2] % q.shape[2] or g.shape != v.shape[:3] or beta.shape != v.shape[:3]):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)} break the contract")
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    if cu_seqlens is not None and cu_seqlens.dtype != torch.int64:
        raise TypeError(f"cu_seqlens must be int64, got {cu_seqlens.dtype}")
    if chunk_indices is not None:
        check_chunk_list(cu_seqlens, chunk_indices)
    if cu_seqlens is None:  # batch mode: row i of every input is sequence i
        seqs = [(i, slice(None)) for i in range(q.shape[0])]
    else:
        cu = cu_seqlens.tolist()
        seqs = [(0, slice(cu[i], cu[i + 1])) for i in range(len(cu) - 1)]
    outs, finals = [], []
    for n, (i, sl) in enumerate(seqs):
        h0 = None if initial_state is None else initial_state[n : n + 1].float()
        if h0 is not None and state_v_first:
            h0 = h0.transpose(-1, -2)
        if sl.start is not None and sl.start == sl.stop:  # an empty sequence: its state stays
            s = h0 if h0 is not None else torch.zeros(1, v.shape[2], k.shape[3], v.shape[3])
        else:
            o, s = torch_chunk_gated_delta_rule(*(x[i : i + 1, sl] for x in (q, k, v, g, beta)),
                                                chunk_size=chunk_size, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
        finals.append(s.transpose(-1, -2) if state_v_first else s)
    o = torch.cat(outs, 0 if cu_seqlens is None else 1)
    return o, (torch.cat(finals, 0) if output_final_state else None)


def check_chunk_list(cu_seqlens, chunk_indices, chunk: int = 64) -> None:
    """Refuse a chunk list that is not ``cu_seqlens``' chunks of ``chunk`` tokens in
    order followed by entries ``(s, 0)`` of an empty sequence ``s``."""
    if cu_seqlens is None or chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
        raise ValueError(f"chunk_indices must be [M, 2] and come with cu_seqlens, got {list(chunk_indices.shape)}")
    cu = cu_seqlens.tolist()
    want = [(s, c) for s in range(len(cu) - 1) for c in range(-(-(cu[s + 1] - cu[s]) // chunk))]
    got = [tuple(e) for e in chunk_indices.tolist()]
    rest = got[len(want):]
    if got[: len(want)] != want or any(c != 0 or not 0 <= s < len(cu) - 1 or cu[s] != cu[s + 1] for s, c in rest):
        raise ValueError(f"chunk_indices {got} are not the chunks {want} of offsets {cu}, then entries of an "
                         f"empty sequence")
