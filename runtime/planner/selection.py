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
from hgraph.runtime.data.lengths import minibatches
from hgraph.runtime.planner.cost.cost_model import without_relief
from hgraph.runtime.planner.interval_cost import DEFAULT_TOKENS_PER_GPU
from hgraph.runtime.planner.plan import PipelinePlan, Plan
from hgraph.runtime.planner.proposal import propose
from hgraph.runtime.planner.schedule.dispatch import dispatch_sequences
from hgraph.runtime.planner.schedule.dispatch_fast import CHUNKED_PIPELINES, dispatch_fast, improve_with_alg1
from hgraph.strategy import Cluster, Scheme, Strategy


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


def _validate(strategy: Strategy, world_size: int, gpus_per_node: int) -> None:
    """Rank count and TP groups inside nodes, per run of equal pipelines in numpy (12,288 GPUs hold
    thousands of pipelines; ``Strategy.validate`` is used for its message when something is wrong)."""
    ok = strategy.num_ranks == world_size
    base = 0
    for d, p in strategy.groups():
        if not ok:
            break
        starts = base + p.tp * np.arange(d * p.pp * p.seq, dtype=np.int64)  # every TP group of the run
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
        latency = priced_latency(res, s, cost)     # with the exposed push: what candidates compare by
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
        total = priced_latency(res, s, cost)
        if best is None or total < best_total:
            best, best_total = (res, s), total
    if best is not None:
        best = (improve_with_alg1(lengths, best[1].pipelines, cost, best[0]), best[1])
    return best, len(greedy), pruned


def priced_latency(res, strategy: Strategy, cost) -> float:
    """A dispatch's latency with each pipeline's exposed push (``CostModel.exposed_push_ms``): what
    candidates are compared by (the dispatch itself balances compute); ``res.latency`` without a
    push model. A compute-only lower bound stays a bound of it."""
    if getattr(cost, "push", None) is None or not res.packs:     # no push model, or a surrogate's screening
        return res.latency
    return max((pk.latency + cost.exposed_push_ms(p, pk.mb_times) if len(pk.mb_times) else 0.0
                for pk, p in zip(res.packs, strategy.pipelines)), default=0.0)


