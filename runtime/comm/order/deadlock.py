"""Do the ranks' collective sequences run to the end under NCCL's strictest reading?

``simulate(sequences)`` runs every rank's sequence with at most one operation of a rank in flight
(what ``--collective-order strict`` enforces at run time, and what NCCL does when a rank's
communicators share one stream): a collective completes when every member of its group has reached
it, a ``p2p`` batch when each of its messages has met the peer's matching one. Every completed
operation lets its ranks go on. When nothing can move and some rank has not finished, the ranks wait
for each other: the verdict names the cycle (each rank, the operation it waits in and the rank it
waits for), or the finished rank that others still wait for. Members that reach one point of a
group's order with different operations are named too (``Collective.signature``).

``first_mismatch(sequences)``: the first point where two members of a group disagree about that
group's own order (the check of recorded sequences, ``--verify-collectives``), without the cycle search.

The cost is linear in the total length of the sequences (each group operation completes once, each
message matches once), so a check of 1,024 ranks runs in one process.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import networkx as nx

from hgraph.runtime.comm.order.collective import Collective

Sequences = Mapping[int, Sequence[Collective]]


@dataclass
class OrderVerdict:
    """The outcome of ``simulate``: ``ok``, the number of ranks and of collectives run (a group's
    operation counts once, a ``p2p`` batch once per rank), and when not ok, ``problem`` (one line)
    with ``waits``: per rank in the cycle (or the chain to a finished rank), the operation it waits in
    and the rank it waits for."""

    ok: bool
    ranks: int
    collectives: int
    problem: str = ""
    waits: list = field(default_factory=list)    # [(rank, Collective, waits_for_rank)]

    def line(self) -> str:
        if self.ok:
            return f"deadlock-free: {self.ranks} ranks, {self.collectives} collectives"
        return self.problem


def _pos(op_index: int) -> str:
    return f"its operation {op_index + 1}"


class _Run:
    """The state of one simulation (see ``simulate``)."""

    def __init__(self, sequences: Sequences) -> None:
        self.seqs = {int(r): list(s) for r, s in sequences.items()}
        self.pos = {r: 0 for r in self.seqs}
        self.at_group: dict[tuple[int, ...], list[int]] = {}       # members waiting at a group's op
        self.unmatched: dict[int, tuple[Counter, Counter]] = {}    # p2p: (sends, recvs) still to meet
        self.completed = 0
        self.problem = ""

    def current(self, r: int) -> Optional[Collective]:
        s = self.seqs[r]
        return s[self.pos[r]] if self.pos[r] < len(s) else None

    def run(self) -> None:
        ready = deque(sorted(self.seqs))
        while ready and not self.problem:
            r = ready.popleft()
            op = self.current(r)
            if op is None:
                continue
            if op.kind == "p2p":
                ready.extend(self._arrive_p2p(r, op))
            else:
                ready.extend(self._arrive(r, op))

    def _arrive(self, r: int, op: Collective) -> list[int]:
        if r not in op.group:
            self.problem = (f"rank {r} issues {op.describe()} at {_pos(self.pos[r])}, "
                            f"a group it is not a member of")
            return []
        unknown = [m for m in op.group if m not in self.seqs]
        if unknown:
            self.problem = f"rank {r} issues {op.describe()}: rank {unknown[0]} has no sequence"
            return []
        waiting = self.at_group.setdefault(op.group, [])
        waiting.append(r)
        if len(waiting) < len(op.group):
            return []
        del self.at_group[op.group]
        first = self.current(waiting[0])
        for m in waiting[1:]:
            other = self.current(m)
            if other.signature != first.signature:
                self.problem = (f"group {list(op.group)} disagrees: rank {waiting[0]} issues "
                                f"{first.describe()} at {_pos(self.pos[waiting[0]])}, rank {m} issues "
                                f"{other.describe()} at {_pos(self.pos[m])}")
                return []
        self.completed += 1
        for m in waiting:
            self.pos[m] += 1
        return sorted(waiting)

    def _arrive_p2p(self, r: int, op: Collective) -> list[int]:
        unknown = [m for m in op.group if m not in self.seqs]
        if unknown:
            self.problem = f"rank {r} issues {op.describe()}: rank {unknown[0]} has no sequence"
            return []
        sends, recvs = Counter(op.sends), Counter(op.recvs)
        self.unmatched[r] = (sends, recvs)
        touched = {r}
        # my sends meet the peers' waiting receives (their side 1), my receives their sends (side 0)
        for mine, theirs in ((sends, 1), (recvs, 0)):
            for peer in list(mine):
                if peer in self.unmatched:
                    other = self.unmatched[peer][theirs]
                    n = min(mine[peer], other[r])
                    if n:
                        mine[peer] -= n
                        other[r] -= n
                        touched.add(peer)
        done = []
        for m in sorted(touched):
            s, v = self.unmatched[m]
            if not any(s.values()) and not any(v.values()):     # counts never go below zero
                del self.unmatched[m]
                self.completed += 1
                self.pos[m] += 1
                done.append(m)
        return done

    def waits_for(self, r: int) -> list[int]:
        """The ranks ``r`` waits for in its current operation."""
        op = self.current(r)
        if op is None:
            return []
        if op.kind == "p2p":
            sends, recvs = self.unmatched.get(r, (Counter(), Counter()))
            return sorted(set((+sends).keys()) | set((+recvs).keys()))
        waiting = set(self.at_group.get(op.group, ()))
        return [m for m in op.group if m not in waiting]


def simulate(sequences: Sequences) -> OrderVerdict:
    """Run ``sequences`` (rank -> its operations in issue order) one operation of a rank at a time;
    see the module docstring."""
    run = _Run(sequences)
    run.run()
    n = len(run.seqs)
    if run.problem:
        return OrderVerdict(False, n, run.completed, run.problem)
    stuck = [r for r in sorted(run.seqs) if run.current(r) is not None]
    if not stuck:
        return OrderVerdict(True, n, run.completed)
    graph = nx.DiGraph()
    for r in stuck:
        for m in run.waits_for(r):
            graph.add_edge(r, m)
    try:
        cycle = [a for a, _ in nx.find_cycle(graph, source=stuck[0])]
    except nx.NetworkXNoCycle:
        cycle = []
    if cycle:
        waits = [(r, run.current(r), cycle[(i + 1) % len(cycle)]) for i, r in enumerate(cycle)]
        steps = "; ".join(f"rank {r} waits in {op.describe()} at {_pos(run.pos[r])} for rank {m}"
                          for r, op, m in waits)
        return OrderVerdict(False, n, run.completed, f"deadlock: {steps}", waits)
    # no cycle: a chain of waits ends at a rank that has finished its sequence
    r, chain = stuck[0], []
    seen = set()
    while r not in seen and run.current(r) is not None:
        seen.add(r)
        ahead = run.waits_for(r)
        nxt = next((m for m in ahead if run.current(m) is None), ahead[0])
        chain.append((r, run.current(r), nxt))
        r = nxt
    steps = "; ".join(f"rank {a} waits in {op.describe()} at {_pos(run.pos[a])} for rank {m}"
                      for a, op, m in chain)
    return OrderVerdict(False, n, run.completed,
                        f"deadlock: {steps}, which has finished its {len(run.seqs[r])} operations", chain)


def first_mismatch(sequences: Sequences) -> Optional[str]:
    """One line naming the first point where the members of a group disagree about that group's
    order (a member issues a different operation there, or none), or None when every group's members
    issue the same operations in the same order. ``p2p`` batches are left to ``simulate``."""
    per_group: dict[tuple[int, ...], dict[int, list[tuple[int, Collective]]]] = {}
    for r, seq in sequences.items():
        for i, op in enumerate(seq):
            if op.kind != "p2p":
                per_group.setdefault(op.group, {}).setdefault(int(r), []).append((i, op))
    worst: Optional[tuple[int, str]] = None
    for group, members in per_group.items():
        for m in group:
            members.setdefault(m, [])
        length = max(len(v) for v in members.values())
        for k in range(length):
            at = {m: (members[m][k] if k < len(members[m]) else None) for m in group}
            present = {m: x for m, x in at.items() if x is not None}
            signatures = {x[1].signature for x in present.values()}
            if len(signatures) == 1 and len(present) == len(group):
                continue
            first_rank = min(present, key=lambda m: present[m][0])
            i, op = present[first_rank]
            other = next((m for m in group if at[m] is None or at[m][1].signature != op.signature))
            there = ("nothing" if at[other] is None
                     else f"{at[other][1].describe()} (its operation {at[other][0] + 1})")
            text = (f"collective order differs in group {list(group)} at its operation {k + 1}: rank "
                    f"{first_rank} issues {op.describe()} (its operation {i + 1}), rank {other} issues {there}")
            if worst is None or i < worst[0]:
                worst = (i, text)
            break
    return None if worst is None else worst[1]
