"""One draft-tree shape for every row of a static step (DESIGN.md section 2, "Trees";
section 7 for the step).

A static step's tree is fixed when the step is built: ``--tree 3,2,1`` is the full tree
with 3 children at the root, 2 under each of those and 1 under each of these
(:meth:`replayssm.ops.trees.DraftTrees.from_branching`, 16 nodes, depth 3); a chain of
``k`` drafts is branching ``1,...,1``. :class:`StaticTree` keeps the shape's index
tensors on the device, built once on the host, so that acceptance, attention masks, KV
compaction and the drafters' tree expansion are tensor ops with no host read.

Node ``i`` of a row is window token ``i``: node 0 the last emitted token (the root),
nodes in breadth-first (topological) order. Node ``i`` sits at rotary position
``start + depth[i]`` and its key and value at cache position ``start + i`` until the
step's KV compaction moves the accepted path to ``start .. start + depth``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..ops.trees import DraftTrees


def parse_branching(text: str) -> tuple[int, ...]:
    """``"3,2,1"`` -> ``(3, 2, 1)``; ``ValueError`` for anything but positive ints."""
    try:
        out = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"a tree is children per depth as comma-separated positive ints (e.g. 3,2,1), "
                         f"got {text!r}") from None
    if not out or any(c < 1 for c in out):
        raise ValueError(f"a tree is children per depth as comma-separated positive ints (e.g. 3,2,1), got {text!r}")
    return out


#: Where a draft tree stops paying, measured end to end on one model: ``(model,
#: drafter, branching)`` -> the smallest batch bucket whose steps verify the tree's
#: spine instead of the tree (``StepGenerator(chain_from=)``; 1: every bucket). The
#: shipped model (``"embedded"``) with MTP drafts: the 3,2,1 tree ran 0.75x the chain's
#: tok/s at batch 1 and 0.80x at 4, its spine steps as fast as chain steps at 16 and 64
#: (BENCHMARKS.md, "Draft trees and their spines per batch bucket"). Only measured
#: configurations are listed; ``bench e2e --tree ... --chain-from B`` measures others.
MEASURED_CHAIN_FROM: dict[tuple[str, str, tuple[int, ...]], int] = {("embedded", "mtp", (3, 2, 1)): 1}


def measured_chain_from(model: str, drafter: str, branching: Sequence[int]) -> int:
    """The measured ``chain_from`` of :data:`MEASURED_CHAIN_FROM` for ``model`` (a shipped
    model's name), ``drafter`` and the tree ``branching``; ``ValueError`` naming the
    measured configurations when this one is not among them."""
    key = (model, drafter, tuple(branching))
    if key not in MEASURED_CHAIN_FROM:
        known = "; ".join(f"{m} with {d} drafts and the {','.join(map(str, b))} tree"
                          for m, d, b in MEASURED_CHAIN_FROM)
        raise ValueError(f"chain_from='measured': no measurement for {model} with {drafter} drafts and the "
                         f"{','.join(map(str, key[2]))} tree (measured: {known}); pass chain_from=B, from "
                         f"bench e2e --tree ... --chain-from B")
    return MEASURED_CHAIN_FROM[key]


class StaticTree:
    """A draft-tree shape shared by every row, with its index tensors on ``device``.

    Attributes (``N`` nodes, depth ``D``, at most ``C`` children per node):
        parents: ``[N]`` int64, ``-1`` for the root.
        depth: ``[N]`` int64.
        ancestors: ``[N, N]`` bool, ``[i, j]`` iff node ``j`` is on node ``i``'s root path.
        path: ``[N, D + 1]`` int64, the node at each depth of node ``i``'s root path
            (``-1`` past ``depth[i]``).
        children: ``[N, C]`` int64, each node's children in index order (``-1`` padding).
        ancestor_bits: ``[N]`` int64, the rows of ``ancestors`` as bit sets.
        levels: per depth ``d``, the ``[M_d]`` int64 nodes at that depth.
        spine: ``[S]`` int64, the root and then each node's first child down to a leaf
            (``S <= D + 1``): the chain the tree holds, its drafter's best token at
            each depth (children take a node's candidates in order, best first).
        branching: the children per depth it was built from, or ``None``.
    """

    def __init__(self, trees: DraftTrees, device: str | torch.device = "cpu", branching=None):
        if not isinstance(trees, DraftTrees):
            raise TypeError(f"trees must be a DraftTrees, got {type(trees).__name__}")
        if trees.batch != 1 or int(trees.num_nodes[0]) != trees.max_nodes:
            raise ValueError("a static tree is one unpadded tree (batch 1, num_nodes == max_nodes)")
        dev = torch.device(device)
        parents = trees.parents[0]
        depth = trees.depth[0]
        n, d = parents.shape[0], int(depth.max())
        self.num_nodes, self.max_depth, self.branching = n, d, branching
        self.device = dev
        plist = parents.tolist()
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[plist[i]].append(i)
        c = max(1, max(len(k) for k in kids))
        self.max_children = c
        path = torch.full((n, d + 1), -1, dtype=torch.int64)
        for i in range(n):
            p = trees.path(0, i)
            path[i, : len(p)] = torch.tensor(p)
        self.parents = parents.to(dev)
        self.depth = depth.to(dev)
        self.ancestors = trees.ancestors()[0].to(dev)
        #: ``[N]`` int64, ``ancestors``' rows as bit sets (what the tree attention's kernel
        #: reads; built here once instead of per attention call)
        self.ancestor_bits = trees.ancestor_bits()[0].to(dev)
        self.path = path.to(dev)
        self.children = torch.tensor([k + [-1] * (c - len(k)) for k in kids], dtype=torch.int64, device=dev)
        self.levels = [torch.tensor([i for i in range(n) if int(depth[i]) == k], dtype=torch.int64, device=dev)
                       for k in range(d + 1)]
        #: per depth: the level's rows of ``ancestors`` and of ``ancestor_bits``
        self.level_ancestors = [self.ancestors[level] for level in self.levels]
        self.level_bits = [self.ancestor_bits[level] for level in self.levels]
        spine = [0]
        while kids[spine[-1]]:
            spine.append(kids[spine[-1]][0])
        self.spine = torch.tensor(spine, dtype=torch.int64, device=dev)
        #: host copies (static shapes are decided from these, never from device values)
        self.host_parents, self.host_children = plist, kids
        self.host_depth = depth.tolist()
        self.is_chain = plist == list(range(-1, n - 1))
        #: per depth ``k < D``: how a drafter expands it, ``(parents [M_k], width, children
        #: [K], source [K])``: the ``width`` best tokens after each of the level's nodes
        #: (``[M_k * width]``, flat) feed children ``children`` from entries ``source``
        self.expansion = []
        for k in range(d):
            level = [i for i in range(n) if self.host_depth[i] == k]
            width = max(len(kids[i]) for i in level)
            child = [ch for i in level for ch in kids[i]]
            source = [m * width + r for m, i in enumerate(level) for r in range(len(kids[i]))]
            self.expansion.append((self.levels[k], width, torch.tensor(child, dtype=torch.int64, device=dev),
                                   torch.tensor(source, dtype=torch.int64, device=dev)))

    @classmethod
    def from_branching(cls, branching: Sequence[int], device: str | torch.device = "cpu") -> "StaticTree":
        """The full tree with ``branching[d]`` children per node at depth ``d``."""
        branching = tuple(branching)
        return cls(DraftTrees.from_branching(branching), device, branching=branching)

    @classmethod
    def chain(cls, length: int, device: str | torch.device = "cpu") -> "StaticTree":
        """A chain of ``length`` tokens (``length - 1`` drafts)."""
        return cls(DraftTrees.chain(length), device, branching=(1,) * (length - 1))

    def draft_trees(self, batch: int) -> DraftTrees:
        """The shape as :class:`DraftTrees` of ``batch`` identical rows (the strategies' argument)."""
        return DraftTrees.from_parents([self.host_parents] * batch)

    def describe(self) -> str:
        """``"3,2,1"`` for a tree built from branching, else its node count and depth."""
        if self.branching is not None:
            return ",".join(str(c) for c in self.branching)
        return f"{self.num_nodes} nodes, depth {self.max_depth}"

    def path_tokens(self, tokens: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        """``[B, D + 1]`` tokens of each row's root path to ``node [B]`` (root first),
        ``-1`` past the node's depth; ``tokens [B, N]``."""
        path = self.path[node]  # [B, D + 1]
        return torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1)
