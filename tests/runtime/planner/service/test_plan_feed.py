"""The planner process gets the run's mini-batches as it plans them, a few ahead of the plans taken,
not all at the run's start: rank 0 used to build every mini-batch of the run and send all their
lengths in one message (at 12,288 GPUs, 22,488 documents a step: ~70 KB a step, GBs for a long run)."""
import numpy as np

from hgraph.frontends.zoo import llama
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.runtime.planner.service.iteration import model_cost_model, parse_candidates
from hgraph.runtime.planner.service.plan_ahead import FEED_AHEAD, PlanConsumer, PlannerProcess

CANDIDATES = "4xTP1PP1;1xTP2PP1+2xTP1PP1"
STEPS, DEPTH = 12, 2


def test_mini_batches_are_read_as_the_plans_are_taken():
    cost = model_cost_model("analytic", llama.build("tiny"), 4)
    candidates = parse_candidates(CANDIDATES, 4)
    rng = np.random.default_rng(0)
    batches = [(k, [int(x) for x in rng.integers(2, 300, size=10)]) for k in range(STEPS)]
    drawn = []

    def stream():
        for b in batches:
            drawn.append(b[0])
            yield b

    with PlannerProcess(depth=DEPTH) as proc:
        consumer = PlanConsumer(proc.channel)
        consumer.setup(cost, candidates, "fast", 10.0, stream())
        assert len(drawn) == DEPTH + FEED_AHEAD
        for step, lengths in batches:
            plan, _ = consumer.get(step)
            assert len(drawn) <= min(STEPS, step + 1 + DEPTH + FEED_AHEAD)
            ref = plan_iteration(lengths, candidates, cost, index=step, previous=None if step == 0 else previous)
            assert str(plan.strategy) == str(ref.strategy) and plan.documents() == ref.documents()
            previous = plan.strategy
        assert drawn == list(range(STEPS)) and consumer.upcoming(wait_for=1) == []
