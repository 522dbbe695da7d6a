"""Layered (Sugiyama-style) layout of an :class:`RGraph` with nested cluster boxes, in pure Python.

Steps: break cycles (reverse DFS back edges), layer by longest path (``networkx.topological_generations``)
and then slide nodes down next to their consumers, add dummy points on edges that skip a few layers,
order each row by barycentre sweeps (keeping the order with the fewest crossings), place rows by
isotonic regression so nodes sit over their neighbours without overlapping, and finally stack rows
and fit cluster boxes.  Edges that skip many layers (forward activations saved for the backward pass)
run down a gutter at the right of their band, one lane per edge with lanes reused where spans do not
overlap, turning only in the gaps between rows: no data edge is drawn through a node, and the number
of dummy points stays small, so thousands of nodes lay out in about a second.

Clusters never overlap because every cluster owns a vertical band of the drawing: a cluster's own
nodes get one band, its sub-clusters sit side by side to the right of it (one column per rank in a
pipeline/stage/rank nesting), and rows are ordered and placed only inside their band.  Rows are shared
by the whole drawing, so a ``comm`` edge between ranks always points down.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right, insort
from dataclasses import dataclass, field

import networkx as nx

from hgraph.tools.render.graph import ClusterTree, REdge, RGraph, cluster_tree, validate_graph

FONT_SIZE = 11.0
CHAR_WIDTH = 6.6  # average advance of a Helvetica-like font at FONT_SIZE, a little generous
LINE_HEIGHT = 13.0
MAX_LABEL_CHARS = 48  # longer label lines are cut with an ellipsis; the tooltip keeps the full text
MAX_LABEL_LINES = 3
NODE_PAD_X = 9.0
NODE_PAD_Y = 6.0
MIN_NODE_WIDTH = 34.0
NODE_GAP = 12.0
LAYER_GAP = 26.0
DUMMY_WIDTH = 4.0
CLUSTER_PAD = 9.0
CLUSTER_LABEL_HEIGHT = 17.0
CLUSTER_GAP = 14.0
BARYCENTRE_SWEEPS = 3  # down+up pairs; the best order seen is kept
PLACEMENT_SWEEPS = 2  # down+up pairs, then one pass that balances both sides
DUMMIES_PER_NODE = 3  # dummy budget per real node, plus DUMMY_BUDGET_BASE: keeps huge graphs fast
DUMMY_BUDGET_BASE = 1000
LONG_EDGE_SPAN = 8  # edges over more layers than this run down the band's gutter instead of dummies
LANE_GAP = 3.0  # between the vertical lanes of the gutter that carries long edges left without dummies
MAX_GUTTER_WIDTH = 60.0
SELF_LOOP_ROOM = 14.0  # kept free at the right of a node that has a self loop
SELF_LOOP_REACH = 16.0  # control-point distance of that loop; the curve reaches 3/4 of it


@dataclass
class NodeBox:
    """Where a node is drawn: centre, size and the label lines shown."""

    x: float
    y: float
    w: float
    h: float
    lines: list[str]


@dataclass
class ClusterBox:
    """A cluster's rectangle (top-left corner and size); depth 0 is a top-level cluster."""

    path: tuple[str, ...]
    x: float
    y: float
    w: float
    h: float

    @property
    def depth(self) -> int:
        return len(self.path) - 1


@dataclass
class Band:
    """The vertical strip of a cluster's own nodes: ``x`` to ``x + width``, rows in the first
    ``row_width``, the gutter of long edges after them."""

    path: tuple[str, ...]
    x: float
    row_width: float
    width: float


@dataclass
class EdgeRoute:
    """An edge and the points its curve goes through, from its source to its destination."""

    edge: REdge
    points: list[tuple[float, float]]


@dataclass
class Layout:
    """Everything a drawing needs; coordinates start at (0, 0) and end at (width, height)."""

    nodes: dict[str, NodeBox]
    clusters: list[ClusterBox]
    edges: list[EdgeRoute]
    width: float
    height: float
    crossings: int  # edge crossings between adjacent rows inside bands, after ordering
    bands: list[Band] = field(default_factory=list)


