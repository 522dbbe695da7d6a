"""The collective order derived from a Program and a plan (``runtime/comm/order/derive``), simulated
one operation of a rank at a time (``order/deadlock``): every strategy and switch of the equivalence
suites, random strategies and schedules up to 64 ranks, and an order made inconsistent on purpose.

A plan gives each pipeline one micro-batch (the last of several none) or 1F1B's steady state (as many
as the pipeline's stages). The steady state needs a stage's activation send to go with the next
backward's gradient receive in one batch, and a tied weight's bucket to wait for the backward's end
(``collectives.flush_deferred``, ``push.spans_earlier_stages``): without either, the strict reading
names the cycle (two sends facing each other; a bucket in front of the gradient its peer waits for).
"""
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.comm.order.collective import Collective
from hgraph.runtime.comm.order.deadlock import simulate
from hgraph.runtime.comm.order.derive import StepPlan, derive_step, derive_steps, representative_plan
from hgraph.strategy import Cluster, Scheme, Strategy
from tests.runtime.engine.equivalence_harness import load_equivalence_harness

EQ = load_equivalence_harness()
_COMPILED = {}


def _compiled(model, overrides, sequence_parallel=None):
    key = (model, tuple(sorted(overrides.items())), sequence_parallel)
    if key not in _COMPILED:
        options = {} if sequence_parallel is None else {"sequence_parallel": sequence_parallel}
        _COMPILED[key] = hgraph.compile(llama.build(model, **overrides), **options)
    return _COMPILED[key]


def _suite_cases():
    """(name, compiled model, strategies, world, shard group, plan options) of every equivalence case."""
    for world, cases in ((4, EQ.CASES_4), (8, EQ.CASES_8)):
        for i, (model, schedule, overrides, options) in enumerate(cases):
            compiled = _compiled(model, overrides, options.get("sequence_parallel"))
            strategies = [Strategy.parse(s) for s in schedule.split(";")]
            plan = {"recompute": options.get("memory_budget") is not None,
                    "grad_clip": options.get("grad_clip") is not None}
            yield f"{world}-{i}", compiled, strategies, world, options.get("shard_group"), plan


SUITE = list(_suite_cases())


def _steps(compiled, strategies, world, shard_group, k, **plan):
    cluster = Cluster(world, shard_group=shard_group)
    return [(compiled.instantiate(s, cluster), representative_plan(s, k=k, **plan)) for s in strategies]


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("case", range(len(SUITE)), ids=[c[0] for c in SUITE])
def test_equivalence_strategies_and_switches_are_deadlock_free(case, backend):
    name, compiled, strategies, world, shard_group, plan = SUITE[case]
    verdict = simulate(derive_steps(_steps(compiled, strategies, world, shard_group, 1, backend=backend, **plan)))
    assert verdict.ok, f"{name} {[str(s) for s in strategies]}: {verdict.line()}"
    assert verdict.line() == f"deadlock-free: {world} ranks, {verdict.collectives} collectives"
    # each step alone, too: a switch is a Program's step after another's
    for s in strategies:
        one = simulate(derive_steps(_steps(compiled, [s], world, shard_group, 1, backend=backend, **plan)))
        assert one.ok, f"{s}: {one.line()}"


@pytest.mark.parametrize("case", range(len(SUITE)), ids=[c[0] for c in SUITE])
def test_steady_state_and_push_in_backward_are_deadlock_free(case):
    """1F1B's steady state (as many micro-batches as stages) with the push inside the backward, also on
    NCCL: the deferred activation sends and the tied weights' buckets keep it deadlock-free."""
    name, compiled, strategies, world, shard_group, plan = SUITE[case]
    for s in strategies:
        verdict = simulate(derive_steps(_steps(compiled, [s], world, shard_group, None, push_in_backward=True, **plan)))
        assert verdict.ok, f"{s}: {verdict.line()}"


