"""The repeated blocks of a traced graph and the block every node belongs to.

* **blocks**: the children of the largest (outermost) container whose integer-indexed children all
  have the same type (``layers.0`` .. ``layers.N-1``), found from ``nn_module_stack``, not from
  parameter names, so it works for models outside the zoo.
* **a node's block**: a node depending on a parameter belongs to the block in its module stack;
  outside every block it is ``"pre"`` before the first block, ``"post"`` after the last one, and
  between blocks it joins the latest block among its inputs. Nodes that depend only on graph inputs,
  buffers and constants (rotary tables from ``position_ids``) get block None: every pipeline stage
  may recompute them.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Optional

import torch.fx as fx

from hgraph.passes.op_kinds import param_of

PRE, POST = "pre", "post"
STACK_KEY = "nn_module_stack"


def _stack_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get(STACK_KEY) or {}
    return [v[0] for v in stack.values()]


def find_blocks(gm: fx.GraphModule) -> list[str]:
    """Module paths of the repeated blocks, in index order.

    Containers that are never called (a ModuleList of ModuleDicts) do not appear in the module
    stacks themselves, so block candidates are all integer-indexed *prefixes* of the recorded module
    paths; a candidate's kind is its module type when it was called, else the set of (relative
    path, type) of the modules called inside it.
    """
    entries: dict[str, Any] = {}
    for node in gm.graph.nodes:
        for path, mtype in (node.meta.get(STACK_KEY) or {}).values():
            entries[path] = mtype
    inside: dict[str, set] = {}
    for path, mtype in entries.items():
        for prefix in _prefixes(path):
            if re.fullmatch(r"(?:.*\.)?\d+", prefix):
                inside.setdefault(prefix, set()).add((path[len(prefix):], mtype))
    groups: dict[str, dict[int, str]] = {}
    kinds: dict[str, set] = {}
    for member, called in inside.items():
        container, _, index = member.rpartition(".")
        groups.setdefault(container, {})[int(index)] = member
        kinds.setdefault(container, set()).add(entries.get(member) or frozenset(called))
    candidates = {p: g for p, g in groups.items() if len(kinds[p]) == 1}
    members = {path for g in candidates.values() for path in g.values()}
    # outermost containers only: experts.0..7 inside layers.3 are not the blocks
    outer = {p: g for p, g in candidates.items()
             if not any(p == m or p.startswith(m + ".") for m in members)}
    if not outer:
        return []
    best = max(outer, key=lambda p: len(outer[p]))  # max keeps the first of equals
    return [outer[best][i] for i in sorted(outer[best])]


def _block_in_stack(node: fx.Node, blocks: set[str]) -> Optional[str]:
    for path in _stack_paths(node):
        for b in _prefixes(path):
            if b in blocks:
                return b
    return None


def _prefixes(path: str) -> Iterable[str]:
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def assign_blocks(gm: fx.GraphModule, blocks: list[str], params: set[str]) -> dict[fx.Node, Optional[str]]:
    """Block of every node."""
    block_set = set(blocks)
    order = {b: i for i, b in enumerate([PRE] + blocks + [POST])}
    nodes = list(gm.graph.nodes)
    # nodes whose value depends on a parameter (through a computation, not the get_attr itself)
    depends: dict[fx.Node, bool] = {}
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            depends[n] = False
            continue
        depends[n] = any(depends[a] or param_of(a, params) is not None for a in n.all_input_nodes)
    in_stack = {n: _block_in_stack(n, block_set) if depends[n] else None for n in nodes}
    positions = [i for i, n in enumerate(nodes) if in_stack[n] is not None]
    first, last = (positions[0], positions[-1]) if positions else (len(nodes), -1)
    out: dict[fx.Node, Optional[str]] = {}
    for i, n in enumerate(nodes):
        if not depends[n]:
            out[n] = None
        elif in_stack[n] is not None:
            out[n] = in_stack[n]
        elif i < first:
            out[n] = PRE
        elif i > last:
            out[n] = POST
        else:  # glue between blocks: it belongs to the latest block it reads from
            ins = [out[a] for a in n.all_input_nodes if out.get(a) is not None]
            out[n] = max(ins, key=order.__getitem__) if ins else PRE
    return out
