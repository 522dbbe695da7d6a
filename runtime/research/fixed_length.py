"""Fixed-length packing, the WLB-LLM Table 2 baselines, and the packer chooser of ``hgraph pack``.

``FixedLengthPacker``: micro-batches hold at most ``max_len`` tokens and only the attention work
``sum l^2`` is balanced (WLB Eq. 1): ``method="greedy"`` places documents longest first into the
micro-batch with least attention work that has room; ``method="solver"`` starts from the greedy
packing and improves it with CP-SAT within a time box (``solve_fixed_length``). Like every stream
packer (``hgraph.runtime.data.wlb_packing.StreamPacker``) it never drops or duplicates a document.
A training run packs with WLB's own packer or the planner; these are what it is measured against.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.wlb_packing import DocLatency, StreamDoc, StreamPacker, WLBPacker


class FixedLengthPacker(StreamPacker):
    """Fixed-length packing baselines of WLB Table 2 (balance attention work ``sum l^2``, Eq. 1).

    ``method``: ``"greedy"`` or ``"solver"`` (CP-SAT improving the greedy packing within
    ``time_limit_s`` seconds per batch). Documents that fit no micro-batch wait for the next batch.
    """

    def __init__(self, latency: DocLatency, num_microbatches: int, max_len: int, *, method: str = "greedy",
                 time_limit_s: float = 1.0, workers: int = 1) -> None:
        super().__init__(latency, num_microbatches, max_len)
        if method not in ("greedy", "solver"):
            raise HGraphError(f"fixed-length packing method must be 'greedy' or 'solver', got {method!r}")
        if time_limit_s <= 0:
            raise HGraphError(f"solver time limit must be positive, got {time_limit_s!r}")
        self.method = method
        self.time_limit_s = float(time_limit_s)
        self.workers = int(workers)

    def take_pending(self, new_docs: list[StreamDoc], flushing: bool = False) -> list[StreamDoc]:
        return list(self.remained) + list(new_docs)

    def _pack(self, docs: list[StreamDoc]) -> tuple[list[list[StreamDoc]], list[StreamDoc]]:
        docs = sorted(docs, key=lambda d: (d.arrival >= self.batch_index, -d.length, d.index))
        lens = np.asarray([d.length for d in docs], dtype=np.int64)
        attn = lens.astype(np.float64) ** 2
        n = self.n
        load = np.zeros(n)
        size = np.zeros(n, dtype=np.int64)
        assign = np.full(len(docs), -1, dtype=np.int64)
        for i in range(len(docs)):
            room = size + lens[i] <= self.max_len
            if not room.any():
                continue
            j = int(np.argmin(np.where(room, load, np.inf)))
            assign[i] = j
            load[j] += attn[i]
            size[j] += lens[i]
        if self.method == "solver":
            placed = np.nonzero(assign >= 0)[0]
            if placed.size > 1 and n > 1:
                assign[placed] = solve_fixed_length(lens[placed], n, self.max_len, assign[placed],
                                                    self.time_limit_s, self.workers)
        bins: list[list[StreamDoc]] = [[] for _ in range(n)]
        left = []
        for i, j in enumerate(assign.tolist()):
            (bins[j].append(docs[i]) if j >= 0 else left.append(docs[i]))
        return bins, left


def solve_fixed_length(lengths: np.ndarray, num_bins: int, max_len: int, hint: np.ndarray,
                       time_limit_s: float, workers: int = 1) -> np.ndarray:
    """CP-SAT for WLB Eq. 1: minimise the largest ``sum l^2`` of a bin, each bin <= ``max_len`` tokens.

    ``hint`` is a feasible assignment (the greedy one), used as the starting solution; the best
    assignment found within the time box is returned (never worse than the hint).
    """
    from ortools.sat.python import cp_model

    lengths = np.asarray(lengths, dtype=np.int64)
    m = cp_model.CpModel()
    U, V = lengths.size, int(num_bins)
    sq = [int(l) * int(l) for l in lengths.tolist()]
    x = [[m.NewBoolVar(f"x{i}_{j}") for j in range(V)] for i in range(U)]
    for i in range(U):
        m.AddExactlyOne(x[i])
    hi = sum(sq)
    z = m.NewIntVar(0, hi, "max_attn")
    for j in range(V):
        m.Add(sum(int(lengths[i]) * x[i][j] for i in range(U)) <= max_len)
        m.Add(sum(sq[i] * x[i][j] for i in range(U)) <= z)
    # Bins are interchangeable, so pinning the longest document to its hinted bin loses nothing.
    m.Add(x[0][int(hint[0])] == 1)
    for i in range(U):
        for j in range(V):
            m.AddHint(x[i][j], int(hint[i]) == j)
    m.Minimize(z)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_search_workers = max(1, int(workers))
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint.copy()
    out = np.asarray([next(j for j in range(V) if solver.Value(x[i][j])) for i in range(U)], dtype=np.int64)
    # Never return something worse than the starting packing.
    def peak(a):
        return max(sum(sq[i] for i in range(U) if a[i] == j) for j in range(V))
    return out if peak(out) <= peak(hint) else hint.copy()


def make_packer(method: str, latency: DocLatency, num_microbatches: int, max_len: int, *,
                capacity: Optional[int] = None, num_queues: int = 2,
                outlier_thresholds: Optional[Sequence[int]] = None,
                solver_time_limit_s: float = 1.0) -> StreamPacker:
    """A packer by name: ``wlb``, ``fixed-greedy`` or ``fixed-solver``.

    ``capacity`` (tokens per micro-batch, default ``max_len``) applies to ``wlb`` only: fixed-length
    packing is by definition limited to the context window.
    """
    if method == "wlb":
        return WLBPacker(latency, num_microbatches, max_len, capacity=capacity, num_queues=num_queues,
                         outlier_thresholds=outlier_thresholds)
    if method == "fixed-greedy":
        return FixedLengthPacker(latency, num_microbatches, max_len, method="greedy")
    if method == "fixed-solver":
        return FixedLengthPacker(latency, num_microbatches, max_len, method="solver",
                                 time_limit_s=solver_time_limit_s)
    raise HGraphError(f"unknown packing method {method!r}; choose wlb, fixed-greedy or fixed-solver")
