"""Instantiate an HGraph for one strategy: run the per-role pass pipeline and plan pull / push.

Ranks of the same role (scheme, stage, TP rank, sequence rank, replica: ``RankRole``) share one compiled
GraphModule; a rank's
``bindings`` (``Strategy.bindings``, keyed by ``hgraph.dims.BindingKey``) say which ranks its TP, CP
(the CP ring through it), Ulysses (its all-to-all group) groups and its previous and next stage are.
A rank's LNK ops (who sends which rows to whom) are planned for that rank alone, from the parameter
layout described per role (``StrategyLayout``, ``passes/lnk/rank_plans``); the plans of the whole
world are planned per parameter only when read (``Program.pull_plans``).
"""
from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from hgraph import dims, ops
from hgraph.comm_plan import ParamLayout, PullPlan, PushPlan
from hgraph.errors import StrategyError
from hgraph.expert_pieces import piece_name, pieces_of, split_shards
from hgraph.graph import HGraph
from hgraph.meta import SlotKind, get_meta
from hgraph.options import CompileOptions
from hgraph.passes.context import PassContext
from hgraph.passes.expert_owners import check_expert_split, held_experts, listed_experts, stacked_experts
from hgraph.passes.lnk.mutual_slices import normalise_ranges
from hgraph.passes.lnk.plans import reduce_scatters_range, scatter_block_count
from hgraph.passes.lnk.rank_plans import RoleLayout, RoleRanks, WorkCount, push_groups, rank_pull_ops, rank_push_ops
from hgraph.passes.lnk.shard_groups import shard_group_pull_plan, shard_group_push_plan
from hgraph.passes.pipeline import instantiation_passes, run_passes
from hgraph.passes.sequence_parallel import SequenceParallelRefused, model_sequence_parallel
from hgraph.passes.shard_tp import TPShardPlanner
from hgraph.passes.stage_split import block_param_costs, split_stages, stage_of_blocks
from hgraph.program import (GroupRound, ParamExchange, ParamShard, Program, RankProgram, RankRole, RoleProgram,
                            SubgraphInfo)
from hgraph.shard_rule import Range
from hgraph.strategy import Cluster, Scheme, Strategy


def validate_for_model(strategy: Strategy, cluster: Cluster, hg: Any) -> None:
    """Strategy checks that need the model: heads and hidden sizes TP must divide."""
    strategy.validate(cluster)
    for p in sorted(set(strategy.pipelines)):
        validate_scheme_for_model(p, hg)


def validate_scheme_for_model(p: Scheme, hg: Any) -> None:
    """The checks of one scheme that need the model (``validate_for_model``)."""
    cfg = hg.model_config
    heads = getattr(cfg, "num_heads", None)
    kv = getattr(cfg, "num_kv_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None)
    if heads and heads % p.tp:
        raise StrategyError(f"scheme {p}: TP={p.tp} does not divide the model's {heads} attention heads; "
                            f"allowed TP degrees divide {heads}")
    if kv and kv % p.tp and p.tp % kv:
        raise StrategyError(f"scheme {p}: TP={p.tp} and the model's {kv} key/value heads do not divide "
                            "one another; allowed TP degrees divide or are multiples of it")
    if hidden and hidden % p.tp:
        raise StrategyError(f"scheme {p}: TP={p.tp} does not divide the hidden size {hidden}")
    check_expert_split(p, hg)


def _param_root(params: dict[str, ParamShard], dtype: Optional[torch.dtype]) -> nn.Module:
    """A module holding shape-only (meta) working parameters under their FQNs."""
    root = nn.Module()
    for name, shard in params.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.empty(shard.shard_shape, device="meta",
                                                              dtype=dtype or torch.float32)))
    return root


def build_role_module(hg: HGraph, role: RankRole, stage_blocks: tuple[tuple[str, ...], ...], shapes: dict,
                      options: CompileOptions, params: dict[str, ParamShard],
                      sp: Any = None) -> tuple[fx.GraphModule, PassContext]:
    """Run the instantiation passes for one role and generate its module (done on first use); ``sp``:
    the sequence-parallel plan when the role runs SP."""
    ctx = PassContext(hg, role, stage_blocks, shapes, options, params=dict(params),
                      sp=sp if role.scheme.tp > 1 else None)
    gm = run_passes(hg.gm, ctx, instantiation_passes(), disabled=options.disabled_passes)
    root = _param_root(ctx.params, options.working_dtype)
    _copy_constants(hg.gm, gm.graph, root)
    name = f"Rank_{role.scheme}_s{role.stage}_t{role.tp_rank}_c{role.cp_rank}" + (
        f"_r{role.replica}" if role.scheme.replicas > 1 else "") + (
        f"_e{role.doc_rank}" if role.scheme.doc_ranks > 1 else "")
    return fx.GraphModule(root, gm.graph, class_name=name), ctx


