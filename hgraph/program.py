"""The result of instantiating an HGraph for one strategy: a program per rank.

Ranks that play the same role (same scheme, stage, TP rank and CP rank, in different pipelines)
share one GraphModule: their graphs differ only in which ranks they talk to, and that lives in the
rank's ``bindings`` (a group name such as ``"tp"`` or ``"pp_next"`` -> ranks), which the runtime
resolves when it runs the graph. This keeps instantiation for 64+ ranks cheap.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx

from hgraph.meta import SlotKind
from hgraph.strategy import Cluster, Scheme, Strategy


@dataclass(frozen=True)
class RankRole:
    """What a rank does, independent of which pipeline it is in."""

    scheme: Scheme
    stage: int
    tp_rank: int
    cp_rank: int


@dataclass(frozen=True)
class ParamShard:
    """The part of one parameter a rank holds in the propagation phase.

    ``ranges`` are the index ranges along ``shard_dim`` of the full parameter that the rank needs,
    in order; concatenated they form the local shard, followed by ``pad`` zero rows (a vocabulary
    padded to a multiple of TP). Replicated parameters have ``tp_sharded == False`` and one range
    covering the whole dimension.
    """

    name: str
    full_shape: tuple[int, ...]
    shard_dim: int
    ranges: tuple[tuple[int, int], ...]
    pad: int = 0
    tp_sharded: bool = False

    @property
    def shard_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if shape:
            shape[self.shard_dim] = sum(hi - lo for lo, hi in self.ranges) + self.pad
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor ``full`` (a new tensor)."""
        if full.dim() == 0:
            return full.clone()
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
        offset = 0
        for lo, hi in self.ranges:
            full.narrow(self.shard_dim, lo, hi - lo).add_(shard.narrow(self.shard_dim, offset, hi - lo))
            offset += hi - lo
        return full

    def padding_of(self, shard: torch.Tensor) -> torch.Tensor:
        """The padding rows of a shard-shaped tensor (empty when there is no padding)."""
        return shard.narrow(self.shard_dim, shard.shape[self.shard_dim] - self.pad, self.pad)


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
    graph, so a Program for 64 ranks plans every rank but compiles only what is asked for.
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
    """One rank's program: its role's graph plus the ranks it talks to."""

    rank: int
    pipeline: int
    role: RoleProgram
    bindings: Mapping[str, tuple[int, ...]]
    pull_ops: list[Any] = field(default_factory=list)      # LNK ops of the pull plans involving this rank
    push_ops: list[Any] = field(default_factory=list)
    describe: Optional[Callable[["RankProgram"], list[SubgraphInfo]]] = field(default=None, repr=False)
    _subgraphs: Optional[list[SubgraphInfo]] = field(default=None, repr=False)

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


@dataclass
class Program:
    """Everything needed to run one iteration of a strategy on every rank."""

    strategy: Strategy
    cluster: Cluster
    ranks: list[RankProgram]
    stage_blocks: dict[int, tuple[tuple[str, ...], ...]]   # pp degree -> blocks of each stage
    pull_plans: dict[str, Any]
    push_plans: dict[str, Any]
    compile_seconds: float = 0.0
    # whether the TP>1 pipelines run Megatron sequence parallelism, and why not when it was only the
    # default (the compile option ``sequence_parallel=None``) and the model does not allow it
    sequence_parallel: bool = False
    sequence_parallel_note: str = ""

    def rank(self, r: int) -> RankProgram:
        return self.ranks[r]

    def roles(self) -> list[RoleProgram]:
        seen: dict[int, RoleProgram] = {}
        for rp in self.ranks:
            seen.setdefault(id(rp.role), rp.role)
        return list(seen.values())
