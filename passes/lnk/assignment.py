"""Which member of a reduce-scatter group receives which reduced piece (Push Gradient sender choice).

After the replicas of one layout reduce-scatter a range, each member holds one reduced piece and
forwards it to the owners of the optimizer segments it overlaps. Any one-to-one assignment of pieces to
members is correct; a good one keeps the bytes on the member that owns them (nothing to send), else on
the owner's node (intra-node link), and spreads the bytes each member sends. Each reduce-scatter is one
min-cost perfect matching with a lexicographic cost:

1. link cost: rows sent intra-node x ``intra`` + rows sent inter-node x ``inter`` (exact optimum);
2. balance: the increase of the sum of squared rows sent per member given what the member already sends
   for earlier reduce-scatters of its group (greedy across reduce-scatters, exact within one);
3. ties: keep piece ``i`` on the ``i``-th member, so identical layouts map pieces in rank order.

A piece costs the same on every member except the few that own some of its rows or share a node
with an owner, up to the member's load. So the plans solve it without a ``k x k`` matrix (a group at
12,288 GPUs holds up to thousands of replicas):

* equal loads (a group's first reduce-scatter, the only one of most large groups):
  ``assign_pieces_sparse``, a maximum-weight matching over those few edges and the identities
  (scipy's ``min_weight_full_bipartite_matching``, LAPJVsp; float64, exact below 2**53, checked);
* loads that differ: ``assign_pieces_by_load``, a min-cost flow in exact integers (ortools) whose
  default arcs go through a node per row count and a node per load level, ``O(k)`` arcs;
* otherwise, and for arbitrary costs (``assign_pieces``): the three terms folded into one integer
  cost, ``assign_pieces_matrix``, scipy's dense ``linear_sum_assignment`` (Jonker-Volgenant) while
  float64 sums stay exact, else a min-cost flow with networkx.

Each finds an optimum of the same cost (tests compare them on random instances); among equal optima
each has its own choice, and the world's plan and one rank's part call the same one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import networkx as nx
import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

#: float64 represents every integer up to this exactly: sums of costs below it are exact.
_EXACT_FLOAT = 2 ** 53


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
    link = np.array([[link_cost(p, j) for j in members] for p in range(k)], dtype=np.int64).reshape(k, k)
    sent = np.array([[sent_rows(p, j) for j in members] for p in range(k)], dtype=np.int64).reshape(k, k)
    return assign_pieces_matrix(members, link, sent, loads)


def assign_pieces_matrix(members: Sequence[int], link: np.ndarray, sent: np.ndarray,
                         loads: Mapping[int, int]) -> list[int]:
    """``assign_pieces`` from the matrices ``link[piece, member]`` and ``sent[piece, member]`` (the
    members' positions in ``members``; non-negative integers)."""
    k = len(members)
    if link.shape != (k, k) or sent.shape != (k, k):
        raise ValueError(f"{k} members need {k} x {k} cost matrices, got {link.shape} and {sent.shape}")
    if k == 1:
        return [members[0]]
    load = np.array([loads.get(m, 0) for m in members], dtype=object)
    if int(sent.max()) + max(load) >= 2 ** 30:             # int64 would not hold the squares
        return _min_cost_flow(members, link.tolist(), _extra(load, sent.astype(object)).tolist())
    load = load.astype(np.int64)
    extra = _extra(load, sent)
    tie_scale = k + 1                                         # > any total of tie costs (<= k)
    balance_scale = (sum(int(x) for x in extra.max(axis=1)) + 1) * tie_scale
    largest = int(link.max()) * balance_scale + int(extra.max()) * tie_scale + 1
    if largest * k >= _EXACT_FLOAT:                         # float64 sums would round: solve in integers
        return _min_cost_flow(members, link.tolist(), extra.tolist())
    cost = link * balance_scale + extra * tie_scale + (1 - np.eye(k, dtype=np.int64))
    pieces, chosen = linear_sum_assignment(cost.astype(np.float64))
    return [members[j] for j in chosen[np.argsort(pieces)]]


def assign_pieces_sparse(members: Sequence[int], default: Sequence[tuple[int, int]],
                         special: Sequence[Mapping[int, tuple[int, int]]], load: int) -> list[int]:
    """``assign_pieces`` when every member already sends ``load`` rows and piece ``p`` costs
    ``default[p] = (link, sent)`` on every member except those of ``special[p]`` (member position ->
    ``(link, sent)``, each no more than the default: its owners and their node mates).

    The cost of a matching is then a constant (every piece at its default) minus the gains of the
    special edges it uses, plus one per piece off its identity member: a maximum-weight matching over
    the special and identity edges (gain, +1 on an identity), the other pieces placed on the members
    left in order (any such place costs the default). The objective is ``assign_pieces_matrix``'s, with
    the same scales.
    """
    k = len(members)
    if len(default) != k or len(special) != k:
        raise ValueError(f"{k} members need {k} default costs and special maps")
    if k == 1:
        return [members[0]]
    extra = lambda sent: sent * (2 * load + sent)                      # noqa: E731
    tie_scale = k + 1
    balance_scale = (sum(max([extra(s) for _, s in special[p].values()] +
                             ([extra(default[p][1])] if len(special[p]) < k else [])) for p in range(k))
                     + 1) * tie_scale
    gains: dict[tuple[int, int], int] = {}
    for p in range(k):
        d_link, d_sent = default[p]
        base = d_link * balance_scale + extra(d_sent) * tie_scale
        for j, (link, sent) in special[p].items():
            gains[p, j] = base - (link * balance_scale + extra(sent) * tie_scale)
        gains[p, p] = gains.get((p, p), 0) + 1                          # identity: one less tie cost
    top = max(gains.values()) + 1
    if top * 2 * k >= _EXACT_FLOAT:
        link = np.array([[special[p].get(j, default[p])[0] for j in range(k)] for p in range(k)], dtype=np.int64)
        sent = np.array([[special[p].get(j, default[p])[1] for j in range(k)] for p in range(k)], dtype=np.int64)
        return assign_pieces_matrix(members, link, sent, {m: load for m in members})
    # maximum-weight matching as a full matching of the doubled graph: piece p may stay unmatched
    # (column k + p), member j too (row k + j), and for every edge (p, j) the two dummies pair up
    rows, cols, cost = [], [], []
    for (p, j), g in gains.items():
        rows += [p, k + j]
        cols += [j, k + p]
        cost += [top - g, top]
    rows += list(range(k)) + list(range(k, 2 * k))
    cols += list(range(k, 2 * k)) + list(range(k))
    cost += [top] * (2 * k)
    graph = csr_matrix((np.asarray(cost, dtype=np.float64), (rows, cols)), shape=(2 * k, 2 * k))
    graph.sum_duplicates()
    matched_rows, matched_cols = min_weight_full_bipartite_matching(graph)
    col_of = dict(zip(matched_rows.tolist(), matched_cols.tolist()))
    member_of: list[int | None] = [col_of[p] if col_of[p] < k else None for p in range(k)]
    free = iter(sorted(set(range(k)) - {j for j in member_of if j is not None}))
    return [members[j if j is not None else next(free)] for j in member_of]


def assign_pieces_by_load(members: Sequence[int], default: Sequence[tuple[int, int]],
                          special: Sequence[Mapping[int, tuple[int, int]]],
                          loads: Mapping[int, int]) -> list[int] | None:
    """``assign_pieces_sparse`` when the members' loads differ: a piece's default cost on a member then
    grows with the member's load (``2 x load x rows``), the same for every member of one load. Solved
    as a min-cost flow (ortools, exact integers) where a piece reaches a member either by a direct arc
    (the member owns some of its rows, shares a node with an owner, or is its identity) or through
    the node of its row count and the node of the member's load: ``O(k)`` arcs, not ``k^2``. A route
    through the two nodes costs at least what the same pair costs directly, so the optimum is the
    matching's. Returns None when ortools is missing or the costs pass its range (the caller solves
    it dense).
    """
    try:
        from ortools.graph.python import min_cost_flow
    except ImportError:
        return None
    k = len(members)
    load = [loads.get(m, 0) for m in members]
    extra = lambda sent, l: sent * (2 * l + sent)                      # noqa: E731
    tie_scale = k + 1
    by_load = sorted(range(k), key=lambda j: -load[j])
    top = []
    for p in range(k):
        worst = [extra(s_, load[j]) for j, (_, s_) in special[p].items()]
        if len(special[p]) < k:      # the most loaded member that takes the piece at its default cost
            j = next(j for j in by_load if j not in special[p])
            worst.append(extra(default[p][1], load[j]))
        top.append(max(worst))
    balance_scale = (sum(top) + 1) * tie_scale

    def cost(link: int, sent: int, j: int, p: int) -> int:
        return link * balance_scale + extra(sent, load[j]) * tie_scale + (p != j)

    direct = {(p, j): cost(*special[p][j], j, p) for p in range(k) for j in special[p]}
    for p in range(k):
        direct.setdefault((p, p), cost(*default[p], p, p))
    rows = sorted({default[p][1] for p in range(k)})
    levels = sorted(set(load))
    hub = {r: 2 * k + i for i, r in enumerate(rows)}
    level = {l_: 2 * k + len(rows) + i for i, l_ in enumerate(levels)}
    arcs: list[tuple[int, int, int, int]] = []      # tail, head, capacity, cost
    arcs += [(p, k + j, 1, c) for (p, j), c in direct.items()]
    arcs += [(p, hub[default[p][1]], 1, default[p][0] * balance_scale + default[p][1] ** 2 * tie_scale + 1)
             for p in range(k)]
    arcs += [(hub[r], level[l_], k, 2 * l_ * r * tie_scale) for r in rows for l_ in levels]
    arcs += [(level[load[j]], k + j, 1, 0) for j in range(k)]
    if max(c for *_, c in arcs) * (2 * k + len(rows) + len(levels)) * 4 >= 2 ** 62:
        return None
    flow = min_cost_flow.SimpleMinCostFlow()
    tails, heads, caps, costs = (np.asarray(x, dtype=np.int64) for x in zip(*arcs))
    flow.add_arcs_with_capacity_and_unit_cost(tails, heads, caps, costs)
    flow.set_nodes_supplies(np.arange(2 * k), np.asarray([1] * k + [-1] * k, dtype=np.int64))
    if flow.solve() != flow.OPTIMAL:
        return None
    used = flow.flows(np.arange(len(arcs))).tolist()
    member_of: list[int | None] = [None] * k
    routed: dict[int, list[int]] = {r: [] for r in rows}     # pieces through each row-count node
    to_level: dict[tuple[int, int], int] = {}
    takers: dict[int, list[int]] = {l_: [] for l_ in levels}
    for (tail, head, _, _), f in zip(arcs, used):
        if not f:
            continue
        if tail < k and head < 2 * k:
            member_of[tail] = head - k
        elif tail < k:
            routed[default[tail][1]].append(tail)
        elif head < 2 * k:
            takers[load[head - k]].append(head - k)
        else:
            to_level[tail, head] = f
    # every piece routed through a load level takes a member of that level at the same cost: in order
    for r in rows:
        pieces = iter(sorted(routed[r]))
        for l_ in levels:
            for _ in range(to_level.get((hub[r], level[l_]), 0)):
                member_of[next(pieces)] = takers[l_].pop(0)
    return [members[j] for j in member_of]


def _extra(load: np.ndarray, sent: np.ndarray) -> np.ndarray:
    """The increase of a member's squared send load when it takes a piece: ``(l + s)^2 - l^2``."""
    return sent * (2 * load[None, :] + sent)


def _min_cost_flow(members: Sequence[int], link: list[list[int]], extra: list[list[int]]) -> list[int]:
    """The lexicographic matching as a min-cost flow in exact integers (networkx)."""
    k = len(members)
    tie_scale = k + 1
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
