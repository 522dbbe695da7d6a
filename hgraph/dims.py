"""The parallel dimensions of a scheme, declared once (``docs/architecture.md``, "Adding a parallel
dimension").

Each dimension (``Dim``) says how it is written in a scheme's text form (its ``letter``, whether it is
written when its degree is 1), where it sits in a pipeline's rank layout (``layout``: 0 innermost), the
binding key a rank's graph names its group by (``BindingKey``: the group of ranks that differ from it in
this dimension only, or for PP the previous / next stage's rank), and which ops of ``hgraph.ops`` run
over that group. ``hgraph.strategy`` generates from ``DIMENSIONS`` a scheme's text form and its errors,
its rank count, the rank layout and every rank's bindings; the passes, the runtime's process groups and
the tools iterate over it instead of naming ``tp``, ``cp`` and ``ul``. What a dimension costs the planner
stays in ``runtime/planner/cost`` (the IR imports no runtime), keyed by these members.

Binding keys are a ``str`` enum, so a graph printed or dumped still reads ``"tp"`` where it names the TP
group, and a mapping keyed by them answers the plain string too.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class BindingKey(enum.StrEnum):
    """The names a rank's graph gives the ranks it talks to; ``RankProgram.bindings`` maps each to ranks."""

    TP = "tp"              # the TP group through the rank
    CP = "cp"              # the CP group through it: one rank per CP shard, all with its Ulysses rank
    UL = "ul"              # the Ulysses all-to-all group through it: the ranks of its CP shard
    PP_PREV = "pp_prev"    # the rank of the previous stage with the same place in its stage
    PP_NEXT = "pp_next"    # the rank of the next stage with the same place in its stage

    def __repr__(self) -> str:   # graphs and dumps print the key as the group's name
        return repr(self.value)


@dataclass(frozen=True)
class Dim:
    """One parallel dimension of a scheme."""

    #: the ``Scheme`` field holding its degree (lower case of ``letter``)
    name: str
    #: how its degree is written in a scheme's text form: ``TP2``
    letter: str
    #: its place in a pipeline's rank layout, 0 innermost: ranks that differ only in this dimension's
    #: coordinate are ``stride`` apart, the product of the degrees of the dimensions inside it
    layout: int
    #: what the dimension is called in messages
    title: str
    #: written even when its degree is 1 (TP, PP); the others are omitted at 1
    always_written: bool = False
    #: the binding of its group through a rank (the ranks that differ from it in this coordinate only)
    key: Optional[BindingKey] = None
    #: the bindings of the neighbours along it, (previous, next): a pipeline's stages
    neighbours: Optional[tuple[BindingKey, BindingKey]] = None
    #: its ranks split each micro-batch's tokens (part of ``Scheme.seq``)
    splits_tokens: bool = False
    #: the ``hgraph.ops`` functions that run over its group (for the docs and dumps)
    ops: tuple[str, ...] = ()
    #: the ``hgraph.meta.CommPoint`` values of the Communicate Activation slots its ops fill
    comm_points: tuple[str, ...] = ()
    #: a spelling that is refused with a hint, and why: (``"SP"``, the reason)
    refused: Optional[tuple[str, str]] = None

    def degree(self, scheme: object) -> int:
        """This dimension's degree in ``scheme`` (a ``hgraph.strategy.Scheme``)."""
        return getattr(scheme, self.name)


TP = Dim("tp", "TP", 0, "TP", always_written=True, key=BindingKey.TP,
         ops=("tp_copy", "tp_reduce_issue", "tp_gather_issue", "sp_scatter_issue", "sp_gather_issue", "sp_linear",
              "sp_narrow", "output_head"), comm_points=("tp_enter", "tp_exit", "tp_gather"))
PP = Dim("pp", "PP", 3, "PP", always_written=True, neighbours=(BindingKey.PP_PREV, BindingKey.PP_NEXT),
         ops=("pp_recv", "pp_send"), comm_points=("pp_boundary",))
CP = Dim("cp", "CP", 2, "CP", key=BindingKey.CP, splits_tokens=True, ops=("cp_kv_gather_issue", "cp_attention"),
         comm_points=("cp_kv",))
UL = Dim("ul", "UL", 1, "Ulysses", key=BindingKey.UL, splits_tokens=True,
         ops=("ulysses_heads_issue", "ulysses_tokens_issue", "ulysses_attention"), comm_points=("ul_a2a",),
         refused=("SP", "SP is Megatron's sequence parallelism, the --sequence-parallel flag"))

#: every dimension, in the order a scheme's text form writes them (``TP2PP1CP2UL2``)
DIMENSIONS: tuple[Dim, ...] = (TP, PP, CP, UL)

#: the dimensions inside out: the rank layout of a pipeline (TP innermost, UL, CP, then the PP stage)
LAYOUT: tuple[Dim, ...] = tuple(sorted(DIMENSIONS, key=lambda d: d.layout))

#: the dimensions whose ranks split a micro-batch's tokens, inside out (a rank's sequence rank)
SEQUENCE: tuple[Dim, ...] = tuple(d for d in LAYOUT if d.splits_tokens)

#: the dimensions whose group through a rank is one of its bindings, in text order
GROUPED: tuple[Dim, ...] = tuple(d for d in DIMENSIONS if d.key is not None)


def by_key(key: str) -> Dim:
    """The dimension whose group ``key`` names (``"tp"``, ``BindingKey.CP``, ``"pp_next"``)."""
    for d in DIMENSIONS:
        if d.key == key or (d.neighbours is not None and key in d.neighbours):
            return d
    raise KeyError(f"no parallel dimension binds {key!r}")


def by_comm_point(point: str) -> Dim:
    """The dimension whose ops fill a Communicate Activation slot at ``point`` (a ``CommPoint``)."""
    for d in DIMENSIONS:
        if point in d.comm_points:
            return d
    raise KeyError(f"no parallel dimension fills the comm point {point!r}")


def _check(dims: tuple[Dim, ...]) -> None:
    """The registry is consistent: distinct letters, names, layout places and keys; TP (stride 1) first."""
    for attr in ("name", "letter", "layout"):
        values = [getattr(d, attr) for d in dims]
        assert len(set(values)) == len(values), f"parallel dimensions share a {attr}: {values}"
    assert sorted(d.layout for d in dims) == list(range(len(dims))), "layout places must be 0..n-1"
    assert all(d.name == d.letter.lower() for d in dims), "a dimension's name is its letter, lower case"
    seq = sorted(d.layout for d in dims if d.splits_tokens)
    assert seq == list(range(min(seq), min(seq) + len(seq))) or not seq, "the sequence dimensions sit together"
    assert LAYOUT[-1].neighbours is not None, "the outermost dimension is the pipeline's stages"


_check(DIMENSIONS)
