"""The candidate strategies of ``--strategies auto`` (``auto_candidates``): the strategy proposer's,
those of a wider proposal that win mini-batches sampled from the data, and the best homogeneous
strategy (``best_homogeneous``) as a floor under every iteration's plan."""
from __future__ import annotations

import math

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.lengths import minibatches
from hgraph.runtime.planner.cost.cost_model import without_relief
from hgraph.runtime.planner.interval_cost import DEFAULT_TOKENS_PER_GPU
from hgraph.runtime.planner.latency_bound import strategy_lower_bound
from hgraph.runtime.planner.proposal import propose
from hgraph.runtime.planner.schedule.dispatch_fast import CHUNKED_PIPELINES, dispatch_fast
from hgraph.runtime.planner.selection import fits_longest, priced_latency, validate_for_cluster
from hgraph.strategy import Scheme, Strategy


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
            validate_for_cluster(variant, gpus, cost.gpus_per_node)
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
        mean = float(np.mean([_latency(dispatch_fast(b, s.pipelines, cost, polish=False), s, cost, b) for b in picked]))
        if mean < best_mean:
            best, best_mean = s, mean
    return best


def _latency(res, strategy: Strategy, cost, lengths) -> float:
    """A dispatch's latency, its EP pipelines priced per replica (``priced_latency``; the even split
    the dispatch balanced is a lower bound of it)."""
    if any(cost.prices_replicas(p) for _, p in strategy.groups()):
        return priced_latency(res, strategy, cost, lengths)
    return res.latency


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
            fitting = [s for s in pool if fits_longest(s, cost, longest)]
            bounds = sorted(((strategy_lower_bound(b, s, cost), i, s) for i, s in enumerate(fitting)),
                            key=lambda x: (x[0], x[1]))
            # Few pipelines: the screening pass of plan_iteration's fast method (one greedy pass per
            # candidate). Many: the full method, because the screening surrogate of a mix whose
            # long-document scheme is short of pipelines reads several percent low.
            best, best_latency = None, math.inf
            for lb, _, s in bounds:
                if lb >= best_latency:
                    break
                latency = _latency(dispatch_fast(b, s.pipelines, cost, polish=many, alg1_seed=False), s, cost, b)
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
