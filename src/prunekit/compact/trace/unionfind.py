"""Union-find over channel ids, recorded while the model runs and solved at once at the end."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["UnionFind"]


class UnionFind:
    """Channel ids joined into components; a component may carry a "blocked" reason.

    Unions and blocks are only *recorded* while the model runs (a tensor append each);
    :meth:`solve` computes every component at once with vectorized hooking and pointer
    jumping (O(log n) rounds of tensor ops instead of one Python call per union). A
    component's root is its smallest id; its reason is the one recorded first among
    its ids.
    """

    def __init__(self) -> None:
        self.n = 0
        self._edges: List[Tensor] = []  # (k, 2) int64 rows to union
        self._rows: List[Tuple[Tensor, Tensor]] = []  # (a, b): union a[i] with b[i]; stacked in solve()
        # ids, reason, and an optional tensor: only ids where it is < 0 (in the order recorded)
        self._blocks: List[Tuple[Tensor, str, Optional[Tensor]]] = []
        self.roots: Optional[Tensor] = None  # after solve(): root of every id
        self.blocked: Dict[int, str] = {}  # after solve(): root -> reason

    def add(self, n: int) -> int:
        start = self.n
        self.n += n
        self.roots = None
        return start

    def union_pairs(self, pairs: Tensor) -> None:
        """Union every row (a, b) of an (N, 2) int64 tensor where both are >= 0."""
        if pairs.numel():
            self._edges.append(pairs.reshape(-1, 2))  # rows with a negative id are dropped in solve()
            self.roots = None

    def union_rows(self, a: Tensor, b: Tensor) -> None:
        """Union the i-th element of ``a`` with the i-th of ``b`` (same number of elements, any shapes:
        both are flattened when solved; negative ids are ignored)."""
        if a.numel():
            self._rows.append((a, b))
            self.roots = None

    def block(self, ids: Tensor, reason: str, where_negative: Optional[Tensor] = None) -> None:
        """Record a reason for the components of ``ids`` (negative ids are ignored).

        ``where_negative``: as many elements as ``ids`` (any shape); only ids at its negative entries count.
        """
        if ids.numel():
            self._blocks.append((ids if ids.dim() == 1 else ids.reshape(-1), reason, where_negative))
            self.roots = None

    def solve(self) -> Tensor:
        """Root (smallest id) of every id's component; fills :attr:`blocked`."""
        if self.roots is not None:
            return self.roots
        parent = torch.arange(self.n, dtype=torch.long)
        if self._rows:  # the union_rows() pairs as (k, 2) edges, kept for a later solve()
            self._edges.append(
                torch.stack([torch.cat([a.reshape(-1) for a, _ in self._rows]),
                             torch.cat([b.reshape(-1) for _, b in self._rows])], dim=1)
            )
            self._rows = []
        if self._edges:
            edges = torch.cat(self._edges).to(torch.long) if len(self._edges) > 1 else self._edges[0].to(torch.long)
            self._edges = [edges]
            a, b = edges.unbind(1)
            lo = torch.minimum(a, b)
            if bool((lo < 0).any()):  # rows with a negative id are dropped
                keep = ((lo >= 0) & (a != b)).nonzero().view(-1)
                a, b = a.index_select(0, keep), b.index_select(0, keep)
            pa, pb = a, b  # parent is the identity before the first round
            while a.numel():
                # hook each root onto the smallest root it touches (roots only decrease: no cycles)
                parent.scatter_reduce_(0, torch.maximum(pa, pb), torch.minimum(pa, pb), reduce="amin")
                while True:  # pointer jumping until every id points at its root
                    nxt = parent.index_select(0, parent)
                    if torch.equal(nxt, parent):
                        break
                    parent = nxt
                pa, pb = parent.index_select(0, a), parent.index_select(0, b)
                # edges whose ends are joined stay joined: only the others go on
                differ = (pa != pb).nonzero().view(-1)
                a, b, pa, pb = (t.index_select(0, differ) for t in (a, b, pa, pb))
        self.blocked = {}
        if self._blocks:
            # all blocks at once: an id counts where it is >= 0 and its condition (if any) < 0.
            # Blocks with and without a condition are gathered apart (no condition is spelled out).
            ids_parts, order_parts = [], []
            for conditioned in (False, True):
                at = [k for k, (_, _, c) in enumerate(self._blocks) if (c is not None) == conditioned]
                if not at:
                    continue
                ids = torch.cat([self._blocks[k][0] for k in at]).to(torch.long)
                keep = ids >= 0
                if conditioned:
                    keep &= torch.cat([self._blocks[k][2].reshape(-1) for k in at]) < 0  # type: ignore[union-attr]
                order = torch.repeat_interleave(torch.tensor(at), torch.tensor([self._blocks[k][0].numel() for k in at]))
                sel = keep.nonzero().view(-1)
                ids_parts.append(ids.index_select(0, sel))
                order_parts.append(order.index_select(0, sel))
            ids, order = torch.cat(ids_parts), torch.cat(order_parts)
            first = torch.full((self.n,), len(self._blocks), dtype=torch.long)
            first.scatter_reduce_(0, parent.index_select(0, ids), order, reduce="amin")
            hit = (first < len(self._blocks)).nonzero().view(-1)
            self.blocked = {r: self._blocks[k][1] for r, k in zip(hit.tolist(), first.index_select(0, hit).tolist())}
        self.roots = parent
        return parent

    def find(self, x: int) -> int:
        return int(self.solve()[x])

    def reason(self, i: int) -> Optional[str]:
        return self.blocked.get(self.find(i))
