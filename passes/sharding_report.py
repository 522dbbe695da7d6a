"""Which parameters tensor parallelism shards, and why each replicated one is not.

``sharding_report(hgraph, shapes, strategy)`` looks at every parameter read inside the repeated
blocks and, for each TP degree of the strategy, where a TP rank's shard comes from
(``shard_tp.TPShardPlanner``: split on a dim, or whole). A replicated parameter carries its reason:
for a linear the node that stopped it from pairing into a column/row group (``annotate`` records it
as ``NodeMeta.tp_reason``), else the kind of op that reads it (a norm weight, a bias added after the
all-reduce). The report gives, per TP degree, the fraction of the blocks' parameter bytes (and of
their 2-D weight bytes) that are sharded: a TP scheme that replicates much of the model pays TP's
communication without saving memory or time, and ``hgraph train`` warns about it. For each scheme with
expert parallelism it gives the share of the MoE blocks' parameter bytes an EP rank holds, alone and
with the scheme's TP (``EPSummary``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch.fx as fx

from hgraph.graph import POST, PRE
from hgraph.meta import OpKind, TPRole, get_meta
from hgraph.passes.expert_owners import held_experts, listed_experts, stacked_experts
from hgraph.passes.shard_tp import TPShardPlanner, param_uses
from hgraph.passes.tp_roles import is_moe_layer
from hgraph.strategy import Scheme, Strategy

#: a TP degree that leaves more than this fraction of the blocks' parameter bytes replicated is worth a warning
REPLICATED_WARNING = 0.10


@dataclass(frozen=True)
class Placement:
    """One parameter of a block under one TP degree."""

    name: str
    block: str
    shape: tuple[int, ...]
    nbytes: int
    sharded: bool
    dim: Optional[int]
    reason: Optional[str]       # why it is whole (None when sharded)


@dataclass(frozen=True)
class TPSummary:
    tp: int
    placements: tuple[Placement, ...]

    def fraction_sharded(self, matrices_only: bool = False) -> float:
        """Bytes of the blocks' parameters (or 2-D weights) a TP rank holds a slice of, over all of them."""
        chosen = [p for p in self.placements if len(p.shape) == 2 or not matrices_only]
        total = sum(p.nbytes for p in chosen)
        return sum(p.nbytes for p in chosen if p.sharded) / total if total else 1.0

    def first_replicated(self) -> Optional[Placement]:
        """The largest replicated parameter (the one to look at first)."""
        whole = [p for p in self.placements if not p.sharded]
        return max(whole, key=lambda p: p.nbytes) if whole else None


@dataclass(frozen=True)
class EPSummary:
    """What a rank of a ``TP<tp>..EP<ep>`` scheme holds of the MoE blocks' parameters (the blocks with an
    MoE op): bytes, averaged over the scheme's EP (and TP) ranks (``expert_owners.held_experts``: its own
    experts, TP-sharded inside; the router, attention and shared experts as TP shards them)."""

    tp: int
    ep: int
    total_bytes: int
    ep_rank_bytes: float           # an EP rank of the scheme without TP (EP alone)
    rank_bytes: float              # a rank of the scheme (TP x EP)

    def fraction_held(self, with_tp: bool = True) -> float:
        """The share of the MoE blocks' parameter bytes a rank holds (``with_tp=False``: EP alone)."""
        held = self.rank_bytes if with_tp else self.ep_rank_bytes
        return held / self.total_bytes if self.total_bytes else 1.0


@dataclass(frozen=True)
class ShardingReport:
    model: str
    strategy: str
    summaries: tuple[TPSummary, ...]
    expert_parallel: tuple[EPSummary, ...] = ()

    def warnings(self) -> list[str]:
        """One line per TP degree that replicates more than ``REPLICATED_WARNING`` of the blocks' bytes."""
        out = []
        for s in self.summaries:
            replicated = 1.0 - s.fraction_sharded()
            if replicated > REPLICATED_WARNING:
                first = s.first_replicated()
                out.append(f"TP{s.tp} leaves {100 * replicated:.0f}% of the blocks' parameter bytes of {self.model} "
                           f"replicated (largest: {first.name}, {first.reason}); `hgraph dump --format report` "
                           "lists every parameter")
        return out

    def text(self) -> str:
        lines = [f"sharding report of {self.model} for {self.strategy}"]
        for e in self.expert_parallel:
            lines.append(f"EP{e.ep}: an EP rank holds {100 * e.fraction_held(False):.1f}% of the MoE blocks' "
                         f"parameter bytes" + (f", a TP{e.tp} x EP{e.ep} rank {100 * e.fraction_held():.1f}%"
                                               if e.tp > 1 else ""))
        if not self.summaries:
            lines.append("no scheme with TP > 1: every rank of a pipeline stage holds its parameters whole")
        for s in self.summaries:
            lines.append(f"TP{s.tp}: {100 * s.fraction_sharded():.1f}% of the blocks' parameter bytes sharded "
                         f"({100 * s.fraction_sharded(True):.1f}% of their 2-D weight bytes)")
            groups: list[tuple[list[str], list[tuple], list]] = []
            for block, rows in _by_block(s.placements).items():
                alike = [(rel, shape, re.sub(r"_\d+\b", "", where)) for rel, shape, where in rows]   # node numbers aside
                if groups and groups[-1][2] == alike:
                    groups[-1][0].append(block)
                else:
                    groups.append(([block], rows, alike))
            for blocks, rows, _ in groups:
                title = blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)} blocks alike)"
                lines.append(f"  {title}:")
                width = max(len(r[0]) for r in rows)
                for rel, shape, where in rows:
                    lines.append(f"    {rel:<{width}}  {str(list(shape)):<14} {where}")
        return "\n".join(lines) + "\n"


