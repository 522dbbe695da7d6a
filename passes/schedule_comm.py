"""Schedule the Pull Parameter / Push Gradient subgraphs onto the communication stream (Fig. 8).

The schedule is the node order (each collective is an issue node and a wait node):

* first PP stage: the pull of a parameter used by block k is issued at the start of block k-1
  (one block of look-ahead, so the transfer overlaps that block's compute) and waited right before
  its first use; pushes are eager: each is issued as soon as the last micro-batch's backward
  finishes that gradient.
* later stages: all pulls are issued at the start of the graph (they hide in the pipeline's
  warm-up bubble) and pushes are grouped at the end of the step (the cool-down bubble).
"""
from __future__ import annotations

import torch.fx as fx

from hgraph import ops
from hgraph.meta import get_meta
from hgraph.passes.context import PassContext


def _first_compute_of_block(g: fx.Graph) -> dict[str, fx.Node]:
    first: dict[str, fx.Node] = {}
    for n in g.nodes:
        m = get_meta(n)
        if n.op in ("call_function", "call_method", "call_module") and m.slot is None and m.block is not None:
            first.setdefault(m.block, n)
    return first


def schedule_comm_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Reorder pull issues and set push modes for ``ctx.role.stage``; a stage without parameters is unchanged."""
    g = gm.graph
    stage = ctx.role.stage
    issues = [n for n in g.nodes if n.target is ops.pull_issue]
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    anchor_start = placeholders[-1]
    order = list(ctx.hgraph.blocks)
    first = _first_compute_of_block(g)

    for n in g.nodes:
        if n.target is ops.push_gradient:
            n.args = n.args[:3] + (stage == 0,)

    for issue in issues:
        wait = next(u for u in g.nodes if u.target is ops.pull_wait and u.args[2] == issue.args[1]
                    and get_meta(u).subgraph == get_meta(issue).subgraph)
        target = None
        if stage == 0:
            user_block = next((get_meta(u).block for u in _consumers(wait) if get_meta(u).block is not None), None)
            if user_block in order:
                i = order.index(user_block)
                prev = next((order[j] for j in range(i - 1, -1, -1) if order[j] in first), None)
                target = first.get(prev) if prev is not None else None
        if target is None:
            anchor_start.append(issue)   # right after the placeholders (and the issues before it)
            anchor_start = issue
        else:
            target.prepend(issue)
    return gm


def _consumers(node: fx.Node) -> list[fx.Node]:
    """The computational ops that consume ``node`` through the cast / push ops of its subgraph."""
    out, work = [], list(node.users)
    while work:
        u = work.pop()
        if get_meta(u).slot is not None:
            work.extend(u.users)
        else:
            out.append(u)
    return out
