"""Dispatch with many pipelines (1024 GPUs and up): the chunked longest-first pass, the vectorised
surrogate and surrogate screening, on small stand-ins (the scale figures come from the planner bench)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.planner.schedule import dispatch_fast as df
from hgraph.runtime.planner.schedule.dispatch_result import estimate_many, scheme_costs
from hgraph.strategy import Strategy

CM = load_cost_model("llama-32b", world_size=320)
MANY = Strategy.parse("8xTP4PP1CP2+4xTP4PP2+56xTP4PP1")  # 68 pipelines: past CHUNKED_PIPELINES


def _lengths(seed, n, cap):
    rng = np.random.default_rng(seed)
    return np.minimum(np.maximum(rng.lognormal(6.0, 1.3, size=n).astype(np.int64), 1), cap)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 200), st.floats(1, 1e4), st.integers(1, 30),
       st.sampled_from(["TP4PP1", "TP4PP2", "TP4PP1CP2", "TP8PP4"]))
def test_estimate_many_equals_the_scalar_surrogate(S_tokens, extra, tmax, n, scheme):
    pipes = Strategy.parse(f"1x{scheme}").pipelines
    g = scheme_costs(pipes, CM, np.array([1]))[0][0]
    L = S_tokens + extra
    S = 0.25 * L + 1e-3
    tm = min(tmax, S)
    one = g.estimate(S, L, tm, n)
    many = estimate_many(np.array([S]), np.array([L]), np.array([tm]), np.array([n]), np.array([g.k]),
                         np.array([g.c]), np.array([g.cap]), np.array([g.util]))
    assert many[0] == one


def test_chunked_pass_is_valid_and_close_to_the_one_by_one_pass():
    assert len(MANY.pipelines) > df.CHUNKED_PIPELINES
    lengths = _lengths(0, 2500, max(CM.max_len(p) for p in MANY.pipelines))
    groups, of = scheme_costs(MANY.pipelines, CM, lengths)
    members, surrogate = df._greedy_members_chunked(lengths, groups, of)
    assert sorted(i for m in members for i in m) == list(range(lengths.size))
    for j, m in enumerate(members):
        assert all(lengths[i] <= groups[of[j]].cap for i in m)
    screened = df.dispatch_fast(lengths, MANY.pipelines, CM, polish=False)
    full = df.dispatch_fast(lengths, MANY.pipelines, CM, greedy_starts=screened.greedy_starts, alg1_seed=False)
    packed = df.pack_dispatch(lengths, MANY.pipelines, CM, screened.greedy_starts[0])
    assert screened.latency <= packed.latency * (1 + 1e-9)   # the surrogate is a lower bound of its packing
    assert full.latency <= packed.latency                     # dealing and local search only improve it
    order = sorted(range(lengths.size), key=lambda i: -int(lengths[i]))
    one_by_one = df.pack_dispatch(lengths, MANY.pipelines, CM, df._greedy_members(lengths, MANY.pipelines, groups, of,
                                                                                  order))
    assert full.latency <= one_by_one.latency * 1.01


def test_plan_with_many_pipelines_and_the_previous_strategy_first():
    """Screening the previous iteration's strategy first changes the order of work, not the choice;
    the plan of a strategy with many pipelines is well formed."""
    from hgraph.runtime.planner.plan import estimate_plan
    from hgraph.runtime.planner.selection import plan_iteration

    cands = [MANY, Strategy.parse("80xTP4PP1"), Strategy.parse("40xTP8PP1")]
    lengths = _lengths(1, 1200, 9000)
    plain = plan_iteration(lengths, cands, CM)
    for previous in cands:
        hinted = plan_iteration(lengths, cands, CM, previous=previous)
        assert hinted.strategy == plain.strategy and hinted.est_latency_ms == plain.est_latency_ms
    assert estimate_plan(plain, CM) == plain.est_latency_ms


def test_many_documents_cap_the_local_search_rounds(monkeypatch):
    rounds = []
    real = df.improve_dispatch

    def spy(*args, rounds=None, **kw):
        rounds_seen.append(rounds)
        return real(*args, rounds=rounds, **kw)

    rounds_seen = rounds
    monkeypatch.setattr(df, "improve_dispatch", spy)
    pipes = Strategy.parse("2xTP4PP1").pipelines
    for n, want in ((df.MANY_DOCS + 1, df.CHUNKED_IMPROVE_ROUNDS), (50, None)):
        rounds.clear()
        res = df.dispatch_fast(_lengths(1, n, 4096), pipes, CM, alg1_seed=False)
        assert rounds and set(rounds) == {want} and np.isfinite(res.latency)


def test_dealing_a_schemes_documents_into_its_microbatches_balances_lumpy_pipelines():
    """CP pipelines holding a few long documents each pack unevenly on their own; dealt over all
    micro-batches of their scheme the same dispatch packs lower, every document once, within MaxLen."""
    from hgraph.runtime.planner.cost.cost_model import load_cost_model as load
    cost = load("llama-32b", world_size=320)
    pipes = Strategy.parse("4xTP4PP1CP8+16xTP4PP1").pipelines
    for seed in range(4):
        rng = np.random.default_rng(seed)
        lengths = np.concatenate([rng.integers(15000, 33000, size=10), rng.integers(200, 4000, size=60)])
        groups, of = scheme_costs(pipes, cost, lengths)
        members, _ = df._greedy_members_chunked(lengths, groups, of)
        own = df.pack_dispatch(lengths, pipes, cost, members)
        dealt = df.deal_dispatch(lengths, pipes, cost, members, groups, of)
        assert dealt.latency < own.latency
        assert sorted(i for a in dealt.assignment for i in a.tolist()) == list(range(lengths.size))
        for p, pk, a in zip(pipes, dealt.packs, dealt.assignment):
            assert sorted(i for mb in pk.microbatches for i in mb.tolist()) == a.tolist()
            assert all(int(lengths[mb].sum()) <= cost.max_len(p) for mb in pk.microbatches)
            times = [cost.microbatch_time(lengths[mb], p) for mb in pk.microbatches]
            assert abs(cost.pipeline_time(times, p) - pk.latency) <= 1e-9 * max(pk.latency, 1.0)
