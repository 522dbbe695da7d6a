"""Point-to-point transfers of many parameters coalesced: one message per peer and bucket.

Pull Parameter and Push Gradient move rows of many parameters between the same two ranks. A message
per transfer cost a send, a receive and a wait each: gloo pays its latency per message and NCCL a
launch per operation, and a 22-layer model has ~200 parameters (its ``1xTP2PP1+2xTP1PP1`` step on
4 gloo ranks, 2 cores, width 64: 556-606 ms coalesced against 687-729 ms before). Here the small
transfers between this rank and one peer, in model order, are coalesced into buckets of up to
``cap_bytes``; such a bucket is one message of one flat buffer, filled by one cast-and-copy
(``torch._foreach_copy_``). A transfer of ``ALONE_BYTES`` or more is bandwidth-bound: it travels
alone, sent from the source itself where that is contiguous and of the message's dtype, so sending
copies no more memory than a message per transfer did. Sender and receiver cut the same buckets:
both walk the same transfers (each rank's ops hold every transfer between it and its peer, as the
world's plan does) in model order, with the same shapes.

Bucket ``k`` of every peer is posted in round ``k`` (one ``batch_isend_irecv``), so the rows of the
first parameters arrive first and the forward can start while the rest travel; its tag is
``2k + parity`` (the pull's odd, the push's even, pipeline activations 0), and NCCL, which ignores
tags, matches a pair's messages in the order both sides post them, which is the bucket order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import torch

from hgraph.comm_plan import Transfer
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.p2p import PeerOp, batch_isend_irecv, host_staged

#: A transfer at least this large is its own message. Below it gloo's per-message latency (tens of us
#: on one host) outweighs the time to move the bytes; above it a coalesced copy would cost memory.
ALONE_BYTES = 64 * 1024

T = TypeVar("T")


@dataclass(frozen=True)
class Rows:
    """Rows ``[lo, hi)`` (full-parameter coordinates) of parameter ``name``, rows-first ``shape``."""

    name: str
    lo: int
    hi: int
    shape: tuple[int, ...]

    numel: int = field(init=False, compare=False, repr=False)     # elements (a rank holds many: kept)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", math.prod(self.shape))


def plan_transfers(ops_by_param: Iterable[tuple[Any, Iterable[Any]]]) -> list[tuple[Rows, int, int]]:
    """The transfers among a rank's ops (``(ParamLayout, that rank's pull or push ops of it)`` pairs,
    model order) as ``(rows, src, dst)``, ordered by rows within a parameter."""
    out = []
    for param, rank_ops in ops_by_param:
        ops = sorted((op for op in rank_ops if isinstance(op, Transfer)), key=lambda op: (op.lo, op.hi))
        name, rest = param.name, param.row_shape
        out += [(Rows(name, op.lo, op.hi, (op.hi - op.lo, *rest)), op.src, op.dst) for op in ops]
    return out


def transfer_sizes(ops_by_param: Iterable[tuple[Any, Iterable[Any]]]) -> list[tuple[int, int, int]]:
    """``plan_transfers`` as ``(elements, src, dst)``, in its order, without a ``Rows`` each."""
    out = []
    for param, rank_ops in ops_by_param:
        row = math.prod(param.row_shape)
        ops = sorted((op for op in rank_ops if isinstance(op, Transfer)), key=lambda op: (op.lo, op.hi))
        out += [((op.hi - op.lo) * row, op.src, op.dst) for op in ops]
    return out


def cut_messages(rank: int, sizes: Iterable[tuple[int, int, int]], element_size: int,
                 cap_bytes: Optional[int]) -> Iterator[tuple[tuple[int, bool], int, bool]]:
    """Per transfer ``(elements, src, dst)`` of ``rank`` (model order): ``((peer, send), k, alone)``, its
    message is bucket ``k`` of that peer and direction. A transfer of ``ALONE_BYTES`` or more travels
    alone; smaller ones join the last bucket until it would pass ``cap_bytes`` (``None``: no limit)."""
    count: dict[tuple[int, bool], int] = {}
    open_elements: dict[tuple[int, bool], Optional[int]] = {}     # the last bucket's, None: alone or none
    for elements, src, dst in sizes:
        send = src == rank
        key = (dst if send else src, send)
        nbytes = elements * element_size
        alone = nbytes >= ALONE_BYTES
        last = open_elements.get(key)
        if alone or last is None or (cap_bytes is not None and last * element_size + nbytes > cap_bytes):
            count[key] = count.get(key, 0) + 1
            last = None if alone else 0
        open_elements[key] = None if alone else last + elements
        yield key, count[key] - 1, alone


def rounds_of(ordered: Sequence[Sequence[T]], sends_something: Callable[[T], bool]) -> list[list[T]]:
    """Round ``k``: bucket ``k`` of every peer and direction (``ordered`` by peer and direction, so
    every rank posts in one order); a bucket of empty transfers sends nothing."""
    n_rounds = max((len(b) for b in ordered), default=0)
    return [[bs[k] for bs in ordered if k < len(bs) and sends_something(bs[k])] for k in range(n_rounds)]


def message_rounds(rank: int, sizes: Iterable[tuple[int, int, int]], element_size: int,
                   cap_bytes: Optional[int]) -> list[list[tuple[int, bool]]]:
    """The rounds ``PeerTransfers`` posts for these transfers (``cut_messages``), each a list of
    ``(peer, send)``, without building its buckets: what a rank's collective order needs."""
    sizes = list(sizes)
    elements: dict[tuple[int, bool], list[int]] = {}      # per peer and direction: each bucket's
    for (key, index, _), (n, _, _) in zip(cut_messages(rank, sizes, element_size, cap_bytes), sizes):
        buckets = elements.setdefault(key, [])
        if index == len(buckets):
            buckets.append(0)
        buckets[-1] += n
    ordered = [[(key, n) for n in buckets] for key, buckets in sorted(elements.items())]
    return [[key for key, _ in round_] for round_ in rounds_of(ordered, lambda bucket: bucket[1] > 0)]


