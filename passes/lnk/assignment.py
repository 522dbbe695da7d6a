"""Which member of a reduce-scatter group receives which reduced piece (Push Gradient sender choice).

After the replicas of one layout reduce-scatter a range, each member holds one reduced piece and
forwards it to the owners of the optimizer segments it overlaps. Any one-to-one assignment of pieces to
members is correct; a good one keeps the bytes on the member that owns them (nothing to send), else on
the owner's node (intra-node link), and spreads the bytes each member sends. Each reduce-scatter is one
min-cost perfect matching, solved as a min-cost flow with networkx, with a lexicographic cost:

1. link cost: rows sent intra-node x ``intra`` + rows sent inter-node x ``inter`` (exact optimum);
2. balance: the increase of the sum of squared rows sent per member given what the member already sends
   for earlier reduce-scatters of its group (greedy across reduce-scatters, exact within one);
3. ties: keep piece ``i`` on the ``i``-th member, so identical layouts map pieces in rank order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import networkx as nx


@dataclass(frozen=True)
class LinkWeights:
    """Relative cost per row sent over an intra-node link and over an inter-node link."""

    intra: int = 1
    inter: int = 8

    def __post_init__(self) -> None:
        if not (isinstance(self.intra, int) and isinstance(self.inter, int) and 0 <= self.intra <= self.inter):
            raise ValueError(f"link weights must be integers with 0 <= intra <= inter, got {self}")


def assign_pieces(members: Sequence[int], num_pieces: int,
                  link_cost: Callable[[int, int], int], sent_rows: Callable[[int, int], int],
                  loads: Mapping[int, int]) -> list[int]:
    """Assign pieces ``0..num_pieces-1`` one-to-one to ``members`` (``num_pieces == len(members)``).

    ``link_cost(piece, member)`` and ``sent_rows(piece, member)`` are non-negative integers;
    ``loads[member]`` is the rows the member already sends. Returns ``member_of[piece]``.
    """
    k = len(members)
    if num_pieces != k:
        raise ValueError(f"{num_pieces} pieces cannot be matched one-to-one with {k} members")
    if k == 1:
        return [members[0]]
    link = [[link_cost(p, m) for m in members] for p in range(k)]
    extra = [[(loads.get(m, 0) + sent_rows(p, m)) ** 2 - loads.get(m, 0) ** 2 for m in members]
             for p in range(k)]
    tie_scale = k + 1                                         # > any total of tie costs (<= k)
    balance_scale = (sum(max(row) for row in extra) + 1) * tie_scale
    graph = nx.DiGraph()
    graph.add_node("source", demand=-k)
    graph.add_node("sink", demand=k)
    for p in range(k):
        graph.add_edge("source", ("piece", p), capacity=1, weight=0)
        for j in range(k):
            cost = link[p][j] * balance_scale + extra[p][j] * tie_scale + (0 if p == j else 1)
            graph.add_edge(("piece", p), ("member", j), capacity=1, weight=cost)
    for j in range(k):
        graph.add_edge(("member", j), "sink", capacity=1, weight=0)
    flow = nx.min_cost_flow(graph)             # k units from source to sink: a perfect matching
    member_of = []
    for p in range(k):
        chosen = [j for j in range(k) if flow[("piece", p)][("member", j)] == 1]
        assert len(chosen) == 1, "a perfect matching assigns every piece once"
        member_of.append(members[chosen[0]])
    return member_of
