"""The result of instantiating an HGraph for one strategy: a program per rank.

Ranks that play the same role (same scheme and coordinates in it: stage, TP rank, sequence rank,
replica and EP rank, ``RankCoord``; in different pipelines) share one GraphModule: their graphs differ only in which ranks they talk to, and that lives in the
rank's ``bindings`` (a ``hgraph.dims.BindingKey`` such as ``"tp"`` or ``"pp_next"`` -> ranks), which
the runtime resolves when it runs the graph. A Program builds a rank's part only when asked (``Program.rank``),
so one rank of 12,288 costs what that rank exchanges, not the world.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx

from hgraph.comm_plan import ParamLayout
from hgraph.dims import BindingKey
from hgraph.meta import SlotKind
from hgraph.shard_rule import Range, optimizer_segments, shard_group_ranks
from hgraph.strategy import Cluster, RankCoord, Scheme, Strategy


@dataclass(frozen=True)
class RankRole:
    """What a rank does, independent of which pipeline it is in: its scheme and its coordinates in it
    (``RankCoord``'s, by what each dimension splits)."""

    scheme: Scheme
    stage: int
    tp_rank: int
    cp_rank: int
    replica: int = 0
    #: its EP rank (``RankCoord.doc_rank``): which experts it holds
    doc_rank: int = 0

    @classmethod
    def of(cls, scheme: Scheme, coord: "RankCoord") -> "RankRole":
        """The role of the rank at ``coord`` in a ``scheme`` pipeline."""
        return cls(scheme, coord.stage, coord.tp_rank, coord.cp_rank, coord.replica, coord.doc_rank)


@dataclass(frozen=True)
class ParamShard:
    """The part of one parameter a rank holds in the propagation phase.

    ``ranges`` are the index ranges along ``shard_dim`` of the full parameter that the rank needs,
    in order; concatenated they form the local shard, followed by ``pad`` zero rows (a vocabulary
    padded to a multiple of TP). Replicated parameters have ``tp_sharded == False`` and one range
    covering the whole dimension. ``experts``: of a stacked ``[E, ...]`` expert tensor under EP, the
    experts ``[lo, hi)`` along dimension 0 that the rank holds (``None``: all of them), each cut along
    ``shard_dim`` by ``ranges`` (its pull and push run per expert: ``expert_pieces``).
    """

    name: str
    full_shape: tuple[int, ...]
    shard_dim: int
    ranges: tuple[tuple[int, int], ...]
    pad: int = 0
    tp_sharded: bool = False
    experts: Optional[tuple[int, int]] = None

    @property
    def shard_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if shape:
            shape[self.shard_dim] = sum(hi - lo for lo, hi in self.ranges) + self.pad
        if self.experts is not None:
            shape[0] = self.experts[1] - self.experts[0]
        return tuple(shape)

    def _held(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` cut to the experts this rank holds (a view; ``full`` itself when it holds all)."""
        return full if self.experts is None else full.narrow(0, self.experts[0], self.experts[1] - self.experts[0])

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor ``full`` (a new tensor)."""
        if full.dim() == 0:
            return full.clone()
        full = self._held(full)
        parts = [full.narrow(self.shard_dim, lo, hi - lo) for lo, hi in self.ranges]
        if self.pad:
            shape = list(full.shape)
            shape[self.shard_dim] = self.pad
            parts.append(full.new_zeros(shape))
        return torch.cat(parts, dim=self.shard_dim) if len(parts) > 1 else parts[0].clone()

    def add_into(self, full: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Add a shard-shaped tensor (e.g. this rank's gradient) into its place in ``full``; the
        inverse of ``take`` (the padding rows are dropped). Returns ``full``."""
        if full.dim() == 0:
            return full.add_(shard)
        offset, held = 0, self._held(full)
        for lo, hi in self.ranges:
            held.narrow(self.shard_dim, lo, hi - lo).add_(shard.narrow(self.shard_dim, offset, hi - lo))
            offset += hi - lo
        return full

    def padding_of(self, shard: torch.Tensor) -> torch.Tensor:
        """The padding rows of a shard-shaped tensor (empty when there is no padding)."""
        return shard.narrow(self.shard_dim, shard.shape[self.shard_dim] - self.pad, self.pad)


@dataclass(frozen=True)
class ParamExchange:
    """What one parameter's Pull and Push are across the world, without their ops.

    Known from the parameter layout described per role (``Program.exchange``), so a rank reads it
    without planning any other rank: ``is_all_gather`` and ``is_plain_reduce_scatter`` equal the
    world plans' (``PullPlan.is_all_gather``, ``PushPlan.is_plain_reduce_scatter``), and so do
    ``all_gather_group`` and ``all_gather_segments``. ``group_size``: the ranks the optimizer shards
    the parameter over (``--shard-group``; the world by default).
    """

    param: ParamLayout
    is_all_gather: bool
    is_plain_reduce_scatter: bool
    group_size: int
    #: bytes per element the pull moves (the working dtype's: ``PullPlan.working_dtype_bytes``)
    working_dtype_bytes: int = 4

    def all_gather_group(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` all-gathers with, in chunk order (its shard group); empty unless
        ``is_all_gather``."""
        return shard_group_ranks(rank, self.group_size) if self.is_all_gather else ()

    @property
    def all_gather_segments(self) -> tuple[Range, ...]:
        """Rows contributed by each rank of an all-gather's group; empty unless ``is_all_gather``."""
        return tuple(optimizer_segments(self.param.size, self.group_size)) if self.is_all_gather else ()


@dataclass(frozen=True)
class GroupRound:
    """One partition of the world's ranks into process groups, as one rank sees it: ``key`` names the
    partition (the same on every rank, and for no other partition), ``part`` is this rank's group in
    it (the rank alone when it is in none). The runtime creates groups a round at a time, every rank
    its own part (``runtime/comm/process_groups``)."""

    key: Any
    part: tuple[int, ...]


@dataclass(frozen=True)
class SubgraphInfo:
    """One filled slot of a rank's program (for dumps and tests)."""

    kind: SlotKind
    param: Optional[str]
    ops: tuple[str, ...]
    peers: tuple[int, ...]
    bytes: int
    comm_point: Optional[str] = None


class RoleProgram:
    """The graph shared by all ranks of one role, with the parameter shards it holds.

    The graph is built on first use (``graph_module``): a process only ever runs its own rank's
    graph. A role's graph does not depend on the strategy, so Programs of one compiled model share it.
    ``recv_specs`` / ``send_specs``: (dims, dtype) of the activations received from the previous
    stage / sent to the next one, dims using ``"B"``/``"T"`` for the micro-batch's shape.
    """

    def __init__(self, role: RankRole, params: dict[str, ParamShard], blocks: tuple[str, ...],
                 build: Callable[[], tuple[fx.GraphModule, Any]]):
        self.role = role
        self.params = params
        self.blocks = blocks
        self._build = build
        self._gm: Optional[fx.GraphModule] = None
        self._specs: tuple[list[Any], list[Any]] = ([], [])

    @property
    def built(self) -> bool:
        return self._gm is not None

    @property
    def graph_module(self) -> fx.GraphModule:
        if self._gm is None:
            gm, ctx = self._build()
            self._specs = (list(ctx.recv_specs), list(ctx.send_specs))
            self._gm = gm
        return self._gm

    @property
    def recv_specs(self) -> list[Any]:
        self.graph_module
        return self._specs[0]

    @property
    def send_specs(self) -> list[Any]:
        self.graph_module
        return self._specs[1]


@dataclass
class RankProgram:
    """One rank's program: its role's graph, the ranks it talks to and its LNK ops.

    ``pull_by_param`` / ``push_by_param``: the ops of each parameter's pull / push plan that involve
    this rank (``plan.for_rank(rank)``), for every parameter it exchanges (an owner sends rows of
    parameters it does not hold), model order; ``pull_ops`` / ``push_ops`` flatten them over the
    parameters the rank holds. ``contributions``: the gradient rows this rank pushes of each
    parameter (``push_plan.contributions[rank]``; parameters it contributes nothing to left out).
    """

    rank: int
    pipeline: int
    role: RoleProgram
    bindings: Mapping[BindingKey, tuple[int, ...]]
    # () -> (pull_by_param, push_by_param): planned on first use, so that walking every rank for its
    # bindings (the groups of a strategy) plans nothing
    plan_lnk: Optional[Callable[[], tuple[Mapping[str, tuple[Any, ...]], Mapping[str, tuple[Any, ...]]]]] = \
        field(default=None, repr=False)
    describe: Optional[Callable[["RankProgram"], list[SubgraphInfo]]] = field(default=None, repr=False)
    # () -> {parameter: gradient rows this rank contributes}: from its role's shards, on first use
    plan_contributions: Optional[Callable[[], Mapping[str, tuple[Range, ...]]]] = field(default=None, repr=False)
    _subgraphs: Optional[list[SubgraphInfo]] = field(default=None, repr=False)
    _lnk: Optional[tuple[Mapping, Mapping]] = field(default=None, repr=False)
    _contributions: Optional[Mapping[str, tuple[Range, ...]]] = field(default=None, repr=False)

    def _lnk_ops(self) -> tuple[Mapping, Mapping]:
        if self._lnk is None:
            self._lnk = self.plan_lnk() if self.plan_lnk else ({}, {})
        return self._lnk

    @property
    def pull_by_param(self) -> Mapping[str, tuple[Any, ...]]:
        """Parameter -> this rank's ops of its pull plan (parameters it takes no part in left out)."""
        return self._lnk_ops()[0]

    @property
    def push_by_param(self) -> Mapping[str, tuple[Any, ...]]:
        """Parameter -> this rank's ops of its push plan (parameters it takes no part in left out)."""
        return self._lnk_ops()[1]

    @property
    def contributions(self) -> Mapping[str, tuple[Range, ...]]:
        """Parameter -> the gradient rows this rank contributes to its push (its push plan's
        ``contributions[rank]``; parameters it contributes nothing to left out)."""
        if self._contributions is None:
            self._contributions = self.plan_contributions() if self.plan_contributions else {}
        return self._contributions

    @property
    def pull_ops(self) -> list[Any]:
        """LNK ops of the pull plans of the parameters this rank holds, model order."""
        return [op for name in self.params for op in self.pull_by_param.get(name, ())]

    @property
    def push_ops(self) -> list[Any]:
        """LNK ops of the push plans of the parameters this rank holds, model order."""
        return [op for name in self.params for op in self.push_by_param.get(name, ())]

    @property
    def subgraphs(self) -> list[SubgraphInfo]:
        """The filled slots of this rank's graph, with peers and bytes (builds the graph if needed)."""
        if self._subgraphs is None:
            self._subgraphs = self.describe(self) if self.describe else []
        return self._subgraphs

    @property
    def stage(self) -> int:
        return self.role.role.stage

    @property
    def tp_rank(self) -> int:
        return self.role.role.tp_rank

    @property
    def cp_rank(self) -> int:
        return self.role.role.cp_rank

    @property
    def replica(self) -> int:
        return self.role.role.replica

    @property
    def doc_rank(self) -> int:
        return self.role.role.doc_rank

    @property
    def counts_loss(self) -> bool:
        """Whether this rank's loss sum is its share of the step's loss: on the last stage, and the first of
        the ranks that compute the same loss (its TP group's, its replicas'); each sequence rank holds
        its own tokens' part, and each EP rank its own documents'."""
        return self.stage == self.scheme.pp - 1 and self.tp_rank == 0 and self.replica == 0

    @property
    def scheme(self) -> Scheme:
        return self.role.role.scheme

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.role.graph_module

    @property
    def params(self) -> dict[str, ParamShard]:
        return self.role.params

    def set_working_params(self, tensors: Mapping[str, torch.Tensor], *,
                           requires_grad: bool = True) -> dict[str, torch.nn.Parameter]:
        """Put real working tensors (this rank's shards) in place of the graph's meta parameters."""
        gm = self.graph_module
        out: dict[str, torch.nn.Parameter] = {}
        for name in self.params:
            module_path, _, leaf = name.rpartition(".")
            owner = gm.get_submodule(module_path) if module_path else gm
            param = torch.nn.Parameter(tensors[name], requires_grad=requires_grad)
            setattr(owner, leaf, param)
            out[name] = param
        return out

    def load_full(self, full: Mapping[str, torch.Tensor], **kwargs) -> dict[str, torch.nn.Parameter]:
        """Load this rank's shards of full parameters (e.g. ``model.named_parameters()``)."""
        return self.set_working_params({n: s.take(full[n].detach()) for n, s in self.params.items()}, **kwargs)


class Program:
    """Everything needed to run one iteration of a strategy: one rank's part, or every rank's.

    A rank's part is built when asked (``rank(r)``): its role's graph on first use, its bindings and
    its LNK ops, in time and memory that follow what the rank exchanges, not the world size. ``ranks``
    builds every rank (dumps, tools); ``pull_plans`` / ``push_plans`` map each parameter (model order)
    to the plan of the whole world, each planned when first read.

    What a rank's runtime needs beyond its own ops comes without planning the world: the parameters
    in model order (``param_names``), their layouts (``param_layout``), what each one's pull and push
    are (``exchange``: all-gather? plain reduce-scatter?) and the process groups the rank is in
    (``binding_rounds``, ``replica_rounds``: its own, never the world's list), all from ``planner``
    (the compiler's per-strategy layout, described per role: ``passes.instantiate.StrategyLayout``).
    ``binding_groups`` / ``replica_groups`` list the world's groups (dumps, tests).
    """

    def __init__(self, strategy: Strategy, cluster: Cluster, stage_blocks: dict[int, tuple[tuple[str, ...], ...]],
                 build_rank: Callable[[int], RankProgram], pull_plans: Mapping[str, Any],
                 push_plans: Mapping[str, Any], *, sequence_parallel: bool = False,
                 sequence_parallel_note: str = "", planner: Any = None) -> None:
        self.strategy = strategy
        self.cluster = cluster
        self.stage_blocks = stage_blocks          # pp degree -> blocks of each stage
        self.pull_plans = pull_plans
        self.push_plans = push_plans
        self.compile_seconds = 0.0
        # whether the TP>1 pipelines run Megatron sequence parallelism, and why not when it was only the
        # default (the compile option ``sequence_parallel=None``) and the model does not allow it
        self.sequence_parallel = sequence_parallel
        self.sequence_parallel_note = sequence_parallel_note
        self.planner: Any = planner               # what builds the ranks (the compiler's per-strategy layout)
        self._build_rank = build_rank
        self._ranks: dict[int, RankProgram] = {}

    def __repr__(self) -> str:
        return f"Program({str(self.strategy)!r}, {self.cluster.world_size} ranks, {len(self._ranks)} built)"

    def rank(self, r: int) -> RankProgram:
        """Rank ``r``'s program (built on first use; only its own role, bindings and ops)."""
        r = operator.index(r)
        rp = self._ranks.get(r)
        if rp is None:
            if not 0 <= r < self.cluster.world_size:
                raise IndexError(f"rank {r} is outside the world of {self.cluster.world_size} ranks")
            rp = self._ranks[r] = self._build_rank(r)
        return rp

    @property
    def param_names(self) -> list[str]:
        """Every parameter, in model order (the order every rank walks the plans in); a stacked expert
        tensor under EP as its experts (``pieces``)."""
        return list(self.pull_plans)

    @property
    def pieces(self) -> Mapping[str, Any]:
        """The names in ``param_names`` that are one expert of a stacked expert tensor, each with its
        ``hgraph.expert_pieces.ExpertPiece`` (the tensor, the expert); empty where the strategy has no EP
        pipeline (such a tensor is then planned whole)."""
        return getattr(self.planner, "pieces", None) or {}

    def param_layout(self, name: str) -> ParamLayout:
        """The shape and shard dimension of parameter ``name`` (no plan made)."""
        return self.planner.param_layout(name)

    def exchange(self, name: str) -> ParamExchange:
        """What parameter ``name``'s pull and push are across the world (no plan made; equal to the
        world plans' ``is_all_gather`` / ``is_plain_reduce_scatter``)."""
        return self.planner.param_exchange(name)

    def binding_groups(self) -> list[tuple[int, ...]]:
        """Every group of more than one rank of a grouped dimension (``hgraph.dims.GROUPED``: every rank's
        TP, CP and Ulysses bindings), sorted, without building the ranks' programs."""
        return self.planner.binding_groups()

    def replica_groups(self) -> list[tuple[int, ...]]:
        """Every group of more than one rank that a reduce-scatter of the world's push plans runs in,
        sorted (the groups of ``push_plans[n].reduce_scatters``, from the layout per role: no plan
        made)."""
        return self.planner.replica_groups()

    def binding_rounds(self, rank: int) -> list[GroupRound]:
        """``rank``'s TP, CP and Ulysses groups as creation rounds (a partition of the world each; none
        where every rank of the strategy is alone in it), by rank arithmetic on its own coordinates."""
        return self.planner.binding_rounds(rank)

    def replica_rounds(self, rank: int) -> list[GroupRound]:
        """The groups ``rank``'s own push reduce-scatters run in, as creation rounds: one per distinct
        partition the world's push layouts make (its part: its replica group, or itself alone), read
        off the layout per role; the union of every rank's parts is ``replica_groups()``."""
        return self.planner.replica_rounds(rank)

    @property
    def ranks(self) -> "RankList":
        """Every rank's program, built as they are read (a caller that walks them all asks for the world)."""
        return RankList(self)

    def roles(self) -> list[RoleProgram]:
        """The distinct roles of every rank (builds every rank)."""
        seen: dict[int, RoleProgram] = {}
        for rp in self.ranks:
            seen.setdefault(id(rp.role), rp.role)
        return list(seen.values())


class RankList(Sequence):
    """``Program.ranks``: a sequence of every rank's program, each built when it is read."""

    def __init__(self, program: Program) -> None:
        self._program = program

    def __len__(self) -> int:
        return self._program.cluster.world_size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._program.rank(r) for r in range(len(self))[i]]
        if i < 0:
            i += len(self)
        return self._program.rank(i)
