"""The parallel dimensions of a scheme, declared once (``docs/architecture.md``, "Adding a parallel
dimension").

Each dimension (``Dim``) says how it is written in a scheme's text form (its ``letter``, whether it is
written when its degree is 1), where it sits in a pipeline's rank layout (``layout``: smaller inner),
what its ranks split (``Splits``: weights, stages, tokens, or nothing), the binding key a rank's graph
names its group by (``BindingKey``: the group of ranks that differ from it in this dimension only, or
for PP the previous / next stage's rank), which ops of ``hgraph.ops`` run over that group and which
passes of its own it adds. ``hgraph.strategy`` generates from ``DIMENSIONS`` the scheme itself (a degree
per dimension), its text form and its errors, its rank count, the rank layout, every rank's bindings and
its coordinates by kind (``RankCoord``); roles, push shares and the loss share follow from those, and the
passes, the runtime's process groups and the tools iterate over the registry instead of naming ``tp``,
``cp`` and ``ul``. ``registered`` adds a dimension while a block runs (a test's). What a dimension costs
the planner stays in ``runtime/planner/cost`` (the IR imports no runtime), keyed by these members.

Binding keys are a ``str`` enum, so a graph printed or dumped still reads ``"tp"`` where it names the TP
group, and a mapping keyed by them answers the plain string too.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional


class BindingKey(enum.StrEnum):
    """The names a rank's graph gives the ranks it talks to; ``RankProgram.bindings`` maps each to ranks."""

    TP = "tp"              # the TP group through the rank
    CP = "cp"              # the CP group through it: one rank per CP shard, all with its Ulysses rank
    UL = "ul"              # the Ulysses all-to-all group through it: the ranks of its CP shard
    EP = "ep"              # the EP group through it: the ranks of its stage with its TP and sequence place
    PP_PREV = "pp_prev"    # the rank of the previous stage with the same place in its stage
    PP_NEXT = "pp_next"    # the rank of the next stage with the same place in its stage

    def __repr__(self) -> str:   # graphs and dumps print the key as the group's name
        return repr(self.value)


class Splits(enum.Enum):
    """What a dimension's ranks split, which says how a rank's coordinate along it enters the rest:
    which parameter shards it holds, which tokens it is fed, what it adds to the loss and the push.

    ``WEIGHTS`` (TP): its ranks hold different shards of the parameters and the same tokens, so they
    compute the same loss (one counts it) and the same gradient of a parameter they all hold whole
    (each pushes its share). ``STAGES`` (PP): its ranks hold different layers; the last stage's
    loss counts. ``TOKENS`` (CP, UL): its ranks hold different tokens of each micro-batch with the
    same weights: each counts its own loss and pushes its own gradient (a rank's sequence rank runs
    over these, inside out). ``REPLICAS``: its ranks hold the same weights and tokens and compute the
    same values (they only reshard activations between ops): one counts the loss and each pushes its
    share of every gradient. ``DOCUMENTS`` (EP): its ranks hold the same dense weights and different
    documents of each micro-batch (data parallel inside the pipeline): for the loss and the dense
    gradients like ``TOKENS`` (each counts its own loss and pushes its own gradient); for the expert
    parameters a split of the weights along the expert axis (place r of n holds experts
    ``[r*E/n, (r+1)*E/n)``).
    """

    WEIGHTS = "weights"
    STAGES = "stages"
    TOKENS = "tokens"
    REPLICAS = "replicas"
    DOCUMENTS = "documents"


