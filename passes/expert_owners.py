"""Which parameters are whose experts, and which of them an EP rank holds (``hgraph.dims.Splits.DOCUMENTS``).

An EP group of ``n`` ranks splits each MoE op's ``E`` experts evenly: EP rank ``r`` holds experts
``shard_bounds(E, r, n)`` (``[r*E/n, (r+1)*E/n)``; ``E % n != 0`` is refused, ``check_expert_split``). Of
a list of expert matrices (``3 x E``: gate, up, down per expert, ``hgraph.moe``) the rank holds only its
experts' parameters: it neither pulls nor pushes the others', and the optimizer layout (every parameter
sharded over all ranks) does not change. Of a stacked or fused ``[E, ...]`` tensor (its TP shard along
another axis) it holds the block of its experts along dimension 0, TP-sharded inside
(``ParamShard.experts``); the tensor is then pulled and pushed as ``E`` per-expert pieces
(``hgraph.expert_pieces``), each over the ranks holding that expert, so the rank moves none of the others.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch.fx as fx

from hgraph.errors import StrategyError
from hgraph.shard_rule import shard_bounds
from hgraph.slots import empty_slot
from hgraph.strategy import Scheme
from hgraph.passes.tp_roles import is_moe_layer


def _param_name(node: Any) -> Optional[str]:
    """The parameter an MoE op's argument reads, through its (empty) parameter slots; None otherwise."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is empty_slot:
        node = node.args[0]
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def moe_ops(hg: Any) -> list[tuple[str, int, tuple[Optional[str], ...]]]:
    """Every MoE op of ``hg``'s graph: (its node's name, its number of experts, the parameters of its expert
    weights in the op's order). The expert count is the router's rows."""
    out = []
    for n in hg.gm.graph.nodes:
        if not is_moe_layer(n):
            continue
        router = _param_name(n.args[1])
        if router is None or router not in hg.params:
            continue        # a computed router: its experts are not a parameter split (moe_ep refuses it)
        out.append((n.name, int(hg.params[router].shape[0]), tuple(_param_name(a) for a in n.args[2:])))
    return out


def listed_experts(hg: Any) -> dict[str, tuple[int, int]]:
    """Each parameter of a list of expert matrices (``3 x E``): (its expert, the op's number of experts)."""
    out: dict[str, tuple[int, int]] = {}
    for _, experts, weights in moe_ops(hg):
        if len(weights) == 3 * experts:
            for k, name in enumerate(weights):
                if name is not None:
                    out[name] = (k % experts, experts)
    return out


def stacked_experts(hg: Any) -> dict[str, int]:
    """Each stacked or fused expert tensor (``[E, ...]``, its shard dimension not the expert axis) of the
    graph's MoE ops: its number of experts ``E``, in model order."""
    found: dict[str, int] = {}
    for _, experts, weights in moe_ops(hg):
        if len(weights) == 3 * experts:
            continue
        for name in weights:
            info = hg.params.get(name) if name is not None else None
            if (info is not None and len(info.shape) > 1 and info.shape[0] == experts
                    and info.shard_dim not in (0, None)):
                found[name] = experts
    return {name: found[name] for name in hg.params if name in found}


def check_expert_split(scheme: Scheme, hg: Any) -> None:
    """``scheme``'s EP degree divides every MoE op's number of experts (one line naming the op otherwise)."""
    n = scheme.doc_ranks
    if n == 1:
        return
    for name, experts, _ in moe_ops(hg):
        if experts % n:
            allowed = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
            raise StrategyError(f"scheme {scheme}: EP{n} does not divide the {experts} experts of the MoE op "
                                f"{name}; allowed EP degrees: {allowed}")


def held_experts(params: dict, scheme: Scheme, doc_rank: int, experts: dict[str, tuple[int, int]],
                 stacked: Optional[dict[str, int]] = None) -> dict:
    """``params`` (a rank's shards by name) without the listed experts its EP rank ``doc_rank`` does not hold,
    and with its block of experts of each ``stacked`` tensor (name -> E: ``ParamShard.experts``)."""
    n = scheme.doc_ranks
    stacked = stacked or {}
    if n == 1 or not (experts or stacked):
        return params
    out = {}
    for name, shard in params.items():
        owner = experts.get(name)
        if owner is not None:
            lo, hi = shard_bounds(owner[1], doc_rank, n)
            if not lo <= owner[0] < hi:
                continue
        if name in stacked:
            shard = replace(shard, experts=shard_bounds(stacked[name], doc_rank, n))
        out[name] = shard
    return out
