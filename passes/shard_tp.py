"""TP sharding: which slice of every parameter a TP rank holds, and the op rewrites that needs.

Megatron conventions, decided from the graph (``NodeMeta.tp_role`` set by ``annotate_pass``):

* COLUMN linear: weight/bias split on the output dim in *units* (the head dim when the output is
  reshaped into heads, else 1). Attention heads must divide by TP (an error otherwise); fewer
  key/value heads than TP are replicated (TP rank t holds KV head ``t * kv // TP``, as Megatron
  does), which needs attention with ``enable_gqa=True``; other sizes TP does not divide are split
  unevenly (the matching ROW linear uses the same split, so the pair stays exact).
* ROW linear: weight split on the input dim with the same rule; its bias is added after the
  all-reduce, on the full output.
* VOCAB embedding / a COLUMN head whose output is gathered: the vocabulary is padded to a multiple
  of TP; the embedding looks up only its rows (zeros elsewhere, summed by the all-reduce) and the
  gathered logits are cut back to the real vocabulary.
* REPLICATED parameters are whole on every TP rank.
* EXPERTS (hgraph's MoE op): each expert's gate / up split on their intermediate rows (a fused
  gate_up part by part), down on the same columns, evenly or not as for a dense MLP; the router whole.
  The op runs unchanged on the rank's slices: its output is the rank's partial sum (reduced with the
  shared experts' when they are added to it: ``passes/partial_sums``).
* A sum / mean over the whole feature dim of a column-parallel output (a full-width norm, e.g. a QK
  norm over all heads) reduces the rank's slice; the all-reduce after it (its slots) sums the
  partial results, a mean weighted by the slice's share of the width. A 1-D parameter of that width
  multiplying the value (the norm's weight) is split like a column bias.

With TP=1 every parameter is whole and the graph is unchanged.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx

from hgraph import ops
from hgraph.errors import HGraphError, StrategyError
from hgraph.meta import CommPoint, OpKind, SlotKind, TPRole, get_meta, update_meta
from hgraph.passes.context import PassContext
from hgraph.program import ParamShard

#: ``NodeMeta.tp_rewrite`` position of a node cutting a fused projection into parts (``tp_roles.FUSED_PART``)
FUSED_PART = -1
#: ``NodeMeta.tp_rewrite`` position of a full-width sum / mean of a sharded value (``tp_roles.PARTIAL_SUM``)
PARTIAL_SUM = -2
_RESHAPES = {"view", "reshape", "transpose", "contiguous", "permute", "unflatten", "flatten"}


def split_range(size: int, tp: int, t: int, unit: int = 1) -> tuple[int, int]:
    """Rank t's range of ``size`` split in ``unit`` blocks over ``tp`` ranks (even when possible)."""
    units = size // unit
    return (t * units // tp) * unit, ((t + 1) * units // tp) * unit


def param_uses(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Parameter name -> the computational nodes that consume it (through its slots)."""
    uses: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        m = get_meta(node)
        if m.slot == SlotKind.PULL_PARAMETER and m.param is not None:
            uses.setdefault(m.param, []).extend(u for u in node.users if get_meta(u).slot is None)
    return uses


def _is_reshape(n: fx.Node) -> bool:
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return n.op in ("call_method", "call_function") and name in _RESHAPES


def _head_unit(shapes: dict, node: fx.Node, forward: bool) -> int:
    """Head dim if ``node``'s value is viewed as (…, heads, head_dim) next to it (through reshapes and
    slots, and forward through ops that keep its shape, such as a norm over the whole width), else 1."""
    seen, work = set(), [node]
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        dims = shapes.get(n.name, (None,))[0]
        if n is not node and dims is not None and len(dims) == 4 and isinstance(dims[-1], int):
            return dims[-1]
        nxt = list(n.users) if forward else list(n.all_input_nodes)
        work.extend(m for m in nxt if _is_reshape(m) or get_meta(m).slot is not None
                    or (forward and dims is not None and shapes.get(m.name, (None,))[0] == dims))
    return 1


def _uses_gqa_attention(gm: fx.GraphModule) -> bool:
    attn = [n for n in gm.graph.nodes if get_meta(n).op == OpKind.ATTENTION]
    return bool(attn) and all(n.kwargs.get("enable_gqa", False) for n in attn)


@dataclass(frozen=True)
class _ParamPlan:
    """What decides a parameter's TP shard, found once per HGraph."""

    name: str
    shape: tuple[int, ...]
    dim: int
    role: Optional[TPRole]
    unit: int
    gathered: bool
    blocks: frozenset
    parts: tuple = ()           # a fused projection: ((lo, hi, unit), ...) of its output rows


class TPShardPlanner:
    """Each parameter's TP shard for any (TP degree, TP rank), from one analysis of the HGraph.

    Splitting this from the pass lets a Program know every rank's shards (for the LNK plans)
    without building every rank's graph.
    """

    def __init__(self, hg: Any, shapes: dict):
        gm = hg.gm
        self.gqa = _uses_gqa_attention(gm)
        # weights whose output a full-width sum / mean reduces: their TP slices must not repeat
        self.reduced_whole = {get_meta(n).tp_rewrite[1] for n in gm.graph.nodes
                              if get_meta(n).tp_rewrite is not None and get_meta(n).tp_rewrite[0] == PARTIAL_SUM}
        self.plans: dict[str, _ParamPlan] = {}
        for name, uses in param_uses(gm).items():
            info = hg.params[name]
            shape = tuple(info.shape)
            role = info.tp_role
            if any(get_meta(op).tp_role == TPRole.EXPERTS for op in uses):
                unit = 1                  # an expert's intermediate rows: no heads
            elif role == TPRole.ROW:
                unit = max(_head_unit(shapes, op.args[0], False) for op in uses)
            elif role == TPRole.COLUMN:
                unit = max(_head_unit(shapes, op, True) for op in uses)   # a bias splits like its weight
            else:
                unit = 1
            parts = next((get_meta(op).tp_parts for op in uses if get_meta(op).tp_parts), None)
            self.plans[name] = _ParamPlan(name, shape, info.shard_dim if shape else 0, role, unit,
                                          any(_feeds(op, CommPoint.TP_GATHER) for op in uses),
                                          frozenset(get_meta(op).block for op in uses),
                                          _part_units(uses, parts, shapes) if role == TPRole.COLUMN and parts else ())

    def shard(self, name: str, tp: int, t: int) -> ParamShard:
        p = self.plans[name]
        shape, dim = p.shape, p.dim
        if tp == 1 or p.role in (None, TPRole.REPLICATED) or not shape:
            return ParamShard(name, shape, dim, ((0, shape[dim]),) if shape else ((0, 1),))
        size = shape[dim]
        if p.parts:          # each TP rank holds its slice of every part of a fused projection
            ranges = []
            for lo, hi, unit in p.parts:
                if ((hi - lo) // unit) % tp:
                    raise StrategyError(f"TP={tp} does not divide the {(hi - lo) // unit} "
                                        f"{'heads' if unit > 1 else 'rows'} of rows {lo}:{hi} of the fused {name}")
                a, b = split_range(hi - lo, tp, t, unit)
                ranges.append((lo + a, lo + b))
            return ParamShard(name, shape, dim, tuple(ranges), 0, tp_sharded=True)
        if p.role == TPRole.COLUMN:
            rng, pad = _column_range(name, size, p.unit, tp, t, p.gathered, self.gqa)
            if name in self.reduced_whole and (rng[1] - rng[0]) * tp != size:
                raise StrategyError(f"TP={tp}: the whole width of {name}'s output is reduced (a norm over all "
                                    f"its heads), which needs its {size} rows split evenly over the TP ranks, "
                                    "each rank its own slice; allowed TP degrees give no two ranks the same "
                                    f"heads (at most {size // p.unit} here)")
        elif p.role == TPRole.ROW:
            if p.unit > 1 and (size // p.unit) % tp:
                raise StrategyError(f"TP={tp} does not divide the {size // p.unit} attention heads feeding "
                                    f"{name}; allowed TP degrees divide {size // p.unit}")
            rng, pad = split_range(size, tp, t, p.unit), 0
        elif p.role == TPRole.VOCAB:
            rng, pad = _column_range(name, size, 1, tp, t, True, self.gqa)
        else:
            raise AssertionError(f"unknown TP role {p.role} of {name}")
        return ParamShard(name, shape, dim, (rng,), pad, tp_sharded=True)


def _part_units(uses: list[fx.Node], parts: tuple, shapes: dict) -> tuple:
    """``(lo, hi, unit)`` per part of a fused projection: the head dim when the part is viewed as heads."""
    units: dict[tuple[int, int], int] = {}
    for op in uses:
        for cut in op.users:
            cut_parts = _cut_parts(cut, parts)
            for part, node in cut_parts:
                units[part] = max(units.get(part, 1), _head_unit(shapes, node, True))
    return tuple((lo, hi, units.get((lo, hi), 1)) for lo, hi in parts)


def _cut_parts(cut: fx.Node, parts: tuple) -> list[tuple[tuple[int, int], fx.Node]]:
    """(part, the node holding it) for a node cutting a fused output: split/chunk items or a slice."""
    if op_name_of(cut) in ("split", "chunk"):
        return [(parts[u.args[1]], u) for u in cut.users if isinstance(u.args[1], int) and u.args[1] < len(parts)]
    index = cut.args[1] if len(cut.args) > 1 else None
    if isinstance(index, tuple) and index and isinstance(index[-1], slice):
        last = index[-1]
        lo = last.start or 0
        return [(p, cut) for p in parts if p[0] == lo]
    return []


def op_name_of(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))


def _column_range(name: str, size: int, unit: int, tp: int, t: int, gathered: bool,
                  gqa: bool) -> tuple[tuple[int, int], int]:
    units = size // unit
    if unit > 1:  # attention heads
        if units % tp == 0:
            return split_range(size, tp, t, unit), 0
        if tp % units == 0:
            if not gqa:
                raise StrategyError(
                    f"TP={tp} is larger than the {units} key/value heads of {name}: replicating them needs "
                    f"attention called with enable_gqa=True; use TP <= {units}")
            h = t * units // tp
            return (h * unit, (h + 1) * unit), 0
        raise StrategyError(f"TP={tp} does not divide the {units} attention heads of {name}; "
                            f"allowed TP degrees divide {units}")
    if gathered and size % tp:
        padded = -(-size // tp) * tp
        lo, hi = split_range(padded, tp, t)
        return (min(lo, size), min(hi, size)), hi - min(hi, size)
    return split_range(size, tp, t), 0


def shard_tp_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite vocab-parallel embeddings and row-parallel biases for the shards in ``ctx.params``.

    Does nothing with TP=1 (every shard is the whole parameter).
    """
    ctx.gathers = {}
    if ctx.role.scheme.tp == 1:
        return gm
    _rewrite_sizes(gm, ctx)
    for name, uses in param_uses(gm).items():
        shard, role = ctx.params[name], ctx.hgraph.params[name].tp_role
        if not shard.tp_sharded:
            continue
        for op in uses:
            if role == TPRole.VOCAB and get_meta(op).op == OpKind.EMBEDDING:   # a tied head is a plain column linear
                _rewrite_vocab_embedding(op, name, shard.ranges[0], ctx.hgraph.params[name].shape[0])
            elif role == TPRole.ROW and get_meta(op).op == OpKind.LINEAR:
                _move_row_bias(gm, op)
    _record_gathers(gm, ctx)
    return gm


def _rewrite_sizes(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Sizes written out in views of sharded values (a head count, a hidden width; ``annotate``
    records which) scaled to this rank's shard: ``size * local / full`` of the column-parallel weight
    the value comes from. A size read from a whole tensor at run time gets the same arithmetic as nodes."""
    for node in list(gm.graph.nodes):
        rewrite = get_meta(node).tp_rewrite
        if rewrite is None:
            continue
        position, source = rewrite
        shard = ctx.params.get(source)
        if position == PARTIAL_SUM:
            _rewrite_partial_reduction(gm, node, source, shard, ctx.role.scheme.tp)
            continue
        if shard is None or not shard.tp_sharded:
            continue
        if position == FUSED_PART:
            _rewrite_cut(node, shard)
            continue
        full = shard.full_shape[shard.shard_dim]
        local = sum(hi - lo for lo, hi in shard.ranges)
        packed = len(node.args) == 2 and isinstance(node.args[1], (tuple, list))
        shape = list(node.args[1] if packed else node.args[1:])
        size = shape[position]
        if isinstance(size, int):
            if (size * local) % full:
                raise StrategyError(f"TP={ctx.role.scheme.tp}: {node.name} views {source}'s output with a size of "
                                    f"{size}, which its shard ({local} of {full}) does not divide")
            shape[position] = size * local // full
        else:
            with gm.graph.inserting_before(node):
                scaled = gm.graph.call_function(operator.mul, (size, local))
                shape[position] = gm.graph.call_function(operator.floordiv, (scaled, full))
        node.args = (node.args[0], tuple(shape)) if packed else (node.args[0], *shape)


def _rewrite_partial_reduction(gm: fx.GraphModule, node: fx.Node, source: str, shard: Optional[ParamShard],
                               tp: int) -> None:
    """A sum / mean over the whole feature dim of a sharded value: the slots after it all-reduce the
    ranks' partial results (``insert_slots``), so a mean is weighted by this rank's share of the width."""
    full = shard.full_shape[shard.shard_dim] if shard is not None else 0
    local = sum(hi - lo for lo, hi in shard.ranges) if shard is not None and shard.tp_sharded else full
    if shard is None or local * tp != full:
        raise StrategyError(f"TP={tp}: {node.name} reduces the whole width of {source}'s output, which needs "
                            f"its {full} features split evenly over the TP ranks, each rank its own slice; "
                            "allowed TP degrees divide it without repeating heads (no more TP ranks than "
                            "key/value heads)")
    if op_name_of(node) == "mean":
        with gm.graph.inserting_after(node):
            share = gm.graph.call_function(operator.mul, (node, local / full))
        node.replace_all_uses_with(share, delete_user_cb=lambda u: u is not share)


def _rewrite_cut(node: fx.Node, shard: ParamShard) -> None:
    """A split / chunk / slice of a fused projection, on this rank's concatenated slices of its parts."""
    parts = _parts_of_cut(node, shard)
    local = [sum(max(0, min(hi, b) - max(lo, a)) for a, b in shard.ranges) for lo, hi in parts]
    name = op_name_of(node)
    if name in ("split", "chunk"):
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else -1)
        node.op, node.target = "call_method", "split"
        node.args, node.kwargs = (node.args[0], list(local)), {"dim": dim}
        return
    lo, hi = parts[0]
    start = sum(max(0, min(b, lo) - a) for a, b in shard.ranges if a < lo)
    *front, _ = node.args[1]
    node.args = (node.args[0], (*front, slice(start, start + local[0])))


def _parts_of_cut(node: fx.Node, shard: ParamShard) -> list[tuple[int, int]]:
    """The row ranges of the fused output a cut node takes (split / chunk: all parts in order)."""
    rows = shard.full_shape[shard.shard_dim]
    name = op_name_of(node)
    if name == "split":
        size = node.args[1]
        if isinstance(size, int):
            return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]
        bounds = [0]
        for x in size:
            bounds.append(bounds[-1] + x)
        return list(zip(bounds, bounds[1:]))
    if name == "chunk":
        size = -(-rows // node.args[1])
        return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]
    last = node.args[1][-1]
    return [(last.start or 0, rows if last.stop is None else last.stop)]


def _feeds(op: fx.Node, point: CommPoint) -> bool:
    return any(get_meta(u).comm_point == point for u in op.users)


# F.embedding's arguments after (input, weight), in order, with their defaults
_EMBEDDING_OPTIONS = (("padding_idx", None), ("max_norm", None), ("norm_type", 2.0),
                      ("scale_grad_by_freq", False), ("sparse", False))


def _rewrite_vocab_embedding(op: fx.Node, param: str, rng: tuple[int, int], vocab_size: int) -> None:
    """F.embedding -> vocab_parallel_embedding over this rank's rows; every argument of the lookup
    is carried over (padding_idx) or refused with a clear error, never dropped."""
    if op.target is ops.vocab_parallel_embedding:
        return
    ids, w = op.args[0], op.args[1]
    options = {name: default for name, default in _EMBEDDING_OPTIONS}
    options.update(zip((name for name, _ in _EMBEDDING_OPTIONS), op.args[2:]))
    options.update(op.kwargs)
    refused = [name for name, default in _EMBEDDING_OPTIONS[1:] if name != "norm_type"
               and options[name] != default]
    if refused:
        raise HGraphError(f"embedding of {param}: {', '.join(f'{n}={options[n]!r}' for n in refused)} cannot "
                          "be kept when the vocabulary is split over TP ranks (each rank sees only its "
                          "rows); use a strategy with TP1 for this model, or an embedding without them")
    padding = options["padding_idx"]
    if padding is not None and padding < 0:
        padding += vocab_size                  # F.embedding counts a negative index from the end
    op.target = ops.vocab_parallel_embedding
    op.args = (ids, w, rng[0], rng[1], padding)
    op.kwargs = {}


def _move_row_bias(gm: fx.GraphModule, op: fx.Node) -> None:
    """linear(x, w, b) -> linear(x, w); the bias is added after the TP_EXIT all-reduce."""
    bias: Optional[fx.Node] = op.args[2] if len(op.args) > 2 else op.kwargs.get("bias")
    if bias is None:
        return
    exits = [u for u in op.users if get_meta(u).comm_point == CommPoint.TP_EXIT]
    if len(exits) != 1:
        raise AssertionError(f"row-parallel {op.name} has no single tp_exit slot after it")
    op.args = tuple(op.args[:2]) + ((None,) if len(op.args) > 2 else ())
    op.kwargs = {k: v for k, v in op.kwargs.items() if k != "bias"}
    exit_node = exits[0]
    with gm.graph.inserting_after(exit_node):
        add = gm.graph.call_function(operator.add, (exit_node, bias))
    exit_node.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    update_meta(add, block=get_meta(op).block, layer=get_meta(op).layer)


def _record_gathers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """For each TP_GATHER slot: the per-rank sizes along the last dim and the real (unpadded) size."""
    tp = ctx.role.scheme.tp
    for node in gm.graph.nodes:
        if get_meta(node).comm_point != CommPoint.TP_GATHER:
            continue
        op = node.args[0]
        w_name = _param_of(op.args[1]) if len(op.args) > 1 else None
        shard = ctx.params.get(w_name) if w_name else None
        if shard is None or not shard.tp_sharded:
            ctx.gathers[node.name] = None
            continue
        size = shard.full_shape[shard.shard_dim]
        padded = -(-size // tp) * tp if shard.pad or size % tp else size
        sizes = [split_range(padded, tp, r)[1] - split_range(padded, tp, r)[0] for r in range(tp)]
        ctx.gathers[node.name] = (sizes, size)


def _param_of(node: fx.Node) -> Optional[str]:
    seen = node
    while isinstance(seen, fx.Node):
        m = get_meta(seen)
        if m.param is not None:
            return m.param
        seen = seen.args[0] if seen.args else None
    return None
