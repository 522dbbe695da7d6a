"""Pull Parameter and Push Gradient on one rank: the LNK plans of a Program run on torch.distributed.

``ParamSync`` is the object behind ``comm.param_sync`` that the rank graphs call
(``hgraph.ops.pull_issue`` / ``pull_wait`` / ``push_gradient``). The executor runs a step through
the ``SyncStep`` that ``ParamSync.step`` opens (``with sync.step(...) as s:``), which owns the step's
phases and their order (the order of the step's collectives, ``order/derive``): entering posts the
pulls; ``s.backward_starts(loss_share)`` before the last backward; ``s.complete_pulls()`` after it;
``s.finish(grads, all_reduce_loss)`` the push (or the overlapped update) with the loss's all-reduce at
its place; leaving ends the step. It composes three parts over one ``RankParams``
(``runtime/comm/rank_params``):

* **Pull** (``runtime/comm/pull``, ``begin_step``): every rank posts its part of every pull plan at
  once, all parameters in model order; ``pull_wait(name)`` completes one parameter into its working
  tensor, ``finish_pulls`` the rest.
* **Push** (``runtime/comm/push``): the bucketed reduce-scatters among replica groups, issued during
  the step's last backward from the gradient hooks (``arm_push``) and flushed by ``flush_pushes``;
  ``push`` then sends the rows to the optimizer owners and returns this rank's gradient shards
  (under ``--shard-group``: the pulls and pushes stay inside the rank's shard group, and ``push``
  sums the shards across the groups in bucketed all-reduces among the rank's replicas).
  ``push_gradient`` (the graph's node) is the identity: autograd accumulates the working gradient
  over micro-batches, and the push sends it once.
* **Overlapped update** (``runtime/comm/overlapped_update``; ``can_overlap_update``: plain data
  parallelism, an ``update`` callable given, on any backend; the executor asks for it per step with
  ``begin_step(overlap_update=True)``): each reduction updates its optimizer shards when taken
  (``set_loss``, ``finish_update``) instead of ``push`` + an optimizer step, and with ``prefetch``
  the next step's all-gathers are done by the time the step returns.

Point-to-point messages coalesce the transfers between two ranks (``runtime/comm/peer_buckets``) and
carry a tag per bucket and direction (pull ``2k+1``, push ``2k+2``; pipeline activations use tag 0),
so gloo matches them by tag; NCCL matches them in order, and every rank posts them in the same
global order. A stacked expert tensor the Program plans per expert (``Program.pieces``) is pulled and
pushed by piece (``rank_params.ExpertPieces``: views of the graph's tensors), its gradient shards
stacked back for the optimizer.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.program import Program
from hgraph.runtime.comm.grad_buckets import DEFAULT_BUCKET_BYTES
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.overlapped_update import OverlappedUpdate, is_plain_data_parallel
from hgraph.runtime.comm.pull import PullParameter
from hgraph.runtime.comm.push import PushGradient, groups_needed
from hgraph.runtime.comm.rank_params import ExpertPieces, RankParams, SyncStats


class ParamSync:
    """Pull/Push of one rank for one Program.

    ``masters``, ``working``, ``shards``, ``working_dtype``, ``aliased``: see ``RankParams``;
    ``groups``: a ``GroupCache`` holding the rank's replica groups and, under ``--shard-group``, its
    shard group and replicas (``groups_needed(program, rank)``); ``update``: the
    optimizer's step on some shards, for the overlapped update; ``all_to_all``: run the push's
    reduce-scatters as all-to-alls (None: where the group's backend is gloo; False forces
    ``reduce_scatter_tensor``, NCCL's path, on gloo too).
    """

    groups_needed = staticmethod(groups_needed)
    is_plain_data_parallel = staticmethod(is_plain_data_parallel)

    def __init__(self, program: Program, rank: int, masters: Mapping[str, torch.Tensor],
                 working: Mapping[str, torch.Tensor], shards: Mapping[str, Any], groups: Any,
                 working_dtype: torch.dtype = torch.float32, aliased: frozenset = frozenset(), *,
                 push_bucket_bytes: int = DEFAULT_BUCKET_BYTES, pull_bucket_bytes: Optional[int] = None,
                 overlap_push: bool = True, update: Optional[Callable[[dict], Any]] = None,
                 issuer: Optional[CollectiveIssuer] = None, all_to_all: Optional[bool] = None) -> None:
        self.program = program
        self.issuer = issuer or CollectiveIssuer()    # every collective of the pull and push goes through it
        # the stacked expert tensors the Program plans per expert: pulled and pushed as views by piece
        self.pieces = ExpertPieces(program, shards)
        self._working = working                        # by the graph's names (freed and given back whole)
        self.params = RankParams(program, rank, self.pieces.masters(masters), self.pieces.working(working),
                                 self.pieces.shards(), working_dtype, frozenset(aliased))
        self.stats = SyncStats()          # the last step's bytes, counted by the pull and the push
        self._active = False
        device = next(iter(masters.values())).device if masters else torch.device("cpu")
        gloo = self.params.world_size > 1 and dist.get_backend() == "gloo"
        shard_group = self.params.shard_group       # the all-gathers run inside it
        gather_group = groups.get(shard_group) if len(shard_group) < self.params.world_size else None
        self.pulls = PullParameter(self.params, self.stats, pull_bucket_bytes, all_to_all=gloo,
                                   gather_group=gather_group, issuer=self.issuer)
        # the reductions are issued from backward's hooks on every backend: their order is the buckets'
        # global order (``GradBuckets``), not the order the gradients become ready in
        self.pushes = PushGradient(self.params, self.stats, groups, device, push_bucket_bytes,
                                   in_backward=overlap_push,
                                   issuer=self.issuer, all_to_all=all_to_all)
        self._buckets = self.pushes.buckets    # the step's reductions, shared with the update
        # the optimizer update overlapped with the backward: a property of the Program, the same on
        # every rank, since it changes the order of the step's collectives; on any backend (the loss
        # rides in the first reduction: gloo's all-to-all or a reduce-scatter, ``GradBuckets.carry``,
        # or takes an all-reduce of its own), and it needs a reduction to carry the loss
        self.can_overlap_update = (update is not None and self.pushes.in_backward and not program.pieces
                                   and not self.params.aliased and is_plain_data_parallel(program)
                                   and bool(self._buckets.buckets))
        self.overlapped = (OverlappedUpdate(self.params, self.pulls, self.pushes, update)
                           if self.can_overlap_update else None)
        self._overlap = False             # this step runs the overlapped update
        if self.overlapped is not None:
            issued = weakref.WeakMethod(self._bucket_issued)
            self._buckets.after_issue = lambda: _call_alive(issued)
        self.pull_reused = False          # this step's all-gathers were prefetched by the last one
        if self.pushes.in_backward and self._buckets.buckets:
            # the hooks hold this object weakly: a tensor's hooks and the object holding the tensor would
            # form a cycle through torch's C++ side that the garbage collector does not free (a finished
            # run would keep its optimizer, through ``update``, in a process that trains again)
            ready = weakref.WeakMethod(self._grad_ready)
            for name, w in working.items():
                if isinstance(w, torch.Tensor) and w.requires_grad and w.is_leaf and name not in aliased:
                    w.register_post_accumulate_grad_hook(lambda p, n=name: _call_alive(ready, n, p))

    @property
    def updates_in_backward(self) -> int:
        """Reductions taken (shards updated) while this step's backward ran."""
        return 0 if self.overlapped is None else self.overlapped.updates_in_backward

    @property
    def push_started_s(self) -> Optional[float]:
        """When this step's first reduction was issued (``time.perf_counter``; None: none yet)."""
        return self._buckets.first_issue_s

    @property
    def global_loss(self) -> Optional[float]:
        """The step's loss sum carried by the overlapped update's first reduction."""
        return None if self.overlapped is None else self.overlapped.global_loss

    @torch.no_grad()
    def release_working(self) -> None:
        """Free the storage of the working parameters and gradients (another Program runs next);
        ``acquire_working`` gives it back. Views taken of them (the gathers' destinations) stay valid:
        only the storage is resized, as FSDP frees unsharded parameters."""
        if self.overlapped is not None:
            self.overlapped.forget_prefetch()
        # the last step's transfer buffers and the gradients its reductions read (they would keep
        # memory of this Program alive while another one runs)
        self.pulls.forget_step()
        self._buckets.reset()
        for name, w in self._working.items():
            w.grad = None
            if name not in self.params.aliased:
                w.untyped_storage().resize_(0)

    def acquire_working(self) -> None:
        """Re-allocate freed working parameters (zeros: padding rows stay zero; pulls fill the rest)."""
        for name, w in self._working.items():
            if name not in self.params.aliased and w.untyped_storage().nbytes() == 0 and w.numel():
                w.untyped_storage().resize_(w.numel() * w.element_size())
                with torch.no_grad():
                    w.zero_()

    def step(self, overlap_update: bool = False, prefetch: bool = False) -> "SyncStep":
        """The step to run with ``with``: entering posts every pull (``begin_step``), leaving ends it."""
        return SyncStep(self, overlap_update, prefetch)

    def begin_step(self, overlap_update: bool = False, prefetch: bool = False) -> None:
        """Post every pull of this rank (all parameters, model order); returns before they complete.

        The all-gather parameters travel in all-gathers of up to ``pull_bucket_bytes``, the LNK ones
        in messages of up to as many bytes, one per peer and bucket; the all-gathers not at all when
        the last step prefetched them and the masters have not changed since. ``overlap_update``
        (only where ``can_overlap_update``; the same on every rank): this step updates the optimizer
        shards as their reductions arrive (``set_loss``, ``finish_update``) instead of ``push`` + an
        optimizer step; ``prefetch``: and posts the next step's all-gathers as soon as their
        parameters are updated.
        """
        if self._active:
            raise HGraphError("ParamSync.begin_step called twice without finishing the step")
        self.stats.reset()
        self._active = True
        self.pushes.begin_step()
        self.pull_reused = self.overlapped is not None and self.overlapped.take_prefetch()
        self._overlap = overlap_update and self.can_overlap_update
        if self.overlapped is not None:
            self.overlapped.begin_step(prefetch=prefetch and self._overlap)
        self.pulls.post(reuse=self.pull_reused)

    # ---- the graph's nodes ---------------------------------------------------------------------
    def pull_issue(self, name: str) -> None:
        """The graph's issue node: the pulls were posted by ``begin_step``, so only check that."""
        if not self._active:
            raise HGraphError(f"pull of {name!r} outside a training step: call ParamSync.begin_step first")

    def pull_wait(self, name: str) -> None:
        """Wait for parameter ``name``'s pull and write it into the working tensor (once per step; a
        stacked expert tensor pulled by piece: each of its experts this rank holds)."""
        held = self.pieces.held.get(name)
        if held is None:
            self.pulls.wait(name)
            return
        for piece, _ in held:
            self.pulls.wait(piece)

    def push_gradient(self, w: torch.Tensor, name: str, eager: bool) -> torch.Tensor:
        """The graph's push node: identity (the gradient accumulates in ``w.grad``; see ``push``)."""
        return w

    # ---- the step's end ------------------------------------------------------------------------
    def finish_pulls(self) -> None:
        """Complete every pull still in flight (sends, and parameters no forward waited for)."""
        self.pulls.finish()

    def arm_push(self) -> None:
        """The step's last backward starts: from now on a finished gradient issues its bucket."""
        self.pushes.arm()

    def _grad_ready(self, name: str, param: torch.Tensor) -> None:
        held = self.pieces.held.get(name)
        if held is None:
            self.pushes.ready(name, param.grad)
            return
        for piece, grad in self.pieces.working({name: param.grad}).items():
            self.pushes.ready(piece, grad)

    def _bucket_issued(self) -> None:
        """After each reduction is issued (backward's or the flush's): an overlapped update takes the
        reductions up to one behind it, posting the next step's all-gathers they complete."""
        if self._overlap:
            self.overlapped.catch_up()

    def set_loss(self, loss_share: float, extra: Sequence[float] = ()) -> None:
        """This rank's share of the step's loss sum, and of ``extra`` values summed with it, before any
        reduction (overlapped update)."""
        self.overlapped.set_loss(loss_share, extra)

    def finish_update(self, grads: Mapping[str, Optional[torch.Tensor]]) -> float:
        """End an overlapped-update step (``OverlappedUpdate.finish``); returns the step's global loss
        sum. Collective."""
        if not self._overlap:
            raise HGraphError("ParamSync.finish_update: this step was not begun with overlap_update")
        return self.overlapped.finish(self.pieces.working(grads))

    def flush_pushes(self, grads: Mapping[str, Optional[torch.Tensor]]) -> None:
        """Issue every reduce-scatter not issued during backward (before any other collective of the
        step's end, so every rank issues its collectives in the same order)."""
        self.pushes.flush(self.pieces.working(grads))

    def push(self, grads: Mapping[str, Optional[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run every push plan (``PushGradient.complete``); returns this rank's summed fp32 gradient
        shard for every parameter. Collective: every rank calls it once per step."""
        return self.pieces.stacked(self.pushes.complete(self.pieces.working(grads)))

    def end_step(self) -> None:
        """Mark the step finished (every pull must have completed)."""
        self.finish_pulls()
        self._active = False


LossAllReduce = Callable[[], tuple[torch.Tensor, Optional[dist.Work]]]
"""Starts summing the step's loss over the world: its buffer and the work to wait for (None: one rank)."""


@dataclass(frozen=True)
class SyncOutcome:
    """What a step's push left: the loss summed over the world, and this rank's gradient shards for the
    optimizer's step (None: the overlapped update has applied them)."""

    loss_sum: float
    grad_shards: Optional[dict[str, torch.Tensor]]
    extra: tuple[float, ...] = ()      # the values summed with the loss (its all-reduce's after the loss)


class SyncStep:
    """One step of a ``ParamSync`` (``ParamSync.step``), owning its phases in the order every rank's
    collectives must follow: entering posts every pull; ``backward_starts`` before the step's last
    backward (at most once); ``complete_pulls``; ``finish`` once; leaving ends the step (not after an
    error: a failed collective is not waited for again). ``overlap_update``: the step updates the
    shards as their reductions arrive, where the Program can (``ParamSync.can_overlap_update``);
    ``prefetch``: and posts the next step's all-gathers."""

    def __init__(self, sync: ParamSync, overlap_update: bool, prefetch: bool) -> None:
        self._sync, self._overlap_update, self._prefetch = sync, overlap_update, prefetch
        self._loss_set = self._finished = False

    def __enter__(self) -> "SyncStep":
        self._sync.begin_step(overlap_update=self._overlap_update, prefetch=self._prefetch)
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], *_: object) -> None:
        if exc_type is None:
            self._sync.end_step()

    @property
    def overlapped(self) -> bool:
        """This step runs the overlapped update."""
        return self._sync._overlap

    @property
    def pull_prefetched(self) -> bool:
        """This step's all-gathers were done by the last one (``prefetch``)."""
        return self._sync.pull_reused

    @property
    def push_started_s(self) -> Optional[float]:
        """When the step's first reduction was issued (``time.perf_counter``; None: none was)."""
        return self._sync.push_started_s

    def bytes_moved(self) -> dict[str, int]:
        """The step's bytes, by direction and kind (``SyncStats``)."""
        return dict(vars(self._sync.stats))

    def backward_starts(self, loss_share: float, extra: Sequence[float] = ()) -> None:
        """The step's last backward starts, every forward done (``loss_share``: this rank's final share
        of the loss sum; ``extra``: of values summed with it, as many on every rank): an overlapped
        update's loss rides in the first reduction, so it is set before any; from now on a finished
        gradient issues its bucket."""
        if self._loss_set or self._finished:
            raise HGraphError("SyncStep.backward_starts: called twice, or after finish")
        if self.overlapped:
            self._sync.set_loss(loss_share, extra)
        self._loss_set = True
        self._sync.arm_push()

    def complete_pulls(self) -> None:
        """Complete every pull still in flight (sends, and parameters no forward waited for)."""
        self._sync.finish_pulls()

    def finish(self, grads: Mapping[str, Optional[torch.Tensor]], all_reduce_loss: LossAllReduce,
               extra: Sequence[float] = ()) -> SyncOutcome:
        """The step's push (collective): with the overlapped update, the rest of its reductions, the
        loss among them (zero from a rank without micro-batches, whose backward never started, with its
        ``extra`` values), and the shards' updates; otherwise the reduce-scatters backward did not
        issue, then the loss's all-reduce (``all_reduce_loss``: the loss, then any values summed with
        it; in flight during the push), then the transfers to the optimizer owners."""
        if self._finished:
            raise HGraphError("SyncStep.finish called twice")
        self._finished = True
        sync = self._sync
        if self.overlapped:
            if not self._loss_set:
                sync.set_loss(0.0, extra)
            loss = sync.finish_update(grads)         # the shards are updated when it is finite
            return SyncOutcome(loss, None, sync.overlapped.global_extra)
        sync.flush_pushes(grads)         # before the loss's all-reduce: every rank issues them in one order
        value, work = all_reduce_loss()
        shards = sync.push(grads)
        if work is not None:
            work.wait()
        loss, *rest = value.tolist()
        return SyncOutcome(loss, shards, tuple(rest))


def _call_alive(method: weakref.WeakMethod, *args: Any) -> None:
    """``method(*args)`` while its object lives (a gradient hook outliving its ``ParamSync`` does nothing)."""
    bound = method()
    if bound is not None:
        bound(*args)