@dataclass(frozen=True, eq=False)
class Dim:
    """One parallel dimension of a scheme (compared and hashed as itself: a scheme's layout is keyed by it)."""

    #: the ``Scheme`` field holding its degree (lower case of ``letter``)
    name: str
    #: how its degree is written in a scheme's text form: ``TP2``
    letter: str
    #: its place in a pipeline's rank layout, smaller inner (a sort key: the built-in ones are 0 to 3, and a
    #: dimension added between two takes a place between theirs): ranks that differ only in this
    #: dimension's coordinate are ``stride`` apart, the product of the degrees of the dimensions inside it
    layout: float
    #: what the dimension is called in messages
    title: str
    #: what its ranks split (``Splits``): how its coordinate enters a rank's role, inputs, loss and push
    splits: Splits
    #: written even when its degree is 1 (TP, PP); the others are omitted at 1
    always_written: bool = False
    #: the binding of its group through a rank (the ranks that differ from it in this coordinate only)
    #: (a ``BindingKey`` member; a dimension registered outside this module may use its own string)
    key: Optional[str] = None
    #: the bindings of the neighbours along it, (previous, next): a pipeline's stages
    neighbours: Optional[tuple[BindingKey, BindingKey]] = None
    #: the ``hgraph.ops`` functions that run over its group (for the docs and dumps)
    ops: tuple[str, ...] = ()
    #: the ``hgraph.meta.CommPoint`` values of the Communicate Activation slots its ops fill
    comm_points: tuple[str, ...] = ()
    #: a spelling that is refused with a hint, and why: (``"SP"``, the reason)
    refused: Optional[tuple[str, str]] = None
    #: instantiation passes of its own (``name_pass(gm, ctx) -> GraphModule``, each doing nothing where the
    #: role's degree is 1), run after a role's stage is extracted and TP-sharded, while its Communicate
    #: Activation slots are still empty (``passes/pipeline.instantiation_passes``); the built-in dimensions'
    #: passes are written into that list
    passes: tuple[Callable[[Any, Any], Any], ...] = ()
    #: what a dump calls a rank's place along it (``place_key``; default ``<name>_rank``)
    place_name: str = ""

    def __reduce__(self) -> tuple:
        # pickled by name: the receiving process's registered dimension (hashed as itself) is the one
        return by_name, (self.name,)

    @property
    def splits_tokens(self) -> bool:
        """Its ranks split each micro-batch's tokens (part of ``Scheme.seq``)."""
        return self.splits is Splits.TOKENS

    @property
    def place_key(self) -> str:
        """The key of a rank's place along this dimension in a dump's JSON (``cp_shard``, ``ul_rank``)."""
        return self.place_name or f"{self.name}_rank"

    def degree(self, scheme: object) -> int:
        """This dimension's degree in ``scheme`` (a ``hgraph.strategy.Scheme``; 1 in a scheme made before
        the dimension was registered)."""
        return getattr(scheme, self.name, 1)


TP = Dim("tp", "TP", 0, "TP", Splits.WEIGHTS, always_written=True, key=BindingKey.TP,
         ops=("tp_copy", "tp_reduce_issue", "tp_gather_issue", "sp_scatter_issue", "sp_gather_issue", "sp_linear",
              "sp_narrow", "output_head"), comm_points=("tp_enter", "tp_exit", "tp_gather"))
PP = Dim("pp", "PP", 3, "PP", Splits.STAGES, always_written=True, neighbours=(BindingKey.PP_PREV, BindingKey.PP_NEXT),
         ops=("pp_recv", "pp_send"), comm_points=("pp_boundary",))
CP = Dim("cp", "CP", 2, "CP", Splits.TOKENS, key=BindingKey.CP, place_name="cp_shard", ops=("cp_kv_gather_issue", "cp_attention"),
         comm_points=("cp_kv",))
UL = Dim("ul", "UL", 1, "Ulysses", Splits.TOKENS, key=BindingKey.UL,
         ops=("ulysses_heads_issue", "ulysses_tokens_issue", "ulysses_attention"), comm_points=("ul_a2a",),
         refused=("SP", "SP is Megatron's sequence parallelism, the --sequence-parallel flag"))

