"""Pull Parameter and Push Gradient on one rank: the LNK plans of a Program run on torch.distributed.

``ParamSync`` is the object behind ``comm.param_sync`` that the rank graphs call
(``hgraph.ops.pull_issue`` / ``pull_wait`` / ``push_gradient``).

* **Pull** (``begin_step``): every rank walks *all* parameters in model order (``Program.pull_plans``
  order, which is ``list(hgraph.params)``), owners included for parameters they do not use, and posts
  its part of each plan at once: the parameters every rank needs whole (``is_all_gather``) travel in
  all-gathers of up to ``pull_bucket_bytes`` each (``param_gather.GatherBucket``, model order, as DDP
  buckets; on gloo run as all-to-alls, one bucket by default), the others as one
  ``batch_isend_irecv`` of the plan's transfers each, the fp32 master rows cast to the working
  dtype; local copies are done on the spot. ``pull_wait(name)`` waits for that parameter's work and
  assembles the received rows into the working tensor (a gathered bucket is written out whole at its
  first wait; idempotent within a step); ``finish_pulls`` completes the rest (the sends, and the
  pulls of a pipeline that ran no micro-batch).
* **Push**: the reduce-scatters among replica groups travel in buckets (``grad_buckets.GradBuckets``,
  reverse model order, up to ``push_bucket_bytes``). On CPU each is issued while the step's last
  backward still runs, as soon as its gradients are final (a post-accumulate-grad hook, armed by
  ``arm_push``), in one global bucket order; ``flush_pushes`` issues the rest. ``push`` then waits
  for them, sends the plan's transfers to the optimizer owners (one batch in model order) and does
  the local adds. Owners get the summed fp32 gradient of their optimizer shard (the reduced rows
  themselves when they are the whole shard). A rank whose pipeline ran no micro-batch pushes zeros,
  so every rank takes part and nothing hangs. ``push_gradient`` (the graph's node) is the identity:
  autograd accumulates the working gradient over micro-batches, and the push sends it once.
* **Overlapped update** (``can_overlap_update``: plain data parallelism on gloo, an ``update``
  callable given; the executor asks for it per step with ``begin_step(overlap_update=True)``): a
  rank's reduced piece of a plain reduce-scatter IS its optimizer shard's gradient, so each
  reduction updates its shards when taken (``update``, the optimizer's ``step`` on those shards),
  one reduction behind the newest during backward and the rest in ``finish_update``; no ``push``.
  With ``prefetch`` the all-gathers of the next step are posted as their parameters are updated and
  completed into the working tensors before ``finish_update`` returns; the next ``begin_step`` of
  this Program pulls nothing while the masters are unchanged (their version counters say so: another
  Program's step or a checkpoint load means a fresh pull). The step's loss rides in the first
  reduction (``set_loss``): no shard is updated unless it is finite. Everything happens at points
  that follow from the order of the reductions, so every rank issues the same collectives in the
  same order on one group.

Point-to-point messages carry a tag per parameter and direction (pull ``2i+1``, push ``2i+2``;
pipeline activations use tag 0), so gloo matches them by tag; NCCL matches them in order, and every
rank posts them in the same global order. Work is layout "rows first": the shard dimension is moved to
dimension 0, so a range of rows is a ``narrow(0, ...)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.comm_plan import LocalAdd, LocalCopy, ReduceScatter, Transfer, uncovered_ranges
from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES, GradBuckets
from hgraph.runtime.engine.optimizer import shard_bounds
from hgraph.runtime.comm.param_gather import GatherBucket

Range = tuple[int, int]

#: Pull all-gathers carry at most this many bytes each (model order): the first parameters arrive
#: early and the forward starts while the later ones are still travelling. Measured with
#: bench_runtime's DP4 step (tiny model, gloo all-gathers, 16 free cores): 25 MB (one all-gather)
#: 55-57 ms, 1 MB 53-56 ms, 256 KB 42-45 ms, 64 KB 72-76 ms (more collectives than the overlap
#: repays). Kept where the gathers are real all-gathers (NCCL).
DEFAULT_PULL_BUCKET_BYTES = 256 * 1024

#: On gloo the gathers run as all-to-alls (``param_gather``), each paying gloo's latency, and the
#: same DP4 step is fastest with one (bench_runtime ratio to DDP, 2 cores, alternated single steps:
#: 1.10 with one gather and one reduction, 1.15 with both in 256 KB buckets; with all-reduces the
#: measure was 16 cores 32-35 ms vs 46-47 ms, 2 cores 88-92 ms vs 103-114 ms).
GLOO_PULL_BUCKET_BYTES = DEFAULT_BUCKET_BYTES


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its shard dimension first (a 0-d tensor becomes one row of one element)."""
    return t.reshape(1) if t.dim() == 0 else t.movedim(dim, 0)


