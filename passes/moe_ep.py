"""Expert parallelism (``EP<n>``): each MoE op of a role whose EP degree is above 1 becomes its EP form
(``hgraph.moe_dispatch``), the exchanges as Communicate Activation subgraphs on the comm stream.

``moe_layer(x, router, *experts, top_k=k, ...)`` becomes, in the op's place::

    routing = route_tokens(x, router, top_k=k, ...)                       # the whole router, this rank's tokens
    splits = moe_split_exchange(comm, routing, 'ep')                      # ep_dispatch: the counts, read back
    dispatch = moe_dispatch_issue(comm, routing, splits, 'ep')            # ep_dispatch: the rows to their experts
    received = comm_wait(comm, dispatch)                                  # ep_dispatch
    out = local_experts(received, splits, *this rank's experts, ...)      # the rank's experts (TP slices under TP)
    combine = moe_combine_issue(comm, out, splits, 'ep')                  # ep_combine: the outputs back
    returned = comm_wait(comm, combine)                                   # ep_combine
    moe_layer = combine_tokens(returned, routing, comm)                   # weighted sum; router losses

Each exchange's backward is the reversed exchange. The rank's experts are those of its EP rank
(``RankRole.doc_rank``: ``moe_dispatch.expert_bounds``): of a list of expert matrices the pass keeps
those and removes the others' parameter slots from the graph (the rank neither pulls nor pushes them);
of a stacked or fused tensor the rank holds the block of its experts (``passes/expert_owners``), which
the op reads as it is (a graph whose rank holds one whole, as a bare pass run without shards does, gets
it narrowed to them). The weighted sum takes the op's name and meta (``moe_dispatch.MOE_OUTPUTS``): the
TP exit after it reads it as it read the op's output.

It runs right after the stage is extracted, before TP sharding (which reads the shard of every
parameter the graph names: the other EP ranks' experts are gone by then). It does nothing where the
role's EP degree is 1.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from hgraph import moe, moe_dispatch, ops
from hgraph.dims import BindingKey
from hgraph.errors import HGraphError
from hgraph.meta import CommPoint, NodeMeta, SlotKind, get_meta, set_meta
from hgraph.passes.context import PassContext
from hgraph.slots import empty_slot


def moe_ep_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite every ``moe.moe_layer`` into its EP form over the ``BindingKey.EP`` group (module
    docstring); nothing where the role's EP degree is 1 or the graph has no MoE op."""
    n = ctx.role.scheme.ep
    if n == 1:
        return gm
    g = gm.graph
    comm = next(p for p in g.nodes if p.op == "placeholder" and p.target == "comm")
    dropped: list[fx.Node] = []
    for node in list(g.nodes):
        if node.target is moe.moe_layer:
            dropped += _rewrite(g, node, comm, ctx, n)
    _erase_unused_params(g, dropped)
    gm.recompile()
    return gm


def _param_of(node: fx.Node) -> Optional[str]:
    """The parameter reaching ``node`` through its (still empty) parameter slots, or None."""
    while node.op == "call_function" and node.target is empty_slot:
        node = node.args[0]
    return node.target if node.op == "get_attr" else None