def _by_block(placements: tuple[Placement, ...]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for p in placements:
        rel = p.name[len(p.block) + 1:] if p.name.startswith(p.block + ".") else p.name
        where = f"split on dim {p.dim}" if p.sharded else f"whole: {p.reason}"
        out.setdefault(p.block, []).append((rel, p.shape, where))
    return out


def _reason(name: str, uses: list[fx.Node]) -> str:
    """Why a parameter is whole when its uses are not a blocked linear."""
    for op in uses:
        m = get_meta(op)
        if m.tp_reason:
            return m.tp_reason
    op = uses[0] if uses else None
    if op is None:
        return "not read by any op"
    m = get_meta(op)
    kind = m.op.value if isinstance(m.op, OpKind) else str(m.op)
    if m.tp_role == TPRole.ROW:
        return "the bias of a row-parallel linear, added after the all-reduce"
    target = getattr(op.target, "__name__", str(op.target))
    return f"read by {target} ({kind}), which works on the whole hidden state"


def sharding_report(hg: Any, shapes: dict, strategy: Strategy) -> ShardingReport:
    """The report of ``hg`` (an HGraph) for the TP degrees of ``strategy``."""
    planner = TPShardPlanner(hg, shapes)
    uses = param_uses(hg.gm)
    tps = sorted({p.tp for p in strategy.pipelines if p.tp > 1})
    summaries = []
    for tp in tps:
        rows = []
        for name, info in hg.params.items():
            block = info.block
            if block in (None, PRE, POST):
                continue
            shard = planner.shard(name, tp, 0)
            shape = tuple(info.shape)
            nbytes = info.shape.numel() * info.dtype.itemsize
            reason = None if shard.tp_sharded else _reason(name, uses.get(name, []))
            rows.append(Placement(name, block, shape, nbytes, shard.tp_sharded,
                                  shard.shard_dim if shard.tp_sharded else None, reason))
        summaries.append(TPSummary(tp, tuple(rows)))
    model = type(hg.model).__name__ if hg.model is not None else "the model"
    degrees = sorted({(p.tp, p.ep) for p in strategy.pipelines if p.ep > 1})
    return ShardingReport(model, str(strategy), tuple(summaries),
                          tuple(expert_parallel_summary(hg, planner, tp, ep) for tp, ep in degrees))


def expert_parallel_summary(hg: Any, planner: TPShardPlanner, tp: int, ep: int) -> EPSummary:
    """What a rank of a ``TP<tp>PP1EP<ep>`` scheme holds of the MoE blocks' parameters (``EPSummary``)."""
    blocks = {get_meta(n).block for n in hg.gm.graph.nodes if is_moe_layer(n)}
    names = [n for n, info in hg.params.items() if info.block in blocks]
    listed, stacked = listed_experts(hg), stacked_experts(hg)
    itemsize = {n: hg.params[n].dtype.itemsize for n in names}

    def held_bytes(degree: int) -> float:
        scheme = Scheme.parse(f"TP{degree}PP1EP{ep}")
        out = 0
        for t in range(degree):
            shards = {n: planner.shard(n, degree, t) for n in names}
            for e in range(ep):
                for n, shard in held_experts(shards, scheme, e, listed, stacked).items():
                    out += math.prod(replace(shard, pad=0).shard_shape) * itemsize[n]
        return out / (degree * ep)

    total = sum(hg.params[n].shape.numel() * itemsize[n] for n in names)
    return EPSummary(tp, ep, total, held_bytes(1), held_bytes(tp))