@dataclass
class SyncStats:
    """Bytes this rank moved in the last step (point-to-point and collective payloads it received)."""

    pull_recv_bytes: int = 0
    pull_send_bytes: int = 0
    pull_all_gather_bytes: int = 0
    push_recv_bytes: int = 0
    push_send_bytes: int = 0
    push_reduce_scatter_bytes: int = 0


@dataclass
class _Pull:
    """The pull of one parameter in flight: work handles and the row buffers it will assemble from."""

    works: list = field(default_factory=list)
    held: list = field(default_factory=list)         # [((lo, hi), rows-first tensor)]
    gather: Optional[GatherBucket] = None             # the shared all-gather carrying this parameter
    done: bool = False


class ParamSync:
    """Pull/Push of one rank for one Program.

    ``masters``: this rank's fp32 optimizer shards (name -> tensor, shard dimension as in the
    optimizer, ``[1]`` for a 0-d parameter); ``working``: the working tensors of the parameters this
    rank's graph holds (shard shape, working dtype); ``shards``: their ``ParamShard``; ``groups``: a
    ``GroupCache`` holding every replica group of the push plans (``groups_needed``).
    """

    def __init__(self, program: Any, rank: int, masters: Mapping[str, torch.Tensor],
                 working: Mapping[str, torch.Tensor], shards: Mapping[str, Any], groups: Any,
                 working_dtype: torch.dtype = torch.float32, aliased: frozenset = frozenset(), *,
                 push_bucket_bytes: int = DEFAULT_BUCKET_BYTES, pull_bucket_bytes: Optional[int] = None,
                 overlap_push: bool = True, update: Optional[Callable[[dict], Any]] = None) -> None:
        self.program = program
        # working tensors that share their fp32 master's storage (one rank, fp32: nothing to move)
        self.aliased = frozenset(aliased)
        self.rank = rank
        self.world_size = program.cluster.world_size
        self.masters = masters
        self.working = working
        self.shards = shards
        self.groups = groups
        self.working_dtype = working_dtype
        self.order = list(program.pull_plans)
        self.tags = {name: i for i, name in enumerate(self.order)}
        self.pull_ops = {n: program.pull_plans[n].for_rank(rank) for n in self.order}
        self.push_ops = {n: program.push_plans[n].for_rank(rank) for n in self.order}
        self.stats = SyncStats()
        self._pulls: dict[str, _Pull] = {}
        self._active = False
        self._sole_add = self._sole_local_adds()
        self._own_rows = self._unreduced_rows()
        device = next(iter(masters.values())).device if masters else torch.device("cpu")
        # the step's last backward finishes each gradient: its hook issues the bucket's reduce-scatter
        # then (``arm_push``); NCCL keeps them at the end (all communicators share one stream order,
        # and pipelines of different schemes finish gradients in different orders)
        self._armed = False
        self.overlap_push = overlap_push and device.type == "cpu"
        # the optimizer update overlapped with the backward (see the module docstring): a property
        # of the Program, the same on every rank, since it changes the order of the step's
        # collectives; gloo only (the loss rides in the first reduction's all-to-all there)
        gloo = self.world_size > 1 and dist.get_backend() == "gloo"
        self.update = update
        self.can_overlap_update = (update is not None and self.overlap_push and gloo and not self.aliased
                                   and self.is_plain_data_parallel(program))
        if pull_bucket_bytes is None:
            pull_bucket_bytes = GLOO_PULL_BUCKET_BYTES if gloo else DEFAULT_PULL_BUCKET_BYTES
        gathered = [n for n in self.order if program.pull_plans[n].is_all_gather and n not in self.aliased]
        self._gathers = [GatherBucket([self._gather_entry(n) for n in names], rank, self.world_size, working_dtype,
                                      all_to_all=gloo)
                         for names in self._pull_buckets(gathered, pull_bucket_bytes)]
        row_shapes = {n: tuple(_rows(self.masters[n], program.push_plans[n].param.shard_dim).shape[1:])
                      for n in self.order}
        self._buckets = GradBuckets(rank, self.order, self.push_ops, row_shapes, groups, self._contribution,
                                    device, push_bucket_bytes)
        if self.can_overlap_update and not self._buckets.buckets:
            self.can_overlap_update = False           # nothing to carry the loss
        # per step of the overlapped update: reduced pieces, the global loss, what was updated/posted
        self._overlap = self._prefetch = False
        self._held: dict[str, list] = {}
        self.global_loss: Optional[float] = None
        self._updated: set[str] = set()
        self._posted: list[GatherBucket] = []
        self._prefetched: Optional[tuple] = None     # masters' stamp when the working tensors were filled
        self.pull_reused = False          # this step's all-gathers were prefetched by the last one
        self.updates_in_backward = 0      # reductions taken (shards updated) while backward ran
        if self.overlap_push and self._buckets.buckets:
            for name, w in working.items():
                if isinstance(w, torch.Tensor) and w.requires_grad and w.is_leaf and name not in self.aliased:
                    w.register_post_accumulate_grad_hook(lambda p, n=name: self._grad_ready(n, p))

    def _sole_local_adds(self) -> dict[str, LocalAdd]:
        """Parameters whose owned segment is one local add and nothing received: the reduced rows
        themselves are the gradient shard (no zeros + add)."""
        out = {}
        for name in self.order:
            seg = shard_bounds(self.program.push_plans[name].param.size, self.rank, self.world_size)
            adds = [op for op in self.push_ops[name] if isinstance(op, LocalAdd)]
            recvs = [op for op in self.push_ops[name] if isinstance(op, Transfer) and op.dst == self.rank]
            if len(adds) == 1 and not recvs and (adds[0].lo, adds[0].hi) == seg and seg[1] > seg[0]:
                out[name] = adds[0]
        return out

    def _unreduced_rows(self) -> dict[str, list[Range]]:
        """Per parameter, the rows this rank forwards from its own gradient: its contributions that no
        reduce-scatter of its carries (all of them when it has no replica)."""
        out = {}
        for name in self.order:
            reduced = [(op.lo, op.hi) for op in self.push_ops[name] if isinstance(op, ReduceScatter)]
            out[name] = [r for lo, hi in self.program.push_plans[name].contributions.get(self.rank, ())
                         for r in uncovered_ranges(lo, hi, reduced)]
        return out

    def _gather_entry(self, name: str) -> tuple:
        """``GatherBucket`` entry of ``name``: rows, master rows, working rows (None if not held)."""
        param = self.program.pull_plans[name].param
        w = self.working.get(name)
        return (name, param.size, _rows(self.masters[name], param.shard_dim),
                None if w is None else _rows(w.data, param.shard_dim))

    @staticmethod
    def groups_needed(program: Any) -> list[tuple[int, ...]]:
        """Every replica group of the push plans (collective group creation needs the same list everywhere)."""
        return sorted({rs.group for plan in program.push_plans.values() for rs in plan.reduce_scatters
                       if len(rs.group) > 1})

    @staticmethod
    def is_plain_data_parallel(program: Any) -> bool:
        """Every rank needs every parameter whole (all-gather pulls) and every gradient is one plain
        reduce-scatter over all ranks onto the optimizer segments: the reduced piece a rank receives
        IS its optimizer shard's gradient, so it can update it on arrival."""
        return all(program.pull_plans[n].is_all_gather and program.push_plans[n].is_plain_reduce_scatter
                   for n in program.pull_plans)

    def _masters_stamp(self) -> tuple:
        """Identity and version counter of every master: any in-place write (an optimizer step, a
        checkpoint load) changes it, so a prefetched pull is reused only while it is current."""
        return tuple((id(m), m._version) for m in self.masters.values())

    # ---- pull ----------------------------------------------------------------------------------
    def _master_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        plan = self.program.pull_plans[name]
        base = shard_bounds(plan.param.size, self.rank, self.world_size)[0]
        rows = _rows(self.masters[name], plan.param.shard_dim)
        return rows.narrow(0, lo - base, hi - lo).to(self.working_dtype).contiguous()

    @torch.no_grad()
    def begin_step(self, overlap_update: bool = False, prefetch: bool = False) -> None:
        """Post every pull of this rank (all parameters, model order); returns before they complete.

        The all-gather parameters travel in all-gathers of up to ``pull_bucket_bytes``, the LNK ones
        as one batch each; none of it when the last step prefetched them and the masters have not
        changed since. ``overlap_update`` (only where ``can_overlap_update``; the same on every
        rank): this step updates the optimizer shards as their reductions arrive (``set_loss``,
        ``finish_update``) instead of ``push`` + an optimizer step; ``prefetch``: and posts the next
        step's all-gathers as soon as their parameters are updated.
        """
        if self._active:
            raise HGraphError("ParamSync.begin_step called twice without finishing the step")
        self.stats = SyncStats()
        self._pulls = {}
        self._active = True
        self._armed = False
        self._buckets.reset()
        reuse = self._prefetched is not None and self._prefetched == self._masters_stamp()
        self._prefetched = None
        self.pull_reused = reuse
        self.updates_in_backward = 0
        self._overlap = overlap_update and self.can_overlap_update
        self._prefetch = prefetch and self._overlap
        self._held = {name: [] for name in self.order}
        self.global_loss = None
        self._updated, self._posted = set(), []
        bucket_of = {}
        for bucket in self._gathers if not reuse else ():
            self._post_gather(bucket)
            bucket_of.update((n, bucket) for n in bucket.names)
        for name in self.order:
            plan = self.program.pull_plans[name]
            pull = _Pull()
            if name in self.aliased or (reuse and plan.is_all_gather):
                pull.done = True
            elif plan.is_all_gather:
                pull.gather = bucket_of[name]
            else:
                p2p = []
                for op in self.pull_ops[name]:
                    if isinstance(op, LocalCopy):
                        pull.held.append(((op.lo, op.hi), self._master_rows(name, op.lo, op.hi)))
                    elif isinstance(op, Transfer) and op.src == self.rank:
                        buf = self._master_rows(name, op.lo, op.hi)
                        p2p.append(dist.P2POp(dist.isend, buf, op.dst, tag=2 * self.tags[name] + 1))
                        pull.held.append(((-1, -1), buf))     # keeps the send buffer alive
                        self.stats.pull_send_bytes += buf.numel() * buf.element_size()
                    elif isinstance(op, Transfer):
                        rest = _rows(self.masters[name], plan.param.shard_dim).shape[1:]
                        buf = torch.empty((op.hi - op.lo, *rest), dtype=self.working_dtype,
                                          device=self.masters[name].device)
                        p2p.append(dist.P2POp(dist.irecv, buf, op.src, tag=2 * self.tags[name] + 1))
                        pull.held.append(((op.lo, op.hi), buf))
                        self.stats.pull_recv_bytes += buf.numel() * buf.element_size()
                if p2p:
                    pull.works = dist.batch_isend_irecv(p2p)
            self._pulls[name] = pull

    def _post_gather(self, bucket: GatherBucket) -> None:
        bucket.post()
        if self.world_size > 1:
            self.stats.pull_all_gather_bytes += (self.world_size - 1) * bucket.send_bytes

    def _pull_buckets(self, names: list[str], cap: int) -> list[list[str]]:
        """``names`` (model order) cut into all-gathers of at most ``pull_bucket_bytes`` (at least one
        parameter each); every rank cuts the same buckets (widths and dtypes are the same everywhere)."""
        buckets: list[list[str]] = []
        size = 0
        for name in names:
            plan = self.program.pull_plans[name]
            width = -(-plan.param.size // self.world_size)
            nbytes = self.world_size * plan.param.slice_bytes(0, width, plan.working_dtype_bytes)
            if not buckets or size + nbytes > cap:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += nbytes
        return buckets

    def pull_issue(self, name: str) -> None:
        """The graph's issue node: the pulls were posted by ``begin_step``, so only check that."""
        if not self._active:
            raise HGraphError(f"pull of {name!r} outside a training step: call ParamSync.begin_step first")

    def pull_wait(self, name: str) -> None:
        """Wait for parameter ``name``'s pull and write it into the working tensor (once per step)."""
        pull = self._pulls.get(name)
        if pull is None:
            raise HGraphError(f"pull of {name!r} was not posted this step")
        if not pull.done:            # the graph calls this once per use: the common case returns here
            with torch.no_grad():
                self._complete_pull(name, pull)

    def _complete_pull(self, name: str, pull: "_Pull") -> None:
        for work in pull.works:
            work.wait()
        pull.done = True
        if pull.gather is not None:                    # every rank needs the whole parameter
            pull.gather.complete()
            pull.gather = None
            return
        if name not in self.working:
            return                                     # an owner that only sent
        plan = self.program.pull_plans[name]
        dest = _rows(self.working[name].data, plan.param.shard_dim)
        offset = 0
        for (lo, hi), tiles in zip(plan.needs[self.rank], plan.assembly[self.rank]):
            for a, b in tiles:
                src = _lookup(pull.held, a, b, name)
                dest.narrow(0, offset + a - lo, b - a).copy_(src)
            offset += hi - lo
        pull.held = []
        pull.gather = None

    def finish_pulls(self) -> None:
        """Complete every pull still in flight (sends, and parameters no forward waited for)."""
        for name in self.order:
            self.pull_wait(name)

    # ---- push ----------------------------------------------------------------------------------
    def push_gradient(self, w: torch.Tensor, name: str, eager: bool) -> torch.Tensor:
        """The graph's push node: identity (the gradient accumulates in ``w.grad``; see ``push``)."""
        return w

    def _contribution(self, name: str, grad: Optional[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` (full-parameter coordinates) of this rank's fp32 gradient (zeros if none)."""
        shard = self.shards[name]
        dim = self.program.push_plans[name].param.shard_dim
        offset = 0
        for a, b in shard.ranges:
            if a <= lo and hi <= b:
                if grad is None:
                    shape = list(_rows(self.working[name], dim).shape)
                    shape[0] = hi - lo
                    return torch.zeros(shape, dtype=torch.float32, device=self.masters[name].device)
                return _rows(grad, dim).narrow(0, offset + lo - a, hi - lo).float()
            offset += b - a
        raise AssertionError(f"rank {self.rank} pushes rows [{lo}, {hi}) of {name!r} that it does not hold")

    def arm_push(self) -> None:
        """The step's last backward starts: from now on a finished gradient issues its bucket."""
        self._armed = self.overlap_push

    def _grad_ready(self, name: str, param: torch.Tensor) -> None:
        if self._armed:
            self._buckets.ready(name, param.grad)
            # overlapped update: one reduction behind the newest (it had that bucket's gradients'
            # time to arrive); blocking and in issue order, so all ranks post the same collectives
            while self._overlap and self._buckets.completed < self._buckets.issued - 1:
                self._update_next()
                self.updates_in_backward += 1

    # ---- the optimizer update overlapped with the backward -------------------------------------
    def set_loss(self, loss_share: float) -> None:
        """This rank's share of the step's loss sum, before any reduction of the step is issued: it
        rides in the first reduction (each rank's value in its own slot, as an fp32 pair hi + lo, so
        the sum is taken in float64 in rank order, the same on every rank)."""
        hi = torch.tensor(loss_share, dtype=torch.float64).to(torch.float32)
        lo = (torch.tensor(loss_share, dtype=torch.float64) - hi.double()).float() if hi.isfinite() else 0.0
        slots = torch.zeros(2 * self.world_size, dtype=torch.float32)
        slots[2 * self.rank], slots[2 * self.rank + 1] = hi, lo
        self._buckets.carry(slots)        # copied into the reduction's buffer, on its device

    def _update_next(self) -> None:
        """Wait for the next reduction (issue order); update its parameters' shards unless the loss is
        not finite, then post every all-gather whose parameters are all updated. Everything happens at
        points that follow from the order of the reductions, so every rank issues the same sequence of
        collectives."""
        names = self._buckets.complete_next(self._held)
        if names is None:
            return
        if self.global_loss is None:
            if self._buckets.carried is None:
                raise HGraphError("overlapped update: the step's loss was not set before its reductions")
            self.global_loss = float(self._buckets.carried.double().view(-1, 2).sum(1).sum())
        if not math.isfinite(self.global_loss):
            return
        self.update({name: self._owned_gradient(name, self._held) for name in names})
        self._updated.update(names)
        if self._prefetch:
            for bucket in reversed(self._gathers):      # reverse model order: as backward finishes
                if bucket not in self._posted and self._updated.issuperset(bucket.names):
                    self._post_gather(bucket)
                    self._posted.append(bucket)

    @torch.no_grad()
    def finish_update(self, grads: Mapping[str, Optional[torch.Tensor]]) -> float:
        """End an overlapped-update step: issue the reductions backward did not, update every shard
        (unless the loss is not finite), then complete the prefetched all-gathers into the working
        tensors. Returns the step's global loss sum. Collective."""
        if not self._overlap:
            raise HGraphError("ParamSync.finish_update: this step was not begun with overlap_update")
        self.flush_pushes(grads)
        while self._buckets.completed < self._buckets.issued:
            self._update_next()
        self.stats.push_reduce_scatter_bytes += self._buckets.bytes_issued
        for bucket in self._posted:
            bucket.complete()
        if self._prefetch and len(self._posted) == len(self._gathers) and math.isfinite(self.global_loss):
            self._prefetched = self._masters_stamp()
        self._held, self._posted = {}, []
        return self.global_loss

    def _owned_gradient(self, name: str, held: Mapping[str, list]) -> torch.Tensor:
        """The fp32 gradient of this rank's optimizer shard of ``name`` when it is exactly the reduced
        rows it holds (a plain reduce-scatter; an empty shard gets an empty gradient)."""
        add = self._sole_add.get(name)
        if add is None:
            return torch.zeros_like(self.masters[name], dtype=torch.float32)
        rows = _lookup(held[name], add.lo, add.hi, name)
        dim = self.program.push_plans[name].param.shard_dim
        return rows.reshape(self.masters[name].shape) if self.masters[name].dim() <= 1 else rows.movedim(0, dim)

    def flush_pushes(self, grads: Mapping[str, Optional[torch.Tensor]]) -> None:
        """Issue every reduce-scatter not issued during backward (before any other collective of the
        step's end, so every rank issues its collectives in the same order)."""
        self._armed = False
        self._buckets.flush(grads)

    @torch.no_grad()
    def push(self, grads: Mapping[str, Optional[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run every push plan; returns this rank's summed fp32 gradient shard for every parameter.

        ``grads[name]``: the working gradient of a parameter this rank holds (``None``: no
        micro-batch ran, pushed as zeros). Collective: every rank calls it once per step.
        """
        if self.aliased:                  # one rank: the working gradient is the owner's gradient
            out = {n: grads[n].float().reshape(self.masters[n].shape) if grads.get(n) is not None
                   else torch.zeros_like(self.masters[n]) for n in self.order if n in self.aliased}
            if len(out) == len(self.order):
                return out
        else:
            out = {}
        held: dict[str, list] = {name: [] for name in self.order}
        self.flush_pushes(grads)          # 1. reduce-scatters among replicas (mostly issued in backward)
        self._buckets.wait(held)
        self.stats.push_reduce_scatter_bytes += self._buckets.bytes_issued
        for name, rows in self._own_rows.items():     # own rows that no reduce-scatter carries
            held[name].extend(((lo, hi), self._contribution(name, grads.get(name), lo, hi)) for lo, hi in rows)
        for name in self.order:
            if name not in out:
                out[name] = self._owned_gradient(name, held)
        p2p, recvs = [], []
        for name in self.order:           # 2. transfers to the owners, one batch in model order
            dim = self.program.push_plans[name].param.shard_dim
            tag = 2 * self.tags[name] + 2
            for op in self.push_ops[name]:
                if not isinstance(op, Transfer):
                    continue
                if op.src == self.rank:
                    buf = _lookup([(r, t) for r, t in held[name]], op.lo, op.hi, name).contiguous()
                    p2p.append(dist.P2POp(dist.isend, buf, op.dst, tag=tag))
                    recvs.append((None, None, None, buf))
                    self.stats.push_send_bytes += buf.numel() * 4
                else:
                    rest = _rows(out[name], dim).shape[1:]
                    buf = torch.empty((op.hi - op.lo, *rest), dtype=torch.float32, device=out[name].device)
                    p2p.append(dist.P2POp(dist.irecv, buf, op.src, tag=tag))
                    recvs.append((name, op.lo, op.hi, buf))
                    self.stats.push_recv_bytes += buf.numel() * 4
        works = dist.batch_isend_irecv(p2p) if p2p else []
        for name in self.order:           # 3. local adds (overlap with the transfers)
            for op in self.push_ops[name]:
                if isinstance(op, LocalAdd) and name not in self._sole_add:
                    self._add(out, name, op.lo, op.hi, _lookup(held[name], op.lo, op.hi, name))
        for work in works:
            work.wait()
        for name, lo, hi, buf in recvs:
            if name is not None:
                self._add(out, name, lo, hi, buf)
        return out

    def _add(self, out: dict, name: str, lo: int, hi: int, rows: torch.Tensor) -> None:
        plan = self.program.push_plans[name]
        base = shard_bounds(plan.param.size, self.rank, self.world_size)[0]
        _rows(out[name], plan.param.shard_dim).narrow(0, lo - base, hi - lo).add_(rows)

    def end_step(self) -> None:
        """Mark the step finished (every pull must have completed)."""
        self.finish_pulls()
        self._active = False


def _lookup(held: Sequence[tuple[Range, torch.Tensor]], lo: int, hi: int, name: str) -> torch.Tensor:
    """Rows ``[lo, hi)`` from the one held buffer that contains them."""
    for (a, b), t in held:
        if a <= lo and hi <= b:
            return t.narrow(0, lo - a, hi - lo)
    raise AssertionError(f"{name}: rows [{lo}, {hi}) are in no buffer this rank holds")
