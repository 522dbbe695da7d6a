"""Choosing the strategy of one iteration: two-stage assignment (dispatch + packing) on every
candidate, best estimate wins (Hydraulis §6).

Candidates are visited in increasing order of a lower bound of their latency and skipped once the
bound reaches the best estimate found, so the choice equals evaluating them all.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.planner.dispatch import dispatch_sequences
from hgraph.runtime.planner.plan import PipelinePlan, Plan
from hgraph.strategy import Cluster, Scheme, Strategy


def strategy_lower_bound(lengths: np.ndarray, strategy: Strategy, cost) -> float:
    """A lower bound of the packed latency of ``strategy`` on ``lengths`` (inf if a doc fits nowhere).

    The larger of two valid bounds: (1) the document whose best eligible pipeline is slowest, alone
    there: ``PP * (a l^2 + b l + c)``; (2) work: a pipeline of ``PP - 1 = k`` with per-sequence work
    ``S`` takes at least ``g(S) = min_V (k+V)(S/V + c) >= (sqrt(S) + sqrt(k c))^2`` (``S + c`` when
    ``k = 0``), so under a makespan ``M`` it holds at most ``h(M) = g^-1(M)`` work; a document costs
    ``r_j t_j(l)`` rank-ms on a pipeline of ``r_j`` ranks, hence ``sum_i min_j r_j t_j(l_i) <=
    sum_j r_j h_j(M)``; the smallest such ``M`` is found by bisection.
    """
    if lengths.size == 0:
        return 0.0
    lf = lengths.astype(np.float64)
    single = np.full(lengths.size, np.inf)
    work = np.full(lengths.size, np.inf)
    groups = strategy.groups()
    counts: dict[Scheme, int] = {}
    for d, s in groups:
        counts[s] = counts.get(s, 0) + d
    for s in counts:
        a, b, c = cost.coeffs(s)
        t = a * lf * lf + b * lf
        ok = lengths <= cost.max_len(s)
        single = np.where(ok, np.minimum(single, s.pp * (t + c)), single)
        work = np.where(ok, np.minimum(work, t * s.num_ranks), work)
    if not np.isfinite(single).all():
        return float("inf")
    need = float(work.sum())
    params = []
    for s, d in counts.items():
        _, _, c = cost.coeffs(s)
        k = s.pp - 1
        params.append((d * s.num_ranks, math.sqrt(k * c), c if k == 0 else 0.0))

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
    for _ in range(60):
        mid = (lo + hi) / 2
        if capacity(mid) >= need:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return max(float(single.max()), lo)


def _fits(strategy: Strategy, cost, longest: int) -> bool:
    return max(cost.max_len(p) for p in strategy.pipelines) >= longest


def plan_iteration(lengths, candidates: Sequence[Strategy], cost, *, method: str = "fast", seed: int = 0,
                   doc_ids=None, index: int = 0, trials: int = 100, time_limit_s: float = 10.0,
                   workers: int = 1) -> Plan:
    """The best plan over ``candidates`` for the documents ``lengths`` of one mini-batch.

    ``doc_ids`` are the documents' indices in the file (default ``0..n-1``); micro-batches in the
    plan hold those. ``method``: ``fast`` (default), ``greedy`` (Alg. 1, ``trials``) or ``cpsat``
    (time-boxed per candidate). Strategies whose pipelines cannot hold the longest document are
    skipped; if none can, HGraphError names the longest length and the largest MaxLen.
    """
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.arange(lengths.size, dtype=np.int64) if doc_ids is None else np.asarray(doc_ids, dtype=np.int64)
    if ids.shape != lengths.shape:
        raise HGraphError(f"doc_ids has {ids.size} entries for {lengths.size} documents")
    if not candidates:
        raise HGraphError("no candidate strategies to plan with")
    cluster = Cluster(cost.world_size, cost.gpus_per_node)
    for s in candidates:
        s.validate(cluster)
        for p in set(s.pipelines):
            if not cost.has(p):
                cost.coeffs(p)  # raises the error naming the available schemes
    longest = int(lengths.max()) if lengths.size else 0
    fitting = [s for s in candidates if _fits(s, cost, longest)]
    skipped = [str(s) for s in candidates if not _fits(s, cost, longest)]
    if not fitting:
        largest = max(cost.max_len(p) for s in candidates for p in s.pipelines)
        raise HGraphError(
            f"no candidate strategy holds the longest document ({longest} tokens): the largest MaxLen among "
            f"their schemes is {largest}")
    bounds = [(strategy_lower_bound(lengths, s, cost), i, s) for i, s in enumerate(fitting)]
    bounds.sort(key=lambda x: (x[0], x[1]))
    best = None
    evaluated = pruned = 0
    for lb, _, s in bounds:
        if best is not None and lb >= best[0].latency:
            pruned += 1
            continue
        res = dispatch_sequences(lengths, s.pipelines, cost, method=method, seed=seed, trials=trials,
                                 time_limit_s=time_limit_s, workers=workers)
        evaluated += 1
        if best is None or res.latency < best[0].latency:
            best = (res, s)
    res, strategy = best
    pipelines = []
    for j, (p, pk) in enumerate(zip(strategy.pipelines, res.packs)):
        # The estimate is recomputed with the cost model's own functions, so that
        # ``estimate_plan(plan, cost) == plan.est_latency_ms`` holds exactly.
        mb_times = [cost.microbatch_time(lengths[mb], p) for mb in pk.microbatches]
        pipelines.append(PipelinePlan(scheme=p, ranks=strategy.pipeline_ranks(j),
                                      microbatches=[ids[mb].tolist() for mb in pk.microbatches],
                                      est_latency_ms=cost.pipeline_time(mb_times, p)))
    return Plan(strategy=strategy, pipelines=pipelines,
                est_latency_ms=max((p.est_latency_ms for p in pipelines), default=0.0),
                solve_ms=(time.perf_counter() - t0) * 1e3,
                doc_lengths=dict(zip(ids.tolist(), lengths.tolist())), index=index,
                candidates_evaluated=evaluated, candidates_pruned=pruned, candidates_skipped=skipped)


def homogeneous_strategies(cost, gpus: int, max_len: int | None = None) -> list[Strategy]:
    """``DP x P`` for every scheme P of the cost model that divides ``gpus`` (and holds ``max_len``)."""
    out = []
    for s in cost.schemes:
        if gpus % s.num_ranks == 0 and (max_len is None or cost.max_len(s) >= max_len):
            out.append(Strategy.homogeneous(gpus // s.num_ranks, s))
    return out


def auto_candidates(lengths, cost, gpus: int, max_len: int) -> tuple[list[Strategy], str]:
    """Candidates for ``--strategies auto`` and where they came from.

    Uses ``hgraph.runtime.planner.proposal.propose_strategies`` when it exists; otherwise every
    homogeneous strategy whose scheme holds ``max_len`` tokens.
    """
    try:
        from hgraph.runtime.planner.proposal import propose_strategies  # type: ignore[attr-defined]
    except ImportError:
        propose_strategies = None
    if propose_strategies is not None:
        return list(propose_strategies(lengths, cost, gpus, max_len)), "proposal"
    cands = homogeneous_strategies(cost, gpus, max_len)
    if not cands:
        raise HGraphError(
            f"no homogeneous strategy of {gpus} GPUs holds {max_len} tokens with profile {cost.name!r} "
            f"(largest MaxLen {cost.largest_max_len()})")
    return cands, "homogeneous"
