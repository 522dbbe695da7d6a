"""annotate_pass: blocks, layers, op kinds and tensor-parallel roles of a canonical traced graph.

Everything is decided from the graph (``nn_module_stack`` and data flow), not from parameter names,
so it works for models outside the zoo: the blocks and each node's block (``passes/blocks``), the
op kinds and the parameters each op reads (``passes/op_kinds``), and the tensor-parallel roles
(``passes/tp_roles``). This pass writes them into every node's ``NodeMeta``.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from hgraph.errors import TraceError
from hgraph.meta import NodeMeta, OpKind, TPRole, set_meta, update_meta
from hgraph.passes.blocks import assign_blocks, find_blocks
from hgraph.passes.context import PassContext
from hgraph.passes.op_kinds import op_kind, op_params, param_of, parameter_names
from hgraph.passes.tp_roles import assign_tp_roles, expert_param_roles, param_role, param_shard_dim


def annotate_pass(gm: fx.GraphModule, ctx: Optional[PassContext] = None) -> fx.GraphModule:
    """Set NodeMeta block / layer / op on every node and param / shard_dim / tp_role on parameter
    get_attr nodes and the ops that read them. Reads nothing from ``ctx``.

    Raises TraceError if the graph has no repeated blocks (nothing to pipeline over). A graph that is
    already annotated is annotated again from scratch (the result is the same).
    """
    params = parameter_names(gm)
    blocks = find_blocks(gm)
    if not blocks:
        raise TraceError("found no repeated blocks (an nn.ModuleList or nn.Sequential of modules of one "
                         "type, e.g. model.layers); hgraph needs them to place pipeline stages")
    layer_of = {b: i for i, b in enumerate(blocks)}
    block_of = assign_blocks(gm, blocks, params)
    reasons: dict[fx.Node, str] = {}
    rewrites: dict[fx.Node, tuple[int, str]] = {}
    fused: dict[fx.Node, tuple] = {}
    partial: dict[fx.Node, bool] = {}
    roles = assign_tp_roles(gm, block_of, blocks, params, reasons, rewrites, fused, partial)

    for n in gm.graph.nodes:
        b = block_of.get(n)
        set_meta(n, NodeMeta(block=b, layer=layer_of.get(b), op=op_kind(n), tp_rewrite=rewrites.get(n),
                             tp_partial=partial.get(n, False)))
    for n, role in roles.items():
        if role == TPRole.EXPERTS:       # the MoE op: each parameter its own role and dim (tp_roles)
            experts = expert_param_roles(n, params, gm)
            update_meta(n, tp_role=role, param=experts[0][0], shard_dim=0, tp_parts=fused.get(n))
            attrs = {param_of(a, params): a for a in n.args[1:]}
            for name, prole, dim in experts:
                update_meta(attrs[name], param=name, tp_role=prole, shard_dim=dim)
            continue
        uses = op_params(n, params)
        if op_kind(n) == OpKind.OTHER and role == TPRole.COLUMN:     # weight * flat value: split like a bias
            uses = [("bias", name, attr) for _, name, attr in uses]
        main = next((u for u in uses if u[0] == "weight"), uses[0])
        update_meta(n, tp_role=role, param=main[1], shard_dim=param_shard_dim(role, main[0], n),
                    tp_reason=reasons.get(n), tp_parts=fused.get(n) if role == TPRole.COLUMN else None)
        for arg_role, name, attr in uses:
            value = gm.get_parameter(name)
            dim = param_shard_dim(role, arg_role, n) if value.dim() else None
            update_meta(attr, param=name, tp_role=param_role(role, arg_role), shard_dim=dim)
    return gm
