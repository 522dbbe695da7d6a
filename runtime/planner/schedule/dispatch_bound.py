"""A proven lower bound of the dispatch + packing optimum (Eq. 3 with Eq. 1) that counts whole
micro-batches: ortools CP-SAT decides, for a trial makespan ``M``, whether the documents could be
spread over the pipelines at all, and a bisection on ``M`` gives the bound.

Why: ``latency_bound.strategy_lower_bound`` charges a micro-batch's overhead ``c`` per ``MaxLen``
tokens (a fractional number of micro-batches). When a pipeline holds one or two micro-batches of
work (``PP = 1`` schemes at a few thousand tokens per GPU), rounding up is most of the gap between
that bound and the best plans (~4% at 64 GPUs, llama-32b).

The relaxation. A pipeline of scheme ``g`` (coefficients ``a, b, c``, ``k = PP - 1``, ``MaxLen``)
running ``V`` micro-batches within ``M`` holds at most ``V * MaxLen`` tokens and at most
``W(M, V) = V * (M / (k + V) - c)`` ms of per-sequence work (``(k+V) * max_mb >= (k+V) * (S/V + c)``),
and every document on it takes ``t(l) + c <= M / (k + V)`` (it sits whole in one micro-batch). The
pipelines of a scheme are pooled into classes by ``V`` (integer counts ``n_{g,V}``, summing to at
most the scheme's pipelines); tokens of a document may be split between classes (integer tokens,
costed at the per-token rate ``a l + b`` of the shortest document of its length bucket, rounded
down). Classes beyond ``V*`` (where ``V* MaxLen`` tokens already cost more than the most work any
``V`` allows) are merged into ``V*`` with the largest ``W`` of them. Every real plan gives a
feasible point, so an infeasible ``M`` is a proven lower bound; a time-boxed solve that proves
nothing counts as feasible (the bound stays valid, only weaker).
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from hgraph.runtime.planner.schedule.dispatch_fast import dispatch_fast
from hgraph.strategy import Scheme

# Costs in the model: integer units of this many per ms (work), rates per token in 1e-9 ms.
_WORK_UNITS_PER_MS = 1_000_000
_RATE_UNITS_PER_MS = 1_000_000_000
# Documents whose per-token rates differ by at most this fraction on every scheme share a bucket.
BUCKET_RATE_TOLERANCE = 0.002
# Time of one feasibility solve: infeasibility is proved in milliseconds where it holds (measured:
# 1 ms at 6 documents, <0.1 s at 200), while finding a feasible point of the integer token split
# can take seconds and is not needed (an unproved step counts as feasible).
STEP_LIMIT_S = 0.25


def _buckets(lengths: np.ndarray, groups, cuts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(tokens, shortest, longest)`` of consecutive length ranges (never across a ``cuts`` value)."""
    width = max(1, int(BUCKET_RATE_TOLERANCE * min((g[1] / g[0]) if g[0] > 0 else math.inf for g in groups)))
    ls = np.sort(lengths)
    out: list[tuple[int, int, int]] = []
    cut_set = sorted(set(int(c) for c in cuts))
    start = 0
    n = ls.size
    while start < n:
        lo = int(ls[start])
        hi_allowed = lo + width
        nxt = next((c for c in cut_set if c >= lo), None)  # a bucket never crosses a MaxLen
        if nxt is not None and nxt < hi_allowed:
            hi_allowed = nxt
        end = int(np.searchsorted(ls, hi_allowed, side="right"))
        end = max(end, start + 1)
        out.append((int(ls[start:end].sum()), lo, int(ls[end - 1])))
        start = end
    return out


# Micro-batch counts considered per pipeline (when ``c`` is tiny; with ``c > 0`` a pipeline has
# no room beyond ``M / c`` micro-batches).
MAX_MICROBATCHES = 1024


def _largest_v(M: float, c: float) -> int:
    return max(1, min(MAX_MICROBATCHES, int(M / c) if c > 0 else MAX_MICROBATCHES))


