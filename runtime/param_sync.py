"""Pull Parameter and Push Gradient on one rank: the LNK plans of a Program run on torch.distributed.

``ParamSync`` is the object behind ``comm.param_sync`` that the rank graphs call
(``graph_ops.pull_issue`` / ``pull_wait`` / ``push_gradient``).

* **Pull** (``begin_step``): every rank walks *all* parameters in model order (``Program.pull_plans``
  order, which is ``list(hgraph.params)``), owners included for parameters they do not use, and posts
  its part of each plan at once: the fp32 master rows are cast to the working dtype, then an
  all-gather (``is_all_gather``; all such parameters share ONE all-gather, as DDP buckets) or one
  ``batch_isend_irecv`` of the plan's transfers; local copies are done on the spot. ``pull_wait(name)`` waits for that parameter's work and assembles the
  received rows into the working tensor (idempotent within a step); ``finish_pulls`` completes the
  rest (the sends, and the pulls of a pipeline that ran no micro-batch).
* **Push** (``push``): after the last micro-batch's backward, for every parameter in model order:
  reduce-scatters among replica groups (async; one per group carrying all its parameters), then the plan's transfers to the optimizer owners
  (one batch), then local adds. Owners get the summed fp32 gradient of their optimizer shard. A rank
  whose pipeline ran no micro-batch pushes zeros, so every rank takes part and nothing hangs.
  ``push_gradient`` (the graph's node) is the identity: autograd accumulates the working gradient
  over micro-batches, and the push at the end of the step sends it once. Pushing parameter by
  parameter from inside backward (``eager``) would give each rank its own order of collectives; one
  shared model order is what keeps NCCL (in-order p2p matching) and gloo (tag matching) both safe.

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
from hgraph.passes.lnk_plans import LocalAdd, LocalCopy, ReduceScatter, Transfer
from hgraph.runtime.comm_ops import all_gather_single, reduce_scatter_single
from hgraph.runtime.optimizer import shard_bounds

Range = tuple[int, int]

_all_gather = all_gather_single
_reduce_scatter = reduce_scatter_single


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
    gather: Optional["_GatherBucket"] = None          # the shared all-gather carrying this parameter
    done: bool = False


class _GatherBucket:
    """One all-gather carrying several parameters: ``layout[name] = (offset, width, size, rest, row_el)``
    inside each rank's chunk of ``chunk`` elements."""

    def __init__(self, works: list, out: torch.Tensor, chunk: int, layout: dict) -> None:
        self.works, self.out, self.chunk, self.layout = works, out, chunk, layout

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def rows(self, name: str, world_size: int) -> torch.Tensor:
        """Parameter ``name``'s full rows (rows-first), put together from every rank's segment."""
        offset, width, size, rest, row_el = self.layout[name]
        parts = []
        for r in range(world_size):
            lo, hi = shard_bounds(size, r, world_size)
            start = r * self.chunk + offset
            parts.append(self.out.narrow(0, start, (hi - lo) * row_el).view(hi - lo, *rest))
        return torch.cat(parts, 0) if len(parts) > 1 else parts[0]