def test_steady_state_sends_go_with_the_gradient_receive():
    compiled = _compiled("tiny-tied", {})
    seqs = derive_steps(_steps(compiled, [Strategy.parse("1xTP1PP2+1xTP2PP1")], 4, None, 2, push_in_backward=True))
    first = [(c.sends, c.recvs, c.label) for c in seqs[0] if c.kind == "p2p" and c.label.startswith("pp_")]
    # stage 0, 2 micro-batches: F0 then F1 (its send deferred), B0 (receive + F1's send), B1
    assert [(s, r) for s, r, _ in first] == [((1,), ()), ((1,), (1,)), ((), (1,))]
    # the tied embedding's bucket over both stages: stage 1 issues it after its backward's last send
    last = seqs[1]
    tied = [i for i, c in enumerate(last) if c.label.startswith("push bucket") and c.group == (0, 1)]
    sends = [i for i, c in enumerate(last) if c.kind == "p2p" and c.label.startswith("pp_recv")]
    assert tied and sends and min(tied) > max(sends)
    assert simulate(seqs).ok


# ---- random strategies and schedules ------------------------------------------------------------------
SCHEMES = [Scheme.parse(s) for s in ("TP1PP1", "TP2PP1", "TP4PP1", "TP1PP2", "TP2PP2", "TP1PP4", "TP1PP1CP2",
                                     "TP2PP1CP2", "TP1PP2CP2", "TP1PP1UL2", "TP2PP1UL2", "TP1PP1CP2UL2")]


@st.composite
def _schedules(draw):
    """2-3 strategies of one world of at most 64 ranks (the first drawn, the others filling its world),
    an optimizer shard group dividing it, micro-batch counts, and what the plan turns on."""
    rng = random.Random(draw(st.integers(0, 2**31)))
    first = [rng.choice(SCHEMES) for _ in range(rng.randint(1, 6))]
    world = sum(p.num_ranks for p in first)
    strategies = [Strategy(tuple(first))]
    for _ in range(rng.randint(1, 2)):
        pipes, left = [], world
        while left:
            fits = [p for p in SCHEMES if p.num_ranks <= left]
            pipes.append(rng.choice(fits))
            left -= pipes[-1].num_ranks
        strategies.append(Strategy(tuple(pipes)))
    groups = [g for g in (2, 4, 8) if world % g == 0 and g < world]
    shard_group = rng.choice([None] + groups)
    plan = {"backend": rng.choice(["nccl", "gloo"]), "recompute": rng.random() < 0.3,
            "grad_clip": rng.random() < 0.3, "push_bucket_bytes": rng.choice([1024, 64 * 1024, 25 * 2**20])}
    return strategies, world, shard_group, [rng.choice([0, 1, 2, None]) for _ in strategies], plan


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schedules())
def test_random_strategies_and_schedules(drawn):
    strategies, world, shard_group, counts, plan = drawn
    assert world <= 64
    compiled = _compiled("tiny", {})
    cluster = Cluster(world, gpus_per_node=world, shard_group=shard_group)
    steps = [(compiled.instantiate(s, cluster), representative_plan(s, k=k, **plan)) for s, k in zip(strategies, counts)]
    verdict = simulate(derive_steps(steps))
    assert verdict.ok, f"{[str(s) for s in strategies]} {counts} {plan}: {verdict.line()}"


def test_tp_peers_issue_a_shared_push_bucket_at_the_same_point_of_their_backward():
    """Drawn by the random test: ranks 10 and 11 (the TP ranks of one CP shard of TP2PP1CP2) share a
    bucket of layer norms with ranks of other pipelines, while their own buckets of the TP-sharded
    weights (17 optimizer shards cut the rows differently) are cut differently. Both must issue the
    shared bucket where its gradients are final (``GradBuckets``' order keyed by a bucket's last
    gradient), not one of them behind an own bucket that completes later: that rank sat in a TP
    all-gather of the backward while its peer sat in the shared bucket."""
    strategy = Strategy.parse("2xTP1PP4+1xTP1PP2+1xTP2PP1CP2+1xTP2PP1+1xTP1PP1")
    program = _compiled("tiny", {}).instantiate(strategy, Cluster(17, gpus_per_node=17))
    seqs = derive_step(program, representative_plan(strategy, k=1))
    shared = (2, 6, 9, 10, 11, 12, 13, 14, 15, 16)
    tp = [[(c.kind, c.group) for c in seqs[r] if c.group in ((10, 11), shared)] for r in (10, 11)]
    assert any(c.group == shared for c in seqs[10]) and tp[0] == tp[1]
    assert simulate(seqs).ok


