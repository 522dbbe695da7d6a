"""Dumps of instantiated programs: text, runnable Python, JSON, and graphs (DOT / SVG / HTML).

``render_program(program, fmt, rank=None)`` is the one entry point; ``rank=None`` means every rank
(for ``python`` and ``text`` the ranks are concatenated; graphs show each rank as a cluster inside
its pipeline and stage).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, Optional

import torch.fx as fx

from hgraph.dims import BindingKey
from hgraph.errors import HGraphError
from hgraph.meta import SlotKind, get_meta
from hgraph.program import Program, RankProgram
from hgraph.shard_rule import replica_ranks, shard_group_ranks
from hgraph.tools.render.graph import REdge, RGraph, RNode, render_dot
from hgraph.tools.render.html import render_html
from hgraph.tools.render.svg import render_svg

FORMATS = ("text", "python", "dot", "svg", "html", "json")


def render_program(program: Program, fmt: str = "text", rank: Optional[int] = None, model: str = "") -> str:
    """``program`` (every rank, or ``rank``) in ``fmt``; ``model`` names the model in graph titles."""
    if fmt not in FORMATS:
        raise HGraphError(f"unknown dump format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if rank is not None and not 0 <= rank < len(program.ranks):
        raise HGraphError(f"rank {rank} is outside the world of {len(program.ranks)} ranks (0..{len(program.ranks) - 1})")
    ranks = program.ranks if rank is None else [program.rank(rank)]
    if fmt == "json":
        return json.dumps(program_json(program, ranks), indent=1)
    if fmt == "text":
        return "\n".join(rank_text(program, rp) for rp in ranks)
    if fmt == "python":
        return "\n\n".join(rank_python(program, rp) for rp in ranks)
    graph = program_rgraph(program, ranks, model)
    if fmt == "dot":
        return render_dot(graph)
    if fmt == "svg":
        return render_svg(graph)
    return render_html(graph)


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
            **dict(zip(("cp_shard", "ul_rank"), rp.scheme.seq_place(rp.cp_rank))),
            "blocks": list(rp.role.blocks),
            "params": [{"name": s.name, "full_shape": list(s.full_shape), "shard_shape": list(s.shard_shape),
                        "shard_dim": s.shard_dim if s.tp_sharded else None}
                       for s in rp.params.values()],
            "subgraphs": [{"kind": sg.kind.value, "param": sg.param, "ops": list(sg.ops), "peers": list(sg.peers),
                           "bytes": sg.bytes, **({"comm_point": sg.comm_point} if sg.comm_point else {})}
                          for sg in rp.subgraphs],
        } for rp in ranks],
    }


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
    if rp.scheme.ul == 1:
        return f"cp_rank {rp.cp_rank}"
    shard, ul_rank = rp.scheme.seq_place(rp.cp_rank)
    return f"seq_rank {rp.cp_rank} (cp_shard {shard}, ul_rank {ul_rank})"


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
        args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in n.args if not _is_comm(a))
        lines.append(f"     {tag}{n.name} = {n.op}:{target}({args})")
    return "\n".join(lines) + "\n"


def _is_comm(a: Any) -> bool:
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


# ---- graphs ---------------------------------------------------------------------------------------
def _kind(n: fx.Node) -> str:
    m = get_meta(n)
    if m.slot is not None:
        return m.slot.value
    if n.op == "placeholder":
        return "input"
    if n.op == "output":
        return "output"
    if n.op == "get_attr":
        return "param"
    return "compute"


OUTSIDE_BLOCKS = "outside blocks"


def _blocks(nodes: list[fx.Node]) -> dict[str, Optional[str]]:
    """Each node's layer block (a box of the HTML page): its ``NodeMeta.block`` if the rank computes
    that block; for a filled slot subgraph the block its parameter lives in (``layers.3.mlp...``) or
    else the one its neighbours outside it are in (a stage's receive of ``layers.1``'s output goes
    with the ``layers.2`` that reads it); a parameter node or compute outside every block goes with
    its users when they are all in one block, else (rotary tables every block reads) into one
    ``outside blocks`` box."""
    known = {get_meta(n).block for n in nodes if get_meta(n).slot is None} - {None}
    block: dict[str, Optional[str]] = {}
    for n in nodes:
        m = get_meta(n)
        owner = [b for b in known if m.param and m.param.startswith(b + ".")]
        block[n.name] = m.block if m.block in known else max(owner, key=len, default=None)
    members: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if get_meta(n).subgraph:
            members.setdefault(get_meta(n).subgraph, []).append(n)
    for group in members.values():
        inside = {n.name for n in group}
        found = [block[n.name] for n in group if block[n.name]] or [
            block[o.name] for n in group for o in (*n.all_input_nodes, *n.users)
            if o.name not in inside and block.get(o.name)]
        for n in group:
            block[n.name] = Counter(found).most_common(1)[0][0] if found else None  # ties: first seen
    for n in reversed(nodes):  # users first, so chains of such nodes follow their consumers
        users = {block.get(u.name) for u in n.users}
        if block[n.name] is None and n.op in ("get_attr", "call_function", "call_method"):
            block[n.name] = users.pop() if len(users) == 1 and None not in users else (
                None if n.op == "get_attr" else OUTSIDE_BLOCKS)
    return block


_SLOT_WORDS = {"pull_parameter": "pull", "push_gradient": "push", "comm_activation": "comm"}


def _box(n: fx.Node, block: Optional[str]) -> tuple[str, ...]:
    """The page's boxes around ``n``: its block, and its slot subgraph named by what it moves."""
    m = get_meta(n)
    outer = (block,) if block else ()
    if not m.subgraph or m.slot is None:
        return outer
    point, _, tail = m.subgraph.partition(":")
    what = m.param or (tail if tail.startswith(point) else f"{point} {tail}".strip())
    if block and what.startswith(block + "."):
        what = what[len(block) + 1:]
    return outer + (f"{_SLOT_WORDS[m.slot.value]} {what}",)