class ParamSync:
    """Pull/Push of one rank for one Program.

    ``masters``: this rank's fp32 optimizer shards (name -> tensor, shard dimension as in the
    optimizer, ``[1]`` for a 0-d parameter); ``working``: the working tensors of the parameters this
    rank's graph holds (shard shape, working dtype); ``shards``: their ``ParamShard``; ``groups``: a
    ``GroupCache`` holding every replica group of the push plans (``groups_needed``).
    """

    def __init__(self, program: Any, rank: int, masters: Mapping[str, torch.Tensor],
                 working: Mapping[str, torch.Tensor], shards: Mapping[str, Any], groups: Any,
                 working_dtype: torch.dtype = torch.float32, aliased: frozenset = frozenset()) -> None:
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
        gathered = [n for n in self.order if self.program.pull_plans[n].is_all_gather and n not in self.aliased]
        bucket = self._post_all_gather(gathered) if gathered else None
        for name in self.order:
            plan = self.program.pull_plans[name]
            pull = _Pull()
            if name in self.aliased:
                pull.done = True
            elif plan.is_all_gather:
                pull.gather = bucket
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

    def _post_all_gather(self, names: list[str]) -> "_GatherBucket":
        """One all-gather of this rank's segments of ``names`` (flattened, each padded to its widest)."""
        layout, pieces, offset = {}, [], 0
        for name in names:
            plan = self.program.pull_plans[name]
            size = plan.param.size
            width = -(-size // self.world_size)
            lo, hi = shard_bounds(size, self.rank, self.world_size)
            mine = _rows(self.masters[name], plan.param.shard_dim).to(self.working_dtype)
            rest = tuple(mine.shape[1:])
            row_el = int(torch.Size(rest).numel())
            flat = mine.reshape(-1)
            if hi - lo < width:
                flat = torch.cat([flat, flat.new_zeros((width - (hi - lo)) * row_el)])
            pieces.append(flat)
            layout[name] = (offset, width, size, rest, row_el)
            offset += width * row_el
        inp = torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()
        if self.world_size == 1:                      # one rank: the "gather" is the cast itself
            return _GatherBucket([], inp, offset, layout)
        out = inp.new_empty(offset * self.world_size)
        works = [_all_gather(out, inp, async_op=True)]
        self.stats.pull_all_gather_bytes += (self.world_size - 1) * inp.numel() * inp.element_size()
        return _GatherBucket(works, out, offset, layout)

    def pull_issue(self, name: str) -> None:
        """The graph's issue node: the pulls were posted by ``begin_step``, so only check that."""
        if not self._active:
            raise HGraphError(f"pull of {name!r} outside a training step: call ParamSync.begin_step first")

    @torch.no_grad()
    def pull_wait(self, name: str) -> None:
        """Wait for parameter ``name``'s pull and write it into the working tensor (once per step)."""
        pull = self._pulls.get(name)
        if pull is None:
            raise HGraphError(f"pull of {name!r} was not posted this step")
        if pull.done:
            return
        for work in pull.works:
            work.wait()
        if pull.gather is not None:
            pull.gather.wait()
        pull.done = True
        if name not in self.working:
            return                                     # an owner that only sent
        plan = self.program.pull_plans[name]
        if pull.gather is not None:
            pull.held = [((0, plan.param.size), pull.gather.rows(name, self.world_size))]
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
        out.update({name: torch.zeros_like(self.masters[name], dtype=torch.float32)
                    for name in self.order if name not in out})
        held: dict[str, list] = {name: [] for name in self.order}
        by_group: dict[tuple[int, ...], list] = {}
        for name in self.order:           # 1. reduce-scatters among replicas: one per group, async
            for op in self.push_ops[name]:
                if isinstance(op, ReduceScatter):
                    by_group.setdefault(op.group, []).append((name, op))
        posted = [self._post_reduce_scatter(group, ops, grads, held) for group, ops in sorted(by_group.items())]
        for work, finish in posted:
            work.wait()
            finish()
        for name in self.order:           # own contribution when not reduced with replicas
            if not held[name] and name in self.shards:
                held[name] = [((lo, hi), self._contribution(name, grads.get(name), lo, hi))
                              for lo, hi in self.program.push_plans[name].contributions.get(self.rank, ())
                              if hi > lo]
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
                if isinstance(op, LocalAdd):
                    self._add(out, name, op.lo, op.hi, _lookup(held[name], op.lo, op.hi, name))
        for work in works:
            work.wait()
        for name, lo, hi, buf in recvs:
            if name is not None:
                self._add(out, name, lo, hi, buf)
        return out

    def _post_reduce_scatter(self, group: tuple[int, ...], ops: list, grads: Mapping[str, Any],
                             held: dict) -> tuple[Any, Any]:
        """One reduce-scatter over ``group`` for all its ``(name, op)`` pieces (model order).

        Member i's input chunk is the concatenation, over the ops, of its piece's rows flattened and
        padded to the op's widest piece, so every member's chunk has the same length.
        """
        chunks: list[list[torch.Tensor]] = [[] for _ in group]
        spans = []                          # (name, (plo, phi), offset, rest) of this rank's pieces
        offset = 0
        for name, op in ops:
            grad = grads.get(name)
            width = max(phi - plo for _, plo, phi in op.pieces)
            proto = self._contribution(name, grad, op.lo, op.lo + 1)
            rest, row_el = tuple(proto.shape[1:]), proto.numel()
            for i, (member, plo, phi) in enumerate(op.pieces):
                rows = self._contribution(name, grad, plo, phi).reshape(-1) if phi > plo else proto.new_zeros(0)
                if phi - plo < width:
                    rows = torch.cat([rows, rows.new_zeros((width - (phi - plo)) * row_el)])
                chunks[i].append(rows)
                if member == self.rank:
                    spans.append((name, (plo, phi), offset, rest))
            offset += width * row_el
        inp = torch.cat([t for chunk in chunks for t in chunk])
        out = inp.new_empty(offset)
        self.stats.push_reduce_scatter_bytes += (len(group) - 1) * offset * 4
        work = _reduce_scatter(out, inp, group=self.groups.get(group), async_op=True)

        def finish() -> None:
            for name, (plo, phi), at, rest in spans:
                n = (phi - plo) * int(torch.Size(rest).numel())
                held[name].append(((plo, phi), out.narrow(0, at, n).view(phi - plo, *rest)))

        return work, finish

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
