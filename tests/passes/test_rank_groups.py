"""The process groups one rank creates are the world's groups it is in, found without the world.

A rank creates its groups in rounds (``runtime/comm/process_groups``): each round one partition of the
world, named by a key, every rank its own part of it. ``Program.binding_rounds`` (TP, CP, Ulysses) and
``Program.replica_rounds`` (the replica groups of its push reduce-scatters) give one rank's rounds from
its coordinates and the layout per role. They must give each rank exactly the groups of the world's
lists it is a member of (``binding_groups``, ``replica_groups``: every rank's bindings, the world's
push plans), the same keys in the same order on every rank, and the same part on every member of a
part; on the strategies of the equivalence suites and on random strategies of 64 to 512 ranks, with
and without shard groups. No process is started.
"""
import random

import pytest

from hgraph import Cluster, Strategy
from hgraph.passes.instantiate import ParamRole, groups_keep_to_shard_groups
from hgraph.runtime.comm.process_groups import shard_groups_of
from hgraph.runtime.engine.executor import program_rounds
from tests.passes.test_rank_programs import (EQUIVALENCE, EQUIVALENCE_GROUPED, WIDE, compiled_models,  # noqa: F401
                                             random_strategy)


def assert_rounds_are_the_worlds_groups(prog, ranks):
    """Every rank of ``ranks``: its rounds' parts of more than one rank are the world's groups it is in
    (bindings', replica groups and, under ``--shard-group``, shard groups and replicas), its keys are
    those of every rank, and each part is the same on the members it names."""
    world = set(prog.binding_groups()) | set(prog.replica_groups())
    if prog.cluster.shard_group is not None:
        world |= set(shard_groups_of(prog.cluster.world_size, prog.cluster.group_size))
    rounds = {}

    def of(r):
        if r not in rounds:
            rounds[r] = {rnd.key: rnd.part for rnd in program_rounds(prog, r)}
        return rounds[r]

    keys = list(of(ranks[0]))
    for r in ranks:
        mine = of(r)
        assert list(mine) == keys, (r, "round keys differ between ranks")
        assert {p for p in mine.values() if len(p) > 1} == {g for g in world if r in g}, r
        for key, part in mine.items():
            assert r in part and list(part) == sorted(set(part))
            for m in part[::max(1, len(part) // 8)]:       # a few members of a large part
                assert of(m)[key] == part, (r, m, key)


@pytest.mark.parametrize("name, overrides, text", EQUIVALENCE, ids=lambda v: v if isinstance(v, str) else "")
def test_equivalence_strategies(compiled_models, name, overrides, text):  # noqa: F811
    strategy = Strategy.parse(text)
    prog = compiled_models(name, overrides).build_program(strategy, Cluster(strategy.num_ranks))
    assert_rounds_are_the_worlds_groups(prog, range(strategy.num_ranks))


@pytest.mark.parametrize("name, overrides, text, group", EQUIVALENCE_GROUPED,
                         ids=lambda v: v if isinstance(v, str) else "")
def test_shard_grouped_equivalence_strategies(compiled_models, name, overrides, text, group):  # noqa: F811
    strategy = Strategy.parse(text)
    prog = compiled_models(name, overrides).build_program(strategy, Cluster(strategy.num_ranks, shard_group=group))
    assert_rounds_are_the_worlds_groups(prog, range(strategy.num_ranks))


@pytest.mark.parametrize("seed, world, group", [(6, 64, None), (1, 128, None), (2, 256, None), (3, 512, None),
                                                (4, 64, 8), (5, 128, 16), (7, 256, 8), (8, 512, 64)])
def test_random_strategies(compiled_models, seed, world, group):  # noqa: F811
    rng = random.Random(seed)
    strategy = random_strategy(rng, world)
    prog = compiled_models("tiny", tuple(sorted(WIDE.items()))).build_program(
        strategy, Cluster(world, 8, shard_group=group))
    ranks = range(world) if world <= 64 else sorted({0, 1, world - 1, *rng.sample(range(world), 12)})
    assert_rounds_are_the_worlds_groups(prog, ranks)


@pytest.mark.parametrize("group", [8, None])
def test_one_ranks_groups_list_no_world(compiled_models, group):  # noqa: F811
    """One rank's rounds read neither world list, and under ``--shard-group`` list no role's ranks
    beyond its shard group (with G the world, only the roles of its own replica groups)."""
    strategy = Strategy.parse("8xTP8PP4+16xTP4PP2+32xTP2PP1+64xTP1PP1")
    prog = compiled_models("tiny", tuple(sorted(WIDE.items()))).build_program(strategy,
                                                                              Cluster(512, 8, shard_group=group))
    planner = prog.planner

    def refuse():
        raise AssertionError("a rank's groups read the world's list")
    planner.binding_groups = planner.replica_groups = refuse
    for rank in (0, 77, 300, 511):
        parts = {rnd.part for rnd in program_rounds(prog, rank)}
        listed = planner.roles._cache          # roles whose every rank was listed
        if group is not None:
            assert not listed, rank
        else:
            assert all(any(set(ranks) <= set(p) for p in parts) for ranks in listed.values()), rank
        listed.clear()
    assert not prog._ranks, "another rank's program was built"


@pytest.mark.parametrize("seed", range(40))
def test_groups_keep_to_shard_groups_equals_listing_the_world(seed):
    """``groups_keep_to_shard_groups`` (does a shard group hold ranks of two replica groups? from the
    ranks where the group changes) equals the answer of every rank's group listed, on random strategies,
    groupings of their roles and shard groups."""
    rng = random.Random(seed)
    world = rng.choice([8, 16, 32, 64])
    strategy = random_strategy(rng, world)
    roles = sorted({ParamRole(p, s, t) for p in strategy.pipelines for s in range(p.pp) for t in range(p.tp)}, key=str)
    kinds = rng.choice([1, 2, 3])
    group_of = {pr: rng.randrange(kinds) if rng.random() < 0.5 else pr[2] % kinds for pr in roles}
    of = [group_of[ParamRole.of(strategy.pipelines[c.pipeline], c)] for c in strategy.coords()]
    for g in (d for d in (1, 2, 4, 8, 16, 32, world) if world % d == 0):
        listed = all(len(set(of[lo:lo + g])) == 1 for lo in range(0, world, g))
        assert groups_keep_to_shard_groups(strategy, group_of, g) == listed, (str(strategy), g, group_of)
