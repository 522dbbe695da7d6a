"""One rank's Program equals the whole world's, and costs what that rank exchanges.

``Program.rank(r)`` plans rank ``r``'s LNK ops from the layout per role (``passes/lnk/rank_plans``);
``Program.pull_plans`` / ``push_plans`` plan every rank (``pull_plan`` / ``push_plan`` over the world,
the reference). Their ops must be the same, op for op and in order, on every strategy the equivalence
suites train and on random strategies of 64 to 512 ranks; and building one rank must visit no more
ranks than its own peers and groups. What a rank's runtime reads of the world besides its ops
(``Program.exchange``: all-gather? plain reduce-scatter?; ``Program.replica_groups``; the rank's
``contributions``; ``Program.binding_groups``) must equal the world plans' (and every rank's) as well.
"""
import random

import pytest
import torch

import hgraph
from hgraph import Cluster, Strategy
from hgraph.frontends.zoo import llama
from hgraph.strategy import Scheme
from tests.passes.test_programs_multirank import CASES as MULTIRANK_CASES
from tests.runtime.engine.equivalence_harness import load_equivalence_harness
from tests.runtime.engine.test_long_context import CP_CASES as LONG_CONTEXT_CASES
from tests.runtime.engine.test_ulysses import CASES as ULYSSES_CASES

EQ = load_equivalence_harness()
# (zoo model, overrides, strategy) of every equivalence suite that trains a zoo Llama
EQUIVALENCE = sorted({(m, tuple(sorted(o.items())), s)
                      for m, sched, o, _ in EQ.CASES_4 + EQ.CASES_8 for s in sched.split(";")}
                     | {(m, tuple(sorted(o.items())), s) for m, sched, o in ULYSSES_CASES for s in sched.split(";")}
                     | {(spec.split(":")[1], tuple(sorted(o.items())), s) for spec, o, s, _ in MULTIRANK_CASES
                        if spec.startswith("llama:")}
                     | {("tiny", (), s) for s, _ in LONG_CONTEXT_CASES})

# the same with the shard group of the equivalence cases that run --shard-group G: (model, overrides,
# strategy, G)
EQUIVALENCE_GROUPED = sorted({(m, tuple(sorted(o.items())), s, opts["shard_group"])
                              for m, sched, o, opts in EQ.CASES_4 + EQ.CASES_8 if opts.get("shard_group")
                              for s in sched.split(";")})

