"""The price of Push Gradient (``cost.push``): only the part the last backward does not hide, in the
cost model's pipeline time, the planner's estimates and choice, and ``hgraph simulate``."""
import json
import math

import numpy as np
import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.cost_model import cost_model_from_entry, load_cost_model
from hgraph.runtime.planner.cost.profiles import builtin_profiles
from hgraph.runtime.planner.cost.push import PushModel, gradient_bytes
from hgraph.runtime.planner.plan import estimate_plan
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.strategy import Scheme, Strategy
from hgraph.tools.cli import main

# 7B's gradients over 8 ranks' links at 5 GB/s: a push of seconds, comparable to a step
PUSH = {"bandwidth_gb_per_s": 5.0, "latency_ms": 0.5}


def _cost(world=8, push=PUSH):
    entry = dict(builtin_profiles()["llama-7b"])
    if push is not None:
        entry["push"] = push
    return cost_model_from_entry("llama-7b", entry, world_size=world)


def test_push_model_hides_what_the_last_backward_covers():
    m = PushModel(bandwidth=1e9, latency_ms=1.0, bucket_bytes=100_000_000)
    full = m.push_ms(1e9)                                   # 10 buckets of 1 ms + 1,000 ms
    assert full == pytest.approx(1010.0)
    assert m.exposed_ms(1e9, 0.0) == pytest.approx(full)    # no backward to hide it under
    assert m.exposed_ms(1e9, 600.0) == pytest.approx(1010.0 - 400.0)   # 2/3 of the last micro-batch
    assert m.exposed_ms(1e9, 1e6) == pytest.approx(101.0)   # the last bucket is never hidden
    assert m.exposed_ms(0.0, 10.0) == 0.0
    with pytest.raises(HGraphError):
        PushModel(bandwidth=0.0)


def test_pipeline_time_adds_the_exposed_push_only():
    plain, priced = _cost(push=None), _cost()
    scheme = Scheme(1, 1)
    mbs = [3000.0, 2000.0, 500.0]
    compute = plain.pipeline_time(mbs, scheme)
    m = priced.model
    full = priced.push.push_ms(gradient_bytes(m.hidden, m.layers, m.vocab, 1, 1))
    exposed = priced.pipeline_time(mbs, scheme) - compute
    assert 0 < exposed < full                                # counted, but not all of it
    assert exposed == pytest.approx(full - 2 / 3 * 500.0)   # the last micro-batch's backward hides the rest
    # a longer last micro-batch hides more; TP and PP shrink a rank's gradients, so its push
    assert priced.exposed_push_ms(scheme, [500.0, 3000.0]) < priced.exposed_push_ms(scheme, [3000.0, 500.0])
    assert priced.exposed_push_ms(Scheme(2, 2), mbs) < priced.exposed_push_ms(scheme, mbs)
    assert priced.pipeline_time([], scheme) == 0.0


def test_plans_are_estimated_and_chosen_with_the_exposed_push():
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.lognormal(7.0, 1.0, size=40).astype(int) + 1, 4000)
    candidates = [Strategy.parse(s) for s in ("4xTP1PP2", "4xTP2PP1", "2xTP4PP1", "2xTP2PP2", "1xTP8PP1")]
    plain, priced = _cost(push=None), _cost()
    a, b = plan_iteration(lengths, candidates, plain), plan_iteration(lengths, candidates, priced)
    assert estimate_plan(b, priced) == b.est_latency_ms     # the estimate recomputes exactly
    assert estimate_plan(a, priced) > estimate_plan(a, plain)
    # the priced choice is the best of the candidates under the priced model
    best = min(estimate_plan(plan_iteration(lengths, [s], priced), priced) for s in candidates)
    assert b.est_latency_ms == pytest.approx(best)
    # without a push model nothing changes
    assert str(a.strategy) == str(plan_iteration(lengths, candidates, _cost(push=None)).strategy)


def test_profile_round_trip_and_a_bad_push_section(tmp_path):
    priced = _cost()
    again = cost_model_from_entry("llama-7b", priced.to_profile_dict()["llama-7b"], world_size=8)
    assert again.push == priced.push and "push" not in again.extra
    with pytest.raises(HGraphError, match="push"):
        _cost(push={"latency_ms": 1.0})
    with pytest.raises(HGraphError, match="push"):
        _cost(push={"bandwidth_gb_per_s": -1.0})


def test_simulate_prices_the_hidden_part(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, np.minimum(rng.lognormal(6.5, 1.5, 2000).astype(int) + 1, 16000))) + "\n")
    profile = tmp_path / "push.json"
    profile.write_text(json.dumps(_cost().to_profile_dict()))

    def run(ref):
        assert main(["simulate", "--lengths", str(lengths), "--profile", ref, "--world-size", "8", "--max-len",
                     "16384", "--tokens-per-iter", "50000", "--iters", "2", "--systems", "hgraph,megatron,dcp",
                     "--max-cp", "1", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["systems"]

    plain, priced = run("llama-7b"), run(str(profile))
    for system in ("hgraph", "megatron", "dcp"):
        assert sum(priced[system]["latency_ms"]) > sum(plain[system]["latency_ms"])
    # at most a whole model's push per rank (TP1PP1 bounds every scheme's) is added to an iteration
    cost = load_cost_model(str(profile), 8)
    m = cost.model
    most = cost.push.push_ms(gradient_bytes(m.hidden, m.layers, m.vocab, 1, 1))
    assert all(p - q <= most + 1e-6 for p, q in zip(priced["megatron"]["latency_ms"], plain["megatron"]["latency_ms"]))
    assert math.isfinite(sum(priced["hgraph"]["latency_ms"]))


def test_the_push_is_priced_as_the_run_issues_it():
    """``--push-bucket-bytes`` and ``--no-overlap-push`` reach the price: smaller buckets pay more
    latencies, and a push after the backward is hidden by none of it."""
    from hgraph.runtime.planner.cost.cost_model import with_push
    cost, scheme, mbs = _cost(), Scheme(2, 2), [40.0, 40.0]
    assert with_push(cost, cost.push.bucket_bytes) is cost                 # as it was: the same model
    assert with_push(_cost(push=None), 1024, overlapped=False).push is None   # nothing to price
    small = with_push(cost, 1024 * 1024)
    assert small.push.bucket_bytes == 1024 * 1024 and small.push.latency_ms == cost.push.latency_ms
    assert small.exposed_push_ms(scheme, mbs) > cost.exposed_push_ms(scheme, mbs)
    after = with_push(cost, cost.push.bucket_bytes, overlapped=False)
    grad = gradient_bytes(cost.model.hidden, cost.model.layers, cost.model.vocab, 2, 2)
    assert after.exposed_push_ms(scheme, mbs) == pytest.approx(cost.push.push_ms(grad))
    assert after.exposed_push_ms(scheme, mbs) > cost.exposed_push_ms(scheme, mbs)