def graph_title(program: Program, ranks: list[RankProgram], model: str = "") -> str:
    """What a drawing shows: the model, the strategy and which ranks."""
    world = program.cluster.world_size
    shown = (f"all {world} ranks" if len(ranks) == world else
             f"rank {ranks[0].rank} of {world}" if len(ranks) == 1 else
             f"ranks {', '.join(str(rp.rank) for rp in ranks)} of {world}")
    return f"{model} under {program.strategy}: {shown}" if model else f"{program.strategy}: {shown}"


def program_rgraph(program: Program, ranks: list[RankProgram], model: str = ""):
    """The renderer-neutral graph of ``ranks``: one cluster per pipeline / stage / rank, and in each
    rank one box per layer block and per filled slot subgraph."""
    nodes, edges = [], []
    for rp in ranks:
        cluster = (f"pipeline {rp.pipeline}: {rp.scheme}", f"stage {rp.stage}", f"rank {rp.rank}")
        graph_nodes = [n for n in rp.graph_module.graph.nodes if not _is_comm(n)]
        blocks = _blocks(graph_nodes)
        for n in graph_nodes:
            target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            m = get_meta(n)
            nodes.append(RNode(f"r{rp.rank}.{n.name}", target if n.op != "placeholder" else n.name, _kind(n),
                               cluster, f"{n.name}: {n.op} {target}" + (f" ({m.param})" if m.param else ""),
                               _box(n, blocks[n.name])))
            for a in n.all_input_nodes:
                if not _is_comm(a):
                    edges.append(REdge(f"r{rp.rank}.{a.name}", f"r{rp.rank}.{n.name}"))
    # cross-rank activation edges: each send to the matching receive of the next stage
    shown = {rp.rank: rp for rp in ranks}
    for rp in ranks:
        nxt = rp.bindings.get(BindingKey.PP_NEXT)
        if not nxt or nxt[0] not in shown:
            continue
        sends = [n for n in rp.graph_module.graph.nodes if (get_meta(n).subgraph or "").startswith("pp_send")]
        recvs = [n for n in shown[nxt[0]].graph_module.graph.nodes if (get_meta(n).subgraph or "").startswith("pp_recv")]
        for s, r in zip(sends, recvs):
            edges.append(REdge(f"r{rp.rank}.{s.name}", f"r{nxt[0]}.{r.name}", "activation", "comm"))
    return RGraph(graph_title(program, ranks, model), nodes, edges)
