"""The data the HTML page draws from: every level of a :class:`CollapsedGraph` with its layout, as
plain JSON-able lists (coordinates rounded to a tenth of a pixel to keep the page small).

Shape, read by :mod:`hgraph.tools.render.page_script`::

    levels: {"" (top level) or box id: {w, h, items: [[id, cx, cy, w, h, label lines, band]],
             clusters: [[path, x, y, w, h]], edges: [[src item, dst item, count, [x, y, ...]]],
             bands: [[x, row width, width]]}}
    boxes:  {box id: {name, kind, parent, tip, n}}      n: nodes inside, at any depth
    order:  box ids, parents first (the order the page expands them in)
    nodes:  {node id: {k: kind, t: tooltip, b: innermost box id or null}}
    comm:   [[src node, dst node, label]]               drawn between whatever shows each end

Data edges are drawn along their level's routes; ``comm`` edges are drawn by the page between the
visible items holding their ends, so they stay visible whatever is collapsed.
"""
from __future__ import annotations

from typing import Any

from hgraph.tools.render.collapse import CollapsedGraph, Level


def _r(v: float) -> float:
    return round(v, 1)


def _level_data(level: Level) -> dict[str, Any]:
    lay = level.layout
    band_of = {band.path: k for k, band in enumerate(lay.bands)}
    cluster = {n.id: n.cluster for n in level.graph.nodes}
    items = [[node_id, _r(b.x), _r(b.y), _r(b.w), _r(b.h), b.lines, band_of[cluster[node_id]]]
             for node_id, b in lay.nodes.items()]
    clusters = [[list(c.path), _r(c.x), _r(c.y), _r(c.w), _r(c.h)] for c in lay.clusters]
    edges = []
    for route in lay.edges:
        e = route.edge
        if e.kind == "comm":
            continue
        flat = [_r(v) for point in route.points for v in point]
        edges.append([e.src, e.dst, level.edge_counts[(e.src, e.dst, e.kind)], flat])
    bands = [[_r(band.x), _r(band.row_width), _r(band.width)] for band in lay.bands]
    return {"w": _r(lay.width), "h": _r(lay.height), "items": items, "clusters": clusters, "edges": edges,
            "bands": bands}


def page_data(c: CollapsedGraph) -> dict[str, Any]:
    """The page's data for ``c``."""
    return {
        "levels": {owner or "": _level_data(level) for owner, level in c.levels.items()},
        "boxes": {box.id: {"name": box.name, "kind": box.kind,
                           "parent": box.parent.id if box.parent else None,
                           "tip": " / ".join(box.cluster + box.path), "n": sum(1 for _ in box.nodes())}
                  for box in c.boxes.values()},
        "order": list(c.boxes),
        "nodes": {n.id: {"k": n.kind, "t": n.tooltip or n.label,
                         "b": c.box_of[n.id].id if c.box_of[n.id] else None} for n in c.graph.nodes},
        "comm": [[e.src, e.dst, e.label] for e in c.graph.edges if e.kind == "comm"],
    }
