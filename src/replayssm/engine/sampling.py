"""Sampling and draft acceptance.

Greedy acceptance keeps draft ``d_j`` while it equals the target's argmax at the
position before it; the first mismatch (or the bonus position after the last draft)
takes the target's argmax. The output is token for token that of plain greedy decoding.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) preserves the target
distribution for temperature / top-k / top-p sampling. With target probabilities ``p_j``
(after warping) and draft probabilities ``q_j`` at window position ``j``:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
    on the first rejection, emit a token drawn from  norm(max(p_j - q_j, 0))
    if every draft is accepted, emit a bonus token drawn from p_T

Deterministic drafters (n-gram lookup, greedy MTP) have ``q_j = onehot(d_j)``: accept
with probability ``p_j(d_j)``, else draw from ``p_j`` with ``d_j`` removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen, and (for :meth:`replayssm.LLM.generate`) how many.

    Attributes:
        temperature: ``0`` for greedy decoding, else the softmax temperature (> 0).
        top_p: nucleus mass in ``(0, 1]``; ``1`` keeps every token.
        top_k: keep the ``k`` most likely tokens; ``0`` keeps every token.
        max_tokens: tokens to generate per request (at most; an end-of-sequence token
            stops earlier). Read by :class:`replayssm.LLM`; the generators take their
            budget as an argument.
        ignore_eos: keep generating past end-of-sequence tokens (:class:`replayssm.LLM`).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p: ``[..., V]`` -> float32 ``[..., V]``.

    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``
    (always at least the most likely token).
    """
    if params.greedy:
        raise ValueError("warp_probs needs temperature > 0 (greedy decoding takes the argmax)")
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs [R, V]`` without a host synchronisation: the index of
    the smallest ``E_i / p_i`` with ``E_i ~ Exp(1)`` (an exponential race), which is
    distributed as ``p``."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(-1)


def greedy_accept(argmax: list[int], drafts: list[int]) -> tuple[int, int]:
    """Greedy acceptance for one request.

    Args:
        argmax: the target's argmax at each window position (``len(drafts) + 1``).
        drafts: the draft tokens (window positions ``1..``).

    Returns:
        ``(accepted_drafts, next_token)``.
    """
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return n, argmax[n]


