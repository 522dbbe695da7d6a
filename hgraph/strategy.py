"""Parallel schemes, heterogeneous strategies, the cluster, and the rank layout.

Text forms (``docs/architecture.md``): a scheme is ``TP2PP1``, ``TP4PP2CP2`` or ``TP2PP1UL2`` (CP and UL
omitted when 1; UL is the Ulysses degree, not called SP because SP already names Megatron's sequence
parallelism of the TP ranks, ``--sequence-parallel``); a strategy is
``2xTP2PP1+1xTP4PP1`` (pipelines in the order written) and ``DP4TP2PP1`` is accepted for the
homogeneous ``4xTP2PP1``. ``Strategy.parse(str(s)) == s`` and strategies hash, so they are cache keys.

Rank layout: pipelines occupy consecutive ranks in the order written; inside a pipeline TP is
innermost, then the sequence group (``Scheme.seq = cp * ul`` ranks that split each micro-batch's tokens),
then the PP stage. Inside the sequence group the Ulysses ranks are inner and the CP ranks outer (USP /
LoongTrain's 2-D): sequence rank ``s`` is CP shard ``s // ul`` and Ulysses rank ``s % ul`` inside it, so
the all-to-all, which moves the most bytes, stays among neighbouring ranks (inside a node) and the CP
ring spans them. ``RankCoord.cp_rank`` is a rank's place in the whole sequence group (``seq_group``);
``cp_group`` / ``ul_group`` are the ring and the all-to-all groups through it.
"""
from __future__ import annotations

import bisect
import itertools
import math
import operator
import re
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Iterator, Optional, Sequence

from hgraph import dims
from hgraph.dims import DIMENSIONS, GROUPED, LAYOUT, SEQUENCE, BindingKey, Dim
from hgraph.errors import StrategyError

def _scheme_pattern() -> str:
    """The regular expression of a scheme, from the registry: ``TP(\\d+)PP(\\d+)(?:CP(\\d+))?(?:UL(\\d+))?``."""
    return "".join(rf"{d.letter}(\d+)" if d.always_written else rf"(?:{d.letter}(\d+))?" for d in DIMENSIONS)


#: a scheme's grammar as the error lines write it: ``TP<n>PP<n>[CP<n>][UL<n>]``
_GRAMMAR = "".join(f"{d.letter}<n>" if d.always_written else f"[{d.letter}<n>]" for d in DIMENSIONS)
_SCHEME_RE = re.compile(_scheme_pattern(), re.IGNORECASE)
_TERM_RE = re.compile(r"\s*(?:(\d+)\s*[xX]\s*|DP(\d+))?", re.IGNORECASE)


def _first_bad_char(text: str) -> int:
    """Offset of the first character of ``text`` that cannot continue a scheme (``_GRAMMAR``)."""
    i = 0
    for j, dim in enumerate(DIMENSIONS):
        key = dim.letter
        if not dim.always_written:
            if i == len(text):
                return i
            head = text[i:i + 1].upper()
            if head != key[0] and any(head == later.letter[0] for later in DIMENSIONS[j + 1:]
                                      if not later.always_written):
                continue      # omitted: the text goes on with a later dimension
        if text[i:i + len(key)].upper() != key:
            return i + next((k for k in range(len(key)) if text[i + k:i + k + 1].upper() != key[k]), 0)
        i += len(key)
        digits = len(text[i:]) - len(text[i:].lstrip("0123456789"))
        if digits == 0:
            return i
        i += digits
    return i


def _sp_hint(text: str) -> str:
    """What to write instead of a refused spelling of a degree (``Dim.refused``: ``SP<n>`` for ``UL<n>``)."""
    for d in DIMENSIONS:
        if d.refused is not None:
            m = re.search(rf"{d.refused[0]}(\d+)", text, re.IGNORECASE)
            if m:
                return f"; the {d.title} degree is written {d.letter}{m.group(1)} ({d.refused[1]})"
    return ""


