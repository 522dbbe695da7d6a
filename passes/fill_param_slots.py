"""Fill the Pull Parameter and Push Gradient slots of one rank.

* push_gradient slot (one per parameter) -> ``push_gradient(comm, w, name, eager)``: identity forward;
  its backward hands the parameter's gradient to the runtime, which reduce-scatters it among the
  pipelines holding the same layout and LNKs it to the optimizer shard owners (the push plan).
* pull_parameter slot (one per use site) -> ``pull_issue(comm, name)`` (starts the LNK of the pull
  plan) + ``pull_wait(comm, w, name)`` + ``to_working_dtype`` (the fp32 -> working-precision cast).

The plans themselves are data in the Program (``hgraph.passes.lnk.plans``); these nodes only say
*when* each transfer is started and waited for. ``schedule_comm_pass`` moves the issues.
"""
from __future__ import annotations

import torch.fx as fx

from hgraph import ops
from hgraph.meta import NodeMeta, SlotKind, get_meta, set_meta
from hgraph.passes.context import PassContext
from hgraph.slots import empty_slot


def fill_param_slots_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace parameter slots with pull / push ops; does nothing for a stage without parameters."""
    g = gm.graph
    comm = next(n for n in g.nodes if n.op == "placeholder" and n.target == "comm")
    dtype = ctx.options.working_dtype
    for slot in list(g.nodes):
        m = get_meta(slot)
        if slot.target is not empty_slot or m.slot not in (SlotKind.PULL_PARAMETER, SlotKind.PUSH_GRADIENT):
            continue
        w, name = slot.args[0], m.param
        tag = f"{m.slot.value}:{slot.name}"

        def mark(node: fx.Node, label: str) -> fx.Node:
            set_meta(node, NodeMeta(block=m.block, layer=m.layer, param=name, slot=m.slot, subgraph=tag))
            node.name = f"{label}_{slot.name}"
            return node

        with g.inserting_before(slot):
            if m.slot == SlotKind.PUSH_GRADIENT:
                out = mark(g.call_function(ops.push_gradient, (comm, w, name, True)), "push")
            else:
                mark(g.call_function(ops.pull_issue, (comm, name)), "pull_issue")
                out = mark(g.call_function(ops.pull_wait, (comm, w, name)), "pull_wait")
                out = mark(g.call_function(ops.to_working_dtype, (out, dtype)), "cast")
        slot.replace_all_uses_with(out)
        g.erase_node(slot)
    return gm
