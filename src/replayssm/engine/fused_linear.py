"""Projections of one input in one matmul: a GDN layer's ``q|k|v``, ``a`` and ``b``; a
full-attention layer's ``q_proj``, ``k_proj`` and ``v_proj``; an MLP's ``gate`` and ``up``.

Transformers' modules run each ``nn.Linear`` as its own matmul. At small batch a matmul
is a weight read plus a launch's latency, so the two ``[HV, hidden]`` gate projections
of a GDN layer cost about what the ``[C, hidden]`` one does. :func:`fuse_linears` lays
the weights of several linears out as consecutive row blocks of one tensor, each
module's weight becoming a view of its block: the values, the parameter names and the
model's memory stay as they were, and the modules still compute what they did.
:func:`fused_weight` then returns that tensor (a view, no copy) while the layout holds,
so one matmul computes every output; after anything replaces a weight (a new
parameter, say) it returns ``None`` and the callers run the modules again.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _plain(linear) -> bool:
    w = getattr(linear, "weight", None)
    return (isinstance(linear, torch.nn.Linear) and linear.bias is None and isinstance(w, torch.Tensor)
            and w.dim() == 2 and w.device.type != "meta" and w.is_contiguous())


def fused_weight(linears: Sequence[torch.nn.Module]) -> torch.Tensor | None:
    """``[sum of out_features, in_features]``: the weights of ``linears`` (plain
    ``nn.Linear`` of one input, no bias) as one tensor, a view of their storage, if
    they lie there as consecutive row blocks (:func:`fuse_linears`); else ``None``."""
    if not linears or not all(_plain(m) for m in linears):
        return None
    first = linears[0].weight
    end, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for m in linears:
        w = m.weight
        if (w.untyped_storage().data_ptr() != storage or w.storage_offset() != end or w.dtype != first.dtype
                or w.shape[1] != first.shape[1]):
            return None
        end += w.numel()
    rows = sum(m.weight.shape[0] for m in linears)
    return first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1))


@torch.no_grad()
def fuse_linears(linears: Sequence[torch.nn.Module]) -> bool:
    """Lay the weights of ``linears`` out as consecutive row blocks of one new tensor
    (the modules' weights become views of it; their old tensors are freed unless held
    elsewhere). Already so laid out: nothing moves. Returns whether
    :func:`fused_weight` now gives the fused tensor (``False``, nothing changed, for
    modules that are not plain ``nn.Linear`` without bias of one input and dtype)."""
    if fused_weight(linears) is not None:
        return True
    if not linears or not all(_plain(m) for m in linears):
        return False
    first = linears[0].weight
    if any(m.weight.dtype != first.dtype or m.weight.device != first.device or m.weight.shape[1] != first.shape[1]
           for m in linears):
        return False
    fused = torch.cat([m.weight.detach() for m in linears], 0)
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[row : row + rows], requires_grad=m.weight.requires_grad)
        row += rows
    return True
