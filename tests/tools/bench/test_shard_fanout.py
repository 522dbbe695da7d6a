"""The fan-out counts of ``tools/bench/shard_fanout`` (no processes): with G = a node, a rank's Pull and
Push peers do not grow with the world; its peers stay in its shard group and its replicas; the rank
arithmetic used for the world's plans at 12,288 ranks equals the plans where both can be computed."""
import pytest

from hgraph.strategy import Cluster, Strategy
from hgraph.tools.bench.shard_fanout import compile_meta, fanout, main
from hgraph.shard_rule import replica_ranks, shard_group_ranks


@pytest.fixture(scope="module")
def tiny():
    return compile_meta("tiny")


@pytest.mark.parametrize("text", ["{n}xTP2PP1", "{h}xTP2PP1+{q}xTP1PP2"])
def test_with_a_node_per_group_the_peers_do_not_grow_with_the_world(tiny, text):
    rows = {}
    for world in (16, 64):
        strategy = Strategy.parse(text.format(n=world // 2, h=world // 4, q=world // 4))
        for rank in (0, world - 1):
            rows[world, rank] = fanout(tiny, strategy, Cluster(world, 4, shard_group=4), rank)
    for rank in (0, -1):
        small, large = rows[16, rank % 16], rows[64, rank % 64]
        # a group's plans do not depend on the world; only the replicas across the groups do
        assert (small.pull_peers, small.pull_msgs, small.pull_bytes) == (large.pull_peers, large.pull_msgs,
                                                                          large.pull_bytes)
        assert (small.push_peers, small.push_msgs) == (large.push_peers, large.push_msgs)
        assert (small.replicas, large.replicas) == (16 // 4, 64 // 4)      # one all-reduce among them
        assert large.pull_peers <= 3 and large.push_peers <= 3 and small.groups == large.groups
    world = fanout(tiny, Strategy.parse(text.format(n=32, h=16, q=16)), Cluster(64, 4), 0)
    assert world.pull_peers > rows[64, 0].pull_peers       # the world layout gathers across the world


def test_the_rank_arithmetic_of_the_world_layout_equals_its_plans_for_pull(tiny):
    strategy = Strategy.parse("2xTP2PP2+2xTP1PP2+1xTP4PP1")
    for rank in (0, 5, 11):
        planned = fanout(tiny, strategy, Cluster(16, 4), rank)
        estimated = fanout(tiny, strategy, Cluster(16, 4), rank, max_plan_ranks=8)
        assert estimated.estimated and not planned.estimated
        assert (estimated.pull_peers, estimated.pull_bytes) == (planned.pull_peers, planned.pull_bytes)
        assert estimated.push_peers >= planned.push_peers      # an upper bound


def test_peers_stay_in_the_group_and_the_replicas(tiny):
    from hgraph.tools.bench import shard_fanout
    strategy = Strategy.parse("2xTP2PP2+2xTP1PP2+1xTP4PP1")
    layouts = shard_fanout.RankLayouts(tiny, strategy)
    cluster = Cluster(16, 4, shard_group=4)
    for rank in (0, 6, 13):
        ranks = [layouts.rank(r) for r in shard_group_ranks(rank, 4)]
        pull_peers, _, _, push_peers, _, _, _, _ = shard_fanout._from_plans(tiny, layouts, ranks, strategy, cluster,
                                                                            rank, 2)
        assert pull_peers | push_peers <= set(shard_group_ranks(rank, 4)) - {rank}
        got = fanout(tiny, strategy, cluster, rank)
        assert got.push_peers == len(push_peers) and got.replicas == len(replica_ranks(rank, 4, 16)) == 4


def test_main_prints_the_table(capsys):
    assert main(["--models", "tiny", "--worlds", "16", "--groups", "4,world", "--strategies", "8xTP2PP1"]) == 0
    out = capsys.readouterr().out
    assert "8xTP2PP1" in out and "pull peers" in out