def rejection_sample(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, num_drafts: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distribution-preserving acceptance for a batch of padded windows.

    Args:
        p: ``[B, T, V]`` target probabilities at each window position (rows past a
            request's ``num_drafts + 1`` positions are ignored).
        drafts: ``[B, T - 1]`` int64 draft tokens (padding ignored).
        q: ``[B, T - 1, V]`` draft probabilities, or ``None`` for deterministic drafts
            (``q_j = onehot(d_j)``).
        num_drafts: ``[B]`` int64 drafts per request, ``0 <= n <= T - 1``.
        generator: random source (on ``p``'s device).

    Returns:
        ``(accepted [B], next_token [B])``: accepted drafts per request and the token
        emitted after them (correction or bonus), both int64.
    """
    if p.dim() != 3:
        raise ValueError(f"p must be [B, T, V], got shape {list(p.shape)}")
    b, t, v = p.shape
    if drafts.shape != (b, t - 1):
        raise ValueError(f"drafts must be [{b}, {t - 1}], got {list(drafts.shape)}")
    if q is not None and q.shape != (b, t - 1, v):
        raise ValueError(f"q must be [{b}, {t - 1}, {v}], got {list(q.shape)}")
    if num_drafts.shape != (b,) or bool(((num_drafts < 0) | (num_drafts > t - 1)).any()):
        raise ValueError(f"num_drafts must be [{b}] with values in [0, {t - 1}]")
    return _reject(p, drafts.long(), q, num_drafts.long(), generator)


def _reject(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, num_drafts: torch.Tensor | None,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule on validated inputs, without a host synchronisation (so a CUDA
    graph can hold it): accept ``d_j`` while ``u q_j(d_j) < p_j(d_j)`` (and ``j <
    num_drafts``; ``None``: every draft counts), then draw the correction from
    ``norm(max(p_j - q_j, 0))`` (``q = None``: ``p_j`` without ``d_j``) or the bonus
    token from ``p``'s next position."""
    b, t, v = p.shape
    if t == 1:
        return torch.zeros(b, dtype=torch.long, device=p.device), sample_categorical(p[:, 0], generator)
    p_d = p[:, :-1].gather(-1, drafts[..., None])[..., 0]  # [B, T-1]
    q_d = torch.ones_like(p_d) if q is None else q.gather(-1, drafts[..., None])[..., 0]
    ok = torch.rand(p_d.shape, device=p.device, generator=generator) * q_d < p_d  # min(1, p/q)
    if num_drafts is not None:
        ok &= torch.arange(t - 1, device=p.device)[None] < num_drafts[:, None]
    n = ok.long().cumprod(1).sum(1)  # the accepted prefix
    p_next = p.gather(1, n[:, None, None].expand(b, 1, v))[:, 0]  # [B, V]: first rejected position / bonus
    j = n.clamp(max=t - 2)  # the draft that failed (if any)
    if q is None:
        residual = p_next.scatter(-1, drafts.gather(1, j[:, None]), 0.0)
    else:
        residual = (p_next - q.gather(1, j[:, None, None].expand(b, 1, v))[:, 0]).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # A rejection has probability 0 when p == q; guard the 0/0 anyway.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    rejected = n < (t - 1 if num_drafts is None else num_drafts)
    return n, sample_categorical(torch.where(rejected[:, None], residual, p_next), generator)


# ---------------------------------------------------------------------- static steps
# Acceptance inside a static (CUDA-graph) step: every row has a full window ``[B, T]``
# (``T - 1`` drafts), nothing is read on the host, and randomness comes from torch's
# generator of the device (graph replays advance it).
def accept_greedy_static(logits: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of full windows.

    Args:
        logits: ``[B, T, V]`` target logits at every window position.
        window: ``[B, T]`` the window's tokens (last accepted token, then ``T - 1`` drafts).

    Returns:
        ``(accepted_drafts [B], next_token [B])`` int64, as :func:`greedy_accept` per row.
    """
    return accept_greedy_argmax(logits.argmax(-1), window)


def accept_greedy_argmax(argmax: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accept_greedy_static` from the target's tokens ``argmax [B, T]`` (int64)."""
    if window.shape[1] == 1:
        return torch.zeros_like(argmax[:, 0]), argmax[:, 0]
    match = window[:, 1:] == argmax[:, :-1]
    n = match.long().cumprod(1).sum(1)
    return n, argmax.gather(1, n[:, None])[:, 0]


def accept_sampled_static(logits: torch.Tensor, window: torch.Tensor, params: SamplingParams,
                          generator: torch.Generator | None = None,
                          q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of full windows: accept draft ``d_j`` with probability
    ``min(1, p_j(d_j) / q_j(d_j))``; on the first rejection draw from
    ``norm(max(p_j - q_j, 0))``; if all are accepted draw the bonus token from ``p_T``.
    ``q = None`` means deterministic drafts (``q_j = onehot(d_j)``: accept with
    probability ``p_j(d_j)``, else draw from ``p_j`` without ``d_j``).

    Args:
        logits, window: as :func:`accept_greedy_static`; ``params`` warps the logits.
        q: ``[B, T - 1, V]`` draft probabilities of sampled drafts, or ``None``.

    Returns:
        ``(accepted_drafts [B], next_token [B])`` int64.
    """
    b, t, v = logits.shape
    p = warp_probs(logits.reshape(b * t, v), params).view(b, t, v)
    return _reject(p, window[:, 1:], q, None, generator)


# ---------------------------------------------------------------------- draft trees
# Acceptance over a static draft tree (:class:`replayssm.engine.trees.StaticTree`): every
# row holds the tree's ``N`` nodes as its window (node 0 the last emitted token); the
# target's outputs at node ``i`` are its prediction for the token after node ``i``'s
# root path. Both rules return the accepted node per row (the deepest node of the path
# they keep; its depth is the accepted drafts) and the token emitted after it.
def accept_greedy_tree(argmax: torch.Tensor, tokens: torch.Tensor, tree) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a draft tree: the deepest node whose root path the target's
    greedy tokens follow (a node is kept when its token is the target's argmax at its
    parent and its parent is kept; between kept nodes of one depth, which only repeated
    sibling tokens make, the first).

    Args:
        argmax: ``[B, N]`` int64 target's greedy token after each node.
        tokens: ``[B, N]`` int64 the window (node tokens).
        tree: the :class:`~replayssm.engine.trees.StaticTree`.

    Returns:
        ``(node [B], next_token [B])`` int64: emitted tokens are the path's drafts
        (:meth:`StaticTree.path_tokens` without the root) and then ``next_token``.
        Graph-safe: no host read.
    """
    n = tree.num_nodes
    if argmax.shape != tokens.shape or tokens.dim() != 2 or tokens.shape[1] != n:
        raise ValueError(f"argmax and tokens must both be [B, {n}], got {list(argmax.shape)} and {list(tokens.shape)}")
    follows = tokens == argmax.gather(1, tree.parents.clamp(min=0)[None].expand_as(tokens))
    follows[:, 0] = True  # the root is the last emitted token
    kept = ~(tree.ancestors[None] & ~follows[:, None, :]).any(-1)  # every node of the root path follows
    order = torch.arange(n, device=tokens.device)
    score = torch.where(kept, tree.depth[None] * n + (n - 1 - order)[None], -1)
    node = score.argmax(1)
    return node, argmax.gather(1, node[:, None])[:, 0]


def accept_sampled_tree(p: torch.Tensor, tokens: torch.Tensor, tree, q: torch.Tensor | None = None,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-candidate rejection sampling over a draft tree (SpecInfer's sequential
    rejection over siblings): from the root, try the current node's children in index
    order; child ``c`` (token ``x``, drawn from ``q_c``) is accepted with probability
    ``min(1, r(x) / q_c(x))``, where ``r`` starts as the target's ``p`` at the current
    node; on a rejection ``r <- norm(max(r - q_c, 0))`` and the next sibling is tried;
    an accepted child becomes the current node (``r = p`` there). When no child is
    accepted (or there are none) the emitted token is drawn from ``r``. The emitted
    tokens are then distributed as the target's sampling of them, token by token.

    ``q = None``: deterministic drafts (top-k, n-gram), ``q_c = onehot(x)``: accept with
    probability ``r(x)``, else remove ``x`` from ``r``. For sampled drafts, ``q[:, c]``
    must be the distribution child ``c``'s token was drawn from given the siblings
    before it (the same ``q`` for siblings drawn independently).

    Args:
        p: ``[B, N, V]`` warped target probabilities at each node.
        tokens: ``[B, N]`` int64 node tokens.
        tree: the :class:`~replayssm.engine.trees.StaticTree`.
        q: ``[B, N, V]`` draft probabilities per node, or ``None``.
        generator: random source (``None``: the device's default generator, which
            CUDA graph replays advance).

    Returns:
        ``(node [B], next_token [B])`` int64. Graph-safe: no host read.
    """
    b, n, v = p.shape
    if tokens.shape != (b, n) or n != tree.num_nodes:
        raise ValueError(f"tokens must be [{b}, {tree.num_nodes}] and p [B, {tree.num_nodes}, V], got "
                         f"{list(tokens.shape)} and {list(p.shape)}")
    if q is not None and q.shape != p.shape:
        raise ValueError(f"q must be {list(p.shape)} like p, got {list(q.shape)}")
    rows = torch.arange(b, device=p.device)
    cur = torch.zeros(b, dtype=torch.long, device=p.device)
    r = p[:, 0]
    alive = torch.ones(b, dtype=torch.bool, device=p.device)  # still descending
    for _ in range(tree.max_depth):
        moved = torch.zeros_like(alive)
        for i in range(tree.max_children):
            child = tree.children[cur, i]
            trying = alive & ~moved & (child >= 0)
            c = child.clamp(min=0)
            x = tokens[rows, c]
            r_x = r.gather(1, x[:, None])[:, 0]
            if q is None:
                q_c = torch.zeros_like(r).scatter_(1, x[:, None], 1.0)
                q_x = torch.ones_like(r_x)
            else:
                q_c = q[rows, c]
                q_x = q_c.gather(1, x[:, None])[:, 0]
            u = torch.rand(b, device=p.device, generator=generator)
            ok = trying & (u * q_x < r_x)
            residual = (r - q_c).clamp(min=0)
            mass = residual.sum(-1, keepdim=True)
            # a rejection has probability 0 where r == q_c; guard the 0/0 anyway
            residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), r)
            r = torch.where((trying & ~ok)[:, None], residual, r)
            cur = torch.where(ok, c, cur)
            r = torch.where(ok[:, None], p[rows, cur], r)
            moved |= ok
        alive &= moved
    return cur, sample_categorical(r, generator)