class PeerBucket:
    """One message: consecutive transfers (model order) between this rank and ``peer``."""

    def __init__(self, peer: int, send: bool, tag: int, alone: bool = False) -> None:
        self.peer, self.send, self.tag = peer, send, tag
        self.alone = alone                            # one large transfer (nothing joins it)
        self.rows: list[Rows] = []
        self.numel = 0
        self.flat: Optional[torch.Tensor] = None      # this step's buffer
        self.views: list[torch.Tensor] = []           # one per ``rows``, into ``flat``
        self.work: Any = None
        self.unread = 0                               # rows not yet copied out of a received buffer

    def add(self, r: Rows) -> None:
        self.rows.append(r)
        self.numel += r.numel

    def allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        self.flat = torch.empty(self.numel, dtype=dtype, device=device)
        self.views = [v.view(r.shape) for v, r in zip(self.flat.split([r.numel for r in self.rows]), self.rows)]
        self.unread = len(self.rows)

    def wait(self) -> None:
        """Wait for the message (idempotent within a step)."""
        if self.work is not None:
            self.work.wait()
            self.work = None


class PeerTransfers:
    """The coalesced point-to-point transfers of one rank for one Program.

    ``transfers``: ``(rows, src, dst)`` of every transfer this rank sends or receives, in model order
    (within a parameter, ordered by rows); ``cap_bytes``: the most bytes a bucket of small transfers
    carries (``None``: no limit); ``parity``: 1 for the pull's tags, 2 for the push's.
    """

    def __init__(self, rank: int, transfers: Iterable[tuple[Rows, int, int]], element_size: int,
                 cap_bytes: Optional[int], parity: int) -> None:
        transfers = list(transfers)
        per_peer: dict[tuple[int, bool], list[PeerBucket]] = {}
        cuts = cut_messages(rank, ((r.numel, src, dst) for r, src, dst in transfers), element_size, cap_bytes)
        for (r, _, _), ((peer, send), index, alone) in zip(transfers, cuts):
            buckets = per_peer.setdefault((peer, send), [])
            if index == len(buckets):
                buckets.append(PeerBucket(peer, send, 2 * index + parity, alone))
            buckets[-1].add(r)
        ordered = [bs for _, bs in sorted(per_peer.items())]
        self._buckets = [b for bs in ordered for b in bs]
        self.rounds = rounds_of(ordered, lambda b: b.numel > 0)
        self.received: dict[str, list[tuple[PeerBucket, int]]] = {}    # name -> (bucket, index in it)
        for bucket in self.buckets():
            if not bucket.send:
                for i, r in enumerate(bucket.rows):
                    self.received.setdefault(r.name, []).append((bucket, i))

    def buckets(self) -> Iterable[PeerBucket]:
        """Every bucket, by peer and direction."""
        return iter(self._buckets)

    def post(self, source: Callable[[Rows], torch.Tensor], dtype: torch.dtype, device: torch.device,
             issuer: Any = None, label: str = "") -> tuple[int, int]:
        """Fill every send buffer from ``source(rows)`` (one cast-and-copy for all) and post every
        bucket, round by round, each round one ``batch_isend_irecv`` through ``issuer`` (the rank's
        ``CollectiveIssuer``; labelled ``LABEL round K``); returns the bytes (sent, received)."""
        dests, srcs = [], []
        sent = received = 0
        for bucket in self.buckets():
            src = source(bucket.rows[0]) if bucket.send and bucket.alone else None
            if src is not None and src.dtype == dtype and src.is_contiguous():
                bucket.flat, bucket.views = src, [src]         # sent as it is: no copy
                sent += src.numel() * src.element_size()
                continue
            bucket.allocate(dtype, device)
            nbytes = bucket.numel * bucket.flat.element_size()
            if bucket.send:
                dests += bucket.views
                srcs += [src] if src is not None else [source(r) for r in bucket.rows]
                sent += nbytes
            else:
                received += nbytes
        if dests:
            torch._foreach_copy_(dests, srcs)
        stage = bool(self.rounds) and host_staged(device)
        issuer = issuer or CollectiveIssuer()
        for k, round_ in enumerate(self.rounds):
            ops = [PeerOp(b.send, b.flat, b.peer, b.tag) for b in round_]
            works = issuer.p2p([b.peer for b in round_ if b.send], [b.peer for b in round_ if not b.send],
                               lambda: batch_isend_irecv(ops, stage=stage), f"{label} round {k}".strip())
            for bucket, work in zip(round_, works):
                bucket.work = work
        return sent, received

    def held(self, name: str) -> list[tuple[int, tuple[int, int], torch.Tensor]]:
        """The received rows of ``name`` as ``(peer, (lo, hi), rows)``, after waiting for their messages
        (several peers may send the same rows: the push's contributions to one owner)."""
        out = []
        for bucket, i in self.received.get(name, ()):
            bucket.wait()
            r = bucket.rows[i]
            out.append((bucket.peer, (r.lo, r.hi), bucket.views[i]))
        return out

    def consumed(self, name: str) -> None:
        """``name``'s received rows were copied out: a buffer whose rows all were is freed (the pull's
        buffers would otherwise hold a copy of the received parameters for the rest of the step)."""
        for bucket, _ in self.received.get(name, ()):
            bucket.unread -= 1
            if bucket.unread == 0:
                bucket.flat, bucket.views = None, []

    def wait_all(self) -> None:
        for bucket in self.buckets():
            bucket.wait()

    def release(self) -> None:
        """Drop the step's buffers (after ``wait_all``)."""
        for bucket in self.buckets():
            bucket.flat, bucket.views, bucket.work = None, [], None
