"""Choosing the strategy of one iteration: two-stage assignment (dispatch + packing) on every
candidate, best estimate wins (Hydraulis §6).

Candidates are visited in increasing order of a lower bound of their latency (``latency_bound``) and
skipped once the bound reaches the best estimate found, so the choice equals evaluating them all. The
candidates of ``--strategies auto`` come from ``auto_candidates``.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.planner.latency_bound import strategy_lower_bound
from hgraph.runtime.planner.plan import PipelinePlan, Plan
from hgraph.runtime.planner.schedule.dispatch import dispatch_sequences
from hgraph.runtime.planner.schedule.dispatch_fast import CHUNKED_PIPELINES, dispatch_fast, improve_with_alg1
from hgraph.strategy import Cluster, Scheme, Strategy


def validate_for_cluster(strategy: Strategy, world_size: int, gpus_per_node: int) -> None:
    """Rank count and TP groups inside nodes, per run of equal pipelines in numpy (12,288 GPUs hold
    thousands of pipelines; ``Strategy.validate`` is used for its message when something is wrong)."""
    ok = strategy.num_ranks == world_size
    base = 0
    for d, p in strategy.groups():
        if not ok:
            break
        starts = base + p.tp * np.arange(d * p.num_ranks // p.tp, dtype=np.int64)  # every TP group of the run
        if p.tp > 1 and np.any(starts // gpus_per_node != (starts + p.tp - 1) // gpus_per_node):
            ok = False
        base += d * p.num_ranks
    if not ok:
        strategy.validate(Cluster(world_size, gpus_per_node))
        raise HGraphError(f"strategy {strategy} does not fit {world_size} GPUs with {gpus_per_node} per node")


# Candidates whose greedy dispatch is within this fraction of the best get the local search.
# Measured at 64 GPUs / 200K tokens (llama-32b, 50 iterations): 3% -> 1% cut the mean CPU time per
# iteration from 34 to 21 ms (p90 53 -> 27 ms) for +0.02% in the summed estimate.
IMPROVE_MARGIN = 0.01
# ... at most this many of them with more than ``CHUNKED_PIPELINES`` pipelines (their screening is
# the surrogate of the chunked pass, within ~0.1% of the packed result; a proposal's near-identical
# variants at 1024 GPUs would otherwise all be packed, ~0.1 s each).
IMPROVE_MANY_PIPELINES = 4


def _select_fast(lengths, bounds, cost, previous=None):
    """Screen every candidate not pruned by its bound with one cheap greedy pass, then run the full
    fast method (restarts, fill pass, local search) on those within ``IMPROVE_MARGIN`` of the best,
    best first: the full method gains ~1-3%, screening costs a fraction of it. The winner alone
    also gets the Alg. 1 start (``improve_with_alg1``): the plan is never worse than Alg. 1 with
    100 trials on the chosen strategy. ``previous`` (the last iteration's strategy, when among
    the candidates) is screened first: consecutive iterations mostly choose the same strategy, so
    its latency prunes the others by their bounds, and with many pipelines stops their screening
    passes early."""
    greedy = []
    best_latency = float("inf")
    best_packed = float("inf")  # bounds prune against plans that exist, not against a surrogate
    pruned = 0
    if previous is not None:
        bounds = sorted(bounds, key=lambda x: x[2] != previous)   # stable: bound order otherwise
    for lb, _, s in bounds:
        if lb >= best_packed:
            pruned += 1
            continue
        res = dispatch_fast(lengths, s.pipelines, cost, polish=False, stop_above=best_latency * (1 + IMPROVE_MARGIN))
        if not math.isfinite(res.latency):
            continue   # many pipelines: its screening pass passed the margin over the best, it cannot win
        latency = priced_latency(res, s, cost, lengths)     # with the exposed push: what candidates compare by
        greedy.append((latency, lb, s, res))
        best_latency = min(best_latency, latency)
        if res.packs:
            best_packed = min(best_packed, latency)
    # The previous strategy's full plan first (it mostly wins again): what it achieves prunes the
    # others, then the rest by screened latency.
    greedy.sort(key=lambda x: (x[2] != previous, x[0]))
    best, best_total = None, math.inf     # the best and its latency with the exposed push (priced_latency)
    many_left = IMPROVE_MANY_PIPELINES
    missed_by: dict[frozenset, float] = {}
    for latency, lb, s, res in greedy:
        many = len(s.pipelines) > CHUNKED_PIPELINES
        if best is not None and lb >= best_total:
            continue
        if not many and latency > min(best_packed, best_total) * (1 + IMPROVE_MARGIN):
            continue   # against plans that exist: a many-pipeline screening is a surrogate, often low
        if many:
            # Screened on the surrogate, a lower bound of the packed greedy pass that can be a few
            # percent low (micro-batches that do not fill): packed while it stays below the best
            # packed so far, also after scaling by what the surrogate missed on a packed candidate
            # of the same schemes (a proposal's near-identical variants).
            family = frozenset(p for _, p in s.groups())
            missed = missed_by.get(family, 1.0)
            if many_left <= 0 or (best is not None and latency * missed >= best_total):
                continue
            many_left -= 1
        screened = latency
        res = dispatch_fast(lengths, s.pipelines, cost, alg1_seed=False, greedy_starts=res.greedy_starts)
        if many and screened > 0:
            missed_by[family] = min(missed_by.get(family, math.inf), res.latency / screened)
        total = priced_latency(res, s, cost, lengths)
        if best is None or total < best_total:
            best, best_total = (res, s), total
    if best is not None:
        best = (improve_with_alg1(lengths, best[1].pipelines, cost, best[0]), best[1])
    return best, len(greedy), pruned


def priced_latency(res, strategy: Strategy, cost, lengths=None) -> float:
    """A dispatch's latency with each pipeline's exposed push (``CostModel.exposed_push_ms``) and each
    EP pipeline's micro-batches priced per replica (``CostModel.microbatch_time``; the dispatch
    balanced their even split, a lower bound): what candidates are compared by; ``res.latency``
    without either. A lower bound of the dispatch stays a bound of it."""
    replicas = lengths is not None and any(cost.prices_replicas(p) for _, p in strategy.groups())
    if (getattr(cost, "push", None) is None and not replicas) or not res.packs:   # or a surrogate's screening
        return res.latency

    def pipeline(pk, p) -> float:
        if not len(pk.mb_times):
            return 0.0
        if replicas and cost.prices_replicas(p):
            return cost.pipeline_time([cost.microbatch_time(lengths[mb], p) for mb in pk.microbatches], p)
        return pk.latency + cost.exposed_push_ms(p, pk.mb_times)
    return max((pipeline(pk, p) for pk, p in zip(res.packs, strategy.pipelines)), default=0.0)


def fits_longest(strategy: Strategy, cost, longest: int) -> bool:
    """Whether some pipeline of ``strategy`` holds a document of ``longest`` tokens."""
    return max(cost.max_len(p) for _, p in strategy.groups()) >= longest


def plan_iteration(lengths, candidates: Sequence[Strategy], cost, *, method: str = "fast", seed: int = 0,
                   doc_ids=None, index: int = 0, trials: int = 100, time_limit_s: float = 10.0,
                   workers: int = 1, previous: Strategy | None = None) -> Plan:
    """The best plan over ``candidates`` for the documents ``lengths`` of one mini-batch.

    ``doc_ids`` are the documents' indices in the file (default ``0..n-1``); micro-batches in the
    plan hold those. ``method``: ``fast`` (default), ``greedy`` (Alg. 1, ``trials``) or ``cpsat``
    (time-boxed per candidate). Strategies whose pipelines cannot hold the longest document are
    skipped; if none can, HGraphError names the longest length and the largest MaxLen.
    ``previous``: the strategy of the previous iteration, screened first by the fast method (it
    changes the order of work, not what is compared).
    """
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.arange(lengths.size, dtype=np.int64) if doc_ids is None else np.asarray(doc_ids, dtype=np.int64)
    if ids.shape != lengths.shape:
        raise HGraphError(f"doc_ids has {ids.size} entries for {lengths.size} documents")
    if not candidates:
        raise HGraphError("no candidate strategies to plan with")
    for s in candidates:
        validate_for_cluster(s, cost.world_size, cost.gpus_per_node)
        for _, p in s.groups():
            if not cost.has(p):
                cost.coeffs(p)  # raises the error naming the available schemes
    longest = int(lengths.max()) if lengths.size else 0
    fitting = [s for s in candidates if fits_longest(s, cost, longest)]
    skipped = [str(s) for s in candidates if not fits_longest(s, cost, longest)]
    if not fitting:
        largest = max(cost.max_len(p) for s in candidates for p in s.pipelines)
        raise HGraphError(
            f"no candidate strategy holds the longest document ({longest} tokens): the largest MaxLen among "
            f"their schemes is {largest}")
    scheme_cache: dict = {}
    bounds = [(strategy_lower_bound(lengths, s, cost, scheme_cache), i, s) for i, s in enumerate(fitting)]
    bounds.sort(key=lambda x: (x[0], x[1]))
    evaluated = pruned = 0
    if method == "fast":
        best, evaluated, pruned = _select_fast(lengths, bounds, cost, previous)
    else:
        best, best_total = None, math.inf
        for lb, _, s in bounds:
            if best is not None and lb >= best_total:
                pruned += 1
                continue
            res = dispatch_sequences(lengths, s.pipelines, cost, method=method, seed=seed, trials=trials,
                                     time_limit_s=time_limit_s, workers=workers)
            evaluated += 1
            total = priced_latency(res, s, cost, lengths)
            if best is None or total < best_total:
                best, best_total = (res, s), total
    res, strategy = best
    pipelines = []
    first_rank = 0
    seq_times: dict[Scheme, np.ndarray] = {}
    for j, (p, pk) in enumerate(zip(strategy.pipelines, res.packs)):
        # The estimate is recomputed with the cost model's own functions, so that
        # ``estimate_plan(plan, cost) == plan.est_latency_ms`` holds exactly.
        mb_times = _microbatch_times(lengths, pk.microbatches, p, cost, seq_times)
        pipelines.append(PipelinePlan(scheme=p, ranks=list(range(first_rank, first_rank + p.num_ranks)),
                                      microbatches=[ids[mb].tolist() for mb in pk.microbatches],
                                      est_latency_ms=cost.pipeline_time(mb_times, p)))
        first_rank += p.num_ranks
    return Plan(strategy=strategy, pipelines=pipelines,
                est_latency_ms=max((p.est_latency_ms for p in pipelines), default=0.0),
                solve_ms=(time.perf_counter() - t0) * 1e3,
                doc_lengths=dict(zip(ids.tolist(), lengths.tolist())), index=index,
                candidates_evaluated=evaluated, candidates_pruned=pruned, candidates_skipped=skipped)


def _microbatch_times(lengths: np.ndarray, microbatches, scheme: Scheme, cost, seq_times: dict) -> list[float]:
    """``cost.microbatch_time`` of each micro-batch, bit for bit: without an activation budget the
    per-document times are computed once per scheme for the whole mini-batch (elementwise the same
    values, summed by ``np.sum`` in the same order), which at 1024 GPUs saves ~1,000 calls; an EP
    pipeline's are priced per replica."""
    if cost.activation_budget_bytes is not None or cost.prices_replicas(scheme):
        return [cost.microbatch_time(lengths[mb], scheme) for mb in microbatches]
    t = seq_times.get(scheme)
    if t is None:
        t = seq_times[scheme] = cost.seq_time(lengths, scheme)
    c = cost.coeffs(scheme)[2]
    return [float(np.sum(t[mb])) + c for mb in microbatches]
