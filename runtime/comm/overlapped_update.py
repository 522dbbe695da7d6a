"""The optimizer update overlapped with the backward, for plain data parallelism on one rank.

Where every rank needs every parameter whole (all-gather pulls) and every gradient is one plain
reduce-scatter over all ranks onto the optimizer segments (``is_plain_data_parallel``), a rank's
reduced piece IS its optimizer shard's gradient. So each reduction updates its shards when taken
(``update``, the optimizer's ``step`` on those shards): one reduction behind the newest after each
reduction is issued (``catch_up``, from ``GradBuckets.after_issue``: in backward, or in ``finish``'s
flush on a rank that ran no micro-batch, at the same points of the bucket order) and the rest in
``finish``; no push to owners.

With ``prefetch`` the all-gathers of the next step are posted as their parameters are updated and
completed into the working tensors before ``finish`` returns; the next step of this Program pulls
nothing while the masters are unchanged (``take_prefetch``: their version counters say so; another
Program's step or a checkpoint load means a fresh pull). The step's loss rides in the first
reduction (``set_loss``): no shard is updated unless it is finite. Riding costs every chunk a slot
pair per rank, ``8 N^2`` bytes over N ranks (8 KB at 32 ranks, 1.2 GB at 12,288), so past
``CARRY_MAX_BYTES`` the loss takes one float64 all-reduce of its own instead, issued before the
first reduction and waited at the first update. Everything happens at points that
follow from the order of the reductions, so every rank issues the same collectives in the same order
on one group.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.program import Program
from hgraph.runtime.comm.param_gather import GatherBucket
from hgraph.runtime.comm.pull import PullParameter
from hgraph.runtime.comm.push import PushGradient
from hgraph.runtime.comm.rank_params import RankParams

#: the most bytes the loss's slots may add to the first reduction (``8 * members * world size``)
CARRY_MAX_BYTES = 64 * 1024


def is_plain_data_parallel(program: Program) -> bool:
    """Every rank needs every parameter whole (all-gather pulls) and every gradient is one plain
    reduce-scatter over all ranks onto the optimizer segments: the reduced piece a rank receives
    IS its optimizer shard's gradient, so it can update it on arrival (not with shard groups: the
    shards are summed across the groups after the reductions). Read from ``Program.exchange``: no plan
    of the world is made."""
    return program.cluster.shard_group is None and all(
        (ex := program.exchange(n)).is_all_gather and ex.is_plain_reduce_scatter for n in program.param_names)


class OverlappedUpdate:
    """The overlapped update of one rank for one plain data-parallel Program (see the module
    docstring); ``pull`` and ``push`` are the rank's, ``update`` takes ``{name: gradient shard}``."""

    def __init__(self, params: RankParams, pull: PullParameter, push: PushGradient,
                 update: Callable[[dict], Any]) -> None:
        self.params, self.pull, self.push, self.update = params, pull, push, update
        # per step: reduced pieces, the global loss, what was updated/posted
        self._prefetch = False
        self._held: dict[str, list] = {}
        self.global_loss: Optional[float] = None
        self._updated: set[str] = set()
        self._posted: list[GatherBucket] = []
        self._prefetched: Optional[tuple] = None     # masters' stamp when the working tensors were filled
        self.updates_in_backward = 0      # reductions taken (shards updated) while backward ran
        self._flushing = False
        # the loss rides in the first reduction (every rank of the world is in it) while its slots are
        # small; else it has an all-reduce of its own (``_loss``, ``_loss_work``)
        first = push.buckets.buckets[0].group if push.buckets.buckets else ()
        self._slot_pairs = len(first) * params.world_size       # a value's slot pairs: 8 bytes each
        self.carry_loss = 8 * self._slot_pairs <= CARRY_MAX_BYTES
        self.global_extra: tuple[float, ...] = ()     # the values summed beside the loss (``set_loss``)
        self._loss: Optional[torch.Tensor] = None
        self._loss_work: Any = None

    def _masters_stamp(self) -> tuple:
        """Identity and version counter of every master: any in-place write (an optimizer step, a
        checkpoint load) changes it, so a prefetched pull is reused only while it is current."""
        return tuple((id(m), m._version) for m in self.params.masters.values())

    def take_prefetch(self) -> bool:
        """Whether the last step's prefetch still holds the current parameters (then the step pulls
        no all-gather); a prefetch serves one step only."""
        reuse = self._prefetched is not None and self._prefetched == self._masters_stamp()
        self._prefetched = None
        return reuse

    def forget_prefetch(self) -> None:
        """The working tensors a prefetch filled are being freed: the next step pulls again."""
        self._prefetched = None

    def begin_step(self, prefetch: bool) -> None:
        """Forget the last step; ``prefetch``: post the next step's all-gathers as parameters update."""
        self.updates_in_backward = 0
        self._prefetch = prefetch
        self._held = {name: [] for name in self.params.order}
        self.global_loss = None
        self.global_extra = ()
        self._loss = self._loss_work = None
        self._updated, self._posted = set(), []

    def set_loss(self, loss_share: float, extra: Sequence[float] = ()) -> None:
        """This rank's share of the step's loss sum (and of ``extra`` values summed alike, the same count
        on every rank: the MoE router losses), before any reduction of the step is issued: they ride in
        the first reduction (each rank's values in its own slots, each as an fp32 pair hi + lo, so each
        sum is taken in float64 in rank order, the same on every rank), or, past ``CARRY_MAX_BYTES``
        (``carry_loss`` False), are summed in one float64 all-reduce issued now."""
        values = (loss_share, *extra)
        if not self.carry_loss or 8 * len(values) * self._slot_pairs > CARRY_MAX_BYTES:
            device = next(iter(self.params.masters.values())).device
            self._loss = torch.tensor(values, dtype=torch.float64, device=device)
            loss = self._loss
            self._loss_work = self.push.issuer.issue("all_reduce", None, loss, lambda: dist.all_reduce(
                loss, async_op=True), "loss")
            return
        rank, world_size, k = self.params.rank, self.params.world_size, len(values)
        slots = torch.zeros(2 * k * world_size, dtype=torch.float32)
        for j, value in enumerate(values):
            hi = torch.tensor(value, dtype=torch.float64).to(torch.float32)
            lo = (torch.tensor(value, dtype=torch.float64) - hi.double()).float() if hi.isfinite() else 0.0
            slots[2 * (rank * k + j)], slots[2 * (rank * k + j) + 1] = hi, lo
        self.push.buckets.carry(slots)    # copied into the reduction's buffer, on its device

    def catch_up(self) -> None:
        """After a reduction was issued: take reductions up to one behind the newest (it had that
        bucket's gradients' time to arrive); blocking and in issue order, so all ranks post the same
        collectives at the same points of the bucket order."""
        buckets = self.push.buckets
        while buckets.completed < buckets.issued - 1:
            self._update_next()
            if not self._flushing:
                self.updates_in_backward += 1

    def _update_next(self) -> None:
        """Wait for the next reduction (issue order); update its parameters' shards unless the loss is
        not finite, then post every all-gather whose parameters are all updated. Everything happens at
        points that follow from the order of the reductions, so every rank issues the same sequence of
        collectives."""
        buckets = self.push.buckets
        names = buckets.complete_next(self._held)
        if names is None:
            return
        if self.global_loss is None:
            if self._loss_work is not None:
                self._loss_work.wait()
                self.global_loss, *extra = self._loss.tolist()
                self.global_extra = tuple(extra)
            elif buckets.carried is None:
                raise HGraphError("overlapped update: the step's loss was not set before its reductions")
            else:       # per value: its pairs' sums, then the ranks' sum in rank order
                pairs = buckets.carried.double().view(self.params.world_size, -1, 2).sum(2)
                sums = [float(pairs[:, j].contiguous().sum()) for j in range(pairs.shape[1])]
                self.global_loss, self.global_extra = sums[0], tuple(sums[1:])
        if not math.isfinite(self.global_loss):
            return
        self.update({name: self.push.owned_gradient(name, self._held) for name in names})
        self._updated.update(names)
        if self._prefetch:
            for bucket in reversed(self.pull.gathers):  # reverse model order: as backward finishes
                if bucket not in self._posted and self._updated.issuperset(bucket.names):
                    self.pull.post_gather(bucket)
                    self._posted.append(bucket)

    @torch.no_grad()
    def finish(self, grads: Mapping[str, Optional[torch.Tensor]]) -> float:
        """End the step: issue the reductions backward did not, update every shard (unless the loss
        is not finite), then complete the prefetched all-gathers into the working tensors. Returns
        the step's global loss sum. Collective."""
        buckets = self.push.buckets
        self._flushing = True             # what the flush's buckets take is not taken in backward
        try:
            self.push.flush(grads)
        finally:
            self._flushing = False
        while buckets.completed < buckets.issued:
            self._update_next()
        self.push.count_reductions()
        for bucket in self._posted:
            bucket.complete()
        if (self._prefetch and len(self._posted) == len(self.pull.gathers)
                and math.isfinite(self.global_loss)):
            self._prefetched = self._masters_stamp()
        self._held, self._posted = {}, []
        return self.global_loss
