"""Packing one pipeline's documents into micro-batches (Eq. 1)."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.planner.schedule.packing import microbatch_range, pack_pipeline, pack_pipeline_cpsat
from hgraph.strategy import Scheme

CM = load_cost_model("llama-13b", world_size=64)


def _recomputed(res, lengths, scheme):
    mb_times = [CM.microbatch_time(lengths[mb], scheme) for mb in res.microbatches]
    return CM.pipeline_time(mb_times, scheme)


def _check(res, lengths, scheme):
    got = sorted(np.concatenate(res.microbatches).tolist()) if res.microbatches else []
    assert got == list(range(len(lengths)))  # every document exactly once
    for mb in res.microbatches:
        assert len(mb) > 0 and int(lengths[mb].sum()) <= CM.max_len(scheme)
    assert res.latency == pytest.approx(_recomputed(res, lengths, scheme), rel=1e-12)


def test_microbatch_range():
    assert microbatch_range(10_000, 20, 4_000, 1_000) == (3, 10)
    assert microbatch_range(10_000, 5, 4_000, 1_000) == (3, 5)
    assert microbatch_range(500, 3, 4_000, 1_000) == (1, 1)  # bounds cross: lower end wins
    assert microbatch_range(9_000, 2, 4_000, 100) == (3, 3)


SCHEMES = [Scheme(2, 1), Scheme(2, 4), Scheme(4, 2), Scheme(8, 1, 2)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12_000), min_size=1, max_size=40), st.sampled_from(SCHEMES))
def test_fast_packing_is_a_valid_partition(lens, scheme):
    lengths = np.minimum(np.array(lens, dtype=np.int64), CM.max_len(scheme))
    res = pack_pipeline(lengths, scheme, CM)
    _check(res, lengths, scheme)
    vmin, vmax = microbatch_range(int(lengths.sum()), len(lengths), CM.max_len(scheme), CM.util_len(scheme))
    assert res.num_microbatches >= vmin


def _brute_force(lengths, scheme):
    """Optimum of Eq. 1 over every assignment and every V in the pruned range (tiny inputs)."""
    a, b, c = CM.coeffs(scheme)
    t = a * lengths.astype(float) ** 2 + b * lengths
    vmin, vmax = microbatch_range(int(lengths.sum()), len(lengths), CM.max_len(scheme), CM.util_len(scheme))
    best = np.inf
    for V in range(vmin, vmax + 1):
        for labels in itertools.product(range(V), repeat=len(lengths)):
            labels = np.array(labels)
            if len(set(labels.tolist())) != V:
                continue
            if any(lengths[labels == j].sum() > CM.max_len(scheme) for j in range(V)):
                continue
            best = min(best, (scheme.pp - 1 + V) * (max(t[labels == j].sum() for j in range(V)) + c))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_cpsat_matches_brute_force_and_fast_is_close(seed):
    rng = np.random.default_rng(seed)
    scheme = Scheme(2, 4)
    lengths = rng.integers(300, 6000, size=6)
    opt = _brute_force(lengths, scheme)
    exact = pack_pipeline_cpsat(lengths, scheme, CM, time_limit_s=5)
    _check(exact, lengths, scheme)
    assert exact.latency == pytest.approx(opt, rel=1e-3)  # CP-SAT works on costs rounded to 1 us
    fast = pack_pipeline(lengths, scheme, CM)
    assert opt <= fast.latency * (1 + 1e-9)
    assert fast.latency <= 4 / 3 * opt  # LPT's worst-case ratio for min-max partitioning


def test_more_stages_prefer_more_microbatches():
    lengths = np.full(32, 1000, dtype=np.int64)
    deep = pack_pipeline(lengths, Scheme(2, 8), CM)
    flat = pack_pipeline(lengths, Scheme(2, 1), CM)
    assert deep.num_microbatches > flat.num_microbatches
    vmin, _ = microbatch_range(32_000, 32, CM.max_len(Scheme(2, 1)), CM.util_len(Scheme(2, 1)))
    assert flat.num_microbatches == vmin  # PP=1: each extra micro-batch only adds c


def test_capacity_forces_more_microbatches_than_the_range():
    scheme = Scheme(2, 1)
    cap = CM.max_len(scheme)
    lengths = np.array([cap // 2 + 1] * 3, dtype=np.int64)  # no two fit together
    res = pack_pipeline(lengths, scheme, CM)
    assert res.num_microbatches == 3
    _check(res, lengths, scheme)


def test_empty_and_too_long():
    assert pack_pipeline([], Scheme(2, 1), CM).latency == 0.0
    with pytest.raises(HGraphError, match="does not fit scheme TP2PP1"):
        pack_pipeline([CM.max_len(Scheme(2, 1)) + 1], Scheme(2, 1), CM)
    with pytest.raises(HGraphError, match="unknown packing method"):
        pack_pipeline([10], Scheme(2, 1), CM, method="nope")