# ---- what the derivation holds, and an inconsistent order ---------------------------------------------
def test_sequence_follows_the_step():
    compiled = _compiled("tiny", {})
    program = compiled.build_program("1xTP2PP1+2xTP1PP1", Cluster(4))
    plan = StepPlan((2, 1, 0), backend="nccl", push_in_backward=True, grad_clip=True)
    seqs = derive_step(program, plan)
    tp_rank = seqs[0]
    labels = [c.label for c in tp_rank]
    assert tp_rank[0].kind == "all_gather" and labels[0].startswith("pull gather")
    # the TP rank's forwards issue its sequence-parallel collectives in node order, backward in reverse
    acts = [c for c in tp_rank if c.group == (0, 1) and c.label.startswith("sp_")]
    assert acts and all(c.kind in ("all_gather", "reduce_scatter") for c in acts)
    # fp32's loss gathers each chunk's logits over the TP group, forward and backward (two micro-batches)
    assert [c.kind for c in tp_rank if c.label.startswith("loss chunk")] == ["all_gather"] * 4
    # the vocabulary-parallel loss (bf16's default): three all-reduces per chunk, none backward
    bf16 = derive_step(program, replace(plan, working_dtype="bfloat16"))[0]
    assert [c.kind for c in bf16 if c.label.startswith("loss chunk")] == ["all_reduce"] * 6
    # (the first graph collective of a backward is that of the last forward one with a backward: the
    # gather before the output head; only the loss's comes before it)
    forward = [c.label for c in acts if "backward" not in c.label]
    first_back = next(c.label for c in tp_rank if "backward" in c.label and c.label.startswith("sp_"))
    assert first_back == [f for f in forward if f.startswith("sp_gather")][-1] + " backward"
    # push buckets: issued inside the last backward, in their global order, before the loss
    buckets = [i for i, c in enumerate(tp_rank) if c.label.startswith("push bucket")]
    assert buckets and buckets[0] < labels.index("loss") - 1
    assert [tp_rank[i].label for i in buckets] == [f"push bucket {j}" for j in range(len(buckets))]
    assert labels[-1] == "gradient norm" and tp_rank[-1].group == (0, 1, 2, 3)
    # the idle pipeline: pulls, every bucket at the flush, the loss, the push
    idle = seqs[3]
    assert not any("backward" in c.label or c.label.startswith("sp_") for c in idle)
    assert [c.label for c in idle].index("loss") > max(i for i, c in enumerate(idle) if c.label.startswith("push bucket"))
    assert simulate(seqs).ok


def test_swapped_buckets_name_the_cycle():
    compiled = _compiled("tiny", {})
    program = compiled.build_program("1xTP2PP1+2xTP1PP1", Cluster(4))
    seqs = derive_step(program, StepPlan((1, 1, 1), push_bucket_bytes=4096))
    assert simulate(seqs).ok
    # the first rank with two consecutive buckets in different groups issues them swapped
    for rank, seq in seqs.items():
        idx = [i for i, c in enumerate(seq) if c.label.startswith("push bucket")]
        pair = next(((a, b) for a, b in zip(idx, idx[1:]) if seq[a].group != seq[b].group), None)
        if pair is not None:
            break
    a, b = pair
    seq[a], seq[b] = seq[b], seq[a]
    verdict = simulate(seqs)
    assert not verdict.ok and verdict.line().startswith("deadlock: rank ")
    cycle = {r for r, _, _ in verdict.waits}
    assert rank in cycle and len(cycle) >= 2
    assert any(op.label.startswith("push bucket") and r == rank for r, op, _ in verdict.waits)
    assert all(isinstance(op, Collective) for _, op, _ in verdict.waits)


def test_plan_is_checked():
    compiled = _compiled("tiny", {})
    program = compiled.build_program("2xTP1PP1", Cluster(2))
    with pytest.raises(ValueError, match="micro-batch counts for the 2 pipelines"):
        derive_step(program, StepPlan((1,)))
    with pytest.raises(ValueError, match="backend"):
        StepPlan((1, 1), backend="mpi")