def label_lines(label: str) -> list[str]:
    """The lines of a label as drawn: at most MAX_LABEL_LINES lines of MAX_LABEL_CHARS characters."""
    lines = label.splitlines() or [""]
    shown = [ln if len(ln) <= MAX_LABEL_CHARS else ln[: MAX_LABEL_CHARS - 1] + "\u2026"
             for ln in lines[:MAX_LABEL_LINES]]
    if len(lines) > MAX_LABEL_LINES:
        shown[-1] = shown[-1][: MAX_LABEL_CHARS - 1] + "\u2026"
    return shown


def text_width(text: str) -> float:
    """Estimated width of one line of text at FONT_SIZE."""
    return len(text) * CHAR_WIDTH


def _node_size(lines: list[str]) -> tuple[float, float]:
    w = max(MIN_NODE_WIDTH, max(text_width(ln) for ln in lines) + 2 * NODE_PAD_X)
    return w, len(lines) * LINE_HEIGHT + 2 * NODE_PAD_Y


# ---- cycle breaking and layering ----------------------------------------------------------------

def _back_edges(n: int, succ: list[list[int]]) -> set[tuple[int, int]]:
    """Edges that close a cycle in an iterative DFS; reversing them all leaves a DAG."""
    state = [0] * n  # 0 unseen, 1 on the DFS stack, 2 finished
    back: set[tuple[int, int]] = set()
    for start in range(n):
        if state[start]:
            continue
        state[start] = 1
        stack = [(start, iter(succ[start]))]
        while stack:
            u, it = stack[-1]
            for v in it:
                if state[v] == 0:
                    state[v] = 1
                    stack.append((v, iter(succ[v])))
                    break
                if state[v] == 1:
                    back.add((u, v))
            else:
                state[u] = 2
                stack.pop()
    return back


def _layers(n: int, oriented: list[tuple[int, int]]) -> list[int]:
    """Longest-path layers, then nodes slid down towards their consumers.

    A node with at least as many out-edges as in-edges moves to just above its highest consumer
    (in reverse topological order, so chains such as parameter -> cast -> LNK slide down together):
    that shortens more edges than it stretches, and keeps e.g. Pull Parameter next to its matmul.
    Empty layers are then removed.
    """
    dag = nx.DiGraph()
    dag.add_nodes_from(range(n))
    dag.add_edges_from(oriented)
    layer = [0] * n
    generations = list(nx.topological_generations(dag))
    for depth, generation in enumerate(generations):
        for u in generation:
            layer[u] = depth
    for generation in reversed(generations):
        for u in generation:
            out_degree = dag.out_degree(u)
            if out_degree and out_degree >= dag.in_degree(u):
                layer[u] = max(layer[u], min(layer[v] for v in dag.successors(u)) - 1)
    used = sorted(set(layer))
    compact = {old: new for new, old in enumerate(used)}
    return [compact[x] for x in layer]


# ---- ordering -----------------------------------------------------------------------------------

def _row_crossings(upper: list[int], pos: list[int], down: list[list[int]], row_of: list[int],
                   lower_row: int) -> int:
    """Crossings of the segments from one row to the next row of the same band."""
    seq: list[tuple[int, int]] = []
    for u in upper:
        for v in down[u]:
            if row_of[v] == lower_row:
                seq.append((pos[u], pos[v]))
    seq.sort()
    seen: list[int] = []
    crossings = 0
    for _, pv in seq:
        crossings += len(seen) - bisect_right(seen, pv)
        insort(seen, pv)
    return crossings


def _total_crossings(rows: list[list[int]], next_row: list[int], pos: list[int], down: list[list[int]],
                     row_of: list[int]) -> int:
    return sum(_row_crossings(row, pos, down, row_of, next_row[r])
               for r, row in enumerate(rows) if next_row[r] >= 0)


def _order_rows(rows: list[list[int]], rows_by_layer: list[list[int]], next_row: list[int],
                up: list[list[int]], down: list[list[int]], row_of: list[int], n_items: int) -> int:
    """Barycentre sweeps down and up, reordering ``rows`` in place; keeps the orders with the fewest
    crossings seen and returns that count."""
    pos = [0] * n_items
    for row in rows:
        for i, item in enumerate(row):
            pos[item] = i
    best = _total_crossings(rows, next_row, pos, down, row_of)
    best_rows = [list(r) for r in rows]
    for sweep in range(2 * BARYCENTRE_SWEEPS):
        if best == 0:
            break
        downward = sweep % 2 == 0
        layer_order = rows_by_layer if downward else rows_by_layer[::-1]
        nbrs = up if downward else down
        for row_ids in layer_order:
            for r in row_ids:
                row = rows[r]
                keys = {}
                for item in row:
                    nb = nbrs[item]
                    keys[item] = sum(pos[v] for v in nb) / len(nb) if nb else pos[item]
                row.sort(key=keys.__getitem__)
                for i, item in enumerate(row):
                    pos[item] = i
        if downward:
            continue  # judged after each down+up pair, which halves the counting
        crossings = _total_crossings(rows, next_row, pos, down, row_of)
        if crossings < best:
            best = crossings
            best_rows = [list(r) for r in rows]
    rows[:] = best_rows
    return best