def _copy_constants(src: nn.Module, graph: fx.Graph, root: nn.Module) -> None:
    """Buffers and tensor constants the graph reads (anything but parameters) come from the HGraph."""
    for n in graph.nodes:
        if n.op != "get_attr":
            continue
        *path, leaf = n.target.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        if hasattr(mod, leaf):
            continue
        value = src
        for part in n.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            mod.register_buffer(leaf, value)
        else:
            setattr(mod, leaf, value)


def push_contribution(shard: ParamShard, scheme: Scheme, tp_rank: int, info: Any,
                      sp_partial: bool = False, replica: int = 0) -> tuple[Range, ...]:
    """The ranges a rank contributes to the gradient of a parameter, so every pipeline counts each
    element once (empty: nothing).

    A parameter replicated across a TP group gets identical gradients on its TP ranks (its inputs are
    replicated), so the range is split among them; TP-sharded slices, CP ranks (different tokens), a
    whole parameter read on TP-sharded heads (``tp_partial``: each rank's gradient covers its heads) and,
    under sequence parallelism, one used only on token-sliced values (``sp_partial``: each TP rank's
    gradient covers its tokens) contribute what they hold. The ranks of a dimension that splits nothing
    (``hgraph.dims.Splits.REPLICAS``: ``replica`` of ``scheme.replicas``) compute the same gradients of
    everything they hold, so each contributes its share of that too.
    """
    share, of = replica, scheme.replicas
    if not (shard.tp_sharded or scheme.tp == 1 or info.tp_partial or sp_partial):
        share, of = share * scheme.tp + tp_rank, of * scheme.tp
    if of == 1:
        return tuple(shard.ranges)
    return _share_of(shard.ranges, share, of)


def _share_of(ranges, share: int, of: int) -> tuple[Range, ...]:
    """Share ``share`` of ``of`` near-equal shares of the rows ``ranges`` hold, in order (one range:
    ``[lo + n * share // of, lo + n * (share + 1) // of)``)."""
    total = sum(hi - lo for lo, hi in ranges)
    first, last = total * share // of, total * (share + 1) // of
    out, offset = [], 0
    for lo, hi in ranges:
        a, b = max(first - offset, 0), min(last - offset, hi - lo)
        if b > a:
            out.append((lo + a, lo + b))
        offset += hi - lo
    return tuple(out)


def stage_params(hg: Any, stage_blocks) -> list[set[str]]:
    """The parameters each stage uses (a tied parameter may be in several stages)."""
    stage_of = stage_of_blocks(stage_blocks)
    out: list[set[str]] = [set() for _ in stage_blocks]
    for name, p in hg.params.items():
        for block in getattr(p, "use_blocks", None) or (p.block,):
            out[stage_of[block] if block in stage_of else 0].add(name)
    return out


class ParamLayouts:
    """The parameter shards a rank holds in the propagation phase, by scheme, stage and TP rank: the
    stage split (balanced parameter elements) and the TP shard rules, without graphs or LNK plans.

    ``instantiate`` takes every rank's shards from here, and so does whoever needs only the layout
    (``CompiledModule.param_shards``: the memory a strategy's working tensors take, for any model
    size and world size, in milliseconds); CP does not shard parameters.
    """

    def __init__(self, hg: Any, shapes: dict) -> None:
        self.hg = hg
        self.shapes = shapes
        numel = {n: int(torch.Size(p.shape).numel()) for n, p in hg.params.items()}
        self._costs = block_param_costs(hg.gm, numel)
        self._planner = TPShardPlanner(hg, shapes)
        self._stage_blocks: dict[int, tuple[tuple[str, ...], ...]] = {}
        self._held: dict[int, list[set[str]]] = {}
        self._experts: Optional[dict[str, tuple[int, int]]] = None
        self._stacked: Optional[dict[str, int]] = None
        self._roles: dict[RankRole, RoleProgram] = {}
        self._params: dict[tuple[int, int, int, int], dict[str, ParamShard]] = {}

    def stage_blocks(self, pp: int) -> tuple[tuple[str, ...], ...]:
        """The repeated blocks of each of ``pp`` stages."""
        if pp not in self._stage_blocks:
            self._stage_blocks[pp] = split_stages(self.hg.blocks, self._costs, pp)
            self._held[pp] = stage_params(self.hg, self._stage_blocks[pp])
        return self._stage_blocks[pp]

    def params(self, scheme: Scheme, stage: int, tp_rank: int, doc_rank: int = 0) -> dict[str, ParamShard]:
        """The shards of the rank at ``stage``, ``tp_rank`` and EP rank ``doc_rank`` of a ``scheme`` pipeline, in
        model order (kept: callers must not change the dict): under EP its own experts only
        (``passes/expert_owners``)."""
        ep = scheme.doc_ranks
        key = (scheme.pp, scheme.tp, stage, tp_rank, ep, doc_rank if ep > 1 else 0)
        shards = self._params.get(key)
        if shards is None:      # once per model and placement: every strategy using it reads this one
            if ep > 1:
                shards = held_experts(self.params(Scheme(scheme.tp, scheme.pp), stage, tp_rank), scheme, doc_rank,
                                      self._listed_experts(), self.stacked_experts())
            else:
                self.stage_blocks(scheme.pp)
                held = self._held[scheme.pp][stage]
                shards = {n: self._planner.shard(n, scheme.tp, tp_rank) for n in self.hg.params if n in held}
            self._params[key] = shards
        return shards

    def _listed_experts(self) -> dict[str, tuple[int, int]]:
        if self._experts is None:
            self._experts = listed_experts(self.hg)
        return self._experts

    def stacked_experts(self) -> dict[str, int]:
        """The stacked / fused expert tensors and their number of experts (``expert_owners.stacked_experts``)."""
        if self._stacked is None:
            self._stacked = stacked_experts(self.hg)
        return self._stacked

    def role_program(self, role: RankRole, options: CompileOptions, sp: Any) -> RoleProgram:
        """The program of ``role`` (its graph built on first use), one per role for every strategy: a
        role's graph depends on its scheme, stage, TP and CP rank, not on the pipelines beside it."""
        prog = self._roles.get(role)
        if prog is None:
            params = self.params(role.scheme, role.stage, role.tp_rank, role.doc_rank)
            blocks = self.stage_blocks(role.scheme.pp)
            build = functools.partial(build_role_module, self.hg, role, blocks, self.shapes, options, params, sp)
            prog = self._roles[role] = RoleProgram(role, params, tuple(blocks[role.stage]), build)
        return prog


