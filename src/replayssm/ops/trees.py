"""Draft trees as data (DESIGN.md section 2, "Trees").

A batch of ``B`` draft trees, each padded to the same ``N`` nodes so that a step's
shapes stay static. Per request the nodes are in topological order: node 0 is the last
committed token (the first token of the window, the root), and every other node's parent
comes before it. Nodes ``num_nodes[b]..N-1`` of request ``b`` are padding: parent ``-1``,
depth ``-1``, in no node's root path and masked everywhere.

A chain of ``n`` tokens is the tree whose parents are ``i - 1``; its ancestor mask is the
causal mask of a window.

Trees are built and validated on the host (their values are read here); the tensors
live on the CPU and may be moved to a device by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from . import _checks


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


#: Most nodes a tree may have when its ancestor sets travel as int32 bitmasks
#: (:meth:`DraftTrees.ancestor_bits`); the Triton tree kernels take at most 16.
MAX_TREE_NODES = 31


class DeviceTrees(NamedTuple):
    """A :class:`DraftTrees` on a device, as the tree kernels and commits read it.

    Attributes:
        parents: ``[B, N]`` int32 (``-1`` for the root and padded nodes).
        num_nodes: ``[B]`` int32.
        depth: ``[B, N]`` int32 (``-1`` for padded nodes).
        ancestor_bits: ``[B, N]`` int32, bit ``j`` of ``[b, i]`` set iff node ``j`` is on
            the root path of node ``i`` (``i`` included); 0 for padded nodes.
        dfs_order: ``[B, N]`` int32, the real nodes in depth-first preorder (children in
            index order), then the padded nodes.
        leaf_paths: ``[B, P, D]`` int32, :meth:`DraftTrees.leaf_paths`.
    """

    parents: torch.Tensor
    num_nodes: torch.Tensor
    depth: torch.Tensor
    ancestor_bits: torch.Tensor
    dfs_order: torch.Tensor
    leaf_paths: torch.Tensor


@dataclass(frozen=True)
class DraftTrees:
    """A validated batch of draft trees.

    Attributes:
        parents: ``[B, N]`` int64; ``parents[b, 0] == -1``, ``0 <= parents[b, i] < i`` for
            a real node ``i > 0``, ``-1`` for padded nodes.
        num_nodes: ``[B]`` int64, real nodes per request, ``1 <= num_nodes[b] <= N``.

    Build one with :meth:`from_parents`, :meth:`from_branching` or :meth:`chain`; the
    constructor validates its arguments and raises ``ValueError`` naming the bad one.
    """

    parents: torch.Tensor
    num_nodes: torch.Tensor

    def __post_init__(self):
        _checks.tensor("parents", self.parents, ndim=2, dtypes=_checks.INDEX_DTYPES)
        _checks.tensor("num_nodes", self.num_nodes, ndim=1, dtypes=_checks.INDEX_DTYPES)
        b, n = self.parents.shape
        if b < 1 or n < 1:
            raise ValueError(f"parents must have at least one request and one node, got shape {[b, n]}")
        _checks.shape("num_nodes", self.num_nodes, [b])
        for r, (row, count) in enumerate(zip(self.parents.tolist(), self.num_nodes.tolist())):
            if not 1 <= count <= n:
                raise ValueError(f"num_nodes[{r}] = {count} is outside [1, max nodes {n}]")
            if row[0] != -1:
                raise ValueError(f"parents[{r}, 0] = {row[0]}: node 0 (the last committed token) must have parent -1")
            for i in range(1, n):
                if i < count and not 0 <= row[i] < i:
                    raise ValueError(f"parents[{r}, {i}] = {row[i]} must lie in [0, {i}) (topological order)")
                if i >= count and row[i] != -1:
                    raise ValueError(f"parents[{r}, {i}] = {row[i]}: padded node (num_nodes {count}) must have parent -1")
        if n > MAX_TREE_NODES:
            raise ValueError(f"parents has {n} nodes per tree, at most {MAX_TREE_NODES} are supported")
        # Frozen dataclass: normalise dtype and device once, on the host.
        object.__setattr__(self, "parents", self.parents.to("cpu", torch.int64))
        object.__setattr__(self, "num_nodes", self.num_nodes.to("cpu", torch.int64))
        object.__setattr__(self, "_on_device", {})
        object.__setattr__(self, "_host", {})  # derived host tensors, computed once

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_parents(cls, parents: Sequence[Sequence[int]], max_nodes: int | None = None) -> "DraftTrees":
        """Trees from per-request parent lists (``[-1, p_1, ...]``), padded to ``max_nodes``
        (default: the longest list)."""
        if not isinstance(parents, (list, tuple)) or not parents:
            raise ValueError("parents must be a non-empty list of per-request parent lists")
        lengths = [len(p) for p in parents]
        n = max(lengths) if max_nodes is None else _positive_int("max_nodes", max_nodes)
        if max(lengths) > n:
            raise ValueError(f"max_nodes = {n} is smaller than the largest tree ({max(lengths)} nodes)")
        rows = [list(p) + [-1] * (n - len(p)) for p in parents]
        return cls(torch.tensor(rows, dtype=torch.int64).reshape(len(rows), n), torch.tensor(lengths, dtype=torch.int64))

    @classmethod
    def from_branching(cls, branching: Sequence[int], batch: int = 1, max_nodes: int | None = None) -> "DraftTrees":
        """The full tree with ``branching[d]`` children per node at depth ``d``, nodes in
        breadth-first order; e.g. ``(3, 2, 1)``: 1 + 3 + 6 + 6 = 16 nodes, depth 3.
        ``()`` is the root alone."""
        if not isinstance(branching, (list, tuple)) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in branching
        ):
            raise ValueError(f"branching must be a sequence of ints >= 1 (children per depth), got {branching!r}")
        parents, level = [-1], [0]
        for children in branching:
            nxt = []
            for p in level:
                for _ in range(children):
                    nxt.append(len(parents))
                    parents.append(p)
            level = nxt
        return cls.from_parents([parents] * _positive_int("batch", batch), max_nodes)

    @classmethod
    def chain(cls, length: int, batch: int = 1, max_nodes: int | None = None) -> "DraftTrees":
        """A chain of ``length`` tokens (parents ``i - 1``): the window of today's verify."""
        length = _positive_int("length", length)
        return cls.from_parents([list(range(-1, length - 1))] * _positive_int("batch", batch), max_nodes)

    # -- derived views ------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return self.parents.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.parents.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """``[B, N]`` bool: real (not padded) nodes."""
        return torch.arange(self.max_nodes)[None, :] < self.num_nodes[:, None]

    @property
    def depth(self) -> torch.Tensor:
        """``[B, N]`` int64: the root has depth 0, a child its parent's + 1, padding -1.
        Computed once and kept, as :meth:`on` keeps the device tensors (a launcher asks
        for it at every call; a caller must not change the result in place)."""
        depth = self._host.get("depth")
        if depth is None:
            depth = torch.full_like(self.parents, -1)
            depth[:, 0] = 0
            for i in range(1, self.max_nodes):
                p = self.parents[:, i]
                depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1, -1)
            self._host["depth"] = depth
        return depth

    def ancestors(self) -> torch.Tensor:
        """``[B, N, N]`` bool ancestor-or-self mask: ``[b, i, j]`` iff node ``j`` lies on
        the root path of node ``i``; rows and columns of padded nodes are all false."""
        b, n = self.parents.shape
        mask = torch.zeros(b, n, n, dtype=torch.bool)
        valid = self.valid
        for i in range(n):
            p = self.parents[:, i]
            # Topological order: the parent's row is complete before node i's.
            inherited = torch.where((p >= 0)[:, None], mask[torch.arange(b), p.clamp(min=0)], False)
            mask[:, i] = inherited
            mask[:, i, i] = valid[:, i]
        return mask

    def path(self, request: int, node: int) -> list[int]:
        """Node indices of the root path of ``node`` in ``request``, root first."""
        if not isinstance(request, int) or not 0 <= request < self.batch:
            raise ValueError(f"request must be an int in [0, {self.batch}), got {request!r}")
        count = int(self.num_nodes[request])
        if not isinstance(node, int) or not 0 <= node < count:
            raise ValueError(f"node must be an int in [0, num_nodes {count}), got {node!r}")
        out, parents = [node], self.parents[request].tolist()
        while parents[out[-1]] >= 0:
            out.append(parents[out[-1]])
        return out[::-1]

    @property
    def is_chain(self) -> bool:
        """Whether every request's tree is a chain of all ``N`` nodes (parents ``i - 1``,
        no padding): the window of today's verify, which such trees go through."""
        full = bool((self.num_nodes == self.max_nodes).all())
        return full and bool((self.parents[:, 1:] == torch.arange(self.max_nodes - 1)[None, :]).all())

    def ancestor_bits(self) -> torch.Tensor:
        """``[B, N]`` int64: :meth:`ancestors` as bitmasks, bit ``j`` of ``[b, i]`` set iff
        node ``j`` lies on the root path of node ``i``."""
        weights = torch.tensor([1 << j for j in range(self.max_nodes)], dtype=torch.int64)
        return (self.ancestors().to(torch.int64) * weights).sum(-1)

    def dfs_order(self) -> torch.Tensor:
        """``[B, N]`` int64: each request's real nodes in depth-first preorder (children
        in index order, so a chain keeps its order), then its padded nodes in order.
        Along this order every node's parent is on the current root path: a kernel can
        keep that path's states in a stack indexed by depth."""
        rows = []
        for parents, count in zip(self.parents.tolist(), self.num_nodes.tolist()):
            children = [[] for _ in range(count)]
            for i in range(1, count):
                children[parents[i]].append(i)
            order, todo = [], [0]
            while todo:
                i = todo.pop()
                order.append(i)
                todo.extend(reversed(children[i]))
            rows.append(order + list(range(count, self.max_nodes)))
        return torch.tensor(rows, dtype=torch.int64).reshape(self.batch, self.max_nodes)

    def leaf_paths(self) -> torch.Tensor:
        """``[B, P, D]`` int64: the root path of every leaf (a real node with no child),
        root first, ``-1`` past its end; ``P`` is the most leaves of any request and
        ``D`` the longest path (deepest depth + 1), and a request with fewer leaves has
        paths of ``-1``. Leaves come in depth-first preorder, so the paths through any
        node are consecutive: a node at depth ``d`` of path ``p`` is on an earlier path
        exactly when it is path ``p - 1``'s node at depth ``d``. Every real node lies on
        at least one of them."""
        rows = []
        for r, (parents, count, order) in enumerate(zip(self.parents.tolist(), self.num_nodes.tolist(),
                                                         self.dfs_order().tolist())):
            has_child = {parents[i] for i in range(1, count)}
            rows.append([self.path(r, i) for i in order[:count] if i not in has_child])
        width = max(len(paths) for paths in rows)
        depth = max(len(path) for paths in rows for path in paths)
        table = torch.full((self.batch, width, depth), -1, dtype=torch.int64)
        for r, paths in enumerate(rows):
            for p, path in enumerate(paths):
                table[r, p, : len(path)] = torch.tensor(path)
        return table

    def on(self, device) -> DeviceTrees:
        """The trees' tensors on ``device`` (:class:`DeviceTrees`), built once per device
        and kept: a static tree shape uploads once, and a CUDA graph that captured a step
        keeps reading the same tensors."""
        device = torch.device(device)
        cached = self._on_device.get(device)
        if cached is None:
            host = (self.parents, self.num_nodes, self.depth, self.ancestor_bits(), self.dfs_order(), self.leaf_paths())
            cached = DeviceTrees(*(t.to(device=device, dtype=torch.int32) for t in host))
            self._on_device[device] = cached
        return cached


