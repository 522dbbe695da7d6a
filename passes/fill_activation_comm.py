"""Fill the Communicate Activation slots of one rank with the collectives its scheme needs.

* ``tp_enter``: Megatron f (``tp_copy``: identity forward, all-reduce of the gradient backward); under
  sequence parallelism (``ctx.sp``) ``sp_gather_issue`` + ``comm_wait``: all-gather of the TP ranks'
  token slices (the gradient reduce-scattered).
* ``tp_exit``: Megatron g: ``tp_reduce_issue`` + ``comm_wait`` (all-reduce of the partial sums); under
  sequence parallelism, after a row-parallel linear / vocab-parallel embedding, ``sp_scatter_issue`` +
  ``comm_wait``: reduce-scatter along the tokens (a full-width partial sum's exit stays an all-reduce).
* ``tp_gather``: ``tp_gather_issue`` + ``comm_wait`` along the last dim, then the vocabulary padding
  is cut off.
* ``cp_kv``: ``cp_kv_gather_issue`` + ``comm_wait``: all-gather of K/V along the sequence over the CP
  group (piece sizes from the micro-batch's CP layout; the backward reduce-scatters). Under Ulysses
  (UL > 1) the slot is the identity: ``packed_attention_pass`` gathers K/V after the all-to-all.
* ``pp_boundary``: already handled by ``extract_stage_pass``; the slot becomes the identity.

With TP=1 and CP=1 every slot becomes the identity, so the rank runs exactly the original ops.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from hgraph.dims import BindingKey
from hgraph import ops
from hgraph.meta import CommPoint, NodeMeta, SlotKind, get_meta, set_meta
from hgraph.passes.context import PassContext
from hgraph.slots import empty_slot


def _comm_placeholder(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "comm")


def _input_ids(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "input_ids")


def _replace(slot: fx.Node, new: fx.Node) -> None:
    slot.replace_all_uses_with(new)
    slot.graph.erase_node(slot)


def _mark(node: fx.Node, slot: fx.Node, name: str) -> fx.Node:
    m = get_meta(slot)
    set_meta(node, NodeMeta(block=m.block, layer=m.layer, slot=SlotKind.COMM_ACTIVATION,
                            comm_point=m.comm_point, subgraph=f"{m.comm_point.value}:{slot.name}"))
    node.name = f"{name}_{slot.name}"
    return node


def fill_activation_comm_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace each comm_activation slot by its issue / wait ops for this rank's scheme."""
    scheme, sp = ctx.role.scheme, ctx.sp
    comm = _comm_placeholder(gm)
    g = gm.graph
    for slot in list(g.nodes):
        m = get_meta(slot)
        if slot.target is not empty_slot or m.slot != SlotKind.COMM_ACTIVATION:
            continue
        x = slot.args[0]
        point = m.comm_point
        # under Ulysses the CP group gathers K/V after the all-to-all (packed_attention_pass)
        if point == CommPoint.PP_BOUNDARY or (point == CommPoint.CP_KV and (scheme.cp == 1 or scheme.ul > 1)) \
                or (point != CommPoint.CP_KV and scheme.tp == 1):
            _replace(slot, x)
            continue
        with g.inserting_before(slot):
            if point == CommPoint.CP_KV:
                dims = ctx.shapes.get(x.name, (None,))[0]
                if dims is None or "T" not in dims:
                    raise AssertionError(f"no sequence dim known for the key/value {x.name}")
                issue = _mark(g.call_function(ops.cp_kv_gather_issue, (comm, x, BindingKey.CP, dims.index("T"))),
                              slot, "all_gather")
                out = _mark(g.call_function(ops.comm_wait, (comm, issue)), slot, "wait")
            elif point == CommPoint.TP_ENTER and sp is not None and slot.name in sp.enters:
                issue = _mark(g.call_function(ops.sp_gather_issue, (comm, x, BindingKey.TP, sp.token_dims[slot.name],
                                                                      _input_ids(gm))), slot, "all_gather")
                out = _mark(g.call_function(ops.comm_wait, (comm, issue)), slot, "wait")
            elif point == CommPoint.TP_ENTER:
                out = _mark(g.call_function(ops.tp_copy, (comm, x, BindingKey.TP)), slot, "tp_copy")
            elif point == CommPoint.TP_EXIT and sp is not None and slot.name in sp.exits:
                dim = sp.token_dims[slot.name]
                issue = _mark(g.call_function(ops.sp_scatter_issue, (comm, x, BindingKey.TP, dim)), slot, "reduce_scatter")
                out = _mark(g.call_function(ops.comm_wait, (comm, issue)), slot, "wait")
            elif point == CommPoint.TP_EXIT:
                issue = _mark(g.call_function(ops.tp_reduce_issue, (comm, x, BindingKey.TP)), slot, "all_reduce")
                out = _mark(g.call_function(ops.comm_wait, (comm, issue)), slot, "wait")
            elif point == CommPoint.TP_GATHER:
                gather = ctx.gathers.get(slot.name)
                if gather is None:   # the op before was not sharded: nothing to gather
                    _replace(slot, x)
                    continue
                sizes, real = gather
                issue = _mark(g.call_function(ops.tp_gather_issue, (comm, x, BindingKey.TP, -1, tuple(sizes))),
                              slot, "all_gather")
                out = _mark(g.call_function(ops.comm_wait, (comm, issue)), slot, "wait")
                if sum(sizes) != real:
                    out = _mark(g.call_function(torch.narrow, (out, -1, 0, real)), slot, "unpad")
            else:
                raise AssertionError(f"unknown comm point {point}")
        _replace(slot, out)
    return gm
