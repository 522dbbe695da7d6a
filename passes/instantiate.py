"""Instantiate an HGraph for one strategy: run the per-role pass pipeline and plan pull / push.

Ranks of the same role (scheme, stage, TP rank, CP rank) share one compiled GraphModule; a rank's
``bindings`` say which ranks its ``"tp"``, ``"cp"`` (the CP ring through it), ``"ul"`` (its Ulysses
all-to-all group), ``"pp_prev"`` and ``"pp_next"`` groups are.
The LNK plans (who sends which mutual slice to whom) are computed once per parameter for the whole
strategy from the shards every rank holds.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from hgraph import ops
from hgraph.comm_plan import ParamLayout
from hgraph.errors import StrategyError
from hgraph.graph import HGraph
from hgraph.meta import SlotKind, get_meta
from hgraph.options import CompileOptions
from hgraph.passes.context import PassContext
from hgraph.passes.lnk.shard_groups import shard_group_pull_plan, shard_group_push_plan
from hgraph.passes.pipeline import instantiation_passes, run_passes
from hgraph.passes.sequence_parallel import SequenceParallelRefused, model_sequence_parallel
from hgraph.passes.shard_tp import TPShardPlanner
from hgraph.passes.stage_split import block_param_costs, split_stages, stage_of_blocks
from hgraph.program import ParamShard, Program, RankProgram, RankRole, RoleProgram, SubgraphInfo
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
    name = f"Rank_{role.scheme}_s{role.stage}_t{role.tp_rank}_c{role.cp_rank}"
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


def _bindings(strategy: Strategy, rank: int) -> dict[str, tuple[int, ...]]:
    c = strategy.coord(rank)
    p = strategy.pipelines[c.pipeline]
    b = {"tp": tuple(strategy.tp_group(c.pipeline, c.stage, c.cp_rank)),
         "cp": tuple(strategy.cp_group(c.pipeline, c.stage, c.tp_rank, c.cp_rank)),
         "ul": tuple(strategy.ul_group(c.pipeline, c.stage, c.tp_rank, c.cp_rank))}
    if c.stage > 0:
        b["pp_prev"] = (strategy.rank_of(c.pipeline, c.stage - 1, c.tp_rank, c.cp_rank),)
    if c.stage < p.pp - 1:
        b["pp_next"] = (strategy.rank_of(c.pipeline, c.stage + 1, c.tp_rank, c.cp_rank),)
    return b


def _push_contributions(strategy: Strategy, ranks: list[RankProgram], name: str, info: Any,
                        sp_partial: bool = False):
    """Ranges each rank contributes to the gradient of ``name`` so every pipeline counts each element once.

    A parameter replicated across a TP group gets identical gradients on its TP ranks (its inputs are
    replicated), so the range is split among them; TP-sharded slices, CP ranks (different tokens), a
    whole parameter read on TP-sharded heads (``tp_partial``: each rank's gradient covers its heads) and,
    under sequence parallelism, one used only on token-sliced values (``sp_partial``: each TP rank's
    gradient covers its tokens) contribute what they hold.
    """
    contrib: dict[int, list[tuple[int, int]]] = {}
    for rp in ranks:
        shard = rp.params.get(name)
        if shard is None:
            continue
        if shard.tp_sharded or rp.scheme.tp == 1 or info.tp_partial or sp_partial:
            contrib[rp.rank] = list(shard.ranges)
        else:
            (lo, hi), = shard.ranges
            tp = rp.scheme.tp
            a, b = lo + (hi - lo) * rp.tp_rank // tp, lo + (hi - lo) * (rp.tp_rank + 1) // tp
            if b > a:
                contrib[rp.rank] = [(a, b)]
    groups: dict[tuple, list[int]] = {}
    for r, rngs in contrib.items():
        groups.setdefault(tuple(rngs), []).append(r)
    return contrib, [tuple(g) for g in groups.values() if len(g) > 1]


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
        numel = {n: int(torch.Size(p.shape).numel()) for n, p in hg.params.items()}
        self._costs = block_param_costs(hg.gm, numel)
        self._planner = TPShardPlanner(hg, shapes)
        self._stage_blocks: dict[int, tuple[tuple[str, ...], ...]] = {}
        self._held: dict[int, list[set[str]]] = {}

    def stage_blocks(self, pp: int) -> tuple[tuple[str, ...], ...]:
        """The repeated blocks of each of ``pp`` stages."""
        if pp not in self._stage_blocks:
            self._stage_blocks[pp] = split_stages(self.hg.blocks, self._costs, pp)
            self._held[pp] = stage_params(self.hg, self._stage_blocks[pp])
        return self._stage_blocks[pp]

    def params(self, scheme: Scheme, stage: int, tp_rank: int) -> dict[str, ParamShard]:
        """The shards of the rank at ``stage`` and ``tp_rank`` of a ``scheme`` pipeline, in model order."""
        self.stage_blocks(scheme.pp)
        held = self._held[scheme.pp][stage]
        return {n: self._planner.shard(n, scheme.tp, tp_rank) for n in self.hg.params if n in held}


def instantiate(hg: Any, strategy: Strategy, cluster: Cluster, options: CompileOptions,
                shapes: dict) -> Program:
    """Plan ``hg`` for ``strategy`` on ``cluster``: every rank's role, shards, peers and LNK plans.

    Each role's graph is compiled on first use (``RankProgram.graph_module``).
    """
    t0 = time.perf_counter()
    validate_for_model(strategy, cluster, hg)
    layouts = ParamLayouts(hg, shapes)
    stage_blocks = {pp: layouts.stage_blocks(pp) for pp in sorted({p.pp for p in strategy.pipelines})}
    order = list(hg.params)   # model order: every rank walks the plans in this order

    sp, sp_note = _sequence_parallel(hg, shapes, options, strategy)
    roles: dict[RankRole, RoleProgram] = {}
    ranks: list[RankProgram] = []
    for c in strategy.coords():
        scheme = strategy.pipelines[c.pipeline]
        role = RankRole(scheme, c.stage, c.tp_rank, c.cp_rank)
        if role not in roles:
            params = layouts.params(scheme, c.stage, c.tp_rank)
            blocks = stage_blocks[scheme.pp]
            build = functools.partial(build_role_module, hg, role, blocks, shapes, options, params, sp)
            roles[role] = RoleProgram(role, params, tuple(blocks[c.stage]), build)
        ranks.append(RankProgram(c.rank, c.pipeline, roles[role], _bindings(strategy, c.rank)))

    wbytes = (options.working_dtype or torch.float32).itemsize
    pulls, pushes = {}, {}
    for name in order:
        info = hg.params[name]
        shape = tuple(info.shape)
        layout = ParamLayout(name, shape, info.shard_dim if shape else 0)
        needs = {rp.rank: list(rp.params[name].ranges) for rp in ranks if name in rp.params}
        # the optimizer's shard groups (``--shard-group``; the world: today's plans exactly)
        pulls[name] = shard_group_pull_plan(layout, needs, cluster.world_size, cluster.gpus_per_node,
                                            cluster.shard_group, working_dtype_bytes=wbytes)
        contrib, groups = _push_contributions(strategy, ranks, name, info,
                                              sp is not None and name in sp.partial_grads)
        pushes[name] = shard_group_push_plan(layout, contrib, cluster.world_size, cluster.gpus_per_node,
                                             cluster.shard_group, replica_groups=groups)
    describe = functools.partial(describe_subgraphs, pulls=pulls, pushes=pushes, shapes=shapes,
                                 dtype=options.working_dtype or torch.float32)
    for rp in ranks:
        rp.pull_ops = [op for name in rp.params for op in pulls[name].for_rank(rp.rank)]
        rp.push_ops = [op for name in rp.params for op in pushes[name].for_rank(rp.rank)]
        rp.describe = describe
    prog = Program(strategy, cluster, ranks, stage_blocks, pulls, pushes,
                   sequence_parallel=sp is not None, sequence_parallel_note=sp_note)
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


def describe_subgraphs(rp: RankProgram, pulls: dict, pushes: dict, shapes: dict,
                       dtype: torch.dtype) -> list[SubgraphInfo]:
    """One SubgraphInfo per filled slot of the rank's graph, with its peers and bytes moved.

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
            plan = (pulls if m.slot == SlotKind.PULL_PARAMETER else pushes)[m.param]
            peers, nbytes = _peers_and_bytes(plan.for_rank(rp.rank), rp.rank)
            out.append(SubgraphInfo(m.slot, m.param, names, peers, nbytes))
        else:
            key = {"pp_boundary": "pp_prev" if tag.startswith("pp_recv") else "pp_next", "ul_a2a": "ul"}.get(
                m.comm_point.value, "tp" if m.comm_point.value.startswith("tp") else "cp")
            peers = tuple(r for r in rp.bindings.get(key, ()) if r != rp.rank)
            out.append(SubgraphInfo(m.slot, None, names, peers, _bytes_per_token(nodes[0], shapes, dtype),
                                    m.comm_point.value))
    return out
