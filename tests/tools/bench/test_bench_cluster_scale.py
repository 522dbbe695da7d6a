"""The cluster-scale bench runs small (``--quick``) and its figures agree with the Program it built."""
from __future__ import annotations

import json

import torch

import hgraph
from hgraph import Cluster
from hgraph.frontends.zoo import llama
from hgraph.tools.bench.cluster_scale import exchanges, main, runtime_setup, strategies


def test_quick_rows_cover_both_strategies_and_count_what_the_rank_exchanges(capsys):
    assert main(["--quick", "--in-process", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert sorted((r["gpus"], r["kind"], str(r["shard_group"])) for r in rows) == [
        (g, k, s) for g in (16, 64) for k in ("heterogeneous", "homogeneous") for s in ("8", "world")]
    for r in rows:
        assert r["cpu_s"] >= r["plans_s"] > 0 and r["added_mb"] >= 0
        assert 0 < r["pull_peers"] < r["gpus"] and 0 < r["push_peers"] < r["gpus"] and r["groups"] >= 1
        # the groups it creates are those it talks in (its ops' and bindings'), less the world's (made at
        # init_process_group); one new_group call per round, its part or a pad
        assert r["runtime_s"] > 0 and r["rank_groups"] <= r["groups"] <= r["rank_groups"] + 1
        assert r["group_calls"] >= r["rank_groups"] >= 1 and r["groups_ms"] >= 0
    # with the optimizer sharded inside a node (G = 8) a rank's Pull and Push peers stay inside its group
    # whatever the world; it adds one all-reduce among its replicas (one per group)
    for r in rows:
        if r["shard_group"] == 8:
            assert r["pull_peers"] <= 7 and r["push_peers"] <= 7 and r["replicas"] == r["gpus"] // 8
    by = {(r["kind"], r["gpus"], str(r["shard_group"])): r for r in rows}
    for kind in ("homogeneous", "heterogeneous"):
        assert by[kind, 16, "8"]["pull_peers"] == by[kind, 64, "8"]["pull_peers"]
        assert by[kind, 16, "8"]["rank_groups"] == by[kind, 64, "8"]["rank_groups"]
        assert by[kind, 64, "world"]["pull_peers"] > by[kind, 16, "world"]["pull_peers"]


def test_exchanges_and_groups_of_one_rank():
    with torch.device("meta"):
        compiled = hgraph.compile(llama.build("tiny"))
    prog = compiled.build_program("2xTP2PP1", Cluster(4))
    got = exchanges(prog.rank(1))
    # rank 1: TP group {0, 1}; replica groups of its reduce-scatters: {1, 3} (its TP rank in both pipelines)
    # and the world's for the parameters every rank contributes whole
    groups = {tuple(g) for g in ([op.group for ops in prog.rank(1).push_by_param.values() for op in ops
                                  if hasattr(op, "group")] + [(0, 1)])}
    assert got["groups"] == len(groups) and (0, 1) in groups and (1, 3) in groups
    assert got["pull_peers"] == 3 and got["push_peers"] == 3


def test_strategies_fill_the_world_and_bad_input_is_exit_2(capsys):
    assert strategies(8, 64) == [("homogeneous", "8xTP8PP1"), ("heterogeneous", "2xTP8PP2+2xTP4PP2+8xTP2PP1")]
    assert main(["--worlds", "64,x", "--models", "tiny"]) == 2
    assert "--worlds" in capsys.readouterr().err
    assert main(["--models", "nope", "--worlds", "16"]) == 2
    assert main(["--quick", "--shard-groups", "8,half"]) == 2
    assert "--shard-groups" in capsys.readouterr().err


def test_runtime_setup_lists_the_ranks_groups_without_its_plans():
    """The runtime's side of one rank (its Pull/Push bookkeeping and the groups it creates) plans
    nothing of the world: ``pull_plans`` / ``push_plans`` stay unplanned; its groups are the world's
    groups it is in."""
    with torch.device("meta"):
        compiled = hgraph.compile(llama.build("tiny"))
    prog = compiled.build_program("1xTP2PP2+1xTP2PP1+2xTP1PP1", Cluster(8))
    got = runtime_setup(prog, 5, torch.bfloat16)
    assert not prog.pull_plans._plans and not prog.push_plans._plans
    tp = {(0, 1), (2, 3), (4, 5)}
    replicas = {rs.group for plan in prog.push_plans.values() for rs in plan.reduce_scatters if len(rs.group) > 1}
    assert got["rank_groups"] == len({g for g in tp | replicas if 5 in g}) == 5
