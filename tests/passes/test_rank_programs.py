"""One rank's Program equals the whole world's, and costs what that rank exchanges.

``Program.rank(r)`` plans rank ``r``'s LNK ops from the layout per role (``passes/lnk/rank_plans``);
``Program.pull_plans`` / ``push_plans`` plan every rank (``pull_plan`` / ``push_plan`` over the world,
the reference). Their ops must be the same, op for op and in order, on every strategy the equivalence
suites train and on random strategies of 64 to 512 ranks; and building one rank must visit no more
ranks than its own peers and groups.
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


@pytest.mark.parametrize("name, overrides, text", EQUIVALENCE, ids=lambda v: v if isinstance(v, str) else "")
def test_every_rank_equals_the_world_on_the_equivalence_strategies(compiled_models, name, overrides, text):
    strategy = Strategy.parse(text)
    prog = compiled_models(name, overrides).build_program(strategy, Cluster(strategy.num_ranks))
    for r in range(strategy.num_ranks):
        assert_rank_equals_world(prog, r)


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