def _rewrite(g: fx.Graph, node: fx.Node, comm: fx.Node, ctx: PassContext, n: int) -> list[fx.Node]:
    """``node``'s EP form in its place; returns the expert arguments it no longer reads."""
    x, router, *weights = node.args
    kwargs = dict(node.kwargs)
    router_name = _param_of(router)
    if router_name is None or router_name not in ctx.hgraph.params:
        raise HGraphError(f"EP{n}: the MoE op {node.name}'s router is not a parameter of the model; expert "
                          "parallelism needs the router's expert count")
    experts = int(ctx.hgraph.params[router_name].shape[0])
    lo, hi = moe_dispatch.expert_bounds(experts, n)[ctx.role.doc_rank]
    if len(weights) == 3 * experts:             # gate_0..E-1, up_0..E-1, down_0..E-1
        local = [w for part in range(3) for w in weights[part * experts + lo:part * experts + hi]]
    elif len(weights) in (2, 3):                # stacked [E, ...] tensors (or fused gate_up and down)
        local = [_narrowed(g, node, w, ctx, lo, hi) for w in weights]
    else:
        raise HGraphError(f"EP{n}: the MoE op {node.name} has {len(weights)} expert weights for {experts} "
                          "experts (allowed: 3 x E matrices, or 2 or 3 stacked tensors)")
    m = get_meta(node)

    def compute(name: str, fn, args: tuple, kw: Optional[dict] = None, meta: Optional[NodeMeta] = None) -> fx.Node:
        out = g.call_function(fn, args, kw or {})
        set_meta(out, meta or NodeMeta(block=m.block, layer=m.layer))
        out.name = f"{name}_{node.name}"
        return out

    def comm_op(name: str, fn, args: tuple, point: CommPoint, part: str) -> fx.Node:
        out = g.call_function(fn, args)
        set_meta(out, NodeMeta(block=m.block, layer=m.layer, slot=SlotKind.COMM_ACTIVATION, comm_point=point,
                               subgraph=f"{point.value}:{node.name}_{part}"))
        out.name = f"{name}_{node.name}"
        return out

    key, dispatch, combine = BindingKey.EP, CommPoint.EP_DISPATCH, CommPoint.EP_COMBINE
    with g.inserting_before(node):
        routing = compute("route", moe_dispatch.route_tokens, (x, router),
                          {"top_k": kwargs["top_k"], "normalize_top_k": kwargs.get("normalize_top_k", False)})
        splits = comm_op("expert_counts", ops.moe_split_exchange, (comm, routing, key), dispatch, "dispatch")
        issued = comm_op("dispatch", ops.moe_dispatch_issue, (comm, routing, splits, key), dispatch, "dispatch")
        received = comm_op("wait_dispatch", ops.comm_wait, (comm, issued), dispatch, "dispatch")
        out = compute("local_experts", moe_dispatch.local_experts, (received, splits, *local),
                      {"implementation": kwargs.get("implementation", "auto")})
        issued = comm_op("combine", ops.moe_combine_issue, (comm, out, splits, key), combine, "combine")
        returned = comm_op("wait_combine", ops.comm_wait, (comm, issued), combine, "combine")
        # the op's own meta (its TP role: the TP exit after it reduces the partial sums) on its output
        y = compute("combine_tokens", moe_dispatch.combine_tokens, (returned, routing, comm), meta=m)
    node.replace_all_uses_with(y)
    name = node.name
    g.erase_node(node)
    y.name = name            # the op's output keeps its name: what finds a model's MoE ops by name finds it
    return [w for w in weights if w not in local]


def _narrowed(g: fx.Graph, node: fx.Node, w: fx.Node, ctx: PassContext, lo: int, hi: int) -> fx.Node:
    """A stacked expert tensor narrowed to experts ``[lo, hi)`` on its expert axis (dim 0), unless the
    rank holds exactly those already."""
    name = _param_of(w)
    shard = ctx.params.get(name) if name is not None else None
    if shard is not None and (shard.experts == (lo, hi)
                              or (shard.shard_dim == 0 and tuple(shard.ranges) == ((lo, hi),))):
        return w          # the rank holds exactly those experts (``expert_owners``: a stacked tensor's block)
    with g.inserting_before(node):
        out = g.call_function(torch.narrow, (w, 0, lo, hi - lo))
    m = get_meta(node)
    set_meta(out, NodeMeta(block=m.block, layer=m.layer))
    out.name = f"experts_{lo}_{hi}_{w.name}"
    return out


def _erase_unused_params(g: fx.Graph, nodes: list[fx.Node]) -> None:
    """The parameter slots (and ``get_attr``) of ``nodes`` that nothing reads any more, removed."""
    stack, erased = list(nodes), set()
    while stack:
        n = stack.pop()
        if n.users or n in erased:
            continue
        if n.op == "get_attr" or (n.op == "call_function" and n.target is empty_slot
                                  and get_meta(n).slot in (SlotKind.PULL_PARAMETER, SlotKind.PUSH_GRADIENT)):
            inputs = list(n.all_input_nodes)
            g.erase_node(n)
            erased.add(n)
            stack += inputs