def accepted_paths(trees: DeviceTrees, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The root paths of the accepted nodes, by tensor ops (no host read).

    Args:
        trees: the step's trees on the device (:meth:`DraftTrees.on`).
        accepted: ``[B]`` integer, the accepted (deepest) node per request, valid
            (``0 <= accepted[b] < num_nodes[b]``; the caller clamps device values).

    Returns:
        ``(path, count)``: ``path`` ``[B, N]`` int32, ``path[b, d]`` the node at depth
        ``d`` of that root path for ``d < count[b]`` (increasing: topological order),
        then ``N - 1``; ``count`` ``[B]`` int32, the path's length, ``depth + 1`` tokens.
    """
    n = trees.parents.shape[1]
    idx = accepted.to(torch.int64).clamp(0, n - 1)[:, None]
    bits = trees.ancestor_bits.gather(1, idx)  # [B, 1]
    nodes = torch.arange(n, device=bits.device, dtype=torch.int32)
    on_path = ((bits >> nodes[None, :]) & 1) != 0
    # Path nodes keep their order and come first; the rest sort after them.
    key = torch.where(on_path, nodes[None, :], nodes[None, :] + n)
    path = torch.sort(key, dim=1).values
    path = torch.where(path < n, path, torch.full_like(path, n - 1)).to(torch.int32)
    return path, on_path.sum(1).to(torch.int32)
