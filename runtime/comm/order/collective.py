"""One operation of a rank's collective sequence, as a communicator sees it.

NCCL runs the operations of one communicator in the order they are issued, and a rank's operations
on all its communicators in the order that rank issues them (one stream, or a serialised one with
``CUDA_DEVICE_MAX_CONNECTIONS=1``). So what a rank issues is a sequence of ``Collective`` records:
the group (sorted ranks of the communicator), the operation, and what its members must agree on. A
``batch_isend_irecv`` group is one record of kind ``p2p`` whose group is the rank and its peers, with
the ranks it sends to and receives from (a peer twice when two messages go to it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: operations whose members all pass tensors of one shape (an all-gather or all-to-all of uneven
#: pieces, or a reduce-scatter's input and output, differ per rank: only kind and dtype must agree)
SAME_SHAPE_KINDS = frozenset({"all_reduce", "broadcast"})

#: every kind a sequence may hold
KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier", "p2p"})


@dataclass(frozen=True)
class Collective:
    """One operation of one rank: ``group`` the communicator's ranks (sorted; ``p2p``: this rank and
    its peers), ``shape`` and ``dtype`` of this rank's tensor, ``label`` where it comes from (e.g.
    ``"push bucket 2"``), and for ``p2p`` the ranks it sends to and receives from."""

    kind: str
    group: tuple[int, ...]
    shape: tuple[int, ...] = ()
    dtype: str = ""
    label: str = ""
    sends: tuple[int, ...] = ()
    recvs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"collective kind {self.kind!r}: expected one of {sorted(KINDS)}")
        if list(self.group) != sorted(set(self.group)):
            raise ValueError(f"collective group {list(self.group)}: ranks must be sorted and distinct")

    @classmethod
    def p2p(cls, rank: int, sends: Sequence[int] = (), recvs: Sequence[int] = (), label: str = "") -> "Collective":
        """A ``batch_isend_irecv`` group of ``rank``: messages to ``sends`` and from ``recvs``."""
        group = tuple(sorted({rank, *sends, *recvs}))
        return cls("p2p", group, label=label, sends=tuple(sorted(sends)), recvs=tuple(sorted(recvs)))

    @property
    def signature(self) -> tuple:
        """What every member of the group must issue alike at this point of the group's order."""
        return (self.kind, self.dtype, self.shape if self.kind in SAME_SHAPE_KINDS else None)

    def describe(self) -> str:
        """``all_reduce on [0, 1] float32[4, 8] (push bucket 0)``; ``p2p send 1 recv 3 (pull)``."""
        if self.kind == "p2p":
            parts = ["p2p"]
            if self.sends:
                parts.append("send " + ",".join(map(str, self.sends)))
            if self.recvs:
                parts.append("recv " + ",".join(map(str, self.recvs)))
            text = " ".join(parts)
        else:
            text = f"{self.kind} on {list(self.group)}"
            if self.dtype:
                text += f" {self.dtype}{list(self.shape)}"
        return f"{text} ({self.label})" if self.label else text
