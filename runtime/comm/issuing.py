"""Issuing and waiting: the one path every collective and point-to-point operation of a rank's graphs
takes (``runtime/comm/collectives``).

An operation is issued with ``async_op=True`` through the rank's ``CollectiveIssuer`` (``comm.issuer``:
the record, the strict order), on CUDA on the context's dedicated comm stream after that stream waited
for the compute stream; its work is registered under the tensor the issue op returns (``PendingWork``),
and ``comm_wait(comm, t)`` waits for it (the compute stream waiting for the comm stream on CUDA) and
returns the finished tensor. ``Issuing`` is what this needs of a rank's communication context.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.process_groups import GroupCache, group_key


@dataclass
class PendingWork:
    """Work handles of one issued op, the buffers they use and how to finish the issued tensor."""

    works: list
    keep: tuple = ()
    finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    done: bool = False

    def wait(self, comm: "Issuing") -> None:
        if self.done:
            return
        with torch.no_grad():   # a backend may finish a collective by copying into its output (gloo's
            for work in self.works:   # reduce-scatter): not an op of the graph for autograd to record
                work.wait()
        if comm.comm_stream is not None:
            torch.cuda.current_stream().wait_stream(comm.comm_stream)
        self.done = True
        self.keep = ()


@dataclass
class InFlight:
    """The ops a rank issued and has not waited for, shared by its context and every micro-batch view."""

    # id(issued tensor) -> (tensor, PendingWork); holding the tensor keeps its id unique
    pending: dict = field(default_factory=dict)
    detached: list = field(default_factory=list)      # sends issued from backward
    deferred: list = field(default_factory=list)      # activation sends waiting for the next gradient receive


class Issuing(Protocol):
    """What the collectives need of a rank's communication context (``runtime/comm/context.CommContext``):
    who it is, its groups and streams, the issuer every collective goes through, its work in flight."""

    rank: int
    world_size: int
    device: torch.device
    groups: GroupCache
    comm_stream: Optional["torch.cuda.Stream"]
    issuer: CollectiveIssuer
    defer_sends: bool
    in_flight: InFlight

    def register(self, t: torch.Tensor, pending: PendingWork) -> None: ...
    def take(self, t: torch.Tensor) -> Optional[PendingWork]: ...
    def detach_work(self, pending: PendingWork) -> None: ...


#: a dimension's process group through this rank (None where the group is the rank alone)
Group = Optional[dist.ProcessGroup]

# ---- issuing on the comm stream ------------------------------------------------------------------
def comm_stream_scope(comm: Issuing, buffers: Sequence[torch.Tensor]) -> ContextManager[Any]:
    """Where an operation on ``buffers`` is issued: the comm stream on CUDA (after the compute stream)."""
    if comm.comm_stream is None:
        return contextlib.nullcontext()
    comm.comm_stream.wait_stream(torch.cuda.current_stream())
    for b in buffers:  # allocated on the compute stream, used on the comm stream
        b.record_stream(comm.comm_stream)
    return torch.cuda.stream(comm.comm_stream)


def issue(comm: Issuing, buffers: Sequence[torch.Tensor], start: Callable[[], Any], op: tuple,
          finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> PendingWork:
    """Issue through the rank's ``CollectiveIssuer`` (``comm.issuer``): ``op`` is ``(kind, group,
    tensor, label)`` of a collective or ``("p2p", sends, recvs, label)`` of a send or receive."""
    with comm_stream_scope(comm, buffers):
        if op[0] == "p2p":
            work = comm.issuer.p2p(op[1], op[2], start, op[3])
        else:
            work = comm.issuer.issue(op[0], op[1], op[2], start, op[3])
    return PendingWork([work], tuple(buffers), finish)


def run_now(comm: Issuing, buffers: Sequence[torch.Tensor], start: Callable[[], Any], op: tuple) -> None:
    """Issue and wait at once (communication inside backward)."""
    issue(comm, buffers, start, op).wait(comm)


def group_of(comm: Issuing, ranks: Sequence[int]) -> tuple[tuple[int, ...], Group]:
    """The sorted ranks of a dimension's group through this rank (a binding, resolved by the context)
    and its process group (None for one rank)."""
    key = group_key(ranks)
    if comm.rank not in key:
        raise HGraphError(f"comm op over ranks {list(ranks)} called on rank {comm.rank}, which is "
                          "not one of them")
    return key, (comm.groups.get(key) if len(key) > 1 else None)


class Holder:
    """Lets an autograd Function hand its PendingWork to the caller (Function outputs are tensors)."""

    pending: Optional[PendingWork] = None


def comm_wait(comm: Issuing, t: torch.Tensor) -> torch.Tensor:
    """Wait for the op issued for ``t`` and return the finished tensor (``t`` itself if none)."""
    pending = comm.take(t)
    if pending is None:
        return t
    pending.wait(comm)
    return pending.finish(t) if pending.finish is not None else t
