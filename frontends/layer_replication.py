"""Exporting a deep model as a 2-layer copy and replicating the layer graph (fast export).

``torch.export`` time grows with depth (~0.5 s per decoder layer on a small CPU), while the layers of
a decoder are copies of one module. ``truncated_layers`` exports the model with only its first two
layers (the layer list and the config's layer count are restored afterwards), and
``replicate_layers`` copies the second layer's nodes once per further layer, renaming its
parameters (``layers.1.*`` -> ``layers.i.*``) and feeding each copy the previous layer's output.

Equivalence is checked, not assumed: layer 1 must be node-for-node layer 0 (same ops, same
parameters up to the layer index, same shared inputs, its other inputs being layer 0's outputs in
the place where layer 0 reads the values before it); otherwise ``NotReplicable`` is raised and the
caller exports the whole model.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch.fx as fx
import torch.nn as nn

from hgraph.frontends.aten_canonical import STACK_KEY

_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")


class NotReplicable(Exception):
    """The exported layers are not copies of each other: export the whole model instead."""


def layer_container(model: nn.Module) -> Optional[tuple[str, nn.ModuleList]]:
    """(path, list) of the model's repeated layers: the ModuleList whose length is the config's layer
    count and whose members share one type, or None."""
    config = getattr(model, "config", None)
    count = next((getattr(config, f) for f in _LAYER_COUNT_FIELDS if isinstance(getattr(config, f, None), int)),
                 None)
    if count is None:
        return None
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == count and len({type(m) for m in mod}) == 1:
            return path, mod
    return None


@contextlib.contextmanager
def truncated_layers(model: nn.Module, path: str, keep: int) -> Iterator[None]:
    """The model with only its first ``keep`` layers (and a config saying so), restored on exit;
    NotReplicable if the config cannot be changed."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    full = getattr(parent, name)
    config = model.config
    fields = [f for f in _LAYER_COUNT_FIELDS if isinstance(getattr(config, f, None), int)]
    counts = {f: getattr(config, f) for f in fields}
    layer_types = getattr(config, "layer_types", None)
    changed: list[str] = []
    try:
        setattr(parent, name, nn.ModuleList(list(full)[:keep]))
        try:
            for f in fields:
                setattr(config, f, keep)
                changed.append(f)
        except (AttributeError, TypeError, dataclasses.FrozenInstanceError):
            raise NotReplicable("the model's config cannot be changed (frozen)") from None
        if isinstance(layer_types, list):
            config.layer_types = layer_types[:keep]
        yield
    finally:
        setattr(parent, name, full)
        for f in changed:
            setattr(config, f, counts[f])
        if isinstance(layer_types, list):
            config.layer_types = layer_types


def _in_layer(node: fx.Node, prefix: str) -> bool:
    return any(isinstance(p, str) and (p == prefix or p.startswith(prefix + "."))
               for p, _ in (node.meta.get(STACK_KEY) or {}).values())


def _layer_nodes(graph: fx.Graph, prefix: str) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output") and _in_layer(n, prefix)]


def _rename(value: str, old: str, new: str) -> str:
    return new + value[len(old):] if value == old or value.startswith(old + ".") else value


def _template(graph: fx.Graph, path: str) -> tuple[list[fx.Node], dict[fx.Node, int]]:
    """Layer 1's nodes and, for each of its inputs from layer 0, the index (in layer 0) of the layer-0
    node that plays the same role for layer 1 as the pre-layer value does for layer 0."""
    l0, l1 = _layer_nodes(graph, f"{path}.0"), _layer_nodes(graph, f"{path}.1")
    if not l0 or len(l0) != len(l1):
        raise NotReplicable(f"layers 0 and 1 have {len(l0)} and {len(l1)} nodes")
    i0, i1 = {n: i for i, n in enumerate(l0)}, {n: i for i, n in enumerate(l1)}
    feeds: dict[fx.Node, int] = {}   # layer-0 node read by layer 1 -> its index in layer 0
    inputs0: dict[fx.Node, fx.Node] = {}   # pre-layer value read by layer 0 -> layer-0 node feeding layer 1 there
    for a, b in zip(l0, l1):
        if (a.op, a.target if a.op != "get_attr" else _rename(str(a.target), f"{path}.0", f"{path}.1")) != \
                (b.op, b.target):
            raise NotReplicable(f"{a.name} and {b.name} differ")
        flat_a, flat_b = [], []
        fx.node.map_arg((a.args, a.kwargs), flat_a.append)
        fx.node.map_arg((b.args, b.kwargs), flat_b.append)
        if len(flat_a) != len(flat_b) or _constants(a) != _constants(b):
            raise NotReplicable(f"{a.name} and {b.name} have different arguments")
        for x, y in zip(flat_a, flat_b):
            if y in i1:
                ok = x in i0 and i0[x] == i1[y]
            elif y in i0:              # layer 1 reads layer 0's output where layer 0 reads the pre value
                ok = x not in i0 and inputs0.setdefault(x, y) is y
                feeds[y] = i0[y]
            else:                      # shared (positions, rotary tables, sizes)
                ok = x is y
            if not ok:
                raise NotReplicable(f"{b.name} reads {y.name} where {a.name} reads {x.name}")
    for n in l0:   # layer 0's values may only be read by layer 0 and layer 1
        if any(u not in i0 and u not in i1 for u in n.users):
            raise NotReplicable(f"{n.name} of layer 0 is read outside layers 0 and 1")
    return l1, feeds


def _constants(node: fx.Node) -> Any:
    """The node's arguments with every node replaced by a marker (constants compared as they are)."""
    return fx.node.map_arg((node.args, node.kwargs), lambda _: "<node>")


def replicate_layers(graph: fx.Graph, root: dict[str, Any], model: nn.Module, path: str, count: int,
                     canonical: dict[int, str]) -> None:
    """Append copies of layer 1 as layers 2..count-1; the nodes after the layers
    then read the last copy. ``root`` gains the copied layers' parameters and buffers."""
    l1, feeds = _template(graph, path)
    index1 = {n: i for i, n in enumerate(l1)}
    after = [u for n in l1 for u in n.users if u not in index1]
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    previous = list(l1)
    anchor = l1[-1]
    for layer in range(2, count):
        old, new = f"{path}.1", f"{path}.{layer}"
        copies: list[fx.Node] = []
        inputs_from_previous = {y: previous[i] for y, i in feeds.items()}

        def arg(a: fx.Node) -> fx.Node:
            if a in index1:
                return copies[index1[a]]
            return inputs_from_previous.get(a, a)
        for n in l1:
            with graph.inserting_after(anchor):
                c = graph.node_copy(n, arg)
            anchor = c
            if n.op == "get_attr":
                target = _rename(str(n.target), old, new)
                obj = params[target] if target in params else buffers[target]
                target = canonical.get(id(obj), target)
                root[target] = obj
                c.target = target
            c.meta = dict(n.meta)
            c.meta[STACK_KEY] = {k: (_rename(p, old, new), t) for k, (p, t) in (n.meta.get(STACK_KEY) or {}).items()}
            copies.append(c)
        previous = copies
    for u in after:   # the final norm / head read the last layer
        u.args = fx.node.map_arg(u.args, lambda a: previous[index1[a]] if a in index1 else a)
        u.kwargs = fx.node.map_arg(u.kwargs, lambda a: previous[index1[a]] if a in index1 else a)
