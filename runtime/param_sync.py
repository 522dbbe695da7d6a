"""Pull Parameter and Push Gradient on one rank: the LNK plans of a Program run on torch.distributed.

``ParamSync`` is the object behind ``comm.param_sync`` that the rank graphs call
(``graph_ops.pull_issue`` / ``pull_wait`` / ``push_gradient``).

* **Pull** (``begin_step``): every rank walks *all* parameters in model order (``Program.pull_plans``
  order, which is ``list(hgraph.params)``), owners included for parameters they do not use, and posts
  its part of each plan at once: the parameters every rank needs whole (``is_all_gather``) travel in
  all-gathers of up to ``pull_bucket_bytes`` each (``param_gather.GatherBucket``, model order, as DDP
  buckets), the others as one ``batch_isend_irecv`` of the plan's transfers each, the fp32 master rows
  cast to the working dtype; local copies are done on the spot. ``pull_wait(name)`` waits for that
  parameter's work and assembles the received rows into the working tensor (a gathered bucket is
  written out whole at its first wait; idempotent within a step); ``finish_pulls`` completes the
  rest (the sends, and the pulls of a pipeline that ran no micro-batch).
* **Push**: the reduce-scatters among replica groups travel in buckets (``grad_buckets.GradBuckets``,
  reverse model order, up to ``push_bucket_bytes``). On CPU each is issued while the step's last
  backward still runs, as soon as its gradients are final (a post-accumulate-grad hook, armed by
  ``arm_push``), in one global bucket order; ``flush_pushes`` issues the rest. ``push`` then waits
  for them, sends the plan's transfers to the optimizer owners (one batch in model order) and does
  the local adds. Owners get the summed fp32 gradient of their optimizer shard (the reduced rows
  themselves when they are the whole shard). A rank whose pipeline ran no micro-batch pushes zeros,
  so every rank takes part and nothing hangs. ``push_gradient`` (the graph's node) is the identity:
  autograd accumulates the working gradient over micro-batches, and the push sends it once.

Point-to-point messages carry a tag per parameter and direction (pull ``2i+1``, push ``2i+2``;
pipeline activations use tag 0), so gloo matches them by tag; NCCL matches them in order, and every
rank posts them in the same global order. Work is layout "rows first": the shard dimension is moved to
dimension 0, so a range of rows is a ``narrow(0, ...)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.passes.lnk_plans import LocalAdd, LocalCopy, ReduceScatter, Transfer, uncovered_ranges
from hgraph.runtime.grad_buckets import DEFAULT_BUCKET_BYTES, GradBuckets
from hgraph.runtime.optimizer import shard_bounds
from hgraph.runtime.param_gather import GatherBucket

Range = tuple[int, int]

#: Pull all-gathers carry at most this many bytes each (model order): the first parameters arrive
#: early and the forward starts while the later ones are still travelling. Measured with
#: bench_runtime's DP4 step (tiny model, gloo, 16 free cores): 25 MB (one all-gather) 55-57 ms,
#: 1 MB 53-56 ms, 256 KB 42-45 ms, 64 KB 72-76 ms (more collectives than the overlap repays). On 2
#: cores shared by 4 ranks and other work, 200 KB measured slower than one bucket: there the gloo
#: threads compete with the forward for the cores.
DEFAULT_PULL_BUCKET_BYTES = 256 * 1024


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
    push_all_reduce_extra_bytes: int = 0      # gloo runs the reduce-scatters as all-reduces (grad_buckets)


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
                 push_bucket_bytes: int = DEFAULT_BUCKET_BYTES, pull_bucket_bytes: int = DEFAULT_PULL_BUCKET_BYTES,
                 overlap_push: bool = True) -> None:
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
        gathered = [n for n in self.order if program.pull_plans[n].is_all_gather and n not in self.aliased]
        self._gathers = [GatherBucket([self._gather_entry(n) for n in names], rank, self.world_size, working_dtype)
                         for names in self._pull_buckets(gathered, pull_bucket_bytes)]
        row_shapes = {n: tuple(_rows(self.masters[n], program.push_plans[n].param.shard_dim).shape[1:])
                      for n in self.order}
        device = next(iter(masters.values())).device if masters else torch.device("cpu")
        self._buckets = GradBuckets(rank, self.order, self.push_ops, row_shapes, groups, self._contribution,
                                    device, push_bucket_bytes)
        # the step's last backward finishes each gradient: its hook issues the bucket's reduce-scatter
        # then (``arm_push``); NCCL keeps them at the end (all communicators share one stream order,
        # and pipelines of different schemes finish gradients in different orders)
        self._armed = False
        self.overlap_push = overlap_push and device.type == "cpu"
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

    # ---- pull ----------------------------------------------------------------------------------
    def _master_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        plan = self.program.pull_plans[name]
        base = shard_bounds(plan.param.size, self.rank, self.world_size)[0]
        rows = _rows(self.masters[name], plan.param.shard_dim)
        return rows.narrow(0, lo - base, hi - lo).to(self.working_dtype).contiguous()

    @torch.no_grad()
    def begin_step(self) -> None:
        """Post every pull of this rank (all parameters, model order); returns before they complete.

        The all-gather parameters travel in ONE all-gather (each rank's segments of all of them,
        concatenated, each padded to the widest segment), the LNK ones as one batch each.
        """
        if self._active:
            raise HGraphError("ParamSync.begin_step called twice without finishing the step")
        self.stats = SyncStats()
        self._pulls = {}
        self._active = True
        self._armed = False
        self._buckets.reset()
        bucket_of = {}
        for bucket in self._gathers:
            bucket.post()
            bucket_of.update((n, bucket) for n in bucket.names)
            if self.world_size > 1:
                self.stats.pull_all_gather_bytes += (self.world_size - 1) * bucket.send_bytes
        for name in self.order:
            plan = self.program.pull_plans[name]
            pull = _Pull()
            if name in self.aliased:
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
        self._armed = False
        self._buckets.flush(grads)        # 1. reduce-scatters among replicas (mostly issued in backward)
        self._buckets.wait(held)
        self.stats.push_reduce_scatter_bytes += self._buckets.bytes_issued
        self.stats.push_all_reduce_extra_bytes += self._buckets.all_reduce_extra_bytes
        for name, rows in self._own_rows.items():     # own rows that no reduce-scatter carries
            held[name].extend(((lo, hi), self._contribution(name, grads.get(name), lo, hi)) for lo, hi in rows)
        for name in self.order:
            if name in out:
                continue
            add = self._sole_add.get(name)
            if add is not None:
                rows = _lookup(held[name], add.lo, add.hi, name)
                dim = self.program.push_plans[name].param.shard_dim
                out[name] = (rows.reshape(self.masters[name].shape) if self.masters[name].dim() <= 1
                             else rows.movedim(0, dim))
            else:
                out[name] = torch.zeros_like(self.masters[name], dtype=torch.float32)
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