# ---- horizontal placement -----------------------------------------------------------------------

def _isotonic(target: list[float]) -> list[float]:
    """Least-squares nondecreasing fit (pool adjacent violators)."""
    sums: list[float] = []
    counts: list[int] = []
    for t in target:
        sums.append(t)
        counts.append(1)
        while len(sums) > 1 and sums[-2] / counts[-2] > sums[-1] / counts[-1]:
            s, c = sums.pop(), counts.pop()
            sums[-1] += s
            counts[-1] += c
    out: list[float] = []
    for s, c in zip(sums, counts):
        out.extend([s / c] * c)
    return out


def _place_row(row: list[int], desired: list[float], width: list[float], lo: float, hi: float,
               x: list[float]) -> None:
    """Centres for one row, in order, at least NODE_GAP apart, inside [lo, hi], as close as possible
    (least squares) to ``desired``: with offsets removed this is an isotonic regression, and clipping
    its solution to the band is optimal because the bound is the same for every element."""
    offsets = [0.0]
    for a, b in zip(row, row[1:]):
        offsets.append(offsets[-1] + (width[a] + width[b]) / 2 + NODE_GAP)
    fit = _isotonic([d - o for d, o in zip(desired, offsets)])
    y_lo = lo + width[row[0]] / 2
    y_hi = hi - width[row[-1]] / 2 - offsets[-1]
    for item, y, o in zip(row, fit, offsets):
        x[item] = min(max(y, y_lo), max(y_hi, y_lo)) + o


def _gutter_lanes(edges: list[tuple[int, int]], band: list[int], layer: list[int],
                  n_bands: int) -> tuple[dict[tuple[int, int], int], list[int]]:
    """Lanes in each band's right gutter for long edges without dummies: edges whose layer spans do
    not overlap share a lane (interval colouring, greedy by start, optimal)."""
    lane_of: dict[tuple[int, int], int] = {}
    lanes = [0] * n_bands
    free: list[list[tuple[int, int]]] = [[] for _ in range(n_bands)]  # heaps of (last layer, lane)
    for u, v in sorted(edges, key=lambda e: (layer[e[0]], layer[e[1]])):
        b, heap = band[u], free[band[u]]
        if heap and heap[0][0] < layer[u]:
            _, lane = heapq.heappop(heap)
        else:
            lane = lanes[b]
            lanes[b] += 1
        lane_of[(u, v)] = lane
        heapq.heappush(heap, (layer[v], lane))
    return lane_of, lanes


def _row_width(row: list[int], width: list[float]) -> float:
    return sum(width[i] for i in row) + NODE_GAP * (len(row) - 1)


# ---- the layout ---------------------------------------------------------------------------------

