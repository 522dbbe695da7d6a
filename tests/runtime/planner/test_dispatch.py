"""Dispatching documents across the pipelines of a strategy (Eq. 3)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost_model import load_cost_model
from hgraph.runtime.planner.dispatch import dispatch_sequences
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
