"""Dispatching documents across the pipelines of a strategy (Eq. 3)."""
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.planner.schedule.dispatch import dispatch_sequences
from hgraph.runtime.planner.schedule.dispatch_alg1 import alg1_assignment
from hgraph.runtime.planner.schedule.dispatch_fast import ALG1_SEED_MAX_DOCS, ALG1_TRIALS
from hgraph.strategy import Strategy

CM = load_cost_model("llama-32b", world_size=64)
STRATEGIES = [Strategy.parse(s) for s in (
    "2xTP8PP2CP2", "1xTP8PP1CP4+4xTP8PP1", "1xTP8PP2CP2+2xTP8PP1+2xTP4PP1+2xTP2PP2", "8xTP4PP2")]


def _wiki_like(rng, n, cap):
    return np.minimum(np.maximum(rng.lognormal(6.0, 1.3, size=n).astype(np.int64), 1), cap)


def _check(res, lengths, strategy):
    docs = sorted(np.concatenate([a for a in res.assignment]).tolist())
    assert docs == list(range(len(lengths)))  # every document exactly once
    for a, pk, p in zip(res.assignment, res.packs, strategy.pipelines):
        packed = sorted(np.concatenate(pk.microbatches).tolist()) if pk.microbatches else []
        assert packed == sorted(a.tolist())
        for mb in pk.microbatches:
            assert int(lengths[mb].sum()) <= CM.max_len(p)  # also: only eligible pipelines
        mb_times = [CM.microbatch_time(lengths[mb], p) for mb in pk.microbatches]
        assert pk.latency == pytest.approx(CM.pipeline_time(mb_times, p), rel=1e-12)
    assert res.latency == max(pk.latency for pk in res.packs)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 120), st.sampled_from(STRATEGIES), st.sampled_from(["fast", "greedy"]))
def test_dispatch_is_a_valid_assignment(seed, n, strategy, method):
    rng = np.random.default_rng(seed)
    cap = max(CM.max_len(p) for p in strategy.pipelines)
    lengths = _wiki_like(rng, n, cap)
    res = dispatch_sequences(lengths, strategy.pipelines, CM, method=method, trials=3, seed=seed)
    _check(res, lengths, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES[:3], ids=str)
def test_fast_beats_randomized_greedy(strategy):
    rng = np.random.default_rng(7)
    cap = max(CM.max_len(p) for p in strategy.pipelines)
    for _ in range(3):
        lengths = _wiki_like(rng, 200, cap)
        fast = dispatch_sequences(lengths, strategy.pipelines, CM, method="fast")
        alg1 = dispatch_sequences(lengths, strategy.pipelines, CM, method="greedy", trials=20, seed=1)
        assert fast.latency <= alg1.latency


@settings(max_examples=12, deadline=None)
@example(0, 200, "2xTP8PP1CP4")  # the local search alone lost these by 0.01-0.04 ms
@example(4, 200, "2xTP4PP1CP8")
@given(st.integers(0, 10_000), st.integers(2, 260),
       st.sampled_from(["2xTP4PP1CP8", "2xTP8PP1CP4", "2xTP8PP2CP2", "1xTP8PP1CP4+4xTP8PP1"]))
def test_fast_never_worse_than_alg1_with_100_trials(seed, n, text):
    # The two-pipeline homogeneous cases are where a pure local search lost to Alg. 1 by ~1e-5.
    strategy = Strategy.parse(text)
    rng = np.random.default_rng(seed)
    lengths = _wiki_like(rng, n, max(CM.max_len(p) for p in strategy.pipelines))
    assert n <= ALG1_SEED_MAX_DOCS
    fast = dispatch_sequences(lengths, strategy.pipelines, CM, seed=seed)
    alg1 = dispatch_sequences(lengths, strategy.pipelines, CM, method="greedy", trials=ALG1_TRIALS, seed=seed)
    assert fast.latency <= alg1.latency


