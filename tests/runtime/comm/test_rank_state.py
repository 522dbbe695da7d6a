"""One rank's Pull/Push bookkeeping reads only that rank's part of the Program, never the world's plans.

A training rank builds its ``RankParams``, ``PullParameter`` and ``PushGradient`` (the state that needs
no process group), the process groups it creates (``groups_needed``, the executor's ``program_rounds``)
and whether the overlapped update applies (``is_plain_data_parallel``). All of
that must come from the rank's own ops (``Program.rank``) and the facts read off the layout per role
(``Program.exchange``, ``replica_rounds``, ``binding_rounds``), building no other rank's program and
never reading ``Program.pull_plans`` / ``push_plans``: they plan the whole world, which at 1,024
ranks of a 70B model takes minutes. Once built, the bookkeeping must equal what the world's plans
give (the ops, the tiles a pull assembles from, the point-to-point messages, the group list), so that
every rank still posts the same messages and collectives as before. No process is started: tensors
live on the meta device and the process groups are never asked for.
"""
import pytest
import torch

import hgraph
from hgraph import Cluster, Strategy
from hgraph.comm_plan import Transfer
from hgraph.frontends.zoo import llama
from hgraph.runtime.comm.overlapped_update import is_plain_data_parallel
from hgraph.runtime.comm.peer_buckets import PeerTransfers, Rows
from hgraph.runtime.comm.process_groups import shard_groups_of
from hgraph.runtime.comm.pull import pull_messages
from hgraph.runtime.comm.push import groups_needed, push_messages
from hgraph.runtime.engine.executor import program_rounds
from hgraph.tools.bench.cluster_scale import meta_rank_state

# a 4-layer model whose heads allow TP8, for worlds of 64 to 512 ranks (as tests/passes/test_rank_programs)
WIDE = dict(num_layers=4, num_heads=8, num_kv_heads=8, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    with torch.device("meta"):
        return hgraph.compile(llama.build("tiny", **WIDE))


def rank_state(prog, rank, dtype=torch.bfloat16):
    """This rank's RankParams, PullParameter and PushGradient over meta tensors (as the executor builds
    them, without process groups; the runtime bench's ``meta_rank_state``)."""
    return meta_rank_state(prog, rank, dtype, all_to_all=True)


def world_transfers(plans, rank, skip=lambda plan: False):
    """What the point-to-point messages were built from before: the world's plans, model order."""
    out = []
    for plan in plans:
        if skip(plan):
            continue
        ops = sorted((op for op in plan.for_rank(rank) if isinstance(op, Transfer)), key=lambda op: (op.lo, op.hi))
        out += [(Rows(plan.param.name, op.lo, op.hi, (op.hi - op.lo, *plan.param.row_shape)), op.src, op.dst)
                for op in ops]
    return out


def messages(peers: PeerTransfers):
    return [(b.peer, b.send, b.tag, [(r.name, r.lo, r.hi) for r in b.rows]) for b in peers.buckets()]


@pytest.mark.parametrize("text, world, group", [
    ("64xTP8PP1", 512, None),
    ("8xTP8PP4+16xTP4PP2+32xTP2PP1+64xTP1PP1", 512, None),
    ("8xTP8PP4+16xTP4PP2+32xTP2PP1+64xTP1PP1", 512, 16),
    ("64xTP1PP1", 64, None),          # plain data parallelism: every pull gathered, every push plain
    ("64xTP1PP1", 64, 8),
])
def test_one_ranks_state_plans_no_world(compiled, text, world, group):
    strategy = Strategy.parse(text)
    prog = compiled.build_program(strategy, Cluster(world, 8, shard_group=group))
    ranks = (0, 77 % world, world - 1)
    states = {r: rank_state(prog, r) for r in ranks}
    needed = {r: {rnd.part for rnd in groups_needed(prog, r) if len(rnd.part) > 1} for r in ranks}
    created = {r: {rnd.part for rnd in program_rounds(prog, r) if len(rnd.part) > 1} for r in ranks}  # bindings' too
    plain_dp = is_plain_data_parallel(prog)
    built = {r: (pull_messages(prog, r, 2, 1 << 20), push_messages(prog, r)) for r in ranks}
    assert not prog.pull_plans._plans and not prog.push_plans._plans, "a rank's state planned the world"
    assert set(prog._ranks) == set(ranks), "another rank's program was built"

    # what was built equals what the world's plans give (read only now)
    pulls, pushes = [prog.pull_plans[n] for n in prog.param_names], [prog.push_plans[n] for n in prog.param_names]
    world_groups = {rs.group for plan in pushes for rs in plan.reduce_scatters if len(rs.group) > 1}
    if group is not None:
        world_groups |= set(shard_groups_of(world, group))
    bindings = {tuple(g) for rp in prog.ranks for k, g in rp.bindings.items() if k in ("tp", "cp", "ul") and len(g) > 1}
    for r in ranks:     # each rank's groups: the world's that it is in
        assert needed[r] == {g for g in world_groups if r in g}
        assert created[r] == {g for g in bindings | world_groups if r in g}
    assert plain_dp == (group is None and all(p.is_all_gather for p in pulls)
                        and all(p.is_plain_reduce_scatter for p in pushes))
    assert plain_dp == (text == "64xTP1PP1" and group is None)
    for r, (params, pull, push) in states.items():
        for name in prog.param_names:
            assert pull.ops[name] == prog.pull_plans[name].for_rank(r)
            assert push.ops[name] == prog.push_plans[name].for_rank(r)
        for name, tiles in pull._tiles.items():
            plan = prog.pull_plans[name]
            assert tiles == tuple(zip(plan.needs[r], plan.assembly[r])), (r, name)
        assert set(pull._tiles) == {n for n in params.working if not prog.pull_plans[n].is_all_gather}
        assert [n for b in pull.gathers for n in b.names] == [n for n in prog.param_names
                                                              if prog.pull_plans[n].is_all_gather]
        pull_msgs, push_msgs = built[r]
        old_pull = PeerTransfers(r, world_transfers(pulls, r, lambda p: p.is_all_gather), 2, 1 << 20, parity=1)
        old_push = PeerTransfers(r, world_transfers(pushes, r), 4, None, parity=2)
        assert messages(pull_msgs) == messages(old_pull)
        assert messages(push_msgs) == messages(old_push)
        assert messages(push.peers) == messages(old_push)