#: expert parallelism: between the sequence ranks and the stages (Megatron's tp-cp-ep-dp-pp order), so an EP
#: group is ranks ``tp * seq`` apart inside one stage, its experts split evenly over it
EP = Dim("ep", "EP", 2.5, "EP", Splits.DOCUMENTS, key=BindingKey.EP,
         ops=("moe_split_exchange", "moe_dispatch_issue", "moe_combine_issue"),
         comm_points=("ep_dispatch", "ep_combine"))

BUILT_IN: tuple[Dim, ...] = (TP, PP, CP, UL, EP)

#: every dimension, in the order a scheme's text form writes them (``TP2PP1CP2UL2``)
DIMENSIONS: tuple[Dim, ...] = BUILT_IN
#: the dimensions inside out: the rank layout of a pipeline (TP innermost, UL, CP, EP, then the PP stage)
LAYOUT: tuple[Dim, ...] = ()
#: the dimensions whose ranks split a micro-batch's tokens, inside out (a rank's sequence rank)
SEQUENCE: tuple[Dim, ...] = ()
#: the dimensions whose group through a rank is one of its bindings, in text order
GROUPED: tuple[Dim, ...] = ()
#: the dimensions whose ranks compute the same values (``Splits.REPLICAS``), inside out
REPLICAS: tuple[Dim, ...] = ()
#: the dimensions whose ranks take different documents of each micro-batch (``Splits.DOCUMENTS``), inside out
DOCUMENTS: tuple[Dim, ...] = ()


def _derive(dimensions: tuple[Dim, ...]) -> None:
    """Set the registry's tables (``DIMENSIONS`` and the orders derived from it) to ``dimensions``."""
    _check(dimensions)
    global DIMENSIONS, LAYOUT, SEQUENCE, GROUPED, REPLICAS, DOCUMENTS
    DIMENSIONS = dimensions
    LAYOUT = tuple(sorted(dimensions, key=lambda d: d.layout))
    SEQUENCE = tuple(d for d in LAYOUT if d.splits is Splits.TOKENS)
    GROUPED = tuple(d for d in dimensions if d.key is not None)
    REPLICAS = tuple(d for d in LAYOUT if d.splits is Splits.REPLICAS)
    DOCUMENTS = tuple(d for d in LAYOUT if d.splits is Splits.DOCUMENTS)


@contextlib.contextmanager
def registered(*added: Dim) -> Iterator[None]:
    """The registry with ``added`` after the built-in dimensions (in text order) while the block runs:
    how a dimension that is not built in (a test's) takes part in every scheme, rank layout and role.
    Read the tables as ``dims.DIMENSIONS`` (not imported by name) so that they follow; schemes made
    inside the block are not for use after it."""
    before = DIMENSIONS
    _derive(before + tuple(added))
    try:
        yield
    finally:
        _derive(before)


def by_name(name: str) -> Dim:
    """The registered dimension whose ``Scheme`` attribute is ``name`` (``"tp"``)."""
    for d in DIMENSIONS:
        if d.name == name:
            return d
    raise KeyError(f"no parallel dimension is named {name!r}")


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
    for attr in ("name", "letter", "layout", "key"):
        values = [getattr(d, attr) for d in dims]
        values = [v for v in values if v is not None]
        assert len(set(values)) == len(values), f"parallel dimensions share a {attr}: {values}"
    assert all(d.name == d.letter.lower() for d in dims), "a dimension's name is its letter, lower case"
    layout = sorted(dims, key=lambda d: d.layout)
    splits = [d.splits for d in layout]
    seq = [i for i, s in enumerate(splits) if s is Splits.TOKENS]
    assert seq == list(range(seq[0], seq[0] + len(seq))) if seq else True, "the sequence dimensions sit together"
    assert splits.count(Splits.STAGES) == 1 and layout[-1].neighbours is not None and splits[-1] is Splits.STAGES, \
        "the outermost dimension is the pipeline's stages, and only it"
    assert splits.count(Splits.WEIGHTS) == 1 and splits[0] is Splits.WEIGHTS, \
        "one dimension splits the weights, innermost (its groups are blocks of consecutive ranks)"


_derive(BUILT_IN)