# a 4-layer model whose heads allow TP8, for worlds of 64 to 512 ranks
WIDE = dict(num_layers=4, num_heads=8, num_kv_heads=8, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def compiled_models():
    cache = {}

    def get(name, overrides):
        key = (name, overrides)
        if key not in cache:
            torch.manual_seed(0)
            with torch.device("meta"):
                cache[key] = hgraph.compile(llama.build(name, **dict(overrides)))
        return cache[key]
    return get


def assert_rank_equals_world(prog, rank):
    rp = prog.rank(rank)
    for name in prog.pull_plans:
        assert rp.pull_by_param.get(name, ()) == prog.pull_plans[name].for_rank(rank), (rank, name, "pull")
        assert rp.push_by_param.get(name, ()) == prog.push_plans[name].for_rank(rank), (rank, name, "push")
    assert rp.pull_ops == [op for n in rp.params for op in prog.pull_plans[n].for_rank(rank)]
    assert rp.push_ops == [op for n in rp.params for op in prog.push_plans[n].for_rank(rank)]
    for name in prog.pull_plans:
        assert rp.contributions.get(name, ()) == prog.push_plans[name].contributions.get(rank, ()), (rank, name)


def assert_facts_equal_world(prog, ranks=()):
    """``Program.exchange`` and ``replica_groups`` (from the role layout) equal what the world's plans
    say; returns how many parameters are all-gathered and plainly reduce-scattered (so a caller can
    check that both kinds were met)."""
    assert prog.param_names == list(prog.pull_plans)
    gathered = plain = 0
    for name in prog.param_names:
        ex, pull, push = prog.exchange(name), prog.pull_plans[name], prog.push_plans[name]
        assert ex.param == pull.param == push.param
        assert ex.is_all_gather == pull.is_all_gather, (name, "all-gather")
        assert ex.is_plain_reduce_scatter == push.is_plain_reduce_scatter, (name, "plain reduce-scatter")
        assert ex.all_gather_segments == pull.all_gather_segments
        assert ex.working_dtype_bytes == pull.working_dtype_bytes
        for r in ranks:
            assert ex.all_gather_group(r) == pull.all_gather_group(r)
        gathered += ex.is_all_gather
        plain += ex.is_plain_reduce_scatter
    world_groups = sorted({rs.group for plan in prog.push_plans.values() for rs in plan.reduce_scatters
                           if len(rs.group) > 1})
    assert prog.replica_groups() == world_groups
    assert prog.binding_groups() == sorted({tuple(g) for rp in prog.ranks for k, g in rp.bindings.items()
                                            if k in ("tp", "cp", "ul") and len(g) > 1})
    return gathered, plain


@pytest.mark.parametrize("name, overrides, text", EQUIVALENCE, ids=lambda v: v if isinstance(v, str) else "")
def test_every_rank_equals_the_world_on_the_equivalence_strategies(compiled_models, name, overrides, text):
    strategy = Strategy.parse(text)
    prog = compiled_models(name, overrides).build_program(strategy, Cluster(strategy.num_ranks))
    for r in range(strategy.num_ranks):
        assert_rank_equals_world(prog, r)
    assert_facts_equal_world(prog, range(strategy.num_ranks))


@pytest.mark.parametrize("name, overrides, text, group", EQUIVALENCE_GROUPED,
                         ids=lambda v: v if isinstance(v, str) else "")
def test_shard_grouped_equivalence_strategies_equal_the_world(compiled_models, name, overrides, text, group):
    strategy = Strategy.parse(text)
    prog = compiled_models(name, overrides).build_program(strategy, Cluster(strategy.num_ranks,
                                                                            shard_group=group))
    for r in range(strategy.num_ranks):
        assert_rank_equals_world(prog, r)
    assert_facts_equal_world(prog, range(strategy.num_ranks))


@pytest.mark.parametrize("text, world, group, kinds", [
    ("8xTP1PP1", 8, None, "all"), ("8xTP1PP1", 8, 2, "all"), ("8xTP1PP1", 8, 1, "all"),
    ("64xTP1PP1", 64, 8, "all"), ("2xTP2PP1", 4, None, "some"), ("2xTP2PP1", 4, 2, "some"),
    ("1xTP2PP1+2xTP1PP1", 4, None, "some"), ("1xTP1PP2+2xTP1PP1", 4, None, "none"),
    ("1xTP1PP2+2xTP1PP1", 4, 2, "none")])
def test_exchange_kinds_of_data_parallel_strategies(compiled_models, text, world, group, kinds):
    """Data parallelism makes every pull an all-gather and every push a plain reduce-scatter, with or
    without shard groups; TP pipelines do so only for what every rank holds whole (the norms); a PP2
    pipeline beside PP1 ones for nothing: the kinds read off the role layout say so, as the world's do."""
    strategy = Strategy.parse(text)
    prog = compiled_models("tiny", ()).build_program(strategy, Cluster(world, 8, shard_group=group))
    gathered, plain = assert_facts_equal_world(prog, range(world))
    n = len(prog.param_names)
    expected = {"all": lambda k: k == n, "some": lambda k: 0 < k < n, "none": lambda k: k == 0}[kinds]
    assert expected(gathered) and expected(plain), (gathered, plain, n)


def random_strategy(rng: random.Random, world: int) -> Strategy:
    """Pipelines of random power-of-two schemes (TP up to 8, PP up to 4, sometimes CP2) filling
    ``world``, largest first, so every TP group stays inside a node of 8."""
    schemes = []
    left = world
    while left:
        s = Scheme(tp=rng.choice([1, 2, 4, 8]), pp=rng.choice([1, 1, 2, 4]), cp=rng.choice([1, 1, 1, 2]))
        while s.num_ranks > left:
            s = Scheme(tp=max(1, s.tp // 2), pp=max(1, s.pp // 2), cp=1)
        count = rng.randint(1, max(1, left // s.num_ranks // 2))    # leave room for other schemes
        schemes += [s] * count
        left -= count * s.num_ranks
    return Strategy(tuple(sorted(schemes, key=lambda s: -s.num_ranks)))


@pytest.mark.parametrize("seed, world", [(6, 64), (1, 128), (2, 256), (3, 512)])
def test_random_strategies_rank_equals_world(compiled_models, seed, world):
    rng = random.Random(seed)
    strategy = random_strategy(rng, world)
    prog = compiled_models("tiny", tuple(sorted(WIDE.items()))).build_program(strategy, Cluster(world, 8))
    ranks = range(world) if world <= 64 else sorted({0, 1, world - 1, *rng.sample(range(world), 12)})
    for r in ranks:
        assert_rank_equals_world(prog, r)
    assert_facts_equal_world(prog, ranks)


def _peers(rank, ops):
    peers = set()
    for op in ops:
        peers.update(getattr(op, "group", ()))
        peers.update(r for r in (getattr(op, "src", None), getattr(op, "dst", None)) if r is not None)
    peers.discard(rank)
    return peers


@pytest.mark.parametrize("text", ["64xTP8PP1", "8xTP8PP4+16xTP4PP2+32xTP2PP1+64xTP1PP1"])
def test_one_rank_visits_only_its_peers_and_groups(compiled_models, text):
    """Count what building one rank of 512 visits: per parameter plan it makes, no more ranks than its
    peers, the members of the replica groups it reduces with or receives from, and its ops; no op it
    does not run; and no plan of the world."""
    strategy = Strategy.parse(text)
    prog = compiled_models("tiny", tuple(sorted(WIDE.items()))).build_program(strategy, Cluster(512, 8))
    prog.planner.work_log = log = []
    for rank in (0, 77, 300, 511):
        rp = prog.rank(rank)
        rp.pull_by_param                  # planned on first use
        made = [(name, work) for name, r, work in log if r == rank]
        assert made, "the rank made its plans"
        for name, work in made:
            ops = rp.pull_by_param.get(name, ()) + rp.push_by_param.get(name, ())
            bound = len(_peers(rank, ops)) + 1 + sum(len(g) for g in work.groups) + len(ops)
            assert work.ranks <= bound, (rank, name, work.ranks, bound)
            assert work.ops == len(ops), (rank, name)
        assert sum(w.ranks for _, w in made) < 512 * len(made)
    assert not prog.pull_plans._plans and not prog.push_plans._plans, "no plan of the whole world was made"


@pytest.mark.parametrize("seed, world, group", [(4, 64, 8), (5, 128, 16), (7, 256, 8)])
def test_shard_grouped_ranks_equal_the_worlds_group_plans(compiled_models, seed, world, group):
    """Under ``--shard-group G`` a rank's ops come from its own shard group's plans only
    (``StrategyLayout.group_lnk_ops``): they equal the world's plans over every group, and never leave
    the group."""
    rng = random.Random(seed)
    strategy = random_strategy(rng, world)
    prog = compiled_models("tiny", tuple(sorted(WIDE.items()))).build_program(strategy,
                                                                              Cluster(world, 8, shard_group=group))
    for r in sorted({0, group - 1, group, world - 1, *rng.sample(range(world), 6)}):
        rp = prog.rank(r)
        base = r - r % group
        assert _peers(r, rp.pull_ops + rp.push_ops) <= set(range(base, base + group)) - {r}
        assert_rank_equals_world(prog, r)
    assert_facts_equal_world(prog, range(0, world, group // 2))
