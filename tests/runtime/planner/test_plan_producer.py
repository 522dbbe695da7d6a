"""Plans computed ahead in a spawned worker process."""
import os
import signal

import numpy as np
import pytest

from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.data.lengths import minibatches
from hgraph.runtime.planner.producer import PlanProducer, PlanProducerDied
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.strategy import Strategy

CM = load_cost_model("llama-7b", world_size=16)
CANDS = [Strategy.parse("4xTP2PP2"), Strategy.parse("2xTP8PP1"), Strategy.parse("1xTP8PP1+2xTP4PP1")]


def _data():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(6.0, 1.2, size=300).astype(np.int64) + 1, 20_000)
    return lengths, minibatches(lengths, 30_000)


def test_plans_arrive_in_order_and_match_inline_planning():
    lengths, batches = _data()
    batches = batches[:4]
    with PlanProducer(lengths, batches, CANDS, CM, depth=2, start_index=10) as prod:
        plans = list(prod)
        assert len(prod.wait_ms) == 4 and prod.total_wait_ms >= 0
        with pytest.raises(StopIteration):
            prod.get()
    for k, (plan, ids) in enumerate(zip(plans, batches)):
        ref = plan_iteration(lengths[ids], CANDS, CM, doc_ids=ids, index=10 + k)
        assert plan.index == 10 + k and plan.strategy == ref.strategy
        assert plan.est_latency_ms == ref.est_latency_ms
        assert sorted(plan.documents()) == ids.tolist()


def test_worker_error_is_reported():
    lengths, batches = _data()
    too_small = [Strategy.parse("16xTP1PP1")]  # llama-7b has no TP1PP1 profile
    with PlanProducer(lengths, batches[:2], too_small, CM) as prod:
        with pytest.raises(PlanProducerDied, match="iteration 0 failed.*TP1PP1 is not available"):
            prod.get(timeout=60)


def test_killed_worker_is_detected():
    lengths, batches = _data()
    with PlanProducer(lengths, batches * 50, CANDS, CM, depth=1) as prod:
        prod.get(timeout=60)
        os.kill(prod.pid, signal.SIGKILL)
        with pytest.raises(PlanProducerDied, match="exited"):
            for _ in range(len(batches) * 50):
                prod.get(timeout=60)
