"""The text forms of an instantiated ``Program``: a readable listing per rank (``text``), each rank's
graph as a runnable Python module (``python``) and a JSON description (``json``).

These are how the IR prints itself (as fx's ``GraphModule.code``): they need nothing but the IR, so
``CompiledModule.dump`` renders them without reaching ``tools``. Drawn graphs (DOT, SVG, HTML) are
``hgraph.tools.report.dump``'s, which also dispatches to the forms here.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

import torch.fx as fx

from hgraph import dims
from hgraph.errors import HGraphError
from hgraph.meta import SlotKind, get_meta
from hgraph.program import Program, RankProgram
from hgraph.shard_rule import replica_ranks, shard_group_ranks

TEXT_FORMATS = ("text", "python", "json")


def render_text(program: Program, fmt: str = "text", rank: Optional[int] = None, model: str = "") -> str:
    """``program`` (every rank, or ``rank``) in one of ``TEXT_FORMATS`` (``model`` is unused: the text
    forms have no title; the argument matches a renderer's of ``CompiledModule.dump``)."""
    if fmt not in TEXT_FORMATS:
        raise HGraphError(f"dump format {fmt!r} is drawn by a renderer: pass renderer="
                          "hgraph.tools.report.dump.render_program (or use hgraph dump); the IR's own formats are "
                          f"{', '.join(TEXT_FORMATS)}")
    ranks = selected_ranks(program, rank)
    if fmt == "json":
        return json.dumps(program_json(program, ranks), indent=1)
    if fmt == "text":
        return "\n".join(rank_text(program, rp) for rp in ranks)
    return "\n\n".join(rank_python(program, rp) for rp in ranks)


def selected_ranks(program: Program, rank: Optional[int]) -> list[RankProgram]:
    """Every rank of ``program``, or ``rank`` alone (a rank outside the world: one line)."""
    if rank is not None and not 0 <= rank < len(program.ranks):
        raise HGraphError(f"rank {rank} is outside the world of {len(program.ranks)} ranks (0..{len(program.ranks) - 1})")
    return program.ranks if rank is None else [program.rank(rank)]


# ---- JSON -----------------------------------------------------------------------------------------
def program_json(program: Program, ranks: list[RankProgram]) -> dict[str, Any]:
    return {
        "strategy": str(program.strategy),
        "world_size": program.cluster.world_size,
        "shard_group": program.cluster.group_size,
        "sequence_parallel": program.sequence_parallel,
        "sequence_parallel_note": program.sequence_parallel_note or None,
        "ranks": [{
            "rank": rp.rank, "pipeline": rp.pipeline, "scheme": str(rp.scheme), "stage": rp.stage,
            "tp_rank": rp.tp_rank, "cp_rank": rp.cp_rank, "optimizer": optimizer_layout(program, rp),
            **_places(program, rp),
            "blocks": list(rp.role.blocks),
            "params": [{"name": s.name, "full_shape": list(s.full_shape), "shard_shape": list(s.shard_shape),
                        "shard_dim": s.shard_dim if s.tp_sharded else None}
                       for s in rp.params.values()],
            "subgraphs": [{"kind": sg.kind.value, "param": sg.param, "ops": list(sg.ops), "peers": list(sg.peers),
                           "bytes": sg.bytes, **({"comm_point": sg.comm_point} if sg.comm_point else {})}
                          for sg in rp.subgraphs],
        } for rp in ranks],
    }


def _places(program: Program, rp: RankProgram) -> dict[str, int]:
    """The rank's places along the dimensions its coordinates combine (``tp_rank`` and ``stage`` say the
    others): the sequence dimensions outer first (``cp_shard``, ``ul_rank``), then those of replicas and of
    documents (``ep_rank``)."""
    return {d.place_key: program.strategy.place(rp.rank, d)
            for d in (*reversed(dims.SEQUENCE), *dims.REPLICAS, *dims.DOCUMENTS)}


def _peers(rp: RankProgram, kind: SlotKind) -> list[int]:
    return sorted({p for sg in rp.subgraphs if sg.kind == kind for p in sg.peers} - {rp.rank})


def optimizer_layout(program: Program, rp: RankProgram) -> dict[str, Any]:
    """Where rank ``rp``'s optimizer shards live (``--shard-group``): its shard group, the ranks holding
    the same shards in the other groups (its Push sums its shards with theirs), and the peers its Pull
    and Push plans exchange with (inside the group)."""
    g, n = program.cluster.group_size, program.cluster.world_size
    return {"shard_group": list(shard_group_ranks(rp.rank, g)), "replicas": list(replica_ranks(rp.rank, g, n)),
            "pull_peers": _peers(rp, SlotKind.PULL_PARAMETER), "push_peers": _peers(rp, SlotKind.PUSH_GRADIENT)}


def optimizer_layout_text(program: Program, rp: RankProgram) -> str:
    lay = optimizer_layout(program, rp)
    g, n = program.cluster.group_size, program.cluster.world_size
    group = lay["shard_group"]
    where = (f"sharded over the world ({n} ranks)" if g == n else
             f"sharded over ranks {group[0]}-{group[-1]} (G {g}), its shards summed across the {n // g} "
             f"groups with ranks {lay['replicas']}")
    return (f"optimizer states: {where}; pull peers {lay['pull_peers']}, push peers {lay['push_peers']}")


# ---- text -----------------------------------------------------------------------------------------
def _seq_rank_text(rp: RankProgram) -> str:
    """The rank's place among the ranks splitting the tokens: its CP rank, or under Ulysses its
    sequence rank with its CP shard and Ulysses rank (Ulysses inner)."""
    ep = f", ep_rank {rp.doc_rank}" if rp.scheme.doc_ranks > 1 else ""      # its documents and experts
    if rp.scheme.ul == 1:
        return f"cp_rank {rp.cp_rank}{ep}"
    shard, ul_rank = rp.scheme.seq_place(rp.cp_rank)
    return f"seq_rank {rp.cp_rank} (cp_shard {shard}, ul_rank {ul_rank}){ep}"


def rank_text(program: Program, rp: RankProgram) -> str:
    lines = [f"== rank {rp.rank}: pipeline {rp.pipeline} ({rp.scheme}), stage {rp.stage}, "
             f"tp_rank {rp.tp_rank}, {_seq_rank_text(rp)}  [strategy {program.strategy}]",
             f"   blocks: {', '.join(rp.role.blocks) or '-'}",
             "   peers: " + ", ".join(f"{k}={list(v)}" for k, v in rp.bindings.items())]
    if rp.scheme.tp > 1:       # what the TP exits and enters are
        note = program.sequence_parallel_note
        lines.append("   sequence parallelism: " + ("on (exits reduce-scatter, enters all-gather the tokens)"
                                                     if program.sequence_parallel else
                                                     "off" + (f": {note}" if note else "")))
    lines.append(f"   parameters ({len(rp.params)}):")
    for s in rp.params.values():
        how = f"split on dim {s.shard_dim} {list(s.ranges)}" + (f" +{s.pad} pad" if s.pad else "") \
            if s.tp_sharded else "whole"
        if s.experts is not None:
            how = f"experts {s.experts[0]}:{s.experts[1]}, " + how
        lines.append(f"     {s.name:48s} {str(list(s.full_shape)):>16s} -> {str(list(s.shard_shape)):16s} {how}")
    counts: dict[str, int] = {}
    for sg in rp.subgraphs:
        counts[sg.kind.value] = counts.get(sg.kind.value, 0) + 1
    lines.append("   subgraphs: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    lines.append(f"   pull bytes {sum(sg.bytes for sg in rp.subgraphs if sg.kind == SlotKind.PULL_PARAMETER)}, "
                 f"push bytes {sum(sg.bytes for sg in rp.subgraphs if sg.kind == SlotKind.PUSH_GRADIENT)}")
    lines.append("   " + optimizer_layout_text(program, rp))
    lines.append("   program:")
    for n in rp.graph_module.graph.nodes:
        m = get_meta(n)
        tag = f"[{m.slot.value}] " if m.slot is not None else ""
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in n.args if not is_comm(a))
        lines.append(f"     {tag}{n.name} = {n.op}:{target}({args})")
    return "\n".join(lines) + "\n"