def _fits(strategy: Strategy, cost, longest: int) -> bool:
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
        _validate(s, cost.world_size, cost.gpus_per_node)
        for _, p in s.groups():
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
            total = priced_latency(res, s, cost)
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
    values, summed by ``np.sum`` in the same order), which at 1024 GPUs saves ~1,000 calls."""
    if cost.activation_budget_bytes is not None:
        return [cost.microbatch_time(lengths[mb], scheme) for mb in microbatches]
    t = seq_times.get(scheme)
    if t is None:
        t = seq_times[scheme] = cost.seq_time(lengths, scheme)
    c = cost.coeffs(scheme)[2]
    return [float(np.sum(t[mb])) + c for mb in microbatches]


def homogeneous_strategies(cost, gpus: int, max_len: int | None = None) -> list[Strategy]:
    """``DP x P`` for every scheme P of the cost model that divides ``gpus`` (and holds ``max_len``)."""
    out = []
    for s in cost.schemes:
        if gpus % s.num_ranks == 0 and (max_len is None or cost.max_len(s) >= max_len):
            out.append(Strategy.homogeneous(gpus // s.num_ranks, s))
    return out


# Mini-batches sampled from the dataset to pick the homogeneous fallback and the proposed
# candidates of ``auto_candidates``.
FALLBACK_SAMPLES = 3
AUTO_SAMPLES = 8
# ... at most this many tokens in all (at least 2 mini-batches): 8 at 200K tokens, 2 at 3.2M.
AUTO_SAMPLE_TOKENS = 1_600_000
# ``auto_candidates`` also draws from a wider proposal: the best 4 roundings per length, 16 candidates.
AUTO_WIDE_PROPOSAL = {"per_len": 4, "max_candidates": 16}
# ... and, with many pipelines, from share variants of the proposal's two-scheme mixes: the scheme
# of the longer MaxLen given this many times its pipelines (``share_variants``).
SHARE_STEPS = (1.1, 1.2, 1.3, 1.4)


def share_variants(strategy: Strategy, cost, gpus: int) -> list[Strategy]:
    """``strategy``, a mix of two schemes, with more of the GPUs on the scheme of the longer MaxLen
    (``SHARE_STEPS`` times its pipelines, the other scheme taking the rest); [] for other mixes.

    Why: the proposal sizes that scheme by the work of the documents only it holds, but they come
    in whole documents that fill its micro-batches unevenly: at 12,288 GPUs (llama-32b, 32K) the
    proposed 105-107 ``TP4PP1CP8`` pipelines beside ``TP4PP1`` packed 8% above their surrogate and
    lost to the homogeneous strategy, while 128-144 of them planned ~3% faster than it."""
    counts: dict[Scheme, int] = {}
    for d, p in strategy.groups():
        counts[p] = counts.get(p, 0) + d
    if len(counts) != 2:
        return []
    long, short = sorted(counts, key=lambda p: (-cost.max_len(p), str(p)))
    out: list[Strategy] = []
    for step in SHARE_STEPS:
        d = math.ceil(counts[long] * step)
        while d * long.num_ranks <= gpus and (gpus - d * long.num_ranks) % short.num_ranks:
            d += 1
        rest = gpus - d * long.num_ranks
        if rest < 0:
            break
        variant = Strategy.parse(f"{d}x{long}" + (f"+{rest // short.num_ranks}x{short}" if rest else ""))
        try:
            _validate(variant, gpus, cost.gpus_per_node)
        except HGraphError:
            continue
        if variant != strategy and variant not in out:
            out.append(variant)
    return out


def sequence_families(cost, max_len: int) -> list[list[Scheme]]:
    """Where the cost model prices both ring CP and Ulysses, the spaces of the systems that have one of
    them: the schemes without UL (Megatron-style CP), and the ``PP = 1`` schemes without CP
    (FlexSP-style groups of Ulysses ranks side by side); each only when it holds ``max_len``. The
    relaxed DP over all schemes mixes both, and its rounding can miss the mix of one space that plans
    better (measured: a proposal over FlexSP's space beat the joint one's candidates by 4% at a 128K
    context on 128 GPUs), so ``auto_candidates`` takes their proposals too."""
    if not any(s.ul > 1 for s in cost.schemes) or not any(s.cp > 1 for s in cost.schemes):
        return []
    families = ([s for s in cost.schemes if s.ul == 1], [s for s in cost.schemes if s.cp == 1 and s.pp == 1])
    return [f for f in families if f and max(cost.max_len(s) for s in f) >= max_len]


def sample_dataset_minibatches(lengths, max_len: int, tokens_per_iter: int, samples: int,
                               seed: int = 0) -> list[np.ndarray]:
    """``samples`` mini-batches of ``tokens_per_iter`` tokens (lengths truncated to ``max_len``),
    each the first one of a window starting at a seeded random position of ``lengths``."""
    lens = np.minimum(np.asarray(lengths, dtype=np.int64), max_len)
    rng = np.random.default_rng(seed)
    picked = []
    for _ in range(samples):
        start = int(rng.integers(0, max(lens.size - 1, 1)))
        window = lens[start:start + max(int(tokens_per_iter), 1)]
        picked.append(window[minibatches(window, int(tokens_per_iter))[0]])
    return picked


def best_homogeneous(lengths, cost, gpus: int, max_len: int, tokens_per_iter: int, *,
                     samples: int = FALLBACK_SAMPLES, seed: int = 0) -> Strategy | None:
    """The homogeneous strategy (holding ``max_len``) with the lowest mean greedy-dispatch latency on
    ``samples`` mini-batches of ``tokens_per_iter`` tokens drawn (seeded) from ``lengths``;
    strategies whose lower bound already exceeds the best mean are skipped. None if none holds it."""
    homogeneous = homogeneous_strategies(cost, gpus, max_len)
    if len(homogeneous) <= 1:
        return homogeneous[0] if homogeneous else None
    picked = sample_dataset_minibatches(lengths, max_len, tokens_per_iter, samples, seed)
    scored = sorted(((float(np.mean([strategy_lower_bound(b, s, cost) for b in picked])), i, s)
                     for i, s in enumerate(homogeneous)), key=lambda x: (x[0], x[1]))
    best, best_mean = None, math.inf
    for lb, _, s in scored:
        if lb >= best_mean:
            continue
        mean = float(np.mean([dispatch_fast(b, s.pipelines, cost, polish=False).latency for b in picked]))
        if mean < best_mean:
            best, best_mean = s, mean
    return best


def auto_candidates(lengths, cost, gpus: int, max_len: int, tokens_per_iter: int | None = None, *,
                    samples: int = AUTO_SAMPLES, seed: int = 0,
                    max_candidates: int | None = None,
                    microbatch_charge: bool | None = None) -> tuple[list[Strategy], str]:
    """Candidates for ``--strategies auto`` and where they came from.

    From the strategy proposer (``proposal.propose``; a candidate proposed for a length range only
    holds documents up to the range's top, and ``plan_iteration`` skips it for iterations with a
    longer document): its default set, whose full-context candidate is always kept, plus the
    candidates of a wider proposal (``AUTO_WIDE_PROPOSAL``; where the cost model prices
    both CP and Ulysses, one more per family, ``sequence_families``) that win at least one of ``samples``
    (fewer when they would hold more than ``AUTO_SAMPLE_TOKENS``) mini-batches sampled from ``lengths`` by the greedy screening pass of ``plan_iteration`` (the
    proposer ranks roundings by an interval-cost
    estimate, which sometimes misses the strategy that plans best), plus the single best
    homogeneous strategy (``best_homogeneous``) when not already there: one candidate (its bound
    prunes it in most iterations) that keeps every iteration's plan never worse than that best
    static strategy. ``tokens_per_iter`` defaults to the proposer's (3125 per GPU). Where the
    proposal's full-context candidate has at most ``CHUNKED_PIPELINES`` pipelines (64 GPUs), the
    candidates of at most that many pipelines of a proposal without the micro-batch charge
    (``propose(microbatch_charge=False)``) join too, and its wider proposal joins the sampled pool:
    each charge misses mixes the other proposes (at 64 GPUs the charged one drops a CP8 + CP2 + TP4
    mix that plans 3.8% faster in one of 20 iterations), and with few pipelines a candidate costs a
    screening pass or its bound.

    ``microbatch_charge``: True or False proposes with that charge alone (the bench compares them).

    ``max_candidates``: at most this many. The proposer keeps at most that many of its own (the
    full-context candidate always among them); the best homogeneous strategy and then the sampled
    winners take what room is left, so a set with room keeps the guarantee above.
    """
    tokens = int(tokens_per_iter or DEFAULT_TOKENS_PER_GPU * gpus)
    if not homogeneous_strategies(cost, gpus, max_len) and cost.largest_max_len() < max_len:
        raise HGraphError(
            f"no strategy of {gpus} GPUs holds {max_len} tokens with profile {cost.name!r} "
            f"(largest MaxLen {cost.largest_max_len()})")
    if max_candidates is not None and max_candidates < 1:
        raise HGraphError(f"max_candidates must be >= 1, got {max_candidates}")
    cap = {} if max_candidates is None else {"max_candidates": max_candidates}
    charge = True if microbatch_charge is None else microbatch_charge

    # The proposer's interval costs do not price relief: where the schemes hold the context without
    # it, it proposes as if none were there, and the relieved model's proposals join the sampled pool
    # (measured without this: relief's longer MaxLen drew narrow proposals that planned 5% slower)
    proposing, relieved_pool = cost, []
    plain = without_relief(cost)
    if plain is not cost and plain.largest_max_len() >= max_len:
        proposing = plain
        relieved_pool = propose(lengths, cost, gpus, max_len, tokens_per_iter=tokens, microbatch_charge=charge,
                                **AUTO_WIDE_PROPOSAL).strategies

    def proposal(with_charge: bool, **opts) -> list[Strategy]:
        return propose(lengths, proposing, gpus, max_len, tokens_per_iter=tokens, microbatch_charge=with_charge,
                       **opts).strategies

    proposed = proposal(charge, **cap)
    full_context = proposed[-1]          # the proposal's last candidate holds the longest documents
    uncharged: list[Strategy] = []
    uncharged_too = microbatch_charge is None and len(proposed[-1].pipelines) <= CHUNKED_PIPELINES
    if uncharged_too:
        uncharged = [s for s in proposal(False, **cap) if s not in proposed and len(s.pipelines) <= CHUNKED_PIPELINES]
    wide = proposal(charge, **AUTO_WIDE_PROPOSAL) + (proposal(False, **AUTO_WIDE_PROPOSAL) if uncharged_too else [])
    many = len(proposed[-1].pipelines) > CHUNKED_PIPELINES
    if many:
        wide += [v for s in proposed for v in share_variants(s, proposing, gpus)]
    for family in sequence_families(proposing, max_len):
        # uncapped, a family's candidates join the proposed ones; under a cap, the sampled pool
        picks = proposal(charge, schemes=family, **cap)
        if max_candidates is None:
            proposed += [s for s in picks if s not in proposed]
        else:
            wide += picks
    wide = [s for s in dict.fromkeys(wide + relieved_pool) if s not in proposed and s not in uncharged]
    winners: set[Strategy] = set()
    samples = min(samples, max(2, AUTO_SAMPLE_TOKENS // tokens))
    if wide and samples > 0:
        pool = list(dict.fromkeys(proposed + wide))
        for b in sample_dataset_minibatches(lengths, max_len, tokens, samples, seed):
            longest = int(b.max())
            fitting = [s for s in pool if _fits(s, cost, longest)]
            bounds = sorted(((strategy_lower_bound(b, s, cost), i, s) for i, s in enumerate(fitting)),
                            key=lambda x: (x[0], x[1]))
            # Few pipelines: the screening pass of plan_iteration's fast method (one greedy pass per
            # candidate). Many: the full method, because the screening surrogate of a mix whose
            # long-document scheme is short of pipelines reads several percent low.
            best, best_latency = None, math.inf
            for lb, _, s in bounds:
                if lb >= best_latency:
                    break
                latency = dispatch_fast(b, s.pipelines, cost, polish=many, alg1_seed=False).latency
                if latency < best_latency:
                    best, best_latency = s, latency
            if best is not None:
                winners.add(best)
    extra = [s for s in wide if s in winners]
    if many and winners:
        # With many pipelines a candidate costs a screening pass of 10-60 ms per iteration: the
        # proposal's candidates that won no sampled mini-batch give way to those that did (the
        # full-context one is always kept).
        proposed = [s for s in proposed if s in winners or s == full_context]
    fallback = best_homogeneous(lengths, cost, gpus, max_len, tokens)
    if max_candidates is not None:
        room = max_candidates - len(proposed)
        if fallback is not None and fallback not in proposed:
            if room > 0:
                room -= 1
            else:
                fallback = None            # no room left for it
        uncharged = uncharged[:max(room, 0)]
        room -= len(uncharged)
        extra = extra[:max(room, 0)]
    extra = [s for s in extra if s not in uncharged]
    cands = list(dict.fromkeys(proposed + uncharged + extra + ([fallback] if fallback is not None else [])))
    added = len(cands) - len(proposed) - len(uncharged) - len(extra)
    source = (f"{len(proposed)} proposed + {len(uncharged)} proposed without the micro-batch charge + "
              f"{len(extra)} of a wider proposal"
              + (" + the best homogeneous" if added else " (the best homogeneous among them)" if fallback is not None
                 else "")
              + (f", at most {max_candidates}" if max_candidates is not None else ""))
    return cands, source