def layout_graph(g: RGraph) -> Layout:
    """Lay out ``g``. Raises HGraphError for an invalid graph."""
    validate_graph(g)
    tree = cluster_tree(g.nodes)
    clusters = list(tree.walk())
    bands = [c for c in clusters if c.members]
    band_index = {c.path: b for b, c in enumerate(bands)}
    ids = [n.id for n in g.nodes]
    index = {node_id: i for i, node_id in enumerate(ids)}
    n = len(ids)

    band: list[int] = [band_index[node.cluster] for node in g.nodes]
    lines = [label_lines(node.label) for node in g.nodes]
    sizes = [_node_size(ln) for ln in lines]
    width = [s[0] for s in sizes]
    height = [s[1] for s in sizes]
    # A self loop is drawn at the node's right: the node takes that much more room in its row.
    room = [0.0] * n
    for e in g.edges:
        if e.src == e.dst:
            room[index[e.src]] = SELF_LOOP_ROOM
    width = [w + r for w, r in zip(width, room)]

    succ: list[list[int]] = [[] for _ in range(n)]
    pairs: list[tuple[int, int]] = []
    for e in g.edges:
        u, v = index[e.src], index[e.dst]
        pairs.append((u, v))
        if u != v:
            succ[u].append(v)
    back = _back_edges(n, succ)
    oriented = [(v, u) if (u, v) in back else (u, v) for u, v in pairs if u != v]
    layer = _layers(n, oriented) if n else []
    n_layers = max(layer, default=-1) + 1

    # Long edges inside one band get one dummy point per crossed layer, so that they take part in
    # ordering and are routed between nodes.  A budget keeps huge graphs fast (shortest edges first).
    up: list[list[int]] = [[] for _ in range(n)]
    down: list[list[int]] = [[] for _ in range(n)]
    chains: dict[tuple[int, int], list[int]] = {}
    budget = DUMMIES_PER_NODE * n + DUMMY_BUDGET_BASE
    gutter_edges: list[tuple[int, int]] = []  # long same-band edges past the budget
    for u, v in sorted(set(oriented), key=lambda e: layer[e[1]] - layer[e[0]]):
        span = layer[v] - layer[u]
        if band[u] != band[v]:
            continue
        chain: list[int] = []
        if 1 < span <= LONG_EDGE_SPAN and span - 1 <= budget:
            budget -= span - 1
            for lay in range(layer[u] + 1, layer[v]):
                d = len(band)
                band.append(band[u])
                layer.append(lay)
                width.append(DUMMY_WIDTH)
                height.append(0.0)
                up.append([])
                down.append([])
                chain.append(d)
            chains[(u, v)] = chain
        elif span > 1:
            gutter_edges.append((u, v))
        path = [u, *chain, v]
        for a, b in zip(path, path[1:]):
            down[a].append(b)
            up[b].append(a)
    n_items = len(band)

    # Rows: one per (band, layer) that holds something; initial order = input order.
    row_key: dict[tuple[int, int], int] = {}
    rows: list[list[int]] = []
    row_of = [0] * n_items
    for item in range(n_items):
        key = (band[item], layer[item])
        r = row_key.get(key)
        if r is None:
            r = row_key[key] = len(rows)
            rows.append([])
        rows[r].append(item)
        row_of[item] = r
    rows_by_layer: list[list[int]] = [[] for _ in range(n_layers)]
    for (b, lay), r in row_key.items():
        rows_by_layer[lay].append(r)
    next_row = [row_key.get((b, lay + 1), -1) for (b, lay) in row_key]
    crossings = _order_rows(rows, rows_by_layer, next_row, up, down, row_of, n_items)

    # Bands side by side in cluster-tree order, each as wide as its widest row plus its gutter.
    row_area = [0.0] * len(bands)
    for r, row in enumerate(rows):
        b = band[row[0]]
        row_area[b] = max(row_area[b], _row_width(row, width))
    lane_of, lanes = _gutter_lanes(gutter_edges, band, layer, len(bands))
    lane_gap = [min(LANE_GAP, MAX_GUTTER_WIDTH / k) if k else 0.0 for k in lanes]
    band_width = [w + (lane_gap[b] * lanes[b] + CLUSTER_PAD / 2 if lanes[b] else 0.0)
                  for b, w in enumerate(row_area)]
    band_x = [0.0] * len(bands)
    cluster_x: dict[tuple[str, ...], tuple[float, float]] = {}

    def place(c: ClusterTree, left: float) -> float:
        pad = CLUSTER_PAD if c.path else 0.0
        x = left + pad
        parts = 0
        if c.members:
            band_x[band_index[c.path]] = x
            x += band_width[band_index[c.path]]
            parts += 1
        for child in c.children.values():
            if parts:
                x += CLUSTER_GAP
            x += place(child, x)
            parts += 1
        w = x + pad - left
        if c.path:
            w = max(w, text_width(c.label) + 2 * CLUSTER_PAD)
        cluster_x[c.path] = (left, w)
        return w

    total_width = place(tree, 0.0)

    x = [0.0] * n_items
    for row in rows:
        b = band[row[0]]
        lo, hi = band_x[b], band_x[b] + row_area[b]
        _place_row(row, [(lo + hi) / 2] * len(row), width, lo, hi, x)
    for sweep in range(2 * PLACEMENT_SWEEPS + 1):
        if sweep == 2 * PLACEMENT_SWEEPS:
            nbrs_of = [u + d for u, d in zip(up, down)]  # last pass balances both sides
            order = rows_by_layer
        else:
            nbrs_of = up if sweep % 2 == 0 else down
            order = rows_by_layer if sweep % 2 == 0 else rows_by_layer[::-1]
        for row_ids in order:
            for r in row_ids:
                row = rows[r]
                b = band[row[0]]
                desired = [sum(x[v] for v in nbrs_of[i]) / len(nbrs_of[i]) if nbrs_of[i] else x[i]
                           for i in row]
                _place_row(row, desired, width, band_x[b], band_x[b] + row_area[b], x)

    # Rows stacked top to bottom; a layer is as tall as its tallest node.
    layer_height = [0.0] * n_layers
    for item in range(n_items):
        layer_height[layer[item]] = max(layer_height[layer[item]], height[item])
    layer_y = [0.0] * n_layers
    y_cursor = 0.0
    for lay in range(n_layers):
        layer_y[lay] = y_cursor + layer_height[lay] / 2
        y_cursor += layer_height[lay] + LAYER_GAP
    y = [layer_y[layer[i]] for i in range(n_items)]

    nodes = {ids[i]: NodeBox(x[i] - room[i] / 2, y[i], width[i] - room[i], height[i], lines[i])
             for i in range(n)}

    # Cluster boxes, children first: around members and sub-clusters, with room for the label on top.
    boxes: dict[tuple[str, ...], ClusterBox] = {}

    def fit(c: ClusterTree) -> tuple[float, float]:
        tops, bottoms = [], []
        for m in c.members:
            box = nodes[m.id]
            tops.append(box.y - box.h / 2)
            bottoms.append(box.y + box.h / 2)
        for child in c.children.values():
            top, bottom = fit(child)
            tops.append(top)
            bottoms.append(bottom)
        top, bottom = min(tops), max(bottoms)
        if c.path:
            top -= CLUSTER_PAD + CLUSTER_LABEL_HEIGHT
            bottom += CLUSTER_PAD
            left, w = cluster_x[c.path]
            boxes[c.path] = ClusterBox(c.path, left, top, w, bottom - top)
        return top, bottom

    if n:
        fit(tree)

    routes: list[EdgeRoute] = []
    for e, (u, v) in zip(g.edges, pairs):
        if u == v:
            right = x[u] + width[u] / 2 - room[u]
            routes.append(EdgeRoute(e, [(right, y[u] - height[u] / 4), (right, y[u] + height[u] / 4)]))
            continue
        a, b = (v, u) if (u, v) in back else (u, v)
        points = [(x[a], y[a] + height[a] / 2)]
        points += [(x[d], y[d]) for d in chains.get((a, b), [])]
        if (a, b) in lane_of:  # down the gutter, turning in the gaps between rows so no node is crossed
            bb = band[a]
            gx = band_x[bb] + row_area[bb] + CLUSTER_PAD / 2 + lane_gap[bb] * (lane_of[(a, b)] + 0.5)
            points.append((gx, layer_y[layer[a]] + layer_height[layer[a]] / 2 + LAYER_GAP / 2))
            points.append((gx, layer_y[layer[b]] - layer_height[layer[b]] / 2 - LAYER_GAP / 2))
        points.append((x[b], y[b] - height[b] / 2))
        if (a, b) != (u, v):
            points.reverse()
        routes.append(EdgeRoute(e, points))

    # Shift so the drawing starts at (0, 0).
    min_x = min([0.0] + [c.x for c in boxes.values()] + [nb.x - nb.w / 2 for nb in nodes.values()])
    min_y = min([0.0] + [c.y for c in boxes.values()] + [nb.y - nb.h / 2 for nb in nodes.values()])
    for nb in nodes.values():
        nb.x -= min_x
        nb.y -= min_y
    for cb in boxes.values():
        cb.x -= min_x
        cb.y -= min_y
    for route in routes:
        route.points = [(px - min_x, py - min_y) for px, py in route.points]
    right = max([total_width - min_x] + [c.x + c.w for c in boxes.values()]
                + [nb.x + nb.w / 2 for nb in nodes.values()])
    bottom = max([0.0] + [c.y + c.h for c in boxes.values()] + [nb.y + nb.h / 2 for nb in nodes.values()])
    ordered_boxes = [boxes[c.path] for c in clusters if c.path]
    band_boxes = [Band(c.path, band_x[b] - min_x, row_area[b], band_width[b]) for b, c in enumerate(bands)]
    return Layout(nodes, ordered_boxes, routes, right, bottom, crossings, band_boxes)