def is_comm(a: Any) -> bool:
    return isinstance(a, fx.Node) and a.op == "placeholder" and a.target == "comm"


# ---- runnable Python ------------------------------------------------------------------------------
def rank_python(program: Program, rp: RankProgram) -> str:
    """The rank's graph as a standalone module: imports, a class with shard-shaped parameters, forward.

    Each filled subgraph is preceded by a ``# ---- <kind> ...`` comment. ``Rank<N>().forward(ids,
    pos, comm)`` runs it (with ``comm=None`` when the rank has no peers).
    """
    gm = rp.graph_module
    code = gm.graph.python_code(root_module="self")
    imports = []
    for name, obj in sorted(code.globals.items()):
        mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if name in ("inf", "nan", "NoneType", "torch", "device", "fx_pytree", "pytree"):
            continue
        if mod and qual and "<" not in qual:
            top, _, rest = qual.partition(".")
            imports.append(f"from {mod} import {top} as {name}" if not rest else
                           f"from {mod} import {top} as _{name}_owner; {name} = _{name}_owner.{rest}")
    tags = {n.name: get_meta(n) for n in gm.graph.nodes}
    body, last_tag = [], None
    for line in code.src.splitlines():
        m = re.match(r"\s+(\w+) = ", line)
        meta = tags.get(m.group(1)) if m else None
        tag = meta.subgraph if meta is not None else None
        if tag != last_tag and tag is not None:
            what = meta.param or (meta.comm_point.value if meta.comm_point else "")
            body.append(f"        # ---- {meta.slot.value}: {what}")
        elif tag is None and last_tag is not None and m:
            body.append("        # ---- compute")
        if m or tag is not None:
            last_tag = tag
        body.append("    " + line if line.strip() else line)
    params = "\n".join(f"        _param(self, {s.name!r}, {list(s.shard_shape)})" for s in rp.params.values())
    header = (f"# hgraph program of rank {rp.rank}: pipeline {rp.pipeline} ({rp.scheme}), stage {rp.stage}, "
              f"tp_rank {rp.tp_rank}, {_seq_rank_text(rp)}; strategy {program.strategy}, world size "
              f"{program.cluster.world_size}\n# peers: " + ", ".join(f"{k}={list(v)}" for k, v in rp.bindings.items()))
    return f'''{header}
import torch
{chr(10).join(sorted(set(imports)))}


def _param(root, name, shape):
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))


class Rank{rp.rank}(torch.nn.Module):
    def __init__(self):
        super().__init__()
{params or "        pass"}

{chr(10).join(body)}
'''