@dataclass(frozen=True, order=True)
class Scheme:
    """How one pipeline (one model replica) is deployed: <TP, PP, CP, UL>.

    ``ul``: the Ulysses degree (DeepSpeed-Ulysses): attention runs on all the tokens of a CP shard
    with ``1/ul`` of the heads between two all-to-alls. With ``cp`` and ``ul`` both above 1 (USP's
    2-D) the micro-batch is split over ``cp`` shards (CP's balanced split) and each shard contiguously
    over ``ul`` ranks.
    """

    tp: int
    pp: int
    cp: int = 1
    ul: int = 1

    def __post_init__(self) -> None:
        for d in DIMENSIONS:
            v = d.degree(self)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise StrategyError(f"scheme {d.letter} degree must be a positive integer, got {v!r}")

    @property
    def seq(self) -> int:
        """Ranks that split each micro-batch's tokens: the CP degree times the Ulysses degree."""
        return math.prod(d.degree(self) for d in SEQUENCE)

    def seq_place(self, seq_rank: int) -> tuple[int, int]:
        """(CP shard, Ulysses rank inside it) of sequence rank ``seq_rank`` (Ulysses inner)."""
        return divmod(seq_rank, self.ul)

    @property
    def num_ranks(self) -> int:
        return math.prod(d.degree(self) for d in DIMENSIONS)

    def stride(self, dim: Dim) -> int:
        """How far apart in the rank layout two ranks are that differ by one in ``dim``'s coordinate."""
        return self._strides[dim.layout]

    @cached_property
    def _strides(self) -> tuple[int, ...]:
        # by layout place: the product of the degrees inside it (asked for every rank's coordinates)
        return tuple(itertools.accumulate((d.degree(self) for d in LAYOUT[:-1]), operator.mul, initial=1))

    def place(self, local: int, dim: Dim) -> int:
        """``dim``'s coordinate of the pipeline's rank ``local`` (0-based inside the pipeline)."""
        return local // self.stride(dim) % dim.degree(self)

    def __str__(self) -> str:
        return "".join(f"{d.letter}{d.degree(self)}" for d in DIMENSIONS
                       if d.always_written or d.degree(self) != 1)

    @classmethod
    def parse(cls, text: str) -> "Scheme":
        m = _SCHEME_RE.fullmatch(text.strip())
        if not m:
            raise StrategyError(
                f"malformed scheme {text!r}: expected {_GRAMMAR}, e.g. TP2PP1, TP4PP2CP2 or "
                f"TP1PP1UL4{_sp_hint(text)}")
        return cls._of(m)

    @classmethod
    def _of(cls, m: "re.Match[str]") -> "Scheme":
        return cls(**{d.name: int(g or 1) for d, g in zip(DIMENSIONS, m.groups())})


assert tuple(f.name for f in fields(Scheme)) == tuple(d.name for d in DIMENSIONS), \
    "Scheme's fields are the registry's dimensions (hgraph.dims.DIMENSIONS), in text order"


@dataclass(frozen=True)
class RankCoord:
    """Where one rank sits in a strategy."""

    rank: int
    pipeline: int
    stage: int
    tp_rank: int
    cp_rank: int