def test_message_rounds_are_the_posted_rounds():
    """The derivation's rounds (``message_rounds``, no buffers) are the rounds ``PeerTransfers`` posts,
    pull (several caps) and push, every rank of a heterogeneous world and of shard groups."""
    from hgraph.runtime.comm.pull import pull_message_rounds, pull_messages
    from hgraph.runtime.comm.push import push_message_rounds, push_messages
    compiled = _compiled("tiny", {})
    for strategy, group in (("2xTP2PP2+8xTP1PP2+2xTP4PP1", None), ("2xTP2PP2+8xTP1PP2+2xTP4PP1", 8)):
        program = compiled.instantiate(strategy, Cluster(32, gpus_per_node=8, shard_group=group))
        for r in range(32):
            for cap in (None, 4096, 256 * 1024):
                posted = [[(b.peer, b.send) for b in round_] for round_ in pull_messages(program, r, 2, cap).rounds]
                assert pull_message_rounds(program, r, 2, cap) == posted
            posted = [[(b.peer, b.send) for b in round_] for round_ in push_messages(program, r).rounds]
            assert push_message_rounds(program, r) == posted


# ---- the MoE router losses' collectives -------------------------------------------------------------------
def test_router_losses_collectives_are_derived():
    """An MoE model with router losses (``engine/router_losses``): per document, each MoE op's counts are
    all-reduced in forward over the Ulysses then the CP group of each micro-batch (and again where a
    recomputed block replays); over the global batch, a counting pass of every micro-batch's forward
    precedes the step's 1F1B, then one world all-reduce of the counts; either way the router values
    ride on the loss's all-reduce (3 values), and the orders are deadlock-free."""
    from hgraph.frontends.zoo import llama_moe
    compiled = _COMPILED.setdefault("llama-moe:tiny", hgraph.compile(llama_moe.build("tiny")))
    strategy = Strategy.parse("1xTP1PP1CP2UL2")
    program = compiled.instantiate(strategy, Cluster(4))
    moe_ops, k = 2, 2            # the tiny MoE model's MoE layers; micro-batches in the plan

    def labels(**plan):
        seqs = derive_step(program, StepPlan((k,), **plan))
        assert simulate(seqs).ok
        return [c.label for c in seqs[0]], seqs[0]

    off, _ = labels()
    assert not any(x.startswith("moe counts") for x in off)
    per_doc, seq = labels(moe_aux_loss="per-document", moe_z_loss=True)
    counts = [c for c in seq if c.label.startswith("moe counts")]
    assert [c.label for c in counts] == ["moe counts ul", "moe counts cp"] * (moe_ops * k)
    assert all(c.kind == "all_reduce" and c.dtype == "int64" for c in counts)
    assert {c.group for c in counts if c.label.endswith("ul")} == {(0, 1)}
    assert {c.group for c in counts if c.label.endswith("cp")} == {(0, 2)}
    # (a plain data-parallel step carries the loss in its first reduction; pushed to owners, its all-reduce)
    _, seq = labels(moe_aux_loss="per-document", overlap_update=False)
    assert next(c for c in seq if c.label == "loss").shape == (3,)
    _, seq = labels(overlap_update=False)
    assert next(c for c in seq if c.label == "loss").shape == (1,)
    replayed, _ = labels(moe_aux_loss="per-document", recompute=True)
    assert sum(x.startswith("moe counts") and x.endswith("replay") for x in replayed) == 2 * moe_ops * k
    glob, seq = labels(moe_aux_loss="global-batch")
    at = glob.index("moe counts global")
    assert seq[at].group == (0, 1, 2, 3) and seq[at].dtype == "int64"
    # the counting pass: k forwards of the step's activation collectives before it, then the step's own
    forward = [x for x in off if not x.startswith(("pull", "push", "loss")) and "backward" not in x]
    pulls = [x for x in off if x.startswith("pull")]
    assert glob[:at] == pulls + forward and glob[at + 1:] == off[len(pulls):]
    assert not any(x.startswith("moe counts") for x in glob if x != "moe counts global")