def _feasible(M: float, buckets, groups, counts, time_limit_s: float) -> bool:
    """Whether the relaxation admits makespan ``M`` (True also when CP-SAT proves nothing in time)."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    x_of_bucket: list[list] = [[] for _ in buckets]
    for gi, (a, b, c, k, cap) in enumerate(groups):
        d = counts[gi]
        vtop = _largest_v(M, c)
        wmax_all = max(V * (M / (k + V) - c) for V in range(1, vtop + 1))
        if wmax_all <= 0:
            continue
        # Most tokens any pipeline of this scheme can hold within M (work >= b per token).
        vstar = min(max(1, math.ceil(wmax_all / (b * cap))), vtop) if b > 0 else vtop
        n_vars = []
        for V in range(1, vstar + 1):
            per_mb = M / (k + V) - c
            if V < vstar:
                work = V * per_mb
                tokens_cap = V * cap
            else:   # V* and beyond, merged: the largest W of them, tokens bounded by work alone
                work = max(v * (M / (k + v) - c) for v in range(vstar, vtop + 1))
                tokens_cap = None
            if work <= 0 or per_mb <= 0:
                continue
            n = m.NewIntVar(0, d, "")
            n_vars.append(n)
            tok_terms, work_terms = [], []
            for bi, (tokens, lo, hi) in enumerate(buckets):
                if lo > cap or a * lo * lo + b * lo > per_mb:
                    continue   # the bucket's documents fit no micro-batch of this class
                x = m.NewIntVar(0, tokens, "")
                x_of_bucket[bi].append(x)
                tok_terms.append(x)
                work_terms.append((x, int(math.floor((a * lo + b) * _RATE_UNITS_PER_MS))))
            if not tok_terms:
                continue
            if tokens_cap is not None:
                m.Add(sum(tok_terms) <= n * int(tokens_cap))
            w_units = int(math.ceil(work * _RATE_UNITS_PER_MS))
            m.Add(sum(coef * v for v, coef in work_terms) <= n * w_units)
        if n_vars:
            m.Add(sum(n_vars) <= d)
    for bi, (tokens, _, _) in enumerate(buckets):
        if not x_of_bucket[bi]:
            return False
        m.Add(sum(x_of_bucket[bi]) == tokens)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit_s, 0.01)
    solver.parameters.num_workers = 1
    status = solver.Solve(m)
    return status != cp_model.INFEASIBLE


def microbatch_lower_bound(lengths, pipelines: Sequence[Scheme], cost, *, lower: float = 0.0,
                           upper: float | None = None, rel_tol: float = 1e-3, time_limit_s: float = 10.0,
                           step_limit_s: float = STEP_LIMIT_S) -> float:
    """A proven lower bound of the latency of any dispatch + packing of ``lengths`` on ``pipelines``.

    Bisection on ``M`` between ``lower`` (a known bound, e.g. ``strategy_lower_bound``) and
    ``upper`` (a known plan's latency) to ``rel_tol``; each step is one CP-SAT feasibility solve
    (module docstring) of at most ``step_limit_s``, all of them within ``time_limit_s`` together.
    Never below ``lower``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return 0.0
    counts_of: dict[Scheme, int] = {}
    for p in pipelines:
        counts_of[p] = counts_of.get(p, 0) + 1
    schemes = list(counts_of)
    groups = []
    for s in schemes:
        a, b, c = cost.coeffs(s)
        groups.append((a, b, c, s.pp - 1, cost.max_len(s)))
    counts = [counts_of[s] for s in schemes]
    buckets = _buckets(lengths, groups, [g[4] for g in groups])
    if upper is None:
        upper = dispatch_fast(lengths, pipelines, cost).latency
    lo, hi = float(lower), float(upper)
    deadline = time.perf_counter() + time_limit_s
    while hi - lo > rel_tol * hi:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        mid = (lo + hi) / 2
        if _feasible(mid, buckets, groups, counts, min(left, step_limit_s)):
            hi = mid
        else:
            lo = mid
    return lo
