"""insert_slots_pass: put empty slots where a strategy may intervene (Hydraulis §5.3).

Run after ``annotate_pass``. Every slot is a ``call_function`` to ``hgraph.slots.empty_slot`` (the
identity) with ``NodeMeta.slot`` (and ``comm_point`` / ``param``) set, so the slotted graph computes
exactly what the traced one does:

* parameters: ONE ``get_attr`` per parameter (the per-use get_attrs of the canonical form are
  merged) feeding ONE ``push_gradient`` slot (its backward is where the gradient is pushed), feeding
  one ``pull_parameter`` slot per use site, placed right before the op that uses it;
* ``tp_enter`` on the input of each column-parallel group (one slot per distinct input: q/k/v share
  one, gate/up share one, the lm head has its own); ``tp_exit`` after each row-parallel linear and
  each vocab-parallel embedding, and ``tp_exit`` + ``tp_enter`` after a full-width sum / mean of a
  sharded value (its partial results all-reduced, and their gradients); ``tp_enter`` before and
  ``tp_exit`` after an MoE op whose experts TP shards (role EXPERTS); one ``tp_exit`` after a sum of
  such partial sums instead of one per term (``passes/partial_sums``: an MoE layer's routed and shared
  experts), the values its scales read routed through their ``tp_enter``; ``tp_gather`` after a
  column-parallel linear in ``post`` (the lm head); ``cp_kv`` on the key and value inputs of each attention; ``pp_boundary`` on each value
  produced in a block (or ``pre``) and consumed in another block (the hidden state between blocks).

A slot gets the block / layer of the node it follows (a pp_boundary: of the block it leaves), except
tp_enter and cp_kv, which belong to the op group they feed (the same block unless the input comes
straight from the previous block, where it must cross the stage boundary first).
Parameter slots follow the parameter's get_attr, so their block is None: every pipeline stage that
uses the parameter holds its own copy of them. A graph without parameters, linears or attention
gets only the slots that apply (possibly none).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch.fx as fx

from hgraph.meta import CommPoint, NodeMeta, OpKind, SlotKind, TPRole, get_meta, is_slot, set_meta, update_meta
from hgraph.passes.context import PassContext
from hgraph.passes.op_kinds import parameter_names
from hgraph.passes.partial_sums import fused_partial_sums
from hgraph.passes.tp_roles import PARTIAL_SUM
from hgraph.slots import empty_slot


def _slot_after(graph: fx.Graph, value: fx.Node, meta: NodeMeta, users: Iterable[fx.Node],
                name: str, anchor: Optional[fx.Node] = None) -> fx.Node:
    """Insert ``empty_slot(value)`` after ``anchor`` (default: ``value``) and route ``users`` to it."""
    users = list(users)
    with graph.inserting_after(anchor if anchor is not None else value):
        slot = _empty_slot(graph, value, meta, name)
    for u in users:
        u.replace_input_with(value, slot)
    return slot


def _empty_slot(graph: fx.Graph, value: fx.Node, meta: NodeMeta, name: str) -> fx.Node:
    slot = graph.create_node("call_function", empty_slot, (value,), {}, name=name)
    set_meta(slot, meta)
    return slot


def _follow(node: fx.Node, **fields: Any) -> NodeMeta:
    m = get_meta(node)
    return NodeMeta(block=m.block, layer=m.layer, **fields)


def insert_parameter_slots(gm: fx.GraphModule) -> None:
    graph = gm.graph
    params = parameter_names(gm)
    attrs: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "get_attr" and n.target in params:
            attrs.setdefault(str(n.target), []).append(n)
    for name, nodes in attrs.items():
        keep = nodes[0]
        for other in nodes[1:]:
            other.replace_all_uses_with(keep)
            graph.erase_node(other)
        m = get_meta(keep)
        users = list(keep.users)
        base = name.replace(".", "_")
        push = _slot_after(graph, keep, _follow(keep, param=name, tp_role=m.tp_role, shard_dim=m.shard_dim,
                                                slot=SlotKind.PUSH_GRADIENT), users, f"push_{base}")
        for user in users:
            with graph.inserting_before(user):
                pull = _empty_slot(graph, push, _follow(push, param=name, tp_role=m.tp_role, shard_dim=m.shard_dim,
                                                        slot=SlotKind.PULL_PARAMETER), f"pull_{base}")
            user.replace_input_with(push, pull)


def _comm(point: CommPoint, of: fx.Node) -> NodeMeta:
    return _follow(of, slot=SlotKind.COMM_ACTIVATION, comm_point=point)


def insert_tp_slots(gm: fx.GraphModule) -> None:
    graph = gm.graph
    column_inputs: dict[tuple[fx.Node, Optional[str]], list[fx.Node]] = {}
    fused = fused_partial_sums(gm)
    reduced_later = {p for f in fused for p in f.producers}    # their sum's exit reduces them
    for n in list(graph.nodes):
        m = get_meta(n)
        partial_sum = m.tp_rewrite is not None and m.tp_rewrite[0] == PARTIAL_SUM
        if not partial_sum and (m.tp_role is None or is_slot(n) or n.op == "get_attr"):
            continue
        if m.tp_role == TPRole.EXPERTS:
            # the MoE op: its input enters like a column group's (shared with the shared experts' gate / up
            # when they read the same value), its partial sums exit like a row-parallel linear's
            column_inputs.setdefault((n.args[0], m.block), []).append(n)
            if n not in reduced_later:
                _slot_after(graph, n, _comm(CommPoint.TP_EXIT, n), list(n.users), f"tp_exit_{n.name}")
        elif m.op == OpKind.LINEAR and m.tp_role == TPRole.COLUMN:
            column_inputs.setdefault((n.args[0], m.block), []).append(n)
            if m.block == "post":
                _slot_after(graph, n, _comm(CommPoint.TP_GATHER, n), list(n.users), f"tp_gather_{n.name}")
        elif ((m.op == OpKind.LINEAR and m.tp_role == TPRole.ROW) or
              (m.op == OpKind.EMBEDDING and m.tp_role == TPRole.VOCAB)) and n not in reduced_later:
            _slot_after(graph, n, _comm(CommPoint.TP_EXIT, n), list(n.users), f"tp_exit_{n.name}")
        if partial_sum:
            # a full-width sum / mean of a sharded value: all-reduce the partial results (forward), and
            # their gradients, which the sharded ops after it give per slice (backward)
            exit_slot = _slot_after(graph, n, _comm(CommPoint.TP_EXIT, n), list(n.users), f"tp_exit_{n.name}")
            _slot_after(graph, exit_slot, _comm(CommPoint.TP_ENTER, n), list(exit_slot.users), f"tp_enter_{n.name}")
    for f in fused:
        _slot_after(graph, f.root, _comm(CommPoint.TP_EXIT, f.root), list(f.root.users), f"tp_exit_{f.root.name}")
        for scale in f.scales:
            readers = scale.cone | {scale.mul}
            for r in readers:
                if any(get_meta(a).slot == SlotKind.PULL_PARAMETER for a in r.all_input_nodes):
                    update_meta(r, tp_partial=True)     # its parameter's gradient: each rank's part of the sum
                for x in scale.entered:
                    # read whole, inside the TP region: through its tp_enter (after x's own exit, if it has one)
                    x = next((u for u in x.users if get_meta(u).comm_point == CommPoint.TP_EXIT), x)
                    if x in r.all_input_nodes:
                        column_inputs.setdefault((x, get_meta(f.root).block), []).append(r)
    for (x, _), linears in column_inputs.items():
        # the slot belongs to the group it feeds (x may come from the previous block)
        _slot_after(graph, x, _comm(CommPoint.TP_ENTER, linears[0]), linears, f"tp_enter_{x.name}")


def insert_cp_slots(gm: fx.GraphModule) -> None:
    graph = gm.graph
    for n in list(graph.nodes):
        if get_meta(n).op != OpKind.ATTENTION:
            continue
        for i, key in ((1, "key"), (2, "value")):
            value = n.args[i] if len(n.args) > i else n.kwargs.get(key)
            if not isinstance(value, fx.Node):
                continue
            with graph.inserting_before(n):
                slot = _empty_slot(graph, value, _comm(CommPoint.CP_KV, n), f"cp_{key}_{n.name}")
            if len(n.args) > i:
                n.update_arg(i, slot)
            else:
                n.update_kwarg(key, slot)


def insert_pp_slots(gm: fx.GraphModule) -> None:
    graph = gm.graph
    for n in list(graph.nodes):
        block = get_meta(n).block
        if block is None or n.op == "output":
            continue
        outside = [u for u in n.users if u.op != "output" and get_meta(u).block not in (block, None)]
        if outside:
            _slot_after(graph, n, _comm(CommPoint.PP_BOUNDARY, n), outside, f"pp_{n.name}")


def insert_slots_pass(gm: fx.GraphModule, ctx: Optional[PassContext] = None) -> fx.GraphModule:
    """Insert the empty parameter, TP, CP and PP slots into ``gm``; reads nothing from ``ctx``.

    Does nothing to a graph that already has slots (it is returned unchanged).
    """
    if any(is_slot(n) for n in gm.graph.nodes):
        return gm
    insert_parameter_slots(gm)
    insert_tp_slots(gm)
    insert_cp_slots(gm)
    insert_pp_slots(gm)
    gm.graph.lint()
    gm.recompile()
    return gm
