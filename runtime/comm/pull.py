"""Pull Parameter on one rank: the pull plans of a Program (``hgraph.comm_plan``) run on torch.distributed.

Every rank walks *all* parameters in model order, owners included for parameters they do not use,
and posts its part of each plan at once (``post``): the parameters every rank needs whole
(``is_all_gather``) travel in all-gathers (inside the rank's shard group) of up to ``bucket_bytes`` each (``param_gather.GatherBucket``,
model order, as DDP buckets; on gloo run as all-to-alls, one bucket by default), the others' transfers
coalesced per peer into messages of up to ``bucket_bytes`` (``peer_buckets``; tags ``2k+1``; through
host memory where the backend needs it, ``p2p``), the fp32 master rows cast to the working dtype as
they are copied into the send buffers. ``wait(name)`` waits for the messages carrying that parameter's
rows, then writes every parameter whose rows are all here (received, and this rank's own, cast as they
are copied) into its working tensor in one batched copy (a gathered bucket is written out whole at its
first wait; idempotent within a step); ``finish`` completes the rest (the sends, and the pulls of a
pipeline that ran no micro-batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph.comm_plan import LocalCopy, Transfer
from hgraph.errors import HGraphError
from hgraph.program import Program
from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.param_gather import GatherBucket
from hgraph.runtime.comm.peer_buckets import (PeerBucket, PeerTransfers, message_rounds, plan_transfers,
                                              transfer_sizes)
from hgraph.runtime.comm.rank_params import Range, RankParams, SyncStats, lookup, rows

#: Pull all-gathers carry at most this many bytes each (model order): the first parameters arrive
#: early and the forward starts while the later ones are still travelling. Measured with the DP4
#: step of ``tools/bench/runtime`` (tiny model, gloo all-gathers, 16 free cores): 25 MB (one
#: all-gather) 55-57 ms, 1 MB 53-56 ms, 256 KB 42-45 ms, 64 KB 72-76 ms (more collectives than the
#: overlap repays). Kept where the gathers are real all-gathers (NCCL).
DEFAULT_PULL_BUCKET_BYTES = 256 * 1024

#: On gloo the gathers run as all-to-alls (``param_gather``), each paying gloo's latency, and the
#: same DP4 step is fastest with one (``tools/bench/runtime`` ratio to DDP, 2 cores, alternated
#: single steps: 1.10 with one gather and one reduction, 1.15 with both in 256 KB buckets; with
#: all-reduces the measure was 16 cores 32-35 ms vs 46-47 ms, 2 cores 88-92 ms vs 103-114 ms).
GLOO_PULL_BUCKET_BYTES = DEFAULT_BUCKET_BYTES


def pull_messages(program: Program, rank: int, dtype_bytes: int, bucket_bytes: Optional[int],
                  aliased: frozenset = frozenset()) -> PeerTransfers:
    """The point-to-point messages of ``rank``'s pull: the transfers of the parameters not all-gathered
    and not ``aliased``, in the working dtype (``dtype_bytes``), small ones to one peer coalesced up to
    ``bucket_bytes``. Reads ``rank``'s own ops only (``Program.rank``), never the world's plans."""
    transfers = plan_transfers(_messaged(program, rank, aliased))
    return PeerTransfers(rank, transfers, dtype_bytes, bucket_bytes, parity=1)


def pull_message_rounds(program: Program, rank: int, dtype_bytes: int, bucket_bytes: Optional[int],
                        aliased: frozenset = frozenset()) -> list[list[tuple[int, bool]]]:
    """The rounds of ``pull_messages`` as ``(peer, send)`` lists, without their buffers' bookkeeping
    (the collective order, ``order/derive``)."""
    return message_rounds(rank, transfer_sizes(_messaged(program, rank, aliased)), dtype_bytes, bucket_bytes)


def _messaged(program: Program, rank: int, aliased: frozenset) -> Iterator[tuple[Any, Sequence[Any]]]:
    """``(ParamLayout, rank's pull ops)`` of the parameters not all-gathered and not ``aliased``, model order."""
    ops = program.rank(rank).pull_by_param
    exchanges = (program.exchange(name) for name in program.param_names if name not in aliased)
    return ((ex.param, ops.get(ex.param.name, ())) for ex in exchanges if not ex.is_all_gather)


def gather_buckets(program: Program, names: Sequence[str], cap: int) -> list[list[str]]:
    """``names`` (all-gathered parameters, model order) cut into all-gathers of at most ``cap`` bytes
    (at least one parameter each); every rank cuts the same buckets (widths and dtypes are the same
    everywhere), and the collective order (``order/derive``) reads them from here."""
    group_size = program.cluster.group_size      # an all-gather runs in the shard group
    buckets: list[list[str]] = []
    size = 0
    for name in names:
        ex = program.exchange(name)
        width = -(-ex.param.size // group_size)
        nbytes = group_size * ex.param.slice_bytes(0, width, ex.working_dtype_bytes)
        if not buckets or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def assembly(needs: Sequence[tuple[int, int]], ops: Sequence[Any], rank: int) -> tuple[tuple[Range, ...], ...]:
    """Per range of ``needs`` (a rank's rows of a parameter, in its working tensor's order), the
    sub-ranges that tile it, each inside one of the rank's local copies or received transfers
    (``PullPlan.assembly[rank]``, from the rank's own ``ops``)."""
    held = sorted((op.lo, op.hi) for op in ops
                  if (isinstance(op, LocalCopy) and op.rank == rank) or (isinstance(op, Transfer) and op.dst == rank))
    return tuple(tuple((max(lo, a), min(hi, b)) for a, b in held if a < hi and lo < b) for lo, hi in needs)


@dataclass
class _Pull:
    """The pull of one parameter in flight: the rows it will assemble from besides the received ones."""

    held: list = field(default_factory=list)         # [((lo, hi), rows-first master view)]: local copies
    gather: Optional[GatherBucket] = None             # the shared all-gather carrying this parameter
    done: bool = False


class PullParameter:
    """The pulls of one rank for one Program.

    ``all_to_all``: gather by all-to-all (gloo); ``bucket_bytes``: the cap of an all-gather and of a
    point-to-point message (``None``: ``GLOO_PULL_BUCKET_BYTES`` with ``all_to_all``, else
    ``DEFAULT_PULL_BUCKET_BYTES``); ``gather_group``: the process group of this rank's shard group,
    which the all-gathers run in (``None``: the world's); ``issuer``: the rank's ``CollectiveIssuer``.
    """

    def __init__(self, params: RankParams, stats: SyncStats, bucket_bytes: Optional[int] = None,
                 all_to_all: bool = False, gather_group: Optional[dist.ProcessGroup] = None, issuer: Optional[CollectiveIssuer] = None) -> None:
        self.params = params
        self.issuer = issuer or CollectiveIssuer()
        self.stats = stats
        program = params.program
        by_param = params.rank_program.pull_by_param
        self.ops = {n: by_param.get(n, ()) for n in params.order}
        # the rows of each parameter this rank holds, each with the tiles it is assembled from
        self._tiles = {n: tuple(zip(params.shards[n].ranges, assembly(params.shards[n].ranges, self.ops[n],
                                                                      params.rank)))
                       for n in params.order if n in params.working and not params.exchange(n).is_all_gather}
        self._pulls: dict[str, _Pull] = {}
        if bucket_bytes is None:
            bucket_bytes = GLOO_PULL_BUCKET_BYTES if all_to_all else DEFAULT_PULL_BUCKET_BYTES
        gathered = [n for n in params.order if params.exchange(n).is_all_gather and n not in params.aliased]
        place = params.shard_group.index(params.rank)
        self.gathers = [GatherBucket([self._gather_entry(n) for n in names], place, params.group_size,
                                     params.working_dtype, all_to_all=all_to_all, group=gather_group,
                                     issuer=self.issuer, label=f"pull gather {k}")
                        for k, names in enumerate(gather_buckets(program, gathered, bucket_bytes))]
        self.peers = pull_messages(program, params.rank, params.working_dtype.itemsize, bucket_bytes,
                                   params.aliased)
        # the messages each parameter waits for, and the parameters each message carries
        self._waits_on = {n: list(dict.fromkeys(b for b, _ in entries if b.numel))
                          for n, entries in self.peers.received.items()}
        self._carries: dict[PeerBucket, list[str]] = {}
        for n, buckets in self._waits_on.items():
            for b in buckets:
                self._carries.setdefault(b, []).append(n)
        self._missing: dict[str, int] = {}      # this step: messages a parameter still waits for
        self._ready: list[str] = []             # this step: parameters whose rows are all here

    def _gather_entry(self, name: str) -> tuple:
        """``GatherBucket`` entry of ``name``: rows, master rows, working rows (None if not held)."""
        param = self.params.layout(name)
        w = self.params.working.get(name)
        return (name, param.size, rows(self.params.masters[name], param.shard_dim),
                None if w is None else rows(w.data, param.shard_dim))

    def _master_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of this rank's fp32 master of ``name`` (a view, rows first)."""
        param = self.params.layout(name)
        base = self.params.segment(param)[0]
        return rows(self.params.masters[name], param.shard_dim).narrow(0, lo - base, hi - lo)

    def forget_step(self) -> None:
        """Drop the last step's pulls (their send and receive buffers)."""
        self._pulls, self._missing, self._ready = {}, {}, []
        self.peers.release()
        for bucket in self.gathers:
            bucket.work = bucket.out = None

    @torch.no_grad()
    def post(self, reuse: bool = False) -> None:
        """Post every pull of this rank (all parameters, model order); returns before they complete.
        ``reuse``: the working tensors already hold the all-gathered parameters (prefetched by the
        last step), so those are not pulled."""
        p = self.params
        self._pulls, self._missing = {}, {}
        bucket_of = {}
        for bucket in self.gathers if not reuse else ():
            self.post_gather(bucket)
            bucket_of.update((n, bucket) for n in bucket.names)
        for name in p.order:
            gathered = p.exchange(name).is_all_gather
            pull = _Pull()
            if name in p.aliased or (reuse and gathered):
                pull.done = True
            elif gathered:
                pull.gather = bucket_of[name]
            else:   # the masters stay as they are until the step's pulls finish: copied from at the wait
                pull.held = [((op.lo, op.hi), self._master_rows(name, op.lo, op.hi))
                             for op in self.ops[name] if isinstance(op, LocalCopy)]
                self._missing[name] = len(self._waits_on.get(name, ()))
            self._pulls[name] = pull
        self._ready = [n for n, k in self._missing.items() if k == 0]
        device = next(iter(p.masters.values())).device if p.masters else torch.device("cpu")
        sent, received = self.peers.post(lambda r: self._master_rows(r.name, r.lo, r.hi), p.working_dtype, device,
                                         self.issuer, "pull")
        self.stats.pull_send_bytes += sent
        self.stats.pull_recv_bytes += received

    def post_gather(self, bucket: GatherBucket) -> None:
        """Start one all-gather (also the overlapped update's prefetch of the next step's pull)."""
        bucket.post()
        if self.params.group_size > 1:
            self.stats.pull_all_gather_bytes += (self.params.group_size - 1) * bucket.send_bytes

    def wait(self, name: str) -> None:
        """Wait for parameter ``name``'s pull and write it into the working tensor (once per step)."""
        pull = self._pulls.get(name)
        if pull is None:
            raise HGraphError(f"pull of {name!r} was not posted this step")
        if not pull.done:            # the graph calls this once per use: the common case returns here
            with torch.no_grad():
                self._complete(name, pull)

    def _complete(self, name: str, pull: _Pull) -> None:
        if pull.gather is not None:                    # every rank needs the whole parameter
            pull.done = True
            pull.gather.complete()
            pull.gather = None
            return
        for bucket in self._waits_on.get(name, ()):
            if bucket.work is not None:                # not waited for yet this step
                bucket.wait()
                for n in self._carries[bucket]:
                    self._missing[n] -= 1
                    if self._missing[n] == 0:
                        self._ready.append(n)
        self._assemble()
        assert pull.done, f"pull of {name!r}: its rows did not all arrive"

    def _assemble(self) -> None:
        """Write every parameter whose rows are all here into its working tensor: the rows it received
        and its local rows (cast as they are copied), all in one ``_foreach_copy_`` per source dtype;
        then free the received buffers whose rows were all copied out."""
        ready, self._ready = self._ready, []
        copies: dict[torch.dtype, tuple[list, list]] = {}
        for name in ready:
            pull = self._pulls[name]
            pull.done = True
            if name not in self.params.working:
                continue                               # an owner that only sent
            dest = rows(self.params.working[name].data, self.params.layout(name).shard_dim)
            held = pull.held + [(span, t) for _, span, t in self.peers.held(name)]
            offset = 0
            for (lo, hi), tiles in self._tiles[name]:
                for a, b in tiles:
                    src = lookup(held, a, b, name)
                    dests, srcs = copies.setdefault(src.dtype, ([], []))
                    dests.append(dest.narrow(0, offset + a - lo, b - a))
                    srcs.append(src)
                offset += hi - lo
            pull.held = []
        for dests, srcs in copies.values():
            torch._foreach_copy_(dests, srcs)
        for name in ready:
            self.peers.consumed(name)

    def finish(self) -> None:
        """Complete every pull still in flight (sends, and parameters no forward waited for)."""
        for name in self.params.order:
            self.wait(name)
        self.peers.wait_all()
