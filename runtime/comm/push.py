"""Push Gradient on one rank: the push plans of a Program (``hgraph.comm_plan``) run on torch.distributed.

The reduce-scatters among replica groups travel in buckets (``grad_buckets.GradBuckets``, reverse
model order, up to ``bucket_bytes``). On every backend each is issued while the step's last
backward still runs, once its gradients are final (``ready``, from a post-accumulate-grad hook,
armed by ``arm``) and every bucket before it in the one global bucket order was issued (so the
order does not depend on when gradients become ready), except from a bucket whose group holds a
rank of an earlier stage of this rank's pipeline (a tied parameter's: that rank is still waiting for
this rank's gradient), which waits for the backward's end; ``flush`` issues the rest. ``complete`` then waits for them,
sends the plan's transfers to the optimizer owners (``peer_buckets``: the small ones in one message
per peer, tags ``2k+2``) and does the local adds; under ``--shard-group`` all of that stays inside the
rank's shard group, and the owners' shards are then summed across the groups (all-reduces among the
rank's replicas, in buckets, ``_sum_across_groups``). Owners get the summed fp32 gradient of their
optimizer shard (the reduced rows themselves when they are the whole shard), laid out as the
parameter is, so that torch's fused Adam takes it without a copy. A rank whose pipeline ran no
micro-batch pushes zeros, so every rank takes part and nothing hangs.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from hgraph.comm_plan import LocalAdd, ReduceScatter, Transfer, uncovered_ranges
from hgraph.program import GroupRound, Program
from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES, GradBuckets
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.peer_buckets import PeerTransfers, message_rounds, plan_transfers, transfer_sizes
from hgraph.runtime.comm.rank_params import Range, RankParams, SyncStats, laid_out_rows, lookup, rows
from hgraph.runtime.comm.process_groups import shard_rounds
from hgraph.strategy import Strategy


def groups_needed(program: Program, rank: int) -> list[GroupRound]:
    """The process groups ``rank``'s push talks in, as creation rounds (``GroupCache.create``, every
    rank its own part of each): the replica groups of its reduce-scatters (``Program.replica_rounds``,
    read off the layout per role) and, when the optimizer shards within groups (``--shard-group``),
    its shard group (its pull's all-gathers) and its replicas (the sum across the groups). A rank
    computes only its own groups, never the world's list (``tools/bench/cluster_scale``: 70B, 12,288
    GPUs, a few groups per rank where the world's list held thousands)."""
    rounds = list(program.replica_rounds(rank))
    cluster = program.cluster
    if cluster.shard_group is not None:
        rounds += shard_rounds(rank, cluster.world_size, cluster.group_size)
    return rounds


def spans_earlier_stages(strategy: Strategy, rank: int) -> Callable[[tuple[int, ...]], bool]:
    """Whether a group (sorted ranks) holds a rank of an earlier stage of ``rank``'s pipeline (a tied
    parameter's reduction across stages): that rank reaches the group's reduction only after this rank's
    last backward has sent it its gradient, so a reduction issued from this rank's backward hooks would
    wait in front of that send (a deadlock where a rank's operations run one at a time: NCCL's stream,
    ``--collective-order strict``); such buckets are issued after the backward (``GradBuckets.flush``).
    Pipelines' ranks are consecutive, earlier stages first: one range, one bisection per group."""
    c = strategy.coord(rank)
    lo, hi = strategy.rank_of(c.pipeline, 0), strategy.rank_of(c.pipeline, c.stage)
    return lambda group: hi > lo and bisect.bisect_left(group, lo) < len(group) and group[bisect.bisect_left(group, lo)] < hi


def _cut(span: Range, at: Range) -> list[Range]:
    """``span`` cut at the two ends of ``at`` (the pieces in order; some may be empty)."""
    lo, hi = span
    a, b = min(max(at[0], lo), hi), min(max(at[1], lo), hi)
    return [(lo, a), (a, b), (b, hi)]


def push_messages(program: Program, rank: int) -> PeerTransfers:
    """The point-to-point messages of ``rank``'s push: its transfers to and from the optimizer owners
    (fp32 rows), the small ones to one peer in one message. Reads ``rank``'s own ops only."""
    ops = program.rank(rank).push_by_param
    transfers = plan_transfers((program.param_layout(n), ops.get(n, ())) for n in program.param_names)  # model order
    return PeerTransfers(rank, transfers, 4, None, parity=2)


def push_message_rounds(program: Program, rank: int) -> list[list[tuple[int, bool]]]:
    """The rounds of ``push_messages`` as ``(peer, send)`` lists (the collective order, ``order/derive``)."""
    ops = program.rank(rank).push_by_param
    sizes = transfer_sizes((program.param_layout(n), ops.get(n, ())) for n in program.param_names)
    return message_rounds(rank, sizes, 4, None)


class PushGradient:
    """The push of one rank for one Program.

    ``groups``: a ``GroupCache`` holding this rank's groups of ``groups_needed``;
    ``in_backward``: issue the reductions from backward's hooks (any backend: a bucket goes only after
    those before it in ``GradBuckets``' global order, whichever gradients finish first);
    ``all_to_all``: see ``GradBuckets``.
    """

    def __init__(self, params: RankParams, stats: SyncStats, groups: Any, device: torch.device,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, in_backward: bool = True,
                 issuer: Optional[CollectiveIssuer] = None, all_to_all: Optional[bool] = None) -> None:
        self.params = params
        self.issuer = issuer or CollectiveIssuer()
        self.stats = stats
        program = params.program
        by_param = params.rank_program.push_by_param
        self.ops = {n: by_param.get(n, ()) for n in params.order}
        self._sole_add = self._sole_local_adds()
        self._own_rows = self._unreduced_rows()
        self.in_backward = in_backward
        self.bucket_bytes = bucket_bytes
        self._armed = False
        layouts = {n: params.layout(n) for n in params.order}
        self.buckets = GradBuckets(params.rank, params.order, self.ops, layouts, groups, self._contribution,
                                   device, bucket_bytes, issuer=self.issuer,
                                   after_backward=spans_earlier_stages(program.strategy, params.rank),
                                   all_to_all=all_to_all)
        self.peers = push_messages(program, params.rank)
        # the ranks holding this rank's shards in the other shard groups (--shard-group): the shards
        # are summed across them after the push inside the group
        self.replica_group = groups.get(params.replicas) if len(params.replicas) > 1 else None

    def _sole_local_adds(self) -> dict[str, LocalAdd]:
        """Parameters whose owned segment is one local add and nothing received: the reduced rows
        themselves are the gradient shard (no zeros + add)."""
        out = {}
        for name in self.params.order:
            seg = self.params.segment(self.params.layout(name))
            adds = [op for op in self.ops[name] if isinstance(op, LocalAdd)]
            recvs = [op for op in self.ops[name] if isinstance(op, Transfer) and op.dst == self.params.rank]
            if len(adds) == 1 and not recvs and (adds[0].lo, adds[0].hi) == seg and seg[1] > seg[0]:
                out[name] = adds[0]
        return out

    def _unreduced_rows(self) -> dict[str, list[Range]]:
        """Per parameter, the rows this rank forwards from its own gradient: its contributions that no
        reduce-scatter of its carries (all of them when it has no replica), cut where this rank's
        optimizer segment begins and ends, so that the rows it keeps are a buffer of their own (every
        transfer lies within one owner's segment)."""
        out = {}
        mine = self.params.rank_program.contributions
        for name in self.params.order:
            reduced = [(op.lo, op.hi) for op in self.ops[name] if isinstance(op, ReduceScatter)]
            contributions = mine.get(name, ())
            cuts = self.params.segment(self.params.layout(name))
            out[name] = [(a, b) for lo, hi in contributions for r in uncovered_ranges(lo, hi, reduced)
                         for a, b in _cut(r, cuts) if b > a]
        return out

    def _contribution(self, name: str, grad: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` (full-parameter coordinates) of this rank's gradient of ``name``, in the working
        dtype: callers copy them into fp32 buffers with one ``_foreach_copy_``, which casts as it copies
        (one fused kernel on CUDA, where a ``.float()`` per parameter launched one each)."""
        p = self.params
        dim = p.layout(name).shard_dim
        offset = 0
        for a, b in p.shards[name].ranges:
            if a <= lo and hi <= b:
                return rows(grad, dim).narrow(0, offset + lo - a, hi - lo)
            offset += b - a
        raise AssertionError(f"rank {p.rank} pushes rows [{lo}, {hi}) of {name!r} that it does not hold")

    def _fp32_rows(self, wanted: list[tuple[str, int, int]], grads: Mapping[str, Optional[torch.Tensor]]
                   ) -> list[torch.Tensor]:
        """The fp32 rows ``(name, lo, hi)`` of this rank's gradients (zeros where it has none), as views
        of one buffer filled by one cast-and-copy. Each is laid out as the parameter is (the rows along
        its shard dimension) and viewed rows first, so a shard made of all its rows is contiguous again
        for the optimizer's fused kernel (which otherwise copied every shard cut along dim > 0)."""
        p = self.params
        layouts = []                      # (rows, row shape, shard dim)
        for name, lo, hi in wanted:
            dim = p.layout(name).shard_dim
            layouts.append((hi - lo, rows(p.working[name], dim).shape[1:], dim))
        sizes = [n * int(torch.Size(rest).numel()) for n, rest, _ in layouts]
        complete = all(grads.get(name) is not None for name, _, _ in wanted)
        device = p.masters[p.order[0]].device if p.order else torch.device("cpu")
        flat = (torch.empty if complete else torch.zeros)(sum(sizes), dtype=torch.float32, device=device)
        views = [laid_out_rows(v, *layout) for v, layout in zip(flat.split(sizes), layouts)]
        dests, srcs = [], []
        for (name, lo, hi), view in zip(wanted, views):
            if grads.get(name) is not None:
                dests.append(view)
                srcs.append(self._contribution(name, grads[name], lo, hi))
        if dests:
            torch._foreach_copy_(dests, srcs)
        return views

    # ---- the step's reductions -----------------------------------------------------------------
    def begin_step(self) -> None:
        """Forget the last step's reductions; nothing is issued until ``arm`` or ``flush``."""
        self._armed = False
        self.buckets.reset()

    def arm(self) -> None:
        """The step's last backward starts: from now on a finished gradient issues its bucket."""
        self._armed = self.in_backward

    def ready(self, name: str, grad: Optional[torch.Tensor]) -> bool:
        """``name``'s gradient is final (its hook): issue what became issuable if armed; returns
        whether it was."""
        if self._armed:
            self.buckets.ready(name, grad)
        return self._armed

    def flush(self, grads: Mapping[str, Optional[torch.Tensor]]) -> None:
        """Issue every reduce-scatter not issued during backward (before any other collective of the
        step's end, so every rank issues its collectives in the same order)."""
        self._armed = False
        self.buckets.flush(grads)

    def count_reductions(self) -> None:
        """Count the step's reduce-scatter payloads (once, after its reductions were issued)."""
        self.stats.push_reduce_scatter_bytes += self.buckets.bytes_issued

    def owned_gradient(self, name: str, held: Mapping[str, list]) -> torch.Tensor:
        """The fp32 gradient of this rank's optimizer shard of ``name`` when it is exactly the reduced
        rows it holds (a plain reduce-scatter; an empty shard gets an empty gradient), else zeros."""
        master = self.params.masters[name]
        add = self._sole_add.get(name)
        if add is None:
            return torch.zeros_like(master, dtype=torch.float32)
        reduced = lookup(held[name], add.lo, add.hi, name)
        dim = self.params.layout(name).shard_dim
        return reduced.reshape(master.shape) if master.dim() <= 1 else reduced.movedim(0, dim)

    # ---- the push to the owners ----------------------------------------------------------------
    @torch.no_grad()
    def complete(self, grads: Mapping[str, Optional[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run every push plan; returns this rank's summed fp32 gradient shard for every parameter.

        ``grads[name]``: the working gradient of a parameter this rank holds (``None``: no
        micro-batch ran, pushed as zeros). Collective: every rank calls it once per step.
        """
        p = self.params
        if p.aliased:                     # one rank: the working gradient is the owner's gradient
            out = {n: grads[n].float().reshape(p.masters[n].shape) if grads.get(n) is not None
                   else torch.zeros_like(p.masters[n]) for n in p.order if n in p.aliased}
            if len(out) == len(p.order):
                return out
        else:
            out = {}
        held: dict[str, list] = {name: [] for name in p.order}
        self.flush(grads)                 # 1. reduce-scatters among replicas (mostly issued in backward)
        self.buckets.wait(held)
        self.count_reductions()
        own = [(name, lo, hi) for name, ranges in self._own_rows.items() for lo, hi in ranges]
        for (name, lo, hi), t in zip(own, self._fp32_rows(own, grads)):   # rows no reduce-scatter carries
            held[name].append(((lo, hi), t))
        device = p.masters[p.order[0]].device if p.order else torch.device("cpu")
        summed = [n for n in p.order if n not in out and n not in self._sole_add]
        out.update(zip(summed, self._zeros(summed, device)))
        for name in p.order:
            if name not in out:
                out[name] = self.owned_gradient(name, held)
        # 2. transfers to the owners (the small ones coalesced per peer)
        sent, received = self.peers.post(lambda r: lookup(held[r.name], r.lo, r.hi, r.name), torch.float32, device,
                                         self.issuer, "push")
        self.stats.push_send_bytes += sent
        self.stats.push_recv_bytes += received
        # 3. local adds (overlap with the transfers), then the received rows, each in the plan's order
        self._add_in_order(out, {n: [(op.lo, op.hi, lookup(held[n], op.lo, op.hi, n)) for op in self.ops[n]
                                     if isinstance(op, LocalAdd)] for n in summed})
        arrived = {}
        for name in p.order:
            came = {(peer, span): t for peer, span, t in self.peers.held(name)}
            arrived[name] = [(op.lo, op.hi, came[(op.src, (op.lo, op.hi))]) for op in self.ops[name]
                             if isinstance(op, Transfer) and op.dst == p.rank]
        self._add_in_order(out, arrived)
        self.peers.wait_all()             # the sends
        self.peers.release()
        if self.replica_group is not None:
            self._sum_across_groups(out)
        return out

    def _sum_across_groups(self, out: Mapping[str, torch.Tensor]) -> None:
        """Each shard summed over the rank's replicas (one per shard group; an owner whose group
        contributed nothing adds its zeros), in place: all-reduces of up to ``bucket_bytes`` of shards
        side by side (model order: every replica holds the same shapes, so cuts the same buckets),
        each copied back into its shards, so the shards keep their layout and the step holds one
        bucket more, not a second copy of its gradients."""
        names = [n for n in self.params.order if out[n].numel()]
        cap = max(self.bucket_bytes // 4, 1)
        start, k = 0, 0
        while start < len(names):
            end, size = start, 0
            while end < len(names) and (end == start or size + out[names[end]].numel() <= cap):
                size += out[names[end]].numel()
                end += 1
            shards = [out[n] for n in names[start:end]]
            flat = torch.cat([s.reshape(-1) for s in shards])
            self.issuer.run("all_reduce", self.replica_group, flat,
                            lambda: dist.all_reduce(flat, group=self.replica_group, async_op=True),
                            f"replica sum {k}")
            k += 1
            self.stats.push_replica_bytes += flat.numel() * flat.element_size()
            torch._foreach_copy_(shards, [v.view(s.shape) for v, s in zip(flat.split([s.numel() for s in shards]), shards)])
            start = end

    def _zeros(self, names: list[str], device: torch.device) -> list[torch.Tensor]:
        """fp32 zeros shaped as the masters of ``names``: views of one buffer (one fill)."""
        masters = [self.params.masters[n] for n in names]
        flat = torch.zeros(sum(m.numel() for m in masters), dtype=torch.float32, device=device)
        return [v.view(m.shape) for v, m in zip(flat.split([m.numel() for m in masters]), masters)]

    def _add_in_order(self, out: dict, adds: Mapping[str, list[tuple[int, int, torch.Tensor]]]) -> None:
        """Add each parameter's ``(lo, hi, rows)`` into its gradient shard in list order: the j-th adds
        of all parameters in one ``_foreach_add_`` (different parameters: disjoint memory), so every
        element sums in the same order as one add after another, in a handful of calls."""
        for j in range(max((len(a) for a in adds.values()), default=0)):
            dests, srcs = [], []
            for name, a in adds.items():
                if j < len(a):
                    lo, hi, reduced = a[j]
                    param = self.params.layout(name)
                    base = self.params.segment(param)[0]
                    dests.append(rows(out[name], param.shard_dim).narrow(0, lo - base, hi - lo))
                    srcs.append(reduced)
            torch._foreach_add_(dests, srcs)
