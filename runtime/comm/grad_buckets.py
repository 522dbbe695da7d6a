"""The reduce-scatters of Push Gradient in buckets, issued while backward still runs (as DDP's buckets).

A rank's reduce-scatter ops (one per parameter and replica group, from the push plans) are cut into
buckets: per group, in reverse model order (the order in which backward finishes gradients), closed
when the next op would pass ``bucket_bytes``, or, for a small group's reductions, a size that gives
them ``MIN_BUCKETS`` buckets (``bucket_cap``), so that the first go out while backward runs. Every
member of a group holds the same ops, so every member cuts the same buckets.

Order: a rank issues its buckets in one global order (key: position of the bucket's last parameter in
reverse model order, where backward completes it, then its first, then the group), and a bucket only
after every bucket before it: a bucket whose gradients are final early waits for its predecessors,
never the other way round. Keyed by the last parameter, a bucket's predecessors are complete by the
time it is (gradients finish in reverse model order), so it is issued where its own gradients are
final: at the same point of the backward on every rank of a role (TP / CP peers), whatever the
rank's other buckets (their groups and cuts differ between peers). So the order does
not depend on timing (in which order the hooks fire), the members of a group issue its buckets in
the same order, and any two ranks issue the buckets they share in the same relative order (what
gloo's per-group matching and NCCL's in-order streams both need).

``ready(name, grad)``: the parameter's gradient is final (called from its post-accumulate-grad hook
during the step's last backward); issues every bucket that became issuable (not one over a group
``after_backward`` names, nor any after it). Every collective goes through the rank's ``issuer``. ``flush(grads)`` issues
the rest (a rank whose pipeline ran no micro-batch pushes zeros). ``wait(held)`` completes them in
order (``complete_next``: one at a time) and hands each member piece to ``held[name]`` as
``((lo, hi), rows)``. ``carry(values)`` sends a few fp32 values with the first bucket (the step's
loss, so that it needs no collective of its own). ``bytes_issued`` counts what the reduce-scatters
receive; ``first_issue_s`` is when the step's first bucket was issued (``time.perf_counter``).

On gloo a reduce-scatter is run as an all-to-all (``all_to_all_single``): member ``i`` receives
every member's chunk ``i`` and sums them itself (each sum is taken on one rank only). That is one
exchange with each peer, where gloo's ring all-reduce and reduce-scatter take ``2(k - 1)`` steps in
sequence, each waiting for a peer to be scheduled; it moves the reduce-scatter's bytes. Measured on 4
local ranks (2 cores), 1 MB: all-to-all 2.2 ms, all-reduce 5.5 ms (gloo's reduce-scatter was slower
still than its all-reduce, 7.3 vs 6.3 ms). Elsewhere (NCCL has no summing all-to-all) it is
``reduce_scatter_tensor``; ``all_to_all`` chooses (None: by the group's backend). Either way the
carried values ride in every chunk, each member's in its own slots and zeros in the others', so their
sum is exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph.comm_plan import ParamLayout, ReduceScatter
from hgraph.errors import HGraphError
from hgraph.runtime.comm.collectives import reduce_scatter_single
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.rank_params import laid_out_rows

#: DDP's default bucket cap (``bucket_cap_mb=25``).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
#: a group's reductions travel in at least this many buckets where they are small (each at least
#: ``MIN_BUCKET_BYTES``): one bucket of a whole small model is issued only when backward ends, so
#: nothing of it overlaps. Measured (4 gloo ranks on 2 shared cores, tiny Llama, 1 MB of gradients,
#: 3 alternating pairs of 15 steps, 1 vs 8): push exposed after the last backward under
#: 1xTP1PP1CP2+2xTP1PP1 5.1 / 22.0 / 3.4 ms -> 0.6 / 1.1 / 1.3 ms; rank 0's push under its backward
#: 2-6% -> 59-62%; the TP and PP strategies' exposed part (their point-to-point push) unchanged
MIN_BUCKETS, MIN_BUCKET_BYTES = 8, 64 * 1024


def bucket_cap(group_bytes: int, bucket_bytes: int) -> int:
    """The bucket size of a group whose reductions take ``group_bytes`` (every member's input): at most
    ``bucket_bytes``, and small enough for ``MIN_BUCKETS`` buckets unless that goes below
    ``MIN_BUCKET_BYTES`` (each collective has a fixed cost)."""
    return min(bucket_bytes, max(group_bytes // MIN_BUCKETS, MIN_BUCKET_BYTES))

# (name, gradient, lo, hi) -> the gradient's rows [lo, hi) in its own dtype (the bucket's copy casts them)
Contribution = Callable[[str, torch.Tensor, int, int], torch.Tensor]


@dataclass
class _Bucket:
    """Reduce-scatter ops of one group travelling together: ``ops[i] = (name, ReduceScatter)``."""

    group: tuple[int, ...]
    ops: list
    elements: int = 0                    # per member chunk (each op padded to its widest piece)
    widths: list = field(default_factory=list)   # per op: rows of its widest piece
    split: list = field(default_factory=list)    # per op: elements in a chunk
    even: list = field(default_factory=list)     # per op: pieces are consecutive blocks of equal width
    mine: list = field(default_factory=list)     # per op: the rows this rank keeps
    missing: set = field(default_factory=set)
    work: Any = None
    finish: Optional[Callable[[dict], None]] = None


class GradBuckets:
    """The bucketed reduce-scatters of one rank for one Program (reset every step by ``reset``)."""

    def __init__(self, rank: int, order: Sequence[str], push_ops: Mapping[str, Sequence[Any]],
                 layouts: Mapping[str, ParamLayout], groups: Any, contribution: Contribution,
                 device: torch.device, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 issuer: Optional[CollectiveIssuer] = None,
                 after_backward: Callable[[tuple[int, ...]], bool] = lambda group: False,
                 all_to_all: Optional[bool] = None) -> None:
        self.rank, self.groups, self.contribution, self.device = rank, groups, contribution, device
        # a bucket over such a group waits for ``flush`` (its members still wait for this rank's backward)
        self.after_backward = after_backward
        self.issuer = issuer or CollectiveIssuer()       # the rank's choke point (order, record)
        self.all_to_all = all_to_all         # None: gloo's all-to-all where the group is gloo's
        # called after each bucket is issued, in ``ready`` and in ``flush`` alike (the overlapped update
        # takes the reductions one behind it there): a point that follows from the bucket order alone,
        # so a rank that flushes every bucket at the end (no micro-batch) issues what follows each
        # bucket where a rank that issued it in backward does
        self.after_issue: Optional[Callable[[], None]] = None
        self.layouts = dict(layouts)         # pieces are laid out as the parameter is (rows along its dim)
        position = {name: i for i, name in enumerate(reversed(order))}
        by_group: dict[tuple[int, ...], list] = {}
        for name in reversed(order):
            for op in push_ops[name]:
                if isinstance(op, ReduceScatter):
                    by_group.setdefault(op.group, []).append((name, op))
        buckets = []
        for group, ops in sorted(by_group.items()):
            widest = [max(phi - plo for _, plo, phi in op.pieces) for _, op in ops]     # rows per op
            sizes = [rows * self.layouts[name].row_elements for (name, _), rows in zip(ops, widest)]
            cap = bucket_cap(sum(sizes) * 4 * len(group), bucket_bytes)    # the same on every member
            current: Optional[_Bucket] = None
            for (name, op), rows, elements in zip(ops, widest, sizes):
                if current is None or (current.ops and (current.elements + elements) * 4 * len(group) > cap):
                    current = _Bucket(group, [])
                    buckets.append(current)
                current.ops.append((name, op))
                current.elements += elements
                current.widths.append(rows)
                current.split.append(elements)
                current.even.append(all(plo == op.lo + i * rows and phi == plo + rows
                                        for i, (_, plo, phi) in enumerate(op.pieces)))
                current.mine.append(next((plo, phi) for m, plo, phi in op.pieces if m == rank))
        # keyed by the bucket's last gradient in reverse model order (when backward completes it), not its
        # first: a bucket waits for every bucket before it, so a key at its first gradient would hold a
        # bucket shared with a TP peer behind one of this rank's own (cut differently from the peer's)
        # that completes later, and the peers would issue the shared bucket at different points of the
        # backward's TP collectives. Ties: first gradient, group, place in the group (the same on every
        # member of the group)
        self.buckets = [b for _, b in sorted(
            ((position[b.ops[-1][0]], position[b.ops[0][0]], b.group, i), b) for i, b in enumerate(buckets))]
        self._bucket_of: dict[str, list[_Bucket]] = {}
        for b in self.buckets:
            for name, _ in b.ops:
                self._bucket_of.setdefault(name, []).append(b)
        self.bytes_issued = 0
        self.reset()

    def reset(self) -> None:
        """Forget the last step's buckets: nothing issued, every gradient pending."""
        for b in self.buckets:
            b.missing = {name for name, _ in b.ops}
            b.work = b.finish = None
        self._next = 0          # buckets issued
        self._done = 0          # buckets completed (in order)
        self._carry: Optional[torch.Tensor] = None
        self.carried: Optional[torch.Tensor] = None    # the carried values' sums, once bucket 0 completed
        self._grads: dict[str, Optional[torch.Tensor]] = {}
        self.bytes_issued = 0
        self.first_issue_s: Optional[float] = None

    @property
    def issued(self) -> int:
        return self._next

    @property
    def completed(self) -> int:
        return self._done

    def carry(self, values: torch.Tensor) -> None:
        """Sum the fp32 ``values`` over the first bucket's group in its collective (every chunk
        carries them): after that bucket completes, ``carried`` holds the sums. Call before the bucket
        is issued."""
        if self._next > 0 or not self.buckets:
            raise HGraphError("GradBuckets.carry: the first bucket was already issued (or there is none)")
        self._carry = values.to(torch.float32)

    def ready(self, name: str, grad: Optional[torch.Tensor]) -> None:
        """``name``'s gradient is final for this step: issue every bucket that can go now, in order."""
        self._grads[name] = grad
        for b in self._bucket_of.get(name, ()):
            b.missing.discard(name)
        while (self._next < len(self.buckets) and not self.buckets[self._next].missing
               and not self.after_backward(self.buckets[self._next].group)):
            self._issue(self.buckets[self._next])
            self._next += 1
            if self.after_issue is not None:
                self.after_issue()

    def flush(self, grads: Mapping[str, Optional[torch.Tensor]]) -> None:
        """Issue every bucket not issued yet (``grads[name]``: the final gradient, ``None`` for zeros)."""
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            for name in b.missing:
                self._grads[name] = grads.get(name)
            b.missing = set()
            self._issue(b)
            self._next += 1
            if self.after_issue is not None:
                self.after_issue()

    def wait(self, held: dict) -> None:
        """Complete every bucket not completed yet (all issued) and put this rank's reduced pieces into
        ``held``."""
        while self.complete_next(held) is not None:
            pass

    def complete_next(self, held: dict) -> Optional[list[str]]:
        """Wait for the next bucket in issue order, if it was issued; put its pieces into ``held`` and
        return its parameters (None when no issued bucket is left)."""
        if self._done >= self._next:
            return None
        b = self.buckets[self._done]
        b.work.wait()
        b.finish(held)
        b.work = b.finish = None
        self._done += 1
        return [name for name, _ in b.ops]

    @torch.no_grad()
    def _issue(self, b: _Bucket) -> None:
        """One collective for the bucket: member ``i``'s chunk holds its piece of every op (rows
        flattened, each padded to the op's widest piece), so all chunks have ``b.elements`` elements
        (followed by the carried values, each member's in its own slots). An op whose pieces are
        consecutive blocks of equal width (the usual case) is copied in with the others in one batched
        copy; any other piece is copied on its own."""
        if self.first_issue_s is None:
            self.first_issue_s = time.perf_counter()
        k = len(b.group)
        group = self.groups.get(b.group)
        by_all_to_all = self.all_to_all if self.all_to_all is not None else dist.get_backend(group) == "gloo"
        carry = self._carry if b is self.buckets[0] else None
        extra = 0 if carry is None else carry.numel()
        exact = all(even for even in b.even) and all(self._grads.get(n) is not None for n, _ in b.ops)
        buf = (torch.empty if exact else torch.zeros)(k, b.elements + extra, dtype=torch.float32, device=self.device)
        pieces = buf.narrow(1, 0, b.elements).split(b.split, dim=1)
        dests, srcs = [], []
        for j, (name, op) in enumerate(b.ops):
            grad, layout, width = self._grads.get(name), self.layouts[name], b.widths[j]
            rest, dim = layout.row_shape, layout.shard_dim
            if grad is None:                              # a missing gradient stays zeros
                continue
            if b.even[j]:                                 # every member's piece at once: (k, width, *rest)
                dests.append(pieces[j].view(k, *rest[:dim], width, *rest[dim:]).movedim(dim + 1, 1))
                srcs.append(self.contribution(name, grad, op.lo, op.hi).unflatten(0, (k, width)))
                continue
            for i, (_, plo, phi) in enumerate(op.pieces):   # a piece's rows first, its padding after
                if phi > plo:
                    dests.append(laid_out_rows(pieces[j][i].narrow(0, 0, (phi - plo) * layout.row_elements),
                                               phi - plo, rest, dim))
                    srcs.append(self.contribution(name, grad, plo, phi))
        if dests:
            torch._foreach_copy_(dests, srcs)
        self.bytes_issued += (k - 1) * b.elements * 4
        if carry is not None:                        # every chunk: each member's values in its own slots
            buf.narrow(1, b.elements, extra).copy_(carry.expand(k, extra))
        if by_all_to_all:                            # member i sums every chunk i itself
            received = torch.empty_like(buf)
            b.work = self.issuer.issue("all_to_all", group, buf, lambda: dist.all_to_all_single(
                received, buf, group=group, async_op=True), f"push bucket {self._next}")
        else:
            received = buf.new_empty(b.elements + extra)
            b.work = self.issuer.issue("reduce_scatter", group, buf, lambda: reduce_scatter_single(
                received, buf.view(-1), group=group, async_op=True), f"push bucket {self._next}")

        def finish(held: dict) -> None:
            sums = received.sum(0) if by_all_to_all else received    # all-to-all: every chunk i, summed here
            out = sums.narrow(0, 0, b.elements)
            if carry is not None:
                self.carried = sums.narrow(0, b.elements, extra)
            for (name, _), piece, (plo, phi) in zip(b.ops, out.split(b.split), b.mine):
                layout = self.layouts[name]
                rows = laid_out_rows(piece.narrow(0, 0, (phi - plo) * layout.row_elements), phi - plo,
                                     layout.row_shape, layout.shard_dim)
                held[name].append(((plo, phi), rows))

        b.finish = finish