class ParamRole(NamedTuple):
    """A role as far as parameters go: the ranks of a role's sequence ranks (different tokens, the same
    shards) hold the same rows and each pushes its own gradient of them; the replica (``RankCoord``'s)
    is part of it because replicas push different shares, and the EP rank (``doc_rank``) because EP ranks
    hold different experts (their dense parameters alike, each pushing its own documents' gradient)."""

    scheme: Scheme
    stage: int
    tp_rank: int
    replica: int = 0
    doc_rank: int = 0

    @classmethod
    def of(cls, scheme: Scheme, coord: Any) -> "ParamRole":
        """The parameter role of the rank at ``coord`` (a ``RankCoord``) in a ``scheme`` pipeline."""
        return cls(scheme, coord.stage, coord.tp_rank, coord.replica, coord.doc_rank)

    @classmethod
    def at(cls, scheme: Scheme, local: int) -> "ParamRole":
        """The parameter role of the pipeline's rank ``local`` (0-based inside it)."""
        stage, tp_rank, _, replica, doc_rank = scheme.coordinates(local)
        return cls(scheme, stage, tp_rank, replica, doc_rank)


class StrategyLayout:
    """One strategy's parameter layout described per role, and one rank's plans from it.

    ``rank_program(r)`` builds rank ``r``'s program: its role (graph shared per model and role through
    ``ParamLayouts``), bindings and LNK ops, visiting only the ranks it exchanges with and the groups it
    reduces with (``passes/lnk/rank_plans``); ``pull_plan(name)`` / ``push_plan(name)`` plan the whole
    world (the reference the rank's ops equal, and what a caller asking for every rank reads).
    ``param_exchange(name)`` (is the pull an all-gather, the push a plain reduce-scatter?) and
    ``replica_groups()`` (the groups of the world's reduce-scatters) are read off the role layout by
    rank arithmetic, without planning: what a rank's runtime needs of the world.
    """

    def __init__(self, hg: Any, strategy: Strategy, cluster: Cluster, options: CompileOptions, shapes: dict,
                 layouts: ParamLayouts, sp: Any) -> None:
        self.hg, self.strategy, self.cluster, self.options = hg, strategy, cluster, options
        self.shapes, self.layouts, self.sp = shapes, layouts, sp
        # a strategy with an EP pipeline plans each stacked expert tensor as its experts (``expert_pieces``)
        self.stacked = layouts.stacked_experts() if any(p.doc_ranks > 1 for p in strategy.pipelines) else {}
        self.pieces = pieces_of(self.stacked)
        self.order = [n for name in hg.params      # model order: every rank walks the plans in this order
                      for n in ([piece_name(name, e) for e in range(self.stacked[name])] if name in self.stacked
                                else [name])]
        self.wbytes = (options.working_dtype or torch.float32).itemsize
        # the pipelines of each scheme, as runs of consecutive indices (no walk over the pipelines)
        self._runs: dict[Scheme, list[range]] = {}
        first = 0
        for count, scheme in strategy.groups():
            self._runs.setdefault(scheme, []).append(range(first, first + count))
            first += count
        self.param_roles: list[ParamRole] = [ParamRole(p, stage, t, r, e) for p in self._runs for stage in range(p.pp)
                                             for t in range(p.tp) for r in range(p.replicas)
                                             for e in range(p.doc_ranks)]
        self._params = {pr: split_shards(layouts.params(pr.scheme, pr.stage, pr.tp_rank, pr.doc_rank), self.stacked)
                        for pr in self.param_roles}
        self.roles = RoleRanks(self._ranks_of)
        self._ops: dict[tuple, tuple[tuple, tuple]] = {}     # layers of one layout share a rank's ops
        self._exchanges: dict[str, ParamExchange] = {}
        self._kinds: dict[tuple, tuple[bool, bool]] = {}      # layers of one layout share their kinds
        self._replica_groups: Optional[list[tuple[int, ...]]] = None
        # set to a list to count what each rank's build visits: (parameter, rank, WorkCount) per plan made
        self.work_log: Optional[list[tuple[str, int, WorkCount]]] = None

    def _ranks_of(self, pr: ParamRole) -> list[int]:
        scheme, stage, t, replica, doc_rank = pr
        return [self.strategy.rank_of(i, stage, t, c, replica, doc_rank) for run in self._runs[scheme] for i in run
                for c in range(scheme.seq)]

    def _info(self, name: str) -> Any:
        """The model's ``ParamInfo`` of ``name`` (a piece's: its stacked parameter's)."""
        piece = self.pieces.get(name)
        return self.hg.params[piece.param if piece is not None else name]

    def param_layout(self, name: str) -> ParamLayout:
        info = self._info(name)
        shape = tuple(info.shape)
        if name in self.pieces:         # one expert of a stacked tensor: the expert axis dropped
            return ParamLayout(name, shape[1:], info.shard_dim - 1)
        return ParamLayout(name, shape, info.shard_dim if shape else 0)

    def needs(self, name: str) -> RoleLayout:
        """The rows of ``name`` each role needs in the working dtype."""
        return tuple((pr, tuple(self._params[pr][name].ranges)) for pr in self.param_roles
                     if name in self._params[pr])

    def contributions(self, name: str) -> RoleLayout:
        """The gradient rows of ``name`` each role contributes (roles contributing nothing left out)."""
        info = self._info(name)
        sp_partial = self.sp is not None and info.name in self.sp.partial_grads
        out = []
        for pr in self.param_roles:
            shard = self._params[pr].get(name)
            if shard is not None:
                ranges = push_contribution(shard, pr.scheme, pr.tp_rank, info, sp_partial, pr.replica)
                if ranges:
                    out.append((pr, ranges))
        return tuple(out)

    def rank_lnk_ops(self, name: str, rank: int, role: ParamRole, world_size: int) -> tuple[tuple, tuple]:
        """The pull and push ops of ``rank`` for parameter ``name`` against the optimizer layout of
        ``world_size`` even segments: the one place a rank's LNK ops are made."""
        layout = self.param_layout(name)
        needs, contributions = self.needs(name), self.contributions(name)
        key = (layout.shape, layout.shard_dim, needs, contributions, rank, world_size)
        ops = self._ops.get(key)
        if ops is None:
            work = WorkCount() if self.work_log is not None else None
            pull = rank_pull_ops(layout, needs, role, rank, world_size, self.roles, self.wbytes, work)
            push = rank_push_ops(layout, contributions, role, rank, world_size, self.cluster.gpus_per_node,
                                 self.roles, work=work)
            ops = self._ops[key] = (pull, push)
            if work is not None:
                self.work_log.append((name, rank, work))
        return ops

    def rank_program(self, rank: int, describe: Callable) -> RankProgram:
        c = self.strategy.coord(rank)
        scheme = self.strategy.pipelines[c.pipeline]
        role = self.layouts.role_program(RankRole.of(scheme, c), self.options, self.sp)
        plan_lnk = functools.partial(self.rank_plans, rank, ParamRole.of(scheme, c))
        contributions = functools.partial(self.role_contributions, ParamRole.of(scheme, c))
        return RankProgram(c.rank, c.pipeline, role, self.strategy.bindings(c.rank), plan_lnk, describe,
                           contributions)

    def role_contributions(self, pr: ParamRole) -> dict[str, tuple[Range, ...]]:
        """The gradient rows a rank of role ``pr`` contributes of each parameter (model order; those it
        contributes nothing to left out): its push plans' ``contributions[rank]``."""
        shards = self._params[pr]
        partial = self.sp.partial_grads if self.sp is not None else ()
        out = {}
        for name in self.order:
            shard = shards.get(name)
            if shard is not None:
                info = self._info(name)
                ranges = push_contribution(shard, pr.scheme, pr.tp_rank, info, info.name in partial, pr.replica)
                if ranges:
                    out[name] = tuple(normalise_ranges(ranges))
        return out

    # ---- what a rank needs to know of the world, without planning it ----

    def param_exchange(self, name: str) -> ParamExchange:
        """Whether ``name``'s pull is an all-gather and its push a plain reduce-scatter, exactly as the
        world's plans say (``pull_plan(name).is_all_gather``, ``push_plan(name).is_plain_reduce_scatter``),
        from the role layout: O(roles), and O(a pipeline's ranks) where replica groups holding the
        whole parameter may split a shard group (``groups_keep_to_shard_groups``)."""
        ex = self._exchanges.get(name)
        if ex is None:
            layout = self.param_layout(name)
            needs, contributions = self.needs(name), self.contributions(name)
            key = (layout.size, needs, contributions)
            kinds = self._kinds.get(key)
            if kinds is None:
                kinds = self._kinds[key] = (self._all_gather(layout.size, needs),
                                            self._plain_reduce_scatter(layout.size, contributions))
            ex = self._exchanges[name] = ParamExchange(layout, *kinds, self.cluster.group_size, self.wbytes)
        return ex

    def _whole_everywhere(self, size: int, layout: RoleLayout) -> bool:
        """Every rank of the world holds exactly the rows ``[0, size)`` (the roles partition the world;
        empty ranges do not count)."""
        whole = ((0, size),)
        return (size > 0 and len(layout) == len(self.param_roles)
                and all(tuple(sorted(r for r in normalise_ranges(ranges) if r[0] < r[1])) == whole
                        for _, ranges in layout))

    def _all_gather(self, size: int, needs: RoleLayout) -> bool:
        """``pull_plan.is_all_gather``: every rank needs the whole parameter, as one range (the same
        inside every shard group)."""
        whole = ((0, size),)
        return (size > 0 and len(needs) == len(self.param_roles)
                and all(tuple(normalise_ranges(ranges)) == whole for _, ranges in needs))

    def _plain_reduce_scatter(self, size: int, contributions: RoleLayout) -> bool:
        """``push_plan.is_plain_reduce_scatter``: every rank contributes the whole parameter and every
        shard group (the world by default) is one replica group, which then reduce-scatters onto the
        optimizer segments with nothing left to send."""
        if not self._whole_everywhere(size, contributions):
            return False
        groups = push_groups(contributions, self.roles)
        group_size = self.cluster.group_size
        if len(groups) == 1 or group_size == 1:
            return True
        # replica groups that all hold the whole parameter (their ranges differ only in empty ones):
        # plain where no shard group has ranks of two of them
        return groups_keep_to_shard_groups(self.strategy, {pr: i for i, (_, roles) in enumerate(groups)
                                                           for pr in roles}, group_size)

    def binding_groups(self) -> list[tuple[int, ...]]:
        """Every group of more than one rank of a grouped dimension (``hgraph.dims.GROUPED``: every rank's
        TP, CP and Ulysses bindings), sorted, by rank arithmetic: no rank's program is built."""
        out = {tuple(g) for r in range(self.cluster.world_size) for d in dims.GROUPED
               for g in [self.strategy.group(d, r)] if len(g) > 1}
        return sorted(out)

    def replica_groups(self) -> list[tuple[int, ...]]:
        """Every group (of more than one rank) that a reduce-scatter of the world's push plans runs in,
        sorted: ``{rs.group for every push plan, rs in plan.reduce_scatters}``, from the role layout (the
        replica groups of each distinct contribution layout, cut at the shard groups' edges, and kept
        where one of their ranges spans as many optimizer segments as they have members), in
        O(roles x their ranks) integers."""
        if self._replica_groups is None:
            group_size, world = self.cluster.group_size, self.cluster.world_size
            members_of: dict[tuple, tuple[int, ...]] = {}
            out: set[tuple[int, ...]] = set()
            for size, groups in self._distinct_push_groups():
                for ranges, roles in groups:
                    members = members_of.get(roles)
                    if members is None:
                        members = members_of[roles] = tuple(sorted(r for pr in roles for r in self.roles.of(pr)))
                    if not ranges or len(members) < 2:
                        continue
                    parts = [members] if group_size == world else _cut_at(members, group_size)
                    out.update(part for part in parts if len(part) > 1 and any(
                        reduce_scatters_range(lo, hi, len(part), size, group_size) for lo, hi in ranges))
            self._replica_groups = sorted(out)
        return list(self._replica_groups)

    # ---- the process groups one rank creates, as rounds (``hgraph.program.GroupRound``) ----

    def binding_rounds(self, rank: int) -> list[GroupRound]:
        """``rank``'s group of every grouped dimension (``hgraph.dims.GROUPED``: TP, CP, Ulysses) as
        creation rounds, from its coordinates: a dimension whose groups are all single ranks makes no
        round. The innermost dimension's groups (TP's) are consecutive blocks, so its key is the blocks'
        sizes (equal TP layouts of two strategies are one partition); the others' is the strategy."""
        runs = self.strategy.groups()
        out = []
        for d in dims.GROUPED:
            if not any(d.degree(p) > 1 for _, p in runs):
                continue
            if d is dims.LAYOUT[0]:
                blocks: list[list[int]] = []        # [degree, blocks of it] in rank order, merged
                for count, p in runs:
                    if blocks and blocks[-1][0] == d.degree(p):
                        blocks[-1][1] += count * p.num_ranks // d.degree(p)
                    else:
                        blocks.append([d.degree(p), count * p.num_ranks // d.degree(p)])
                key: tuple = (d.key, tuple(map(tuple, blocks)))
            else:
                key = (d.key, str(self.strategy))
            out.append(GroupRound(key, tuple(self.strategy.group(d, rank))))
        return out

    def replica_rounds(self, rank: int) -> list[GroupRound]:
        """The groups ``rank``'s push reduce-scatters run in, as creation rounds: one per distinct
        partition that the distinct contribution layouts make (the parts of ``replica_groups``: each
        replica group's ranks cut at the shard groups, kept where a range spans as many optimizer
        segments as the part has ranks), in model order. A partition is keyed by its replica groups'
        roles and the largest part kept, which every rank computes alike in O(roles); this rank's part
        is found among its own group's ranks (in its shard group only, under ``--shard-group``)."""
        c = self.strategy.coord(rank)
        mine = ParamRole.of(self.strategy.pipelines[c.pipeline], c)
        group_size = self.cluster.group_size
        lo = rank - rank % group_size
        rounds: dict[tuple, tuple[int, ...]] = {}
        for size, groups in self._distinct_push_groups():
            partition, part = [], (rank,)
            for ranges, roles in groups:
                n = sum(self._role_count(pr) for pr in roles)
                if not ranges or n < 2:
                    continue
                most = min(n, group_size, max(scatter_block_count(a, b, size, group_size) for a, b in ranges))
                if most < 2:
                    continue
                partition.append((roles, most))      # its parts of 2 to ``most`` ranks reduce-scatter
                if mine in roles:
                    members = tuple(sorted(r for pr in roles for r in self._role_ranks_in(pr, lo, lo + group_size)))
                    if 2 <= len(members) <= most:
                        part = members
            if partition:
                rounds.setdefault(("replica groups", str(self.strategy), group_size, frozenset(partition)), part)
        return [GroupRound(key, part) for key, part in rounds.items()]

    def _distinct_push_groups(self) -> Iterator[tuple[int, list[tuple[tuple[Range, ...], tuple]]]]:
        """Once per distinct (size, contribution layout) among the parameters, in model order: the size
        and its replica groups (``push_groups``: each group's roles and ranges, the ranges normalised,
        sorted and without empty ones)."""
        seen: set[tuple] = set()
        for name in self.order:
            size = self.param_layout(name).size
            contributions = self.contributions(name)
            if (size, contributions) in seen:
                continue
            seen.add((size, contributions))
            yield size, [(tuple(sorted(r for r in normalise_ranges(ranges) if r[0] < r[1])), roles)
                         for ranges, roles in push_groups(contributions, self.roles)]

    def _role_count(self, pr: ParamRole) -> int:
        """How many ranks play role ``pr`` (its scheme's pipelines times their sequence ranks)."""
        return sum(len(run) for run in self._runs[pr.scheme]) * pr.scheme.seq

    def _role_ranks_in(self, pr: ParamRole, lo: int, hi: int) -> list[int]:
        """The ranks of role ``pr`` in ``[lo, hi)``, by rank arithmetic over the pipelines meeting it."""
        if lo == 0 and hi >= self.cluster.world_size:
            return list(self.roles.of(pr))
        scheme, stage, t, replica, doc_rank = pr
        span, out = scheme.num_ranks, []
        for run in self._runs[scheme]:
            first = self.strategy.rank_of(run.start, 0)      # a run's pipelines are consecutive spans
            for k in range(max(0, (lo - first) // span), min(len(run), -(-(hi - first) // span))):
                ranks = (self.strategy.rank_of(run.start + k, stage, t, c, replica, doc_rank) for c in range(scheme.seq))
                out += [r for r in ranks if lo <= r < hi]
        return out

    def group_lnk_ops(self, name: str, rank: int) -> tuple[tuple, tuple]:
        """The pull and push ops of ``rank`` for parameter ``name`` when the optimizer shards inside
        groups of ``G`` ranks (``--shard-group``): its shard group's plans (``passes/lnk/shard_groups``,
        over the group's members only), so the work is the group's, not the world's."""
        size = self.cluster.group_size
        g = rank // size
        lo, hi = g * size, (g + 1) * size
        layout = self.param_layout(name)
        needs, contributions = self.needs(name), self.contributions(name)
        key = (layout.shape, layout.shard_dim, needs, contributions, "group", g)
        plans = self._ops.get(key)
        if plans is None:
            group_needs = {r: ranges for pr, ranges in needs for r in self._ranks_in(pr, lo, hi)}
            group_contrib = {r: ranges for pr, ranges in contributions for r in self._ranks_in(pr, lo, hi)}
            replicas = [part for _, roles in push_groups(contributions, self.roles)
                        if sum(len(self.roles.of(pr)) for pr in roles) > 1
                        and (part := tuple(sorted(r for pr in roles for r in self._ranks_in(pr, lo, hi))))]
            pull = shard_group_pull_plan(layout, group_needs, self.cluster.world_size, self.cluster.gpus_per_node,
                                         size, working_dtype_bytes=self.wbytes, groups=[g])
            push = shard_group_push_plan(layout, group_contrib, self.cluster.world_size,
                                         self.cluster.gpus_per_node, size, replica_groups=replicas, groups=[g])
            plans = self._ops[key] = (pull, push)
        return plans[0].for_rank(rank), plans[1].for_rank(rank)

    def _ranks_in(self, pr: ParamRole, lo: int, hi: int) -> tuple[int, ...]:
        """The ranks of ``pr`` in ``[lo, hi)`` (a shard group), from its sorted ranks."""
        ranks = self.roles.of(pr)
        return ranks[bisect.bisect_left(ranks, lo):bisect.bisect_left(ranks, hi)]

    def rank_plans(self, rank: int, role: ParamRole) -> tuple[dict[str, tuple], dict[str, tuple]]:
        """``rank``'s pull and push ops of every parameter it takes part in (model order)."""
        pulls, pushes = {}, {}
        grouped = self.cluster.shard_group is not None
        for name in self.order:
            pull, push = (self.group_lnk_ops(name, rank) if grouped
                          else self.rank_lnk_ops(name, rank, role, self.cluster.world_size))
            if pull:
                pulls[name] = pull
            if push:
                pushes[name] = push
        return pulls, pushes

    # ---- the world's plans (every rank): the reference, and what callers asking for all of it read ----

    def _expand(self, layout: RoleLayout) -> dict[int, tuple[Range, ...]]:
        return {r: ranges for pr, ranges in layout for r in self.roles.of(pr)}

    def pull_plan(self, name: str) -> PullPlan:
        return shard_group_pull_plan(self.param_layout(name), self._expand(self.needs(name)),
                                     self.cluster.world_size, self.cluster.gpus_per_node, self.cluster.shard_group,
                                     working_dtype_bytes=self.wbytes)

    def push_plan(self, name: str) -> PushPlan:
        contributions = self.contributions(name)
        groups = [members for _, roles in push_groups(contributions, self.roles)
                  if len(members := tuple(sorted(r for pr in roles for r in self.roles.of(pr)))) > 1]
        return shard_group_push_plan(self.param_layout(name), self._expand(contributions),
                                     self.cluster.world_size, self.cluster.gpus_per_node, self.cluster.shard_group,
                                     replica_groups=groups)


def groups_keep_to_shard_groups(strategy: Strategy, group_of: Mapping[ParamRole, Any], group_size: int) -> bool:
    """Whether no shard group (``group_size`` consecutive ranks) holds ranks of two groups, a rank's
    group being ``group_of`` its role. Found from the ranks where the group changes, without listing
    the world: inside a pipeline they follow from its scheme (O(its ranks), once per run of equal
    pipelines), and a run repeats them every pipeline; each such rank must start a shard group."""
    start, last = 0, None
    for count, p in strategy.groups():
        span = p.num_ranks
        local = [group_of[ParamRole.at(p, i)] for i in range(span)]
        changes = [i for i in range(1, span) if local[i] != local[i - 1]]
        if changes and ((count > 1 and span % group_size) or any((start + i) % group_size for i in changes)):
            return False
        if local[0] != local[-1] and count > 1 and ((start + span) % group_size or (count > 2 and span % group_size)):
            return False       # between two pipelines of the run
        if last is not None and last != local[0] and start % group_size:
            return False       # between two runs
        last, start = local[-1], start + count * span
    return True


def _cut_at(ranks: tuple[int, ...], group_size: int) -> list[tuple[int, ...]]:
    """Sorted ``ranks`` cut into their parts in each shard group of ``group_size`` consecutive ranks."""
    parts: list[list[int]] = []
    for r in ranks:
        if parts and parts[-1][0] // group_size == r // group_size:
            parts[-1].append(r)
        else:
            parts.append([r])
    return [tuple(p) for p in parts]


class PlansByParam(Mapping):
    """Parameter name (model order) -> its plan for the whole world, planned on first read."""

    def __init__(self, order: list[str], plan: Callable[[str], Any]) -> None:
        self._order, self._plan, self._plans = order, plan, {}

    def __getitem__(self, name: str) -> Any:
        plan = self._plans.get(name)
        if plan is None:
            if name not in self._order:
                raise KeyError(name)
            plan = self._plans[name] = self._plan(name)
        return plan

    def __iter__(self):
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._order


def instantiate(hg: Any, strategy: Strategy, cluster: Cluster, options: CompileOptions,
                shapes: dict, layouts: Optional[ParamLayouts] = None) -> Program:
    """Plan ``hg`` for ``strategy`` on ``cluster``: a Program whose ranks are built when asked.

    What is done here does not grow with the world: the checks, the stage split, the role layout.
    ``Program.rank(r)`` then builds that rank's role, bindings and LNK ops; its role's graph is
    compiled on first use (``RankProgram.graph_module``) and shared by the Programs of ``layouts``
    (one per compiled model; a new one when not given).
    """
    t0 = time.perf_counter()
    validate_for_model(strategy, cluster, hg)
    layouts = layouts or ParamLayouts(hg, shapes)
    stage_blocks = {pp: layouts.stage_blocks(pp) for pp in sorted({p.pp for p in strategy.pipelines})}
    sp, sp_note = _sequence_parallel(hg, shapes, options, strategy)
    plan = StrategyLayout(hg, strategy, cluster, options, shapes, layouts, sp)
    describe = functools.partial(describe_subgraphs, shapes=shapes, dtype=options.working_dtype or torch.float32,
                                 pieces=plan.pieces)
    prog = Program(strategy, cluster, stage_blocks, functools.partial(plan.rank_program, describe=describe),
                   PlansByParam(plan.order, plan.pull_plan), PlansByParam(plan.order, plan.push_plan),
                   sequence_parallel=sp is not None, sequence_parallel_note=sp_note, planner=plan)
    prog.compile_seconds = time.perf_counter() - t0
    return prog


def _sequence_parallel(hg: Any, shapes: dict, options: CompileOptions, strategy: Strategy) -> tuple[Any, str]:
    """The SP plan the strategy's TP>1 pipelines run (None: no SP) and, when SP was only the default and
    the model refused it, why."""
    if options.sequence_parallel is False or all(p.tp == 1 for p in strategy.pipelines):
        return None, ""
    cached = model_sequence_parallel(hg, shapes)
    if isinstance(cached, SequenceParallelRefused):
        if options.sequence_parallel:
            raise cached
        return None, f"{cached}; running TP without it"
    return cached, ""


def _peers_and_bytes(plan_ops, rank: int) -> tuple[tuple[int, ...], int]:
    peers, nbytes = set(), 0
    for op in plan_ops:
        src, dst = getattr(op, "src", None), getattr(op, "dst", None)
        if src is not None and dst is not None:
            peers.add(dst if src == rank else src)
            nbytes += getattr(op, "bytes", 0)
        group = getattr(op, "group", None)
        if group:
            peers.update(r for r in group if r != rank)
    return tuple(sorted(peers)), nbytes


def _bytes_per_token(node: fx.Node, shapes: dict, dtype: torch.dtype) -> int:
    """Bytes of the activation a comm node moves for one token of the micro-batch (B = T = 1)."""
    if node.target is ops.pp_recv:
        dims, dt = node.args[3], node.args[4]
    else:
        x = next((a for a in node.args if isinstance(a, fx.Node) and a.op != "placeholder"), None)
        if x is None or x.name not in shapes:
            return 0
        dims, dt = shapes[x.name]
        dt = dtype if dt.is_floating_point else dt
    numel = 1
    for d in dims:
        numel *= 1 if isinstance(d, str) else int(d)
    return numel * dt.itemsize


def describe_subgraphs(rp: RankProgram, shapes: dict, dtype: torch.dtype,
                       pieces: Optional[Mapping[str, Any]] = None) -> list[SubgraphInfo]:
    """One SubgraphInfo per filled slot of the rank's graph, with its peers and bytes moved (a stacked
    expert tensor's: its ``pieces``' together).

    Pull / push bytes are what the LNK plan moves for this rank (sent + received); comm_activation
    bytes are per token of the micro-batch (the tensor the collective or send/recv carries).
    """
    by_tag: dict[str, list[fx.Node]] = {}
    for n in rp.graph_module.graph.nodes:
        m = get_meta(n)
        if m.subgraph is not None:
            by_tag.setdefault(m.subgraph, []).append(n)
    out: list[SubgraphInfo] = []
    for tag, nodes in by_tag.items():
        m = get_meta(nodes[0])
        names = tuple(n.name for n in nodes)
        if m.slot in (SlotKind.PULL_PARAMETER, SlotKind.PUSH_GRADIENT):
            by_param = rp.pull_by_param if m.slot == SlotKind.PULL_PARAMETER else rp.push_by_param
            ops = by_param.get(m.param, ()) or tuple(op for piece, of in (pieces or {}).items()
                                                     if of.param == m.param for op in by_param.get(piece, ()))
            peers, nbytes = _peers_and_bytes(ops, rp.rank)
            out.append(SubgraphInfo(m.slot, m.param, names, peers, nbytes))
        else:
            d = dims.by_comm_point(m.comm_point)
            key = d.key if d.key is not None else d.neighbours[0 if tag.startswith("pp_recv") else 1]
            peers = tuple(r for r in rp.bindings.get(key, ()) if r != rp.rank)
            out.append(SubgraphInfo(m.slot, None, names, peers, _bytes_per_token(nodes[0], shapes, dtype),
                                    m.comm_point.value))
    return out
