"""A lower bound of a strategy's packed latency on one mini-batch (``strategy_lower_bound``): the
planner visits candidates in increasing order of it and skips one once its bound reaches the best
estimate found, so the choice equals evaluating them all (``selection.plan_iteration``)."""
from __future__ import annotations

import math

import numpy as np

from hgraph.strategy import Scheme, Strategy


def _fluid_bound(need: float, params: list[tuple[float, float, float]]) -> float:
    """Smallest M with ``sum_j weight_j * h_j(M) >= need``, ``h(M) = (sqrt(M - c0) - sqrt(k c))^2``."""
    if need <= 0 or not params:
        return 0.0

    def capacity(M: float) -> float:
        total = 0.0
        for weight, root_kc, c0 in params:
            x = M - c0
            if x > 0:
                r = math.sqrt(x) - root_kc
                if r > 0:
                    total += weight * r * r
        return total

    lo, hi = 0.0, 1.0
    while capacity(hi) < need:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if capacity(mid) >= need:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return lo


def _linear_bound(need: float, params: list[tuple[float, float]]) -> float:
    """Smallest M with ``sum_j weight_j * max(M - offset_j, 0) >= need`` (exact, piecewise linear)."""
    if need <= 0 or not params:
        return 0.0
    params = sorted(params, key=lambda p: p[1])
    slope = covered = 0.0
    for n, (weight, offset) in enumerate(params):
        slope += weight
        covered += weight * offset
        nxt = params[n + 1][1] if n + 1 < len(params) else math.inf
        M = (need + covered) / slope  # sum_{j <= n} weight_j (M - offset_j) = need
        if M <= nxt:
            return M
    return math.inf


def strategy_lower_bound(lengths: np.ndarray, strategy: Strategy, cost, scheme_cache: dict | None = None) -> float:
    """A lower bound of the packed latency of ``strategy`` on ``lengths`` (inf if a doc fits nowhere).

    The largest of valid bounds: (1) the document whose best eligible pipeline is slowest, alone
    there: ``PP * (a l^2 + b l + c)``; (2) work: a pipeline with ``PP - 1 = k`` and per-sequence work
    ``S`` takes at least ``g(S) = min_V (k+V)(S/V + c) >= (sqrt(S) + sqrt(k c))^2`` (``S + c`` when
    ``k = 0``), so under a makespan ``M`` it holds at most ``h(M) = g^-1(M)`` work; a document costs
    ``r_j t_j(l)`` rank-ms on a pipeline of ``r_j`` ranks, hence ``sum_i min_j r_j t_j(l_i) <=
    sum_j r_j h_j(M)``, solved for ``M`` by bisection; (3) micro-batch count: a pipeline holding
    ``T`` tokens runs ``V >= T / MaxLen`` micro-batches and ``(k+V)(S/V + c) >= S + c T / MaxLen +
    k c``, so a document costs at least ``r_j (t_j(l) + c_j l / MaxLen_j)`` rank-ms against a
    capacity of ``r_j (M - k_j c_j)`` per pipeline (this one counts the ``c`` of every micro-batch,
    which (2) charges once). (2) and (3) are applied to all documents and, for every MaxLen level,
    to the documents longer than it and the pipelines that can hold them.

    ``scheme_cache``: a dict shared by calls on the same ``lengths`` (the candidates of one
    iteration), which keeps each scheme's per-document arrays.
    """
    if lengths.size == 0:
        return 0.0
    lf = lengths.astype(np.float64)
    counts: dict[Scheme, int] = {}
    for d, s in strategy.groups():
        counts[s] = counts.get(s, 0) + d
    schemes = list(counts)
    caps = np.array([cost.max_len(s) for s in schemes])
    single = np.full(lengths.size, np.inf)
    rank_work = np.empty((len(schemes), lengths.size))
    rank_work_mb = np.empty((len(schemes), lengths.size))  # with c per MaxLen tokens, bound (3)
    params, params_mb = [], []
    for gi, s in enumerate(schemes):
        a, b, c = cost.coeffs(s)
        arrays = scheme_cache.get(s) if scheme_cache is not None else None
        if arrays is None:
            t = a * lf * lf + b * lf
            ok = lengths <= caps[gi]
            arrays = (np.where(ok, s.pp * (t + c), np.inf), np.where(ok, t * s.num_ranks, np.inf),
                      np.where(ok, (t + c * lf / caps[gi]) * s.num_ranks, np.inf))
            if scheme_cache is not None:
                scheme_cache[s] = arrays
        single = np.minimum(single, arrays[0])
        rank_work[gi] = arrays[1]
        rank_work_mb[gi] = arrays[2]
        k = s.pp - 1
        params.append((counts[s] * s.num_ranks, math.sqrt(k * c), c if k == 0 else 0.0))
        params_mb.append((counts[s] * s.num_ranks, k * c))
    if not np.isfinite(single).all():
        return float("inf")
    best = float(single.max())
    for level in sorted(set([0] + caps.tolist())):
        docs = lengths > level
        usable = [gi for gi in range(len(schemes)) if caps[gi] > level]
        if not docs.any() or not usable:
            continue
        need = float(rank_work[usable][:, docs].min(axis=0).sum())
        need_mb = float(rank_work_mb[usable][:, docs].min(axis=0).sum())
        best = max(best, _fluid_bound(need, [params[gi] for gi in usable]),
                   _linear_bound(need_mb, [params_mb[gi] for gi in usable]))
    return best
