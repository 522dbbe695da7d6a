"""Fan-out at cluster scale: per rank and step, the peers, messages and bytes of Pull and Push, and
the process groups a rank belongs to, at shard groups G = 8, 64 and the world.

``python -m hgraph.tools.bench.shard_fanout`` (``--json`` for one JSON object): the zoo's 70B and 32B
built on the meta device, at 1,024 and 12,288 ranks, one homogeneous and one heterogeneous strategy
each. Simulated in one process from the plans (``passes/lnk/shard_groups``), never run: the plans of
the counted rank's own shard group only, so G = 8 and 64 cost what one group exchanges at any world
size. G = world plans the whole world; where that passes ``--max-plan-ranks`` (default 512: the
world's plans at 1,024 ranks did not finish in 10 minutes here, at 12,288 they would take hours),
the figures are rank arithmetic instead, marked ``~``: Pull exactly (plans are byte-minimal, so a
rank receives the rows it needs and does not own, from their owners), Push an upper bound (the rank's
replicas and the owners of every row it contributes; bytes as if nothing were reduced on the way).

Per rank and step (the ranks counted: ``--ranks``, default the first and the last, which in the
heterogeneous strategies sit in different schemes):

* ``pull_peers`` / ``push_peers``: distinct ranks it exchanges with (point-to-point, all-gather,
  reduce-scatter); with G < N the push adds one all-reduce of its shards among its ``replicas``
  (``N / G`` ranks, one per group: a collective whose ring or tree gives each rank 2-3 direct
  neighbours, counted apart);
* ``pull_msgs`` / ``push_msgs``: point-to-point messages (coalesced per peer as ``peer_buckets``
  cuts them) plus collectives (all-gather buckets, reduce-scatter buckets, the all-reduce);
* ``pull_bytes`` / ``push_bytes``: bytes it receives (working dtype for Pull, fp32 for Push; a
  collective counted as a ring moves it);
* ``groups``: process groups it belongs to in this strategy (TP / CP / Ulysses, reduce-scatter
  replicas, its shard group and its replicas; the world's default group counted once): each is an
  NCCL communicator with buffers of its own.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch

import hgraph
from hgraph import dims
from hgraph.comm_plan import ParamLayout, ReduceScatter, Transfer, merge_ranges
from hgraph.frontends.zoo import build
from hgraph.passes.instantiate import push_contribution
from hgraph.passes.lnk.shard_groups import shard_group_pull_plan, shard_group_push_plan
from hgraph.passes.sequence_parallel import model_sequence_parallel
from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES
from hgraph.runtime.comm.peer_buckets import PeerTransfers, plan_transfers
from hgraph.runtime.comm.pull import DEFAULT_PULL_BUCKET_BYTES
from hgraph.shard_rule import group_shard_bounds, owner_chunks, replica_ranks, shard_group_ranks
from hgraph.strategy import Cluster, Strategy

MODELS = ("70b", "32b")
WORLDS = (1024, 12288)
GROUPS = ("8", "64", "world")


def strategies_for(world: int, heads: int) -> tuple[str, str]:
    """A homogeneous strategy (pipelines of the widest TP up to 8 dividing the model's ``heads``) and a
    heterogeneous one (half of the ranks in those, half in PP4 pipelines of half that TP)."""
    tp = next(t for t in (8, 4, 2, 1) if heads % t == 0)
    half = max(tp // 2, 1)
    return f"{world // tp}xTP{tp}PP1", f"{world // (2 * tp)}xTP{tp}PP1+{world // (8 * half)}xTP{half}PP4"


@dataclass
class Fanout:
    model: str
    strategy: str
    world: int
    shard_group: int
    rank: int
    pull_peers: int
    pull_msgs: Optional[int]
    pull_bytes: int
    push_peers: int
    push_msgs: Optional[int]
    push_bytes: int
    replicas: int
    groups: int
    estimated: bool
    seconds: float


class RankLayouts:
    """Every rank's shards of one strategy by rank arithmetic (one shard dict per role), and what the
    plans take from them: needs and contributions of chosen ranks."""

    def __init__(self, compiled: Any, strategy: Strategy) -> None:
        self.compiled, self.strategy = compiled, strategy
        self._roles: dict[Any, dict] = {}
        sp = model_sequence_parallel(compiled.hgraph, compiled.symbolic_shapes())
        self.sp_partial = set(getattr(sp, "partial_grads", ()) or ()) if any(p.tp > 1 for p in strategy.pipelines) else set()

    def rank(self, r: int) -> SimpleNamespace:
        c = self.strategy.coord(r)
        scheme = self.strategy.pipelines[c.pipeline]
        if scheme not in self._roles:
            self._roles[scheme] = self.compiled.param_shards(scheme)
        return SimpleNamespace(rank=r, scheme=scheme, tp_rank=c.tp_rank, replica=c.replica,
                               params=self._roles[scheme][(c.stage, c.tp_rank)])

    def needs(self, ranks: list[SimpleNamespace], name: str) -> dict[int, list]:
        return {rp.rank: list(rp.params[name].ranges) for rp in ranks if name in rp.params}

    def contributions(self, ranks: list[SimpleNamespace], name: str):
        """The gradient rows each of ``ranks`` contributes, and the replica groups (identical rows)."""
        info = self.compiled.hgraph.params[name]
        contrib: dict[int, list] = {}
        for rp in ranks:
            shard = rp.params.get(name)
            ranges = push_contribution(shard, rp.scheme, rp.tp_rank, info, name in self.sp_partial,
                                       rp.replica) if shard else ()
            if ranges:
                contrib[rp.rank] = list(ranges)
        same: dict[tuple, list[int]] = {}
        for r, ranges in contrib.items():
            same.setdefault(tuple(ranges), []).append(r)
        return contrib, [tuple(g) for g in same.values() if len(g) > 1]


def _layout(compiled: Any, name: str) -> ParamLayout:
    info = compiled.hgraph.params[name]
    shape = tuple(int(d) for d in info.shape)
    return ParamLayout(name, shape, info.shard_dim if shape else 0)


def _ring_bytes(members: int, chunk_bytes: int) -> int:
    """What a member receives in an all-gather (or a reduce-scatter) of equal chunks over ``members``."""
    return (members - 1) * chunk_bytes


def fanout(compiled: Any, strategy: Strategy, cluster: Cluster, rank: int = 0, *, working_bytes: int = 2,
           model: str = "", max_plan_ranks: int = 512) -> Fanout:
    """The Pull / Push fan-out of ``rank`` for one step of ``strategy`` on ``cluster`` (its
    ``shard_group``), from the plans of the rank's shard group (or by rank arithmetic, ``estimated``,
    when G is the world and larger than ``max_plan_ranks``)."""
    t0 = time.perf_counter()
    world, size = cluster.world_size, cluster.group_size
    layouts = RankLayouts(compiled, strategy)
    members = shard_group_ranks(rank, size)
    if size == world and world > max_plan_ranks:
        out = _estimate(compiled, layouts, strategy, cluster, rank, working_bytes)
    else:
        out = _from_plans(compiled, layouts, [layouts.rank(r) for r in members], strategy, cluster, rank,
                          working_bytes)
    pull_peers, pull_msgs, pull_bytes, push_peers, push_msgs, push_bytes, rs_groups, estimated = out
    replicas = replica_ranks(rank, size, world)
    groups = {tuple(g) for d in dims.GROUPED for g in [strategy.group(d, rank)] if len(g) > 1}
    groups |= rs_groups
    groups.add(tuple(range(world)))                 # the default group (the loss, barriers)
    if size < world:
        groups |= {g for g in (members, replicas) if len(g) > 1}
        if push_msgs is not None:
            push_msgs += 1                          # the all-reduce of the shards across the groups
        shard_bytes = sum(math.prod(_layout(compiled, n).row_shape or (1,)) * 4
                          * (lambda b: b[1] - b[0])(group_shard_bounds(_layout(compiled, n).size, rank, size))
                          for n in compiled.hgraph.params)
        push_bytes += 2 * (len(replicas) - 1) * shard_bytes // len(replicas)     # ring all-reduce
    return Fanout(model, str(strategy), world, size, rank, len(pull_peers), pull_msgs, pull_bytes,
                  len(push_peers), push_msgs, push_bytes, len(replicas), len(groups), estimated,
                  time.perf_counter() - t0)


def _from_plans(compiled, layouts, ranks, strategy, cluster, rank, wbytes):
    world, size = cluster.world_size, cluster.group_size
    shard_group = None if size == world else size
    mine = [rank // size]
    pulls, pushes = [], []
    for name in compiled.hgraph.params:
        layout = _layout(compiled, name)
        pulls.append(shard_group_pull_plan(layout, layouts.needs(ranks, name), world, cluster.gpus_per_node,
                                           shard_group, working_dtype_bytes=wbytes, groups=mine))
        contrib, replica_groups = layouts.contributions(ranks, name)
        pushes.append(shard_group_push_plan(layout, contrib, world, cluster.gpus_per_node, shard_group,
                                            replica_groups, groups=mine))
    # Pull: the all-gathered parameters in buckets (as PullParameter cuts them), the rest point to point
    pull_peers, pull_bytes, gather_buckets, bucket = set(), 0, 0, None
    for plan in pulls:
        if plan.is_all_gather:
            group = plan.all_gather_group(rank)
            pull_peers |= set(group) - {rank}
            width = -(-plan.param.size // len(group))
            chunk = plan.param.slice_bytes(0, width, wbytes)
            pull_bytes += _ring_bytes(len(group), chunk)
            nbytes = len(group) * chunk
            if bucket is None or bucket + nbytes > DEFAULT_PULL_BUCKET_BYTES:
                gather_buckets, bucket = gather_buckets + 1, 0
            bucket += nbytes
    p2p = [p for p in pulls if not p.is_all_gather]
    pull_msgs = len(list(PeerTransfers(rank, plan_transfers((p.param, p.for_rank(rank)) for p in p2p), wbytes, DEFAULT_PULL_BUCKET_BYTES, 1).buckets()))
    for plan in p2p:
        for op in plan.for_rank(rank):
            if isinstance(op, Transfer):
                pull_peers.add(op.dst if op.src == rank else op.src)
                pull_bytes += op.bytes if op.dst == rank else 0
    # Push: reduce-scatters among replicas (in buckets per group, as GradBuckets cuts them), then LNK
    push_peers, push_bytes, rs_groups, rs_buckets = set(), 0, set(), {}
    for plan in pushes:
        push_bytes += plan.reduce_scatter_recv_bytes().get(rank, 0)
        for op in plan.for_rank(rank):
            if isinstance(op, ReduceScatter):
                rs_groups.add(op.group)
                push_peers |= set(op.group) - {rank}
                widest = max(hi - lo for _, lo, hi in op.pieces) * plan.param.row_elements * 4 * len(op.group)
                count, filled = rs_buckets.get(op.group, (0, None))
                if filled is None or filled + widest > DEFAULT_BUCKET_BYTES:
                    count, filled = count + 1, 0
                rs_buckets[op.group] = (count, filled + widest)
            elif isinstance(op, Transfer):
                push_peers.add(op.dst if op.src == rank else op.src)
                push_bytes += op.bytes if op.dst == rank else 0
    push_msgs = (len(list(PeerTransfers(rank, plan_transfers((p.param, p.for_rank(rank)) for p in pushes), 4, None, 2).buckets()))
                 + sum(c for c, _ in rs_buckets.values()))
    return (pull_peers, pull_msgs + gather_buckets, pull_bytes, push_peers, push_msgs, push_bytes, rs_groups, False)


def _estimate(compiled, layouts, strategy, cluster, rank, wbytes):
    """G = the world, by rank arithmetic (``fanout``'s docstring): no plan of the world is built."""
    world = cluster.world_size
    me = layouts.rank(rank)
    pull_peers, pull_bytes, push_peers, push_bytes = set(), 0, set(), 0
    # the ranks whose contributions have this rank's layout (its reduce-scatter replicas): by role, the
    # layout being the same in every pipeline of a scheme
    ranks_of: dict[tuple, list[int]] = {}
    for r in range(world):
        c = strategy.coord(r)
        ranks_of.setdefault((strategy.pipelines[c.pipeline], c.stage, c.tp_rank, c.replica), []).append(r)
    role_ranks = {key: layouts.rank(rs[0]) for key, rs in ranks_of.items()}
    rs_groups, seen = set(), {}
    for name in compiled.hgraph.params:
        layout = _layout(compiled, name)
        row = layout.row_elements
        shard = me.params.get(name)
        if shard is not None:
            for lo, hi, owner in (c for a, b in merge_ranges(shard.ranges) for c in owner_chunks(a, b, layout.size, world)):
                if owner != rank:
                    pull_peers.add(owner)
                    pull_bytes += (hi - lo) * row * wbytes
        contrib, _ = layouts.contributions([*role_ranks.values(), me], name)
        ranges = contrib.get(rank)
        if not ranges:
            continue
        same = frozenset(key for key, rp in role_ranks.items() if contrib.get(rp.rank) == ranges)
        if same not in seen:
            seen[same] = tuple(sorted(r for key in same for r in ranks_of[key]))
            if len(seen[same]) > 1:
                rs_groups.add(seen[same])
                push_peers |= set(seen[same]) - {rank}
        for lo, hi, owner in (c for a, b in merge_ranges(ranges) for c in owner_chunks(a, b, layout.size, world)):
            if owner != rank:
                push_peers.add(owner)
                push_bytes += (hi - lo) * row * 4
    return pull_peers, None, pull_bytes, push_peers, None, push_bytes, rs_groups, True


def compile_meta(model: str) -> Any:
    """The zoo model ``model`` built on the meta device and compiled (shapes only)."""
    with torch.device("meta"):
        module = build(model)
    return hgraph.compile(module, dtype="bf16")


def run(models=MODELS, worlds=WORLDS, groups=GROUPS, ranks=(0, -1), max_plan_ranks: int = 512,
        gpus_per_node: int = 8, strategies=None, each=None) -> list[Fanout]:
    """Every row of the table: per model, world size, strategy, shard group and counted rank (a
    negative rank counts from the end); ``each(row)`` is called as each row is done."""
    out = []
    for model in models:
        compiled = compile_meta(model)
        for world in worlds:
            for text in strategies or strategies_for(world, int(compiled.hgraph.model_config.num_heads)):
                strategy = Strategy.parse(text)
                for g in groups:
                    size = world if g == "world" else int(g)
                    cluster = Cluster(world, gpus_per_node, shard_group=size)
                    for rank in ranks:
                        out.append(fanout(compiled, strategy, cluster, rank % world, model=model,
                                          max_plan_ranks=max_plan_ranks))
                        if each is not None:
                            each(out[-1])
    return out


HEAD = (f"{'model':>5} {'world':>6} {'strategy':<26} {'G':>6} {'rank':>6} | {'pull peers':>10} {'msgs':>6} "
        f"{'MB':>9} | {'push peers':>10} {'msgs':>6} {'MB':>9} {'replicas':>8} | {'groups':>6} {'s':>6}")
NOTE = "~: rank arithmetic (the world's plans are not built): Pull exact, Push an upper bound"


def line(f: Fanout) -> str:
    """One row of the table."""
    est = "~" if f.estimated else " "
    msgs = lambda m: "-" if m is None else str(m)  # noqa: E731
    return (f"{f.model:>5} {f.world:>6} {f.strategy:<26} {f.shard_group:>6} {f.rank:>6} | {est}{f.pull_peers:>9} "
            f"{msgs(f.pull_msgs):>6} {f.pull_bytes / 1e6:>9.1f} | {est}{f.push_peers:>9} "
            f"{msgs(f.push_msgs):>6} {f.push_bytes / 1e6:>9.1f} {f.replicas:>8} | {f.groups:>6} {f.seconds:>6.1f}")


def table(rows: list[Fanout]) -> str:
    return "\n".join([HEAD, "-" * len(HEAD), *map(line, rows), NOTE])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.shard_fanout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), metavar="M,M")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), metavar="N,N")
    p.add_argument("--groups", default=",".join(GROUPS), metavar="G,G", help="shard groups (integers or world)")
    p.add_argument("--strategies", default=None, metavar="S;S", help="default: one homogeneous and one "
                   "heterogeneous strategy per world size")
    p.add_argument("--ranks", default="0,-1", metavar="R,R", help="ranks counted (negative: from the end)")
    p.add_argument("--max-plan-ranks", type=int, default=512, metavar="N",
                   help="G = world larger than this is estimated by rank arithmetic")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not args.json:
        print(HEAD + "\n" + "-" * len(HEAD), flush=True)
    rows = run(args.models.split(","), [int(w) for w in args.worlds.split(",")], args.groups.split(","),
               [int(r) for r in args.ranks.split(",")], args.max_plan_ranks,
               strategies=args.strategies.split(";") if args.strategies else None,
               each=None if args.json else (lambda f: print(line(f), flush=True)))
    print(json.dumps({"rows": [asdict(r) for r in rows]}) if args.json else NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