def _alg1_one_trial_at_a_time(lengths, pipelines, trials, seed):
    """Hydraulis Alg. 1 written plainly: one trial after another, one document at a time."""
    rng = np.random.default_rng(seed)
    coeffs = [CM.coeffs(p) for p in pipelines]
    best, best_assign = np.inf, None
    for _ in range(trials):
        perm = rng.permutation(len(lengths))
        work = [0.0] * len(pipelines)
        longest = [0] * len(pipelines)
        total = [0.0] * len(pipelines)
        assign = {}
        for i in perm:
            l = int(lengths[i])
            objs = []
            for j, (p, (a, b, c)) in enumerate(zip(pipelines, coeffs)):
                if l > CM.max_len(p):
                    objs.append(np.inf)
                    continue
                lm = max(longest[j], l)
                new = work[j] + a * l * l + b * l + c + (a * lm * lm + b * lm + c) * (p.pp - 1)
                objs.append(max([new] + [total[q] for q in range(len(pipelines)) if q != j]))
            j = int(np.argmin(objs))
            a, b, c = coeffs[j]
            work[j] += a * l * l + b * l
            longest[j] = max(longest[j], l)
            total[j] = work[j] + c + (a * longest[j] ** 2 + b * longest[j] + c) * (pipelines[j].pp - 1)
            assign[int(i)] = j
        if max(total) < best:
            best, best_assign = max(total), assign
    return [sorted(i for i, j in best_assign.items() if j == q) for q in range(len(pipelines))]


@pytest.mark.parametrize("text", ["2xTP8PP2CP2", "1xTP8PP2CP2+2xTP8PP1+2xTP4PP1+2xTP2PP2"])
def test_alg1_trials_side_by_side_match_the_plain_algorithm(text):
    strategy = Strategy.parse(text)
    lengths = _wiki_like(np.random.default_rng(5), 40, max(CM.max_len(p) for p in strategy.pipelines))
    got = alg1_assignment(lengths, strategy.pipelines, CM, trials=7, seed=3)
    want = _alg1_one_trial_at_a_time(lengths, strategy.pipelines, 7, 3)
    assert [sorted(g) for g in got] == want


def test_homogeneous_fast_is_balanced():
    rng = np.random.default_rng(3)
    strategy = STRATEGIES[0]
    lengths = _wiki_like(rng, 200, CM.max_len(strategy.pipelines[0]))
    res = dispatch_sequences(lengths, strategy.pipelines, CM)
    assert max(res.latencies) / min(res.latencies) - 1 <= 0.02


def test_cpsat_never_worse_and_bounded():
    rng = np.random.default_rng(11)
    strategy = Strategy.parse("1xTP8PP2+2xTP4PP1")
    lengths = _wiki_like(rng, 14, CM.max_len(strategy.pipelines[0]))
    fast = dispatch_sequences(lengths, strategy.pipelines, CM)
    exact = dispatch_sequences(lengths, strategy.pipelines, CM, method="cpsat", time_limit_s=3)
    _check(exact, lengths, strategy)
    assert exact.latency <= fast.latency
    assert exact.bound is not None and exact.bound <= exact.latency * (1 + 1e-6)


def test_long_documents_only_on_pipelines_that_hold_them():
    strategy = Strategy.parse("1xTP8PP2CP2+2xTP2PP2")
    big = CM.max_len(strategy.pipelines[1]) + 100
    lengths = np.array([big, big, 300, 200, 100], dtype=np.int64)
    res = dispatch_sequences(lengths, strategy.pipelines, CM)
    assert {0, 1} <= set(res.assignment[0].tolist())
    _check(res, lengths, strategy)


def test_errors():
    strategy = Strategy.parse("2xTP2PP2")
    too_long = CM.max_len(strategy.pipelines[0]) + 1
    with pytest.raises(HGraphError, match=f"{too_long} tokens is longer than the largest MaxLen"):
        dispatch_sequences([10, too_long], strategy.pipelines, CM)
    with pytest.raises(HGraphError, match="unknown dispatch method"):
        dispatch_sequences([10], strategy.pipelines, CM, method="magic")
    with pytest.raises(HGraphError, match="trials"):
        dispatch_sequences([10], strategy.pipelines, CM, method="greedy", trials=0)