@dataclass(frozen=True)
class Strategy:
    """The pipelines of one iteration, in rank order: ``S = sum_i d_i x P_i``."""

    pipelines: tuple[Scheme, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        if not self.pipelines:
            raise StrategyError("a strategy needs at least one pipeline")
        for p in self.pipelines:
            if not isinstance(p, Scheme):
                raise StrategyError(f"strategy pipelines must be Scheme objects, got {p!r}")

    # ---- text form -------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Parse ``2xTP2PP1+1xTP4PP1``, ``TP2PP1+TP1PP1`` or ``DP4TP2PP1``.

        A malformed text raises StrategyError naming the character position where it goes wrong.
        """
        if not isinstance(text, str) or not text.strip():
            raise StrategyError("empty strategy: expected e.g. 2xTP2PP1+1xTP4PP1 or DP4TP2PP1")
        pipelines: list[Scheme] = []
        pos = 0
        for term in text.split("+"):
            m = _TERM_RE.match(term)
            count_text = m.group(1) or m.group(2)
            rest_start = m.end()
            scheme_text = term[rest_start:].strip()
            sm = _SCHEME_RE.fullmatch(scheme_text)
            if not sm:
                lead = len(term[rest_start:]) - len(term[rest_start:].lstrip())
                bad = pos + rest_start + lead + _first_bad_char(scheme_text)
                raise StrategyError(
                    f"malformed strategy {text!r} at position {bad} (term {term.strip()!r}): expected "
                    f"[<d>x]{_GRAMMAR} terms joined by '+', or DP<d>{_GRAMMAR}" + _sp_hint(scheme_text))
            count = int(count_text) if count_text else 1
            if count < 1:
                raise StrategyError(f"malformed strategy {text!r} at position {pos}: pipeline count must be >= 1")
            scheme = Scheme._of(sm)
            pipelines.extend([scheme] * count)
            pos += len(term) + 1
        return cls(tuple(pipelines))

    @classmethod
    def homogeneous(cls, dp: int, scheme: Scheme) -> "Strategy":
        return cls((scheme,) * dp)

    @classmethod
    def of(cls, value: "Strategy | str | Sequence[Scheme]") -> "Strategy":
        if isinstance(value, Strategy):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        return cls(tuple(value))

    def groups(self) -> list[tuple[int, Scheme]]:
        """Runs of equal consecutive schemes as (count, scheme), in order."""
        return list(self._runs)

    @cached_property
    def _runs(self) -> tuple[tuple[int, Scheme], ...]:
        # Computed once per strategy (a planner asks every iteration; 12,288 GPUs hold thousands of
        # pipelines). Not a field: equality and hashing are unchanged.
        out: list[tuple[int, Scheme]] = []
        for p in self.pipelines:
            if out and out[-1][1] == p:
                out[-1] = (out[-1][0] + 1, p)
            else:
                out.append((1, p))
        return tuple(out)

    def __str__(self) -> str:
        return "+".join(f"{d}x{p}" for d, p in self.groups())

    def __repr__(self) -> str:
        return f"Strategy({str(self)!r})"

    # ---- layout ----------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self._starts[-1]

    @property
    def tp_max(self) -> int:
        return max(p.tp for p in self.pipelines)

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        # the first rank of every pipeline, and the world size last: rank arithmetic in O(1) (a rank's
        # build asks for its peers' coordinates; 12,288 GPUs hold thousands of pipelines)
        return tuple(itertools.accumulate((p.num_ranks for p in self.pipelines), initial=0))

    def pipeline_ranks(self, i: int) -> list[int]:
        start = self._starts[i]
        return list(range(start, start + self.pipelines[i].num_ranks))

    def rank_of(self, pipeline: int, stage: int, tp_rank: int = 0, cp_rank: int = 0) -> int:
        """The rank at stage ``stage``, TP rank ``tp_rank`` and sequence rank ``cp_rank`` of a pipeline: the
        sequence dimensions sit together in the layout (``hgraph.dims``), their ranks numbered inside out."""
        p = self.pipelines[pipeline]
        return (self._starts[pipeline] + stage * p.stride(dims.PP) + tp_rank * p.stride(dims.TP)
                + cp_rank * p.stride(dims.SEQUENCE[0]))

    def _locate(self, rank: int) -> tuple[int, Scheme, int]:
        """(pipeline, its scheme, ``rank``'s place inside it)."""
        if not 0 <= rank < self.num_ranks:
            raise StrategyError(f"rank {rank} is outside strategy {self} of {self.num_ranks} ranks")
        i = bisect.bisect_right(self._starts, rank) - 1
        return i, self.pipelines[i], rank - self._starts[i]

    def coord(self, rank: int) -> RankCoord:
        i, p, local = self._locate(rank)
        return RankCoord(rank, i, p.place(local, dims.PP), p.place(local, dims.TP),
                         local // p.stride(dims.SEQUENCE[0]) % p.seq)

    def group(self, dim: Dim, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` only in ``dim``'s coordinate, in that coordinate's order
        (its group: the TP group, the CP ring, the Ulysses all-to-all group, its pipeline's stages)."""
        _, p, local = self._locate(rank)
        stride = p.stride(dim)
        first = rank - p.place(local, dim) * stride
        return [first + k * stride for k in range(dim.degree(p))]

    def bindings(self, rank: int) -> dict[BindingKey, tuple[int, ...]]:
        """What ``rank``'s graph names the ranks it talks to (``hgraph.dims.BindingKey``): the group of
        every grouped dimension through it, and its neighbours along the others (the previous and next
        stage's rank, where there is one)."""
        out = {d.key: tuple(self.group(d, rank)) for d in GROUPED}
        _, p, local = self._locate(rank)
        for d in DIMENSIONS:
            if d.neighbours is not None:
                place, stride = p.place(local, d), p.stride(d)
                if place > 0:
                    out[d.neighbours[0]] = (rank - stride,)
                if place < d.degree(p) - 1:
                    out[d.neighbours[1]] = (rank + stride,)
        return out

    def coords(self) -> Iterator[RankCoord]:
        for r in range(self.num_ranks):
            yield self.coord(r)

    def tp_group(self, pipeline: int, stage: int, cp_rank: int = 0) -> list[int]:
        return self.group(dims.TP, self.rank_of(pipeline, stage, 0, cp_rank))

    def seq_group(self, pipeline: int, stage: int, tp_rank: int = 0) -> list[int]:
        """Every rank splitting the tokens of ``tp_rank``'s micro-batches: CP x UL, Ulysses inner."""
        p = self.pipelines[pipeline]
        return [self.rank_of(pipeline, stage, tp_rank, c) for c in range(p.seq)]

    def cp_group(self, pipeline: int, stage: int, tp_rank: int = 0, seq_rank: int = 0) -> list[int]:
        """The CP ring (or all-gather) group through sequence rank ``seq_rank``: one rank per CP shard,
        all with its Ulysses rank (so the same heads after the all-to-all)."""
        return self.group(dims.CP, self.rank_of(pipeline, stage, tp_rank, seq_rank))

    def ul_group(self, pipeline: int, stage: int, tp_rank: int = 0, seq_rank: int = 0) -> list[int]:
        """The Ulysses all-to-all group through sequence rank ``seq_rank``: the ranks of its CP shard."""
        return self.group(dims.UL, self.rank_of(pipeline, stage, tp_rank, seq_rank))

    def stage_ranks(self, pipeline: int, stage: int) -> list[int]:
        p = self.pipelines[pipeline]
        return [self.rank_of(pipeline, stage, t, c) for c in range(p.seq) for t in range(p.tp)]

    def validate(self, cluster: "Cluster") -> None:
        """World size and node boundaries; model-dependent checks live in the compiler."""
        if self.num_ranks != cluster.world_size:
            raise StrategyError(
                f"strategy {self} uses {self.num_ranks} ranks but the world size is {cluster.world_size}")
        first = 0
        for count, p in self.groups():
            # pipeline j of a run starts at first + j * p.num_ranks: where its TP groups fall in a node
            # repeats every gpus_per_node pipelines, so those are all that need a look
            for i in range(first, first + min(count, cluster.gpus_per_node)):
                self._check_tp_in_node(i, p, cluster)
            first += count

    def _check_tp_in_node(self, i: int, p: Scheme, cluster: "Cluster") -> None:
        """Every TP group of pipeline ``i`` (scheme ``p``) lies inside one node."""
        for s in range(p.pp):
            for c in range(p.seq):
                group = self.tp_group(i, s, c)
                if group[0] // cluster.gpus_per_node != group[-1] // cluster.gpus_per_node:
                    raise StrategyError(
                        f"strategy {self}: the TP group of pipeline {i} ({p}) stage {s} spans ranks "
                        f"{group[0]}-{group[-1]}, crossing a node boundary of {cluster.gpus_per_node} "
                        "GPUs per node; TP groups must stay inside one node")


def parse_strategy_list(text: str, world_size: int, option: str, *, alternatives: str = "") -> list[Strategy]:
    """``"S1;S2;..."`` given to ``option`` -> strategies, each using exactly ``world_size`` ranks.

    Bad input raises StrategyError with one line naming the option; ``alternatives`` names other
    accepted values in that message (e.g. ``"'auto' or "``).
    """
    parts = [p.strip() for p in text.split(";")]
    if not text.strip() or any(not p for p in parts):
        raise StrategyError(f"{option} {text!r}: expected {alternatives}strategies separated by ';', "
                            "e.g. '4xTP1PP1;1xTP2PP2'")
    out = []
    for part in parts:
        s = Strategy.parse(part)
        if s.num_ranks != world_size:
            raise StrategyError(f"{option}: strategy {part!r} uses {s.num_ranks} ranks but --world-size is "
                                f"{world_size}")
        out.append(s)
    return out


@dataclass(frozen=True)
class Cluster:
    """The devices a program is compiled for."""

    world_size: int
    gpus_per_node: int = 8
    memory_bytes: int = 80 * 2**30
    #: the optimizer states are sharded over groups of this many consecutive ranks and replicated
    #: across the groups (``--shard-group``; ``None``: over the whole world)
    shard_group: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("world_size", "gpus_per_node", "memory_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise StrategyError(f"cluster {name} must be a positive integer, got {v!r}")
        g = self.shard_group
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 1 or self.world_size % g):
            raise StrategyError(f"cluster shard_group must be a positive integer dividing the world size "
                                f"{self.world_size}, got {g!r}")
        if g == self.world_size:
            object.__setattr__(self, "shard_group", None)     # one spelling of "the world"

    @property
    def group_size(self) -> int:
        """Ranks sharing one copy of the optimizer states (``shard_group``, or the world)."""
        return self.shard_group or self.world_size

    def __str__(self) -> str:
        return f"{self.world_size} ranks, {self.gpus_per_node} per node, {self.memory_bytes / 2**30:g} GiB each"
