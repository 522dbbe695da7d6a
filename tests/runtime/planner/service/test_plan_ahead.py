"""The planner process of a training run: plans in order and equal to inline planning, at most
``depth`` ahead, a lost process reported at once; end to end, ``hgraph train`` survives the planner
process being killed mid-run (SIGKILL from outside), warns once, and still trains every document of
every mini-batch exactly once."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from tests.runtime.reference_training import write_random_documents

from hgraph.frontends.zoo import llama
from hgraph.runtime.data.documents import mini_batches, read_jsonl
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.runtime.planner.service.iteration import model_cost_model, parse_candidates
from hgraph.runtime.planner.service.plan_ahead import PlanConsumer, PlannerLost, PlannerProcess

CANDIDATES = "4xTP1PP1;1xTP2PP1+2xTP1PP1;2xTP1PP2"


@pytest.fixture(scope="module")
def cost():
    return model_cost_model("analytic", llama.build("tiny"), 4)


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(k, [int(x) for x in rng.integers(2, 300, size=12)]) for k in range(n)]


def test_plans_arrive_in_order_equal_to_inline_planning_and_at_most_depth_ahead(cost):
    candidates = parse_candidates(CANDIDATES, 4)
    batches = _batches(6)
    with PlannerProcess(depth=2) as proc:
        consumer = PlanConsumer(proc.channel)
        consumer.setup(cost, candidates, "fast", 10.0, batches)
        deadline = time.monotonic() + 60
        while proc.channel.plans.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)             # room for a third plan if the bound did not hold
        assert proc.channel.plans.qsize() == 2
        for step, lengths in batches:
            plan, wait = consumer.get(step)
            ref = plan_iteration(lengths, candidates, cost, method="fast", index=step)
            assert plan.index == step and str(plan.strategy) == str(ref.strategy)
            assert [p.microbatches for p in plan.pipelines] == [p.microbatches for p in ref.pipelines]
            assert plan.est_latency_ms == pytest.approx(ref.est_latency_ms)
            assert wait >= 0.0


def test_the_next_steps_strategies_are_read_ahead_without_the_planner_running_further(cost):
    """``upcoming`` reads the plans delivered for the next steps (what the ranks build ahead); they
    stay for ``get``, and the planner still makes at most ``depth`` plans not yet consumed."""
    candidates = parse_candidates(CANDIDATES, 4)
    batches = _batches(6, seed=1)
    refs = [plan_iteration(lengths, candidates, cost, method="fast", index=step) for step, lengths in batches]
    with PlannerProcess(depth=2) as proc:
        consumer = PlanConsumer(proc.channel)
        consumer.setup(cost, candidates, "fast", 10.0, batches)
        assert [str(s) for s in consumer.upcoming(wait_for=2)] == [str(r.strategy) for r in refs[:2]]
        time.sleep(0.5)             # room for a third plan if the bound did not hold
        assert [str(s) for s in consumer.upcoming()] == [str(r.strategy) for r in refs[:2]]
        assert proc.channel.plans.qsize() == 0
        for step in range(len(batches)):
            plan, _ = consumer.get(step)
            assert plan.index == step
            # waiting for two: the planner delivers them (fewer at the end of the batches)
            want = [str(r.strategy) for r in refs[step + 1:step + 3]]
            assert [str(s) for s in consumer.upcoming(wait_for=2)] == want


def test_a_killed_planner_is_reported_at_once_naming_the_step(cost):
    with PlannerProcess(depth=1) as proc:
        consumer = PlanConsumer(proc.channel)
        consumer.setup(cost, parse_candidates(CANDIDATES, 4), "fast", 10.0, _batches(5))
        consumer.get(0)
        os.kill(proc.channel.pid, signal.SIGKILL)
        proc.process.join(5)
        delivered = []
        with pytest.raises(PlannerLost):
            for step in range(1, 5):
                consumer.get(step)
                delivered.append(step)
        # at most the one plan already queued (depth 1), then the loss: no waiting for plans that
        # cannot come
        assert delivered in ([], [1])
        assert f"exited before the plan of step {1 + len(delivered)}" in consumer.lost


def test_a_planning_error_is_forwarded_not_hung(cost):
    with PlannerProcess(depth=2) as proc:
        consumer = PlanConsumer(proc.channel)
        too_long = [(0, [cost.largest_max_len() + 1])]
        consumer.setup(cost, parse_candidates("4xTP1PP1", 4), "fast", 10.0, too_long)
        with pytest.raises(PlannerLost, match="failed at step 0: HGraphError"):
            consumer.get(0)


# ---- end to end -----------------------------------------------------------------------------------
LENGTHS = [90, 5, 9, 7, 11, 3, 6, 60, 10, 4, 12, 2, 40, 8, 3, 17, 5, 70, 6, 9] * 3
TOKENS_PER_ITER = 130
STEPS = 10


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_random_documents(tmp_path_factory.mktemp("ahead") / "docs.jsonl", LENGTHS, seed=7)


def test_training_survives_the_planner_process_killed_mid_run(data, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hgraph.tools.cli", "train", "--model", "tiny", "--data", str(data),
           "--world-size", "2", "--steps", str(STEPS), "--tokens-per-iter", str(TOKENS_PER_ITER),
           "--strategies", "2xTP1PP1;1xTP2PP1;1xTP1PP2", "--profile", "analytic", "--plan-ahead", "1",
           "--run-dir", str(run_dir), "--progress", "off"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, pid, killed = [], None, False
    try:
        for line in proc.stdout:
            out.append(line)
            m = re.search(r"ahead in process (\d+)", line)
            if m:
                pid = int(m.group(1))
            if line.startswith("step    1") and pid is not None and not killed:
                os.kill(pid, signal.SIGKILL)
                killed = True
        err = proc.stderr.read()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed, "".join(out)
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "planning inline from step" in warnings[0], err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    sources = [r["planner_source"] for r in records]
    first_inline = sources.index("inline")
    assert sources[:2] == ["ahead", "ahead"] and set(sources[first_inline:]) == {"inline"}
    assert f"planning inline from step {first_inline} on" in warnings[0]
    expected = [sorted(d.index for d in b.docs) for b in mini_batches(read_jsonl(data), TOKENS_PER_ITER, STEPS)]
    assert [r["plan_documents"] for r in records] == expected
    assert "summary: 10 steps" in "".join(out)


def test_inline_planning_uses_the_runs_method_and_time_limit(cost, monkeypatch):
    from hgraph.runtime.data.documents import Document, MiniBatch
    from hgraph.runtime.planner import selection
    from hgraph.runtime.planner.service.iteration import IterationPlanner
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return plan_iteration(*args, **kwargs)
    monkeypatch.setattr(selection, "plan_iteration", spy)
    planner = IterationPlanner(cost, parse_candidates(CANDIDATES, 4), 0, method="cpsat", time_limit_s=0.25)
    batch = MiniBatch(3, tuple(Document(i, (1,) * n) for i, n in enumerate([40, 7, 90, 12])))
    plan, source, _, _, upcoming = planner._plan_on_rank0(batch)
    assert source == "inline" and upcoming == [] and seen["method"] == "cpsat" and seen["time_limit_s"] == 0.25
    assert sorted(plan.documents()) == [0, 1, 2, 3]
