"""Our SVG renderer and layout: structure checked by parsing the SVG (no Graphviz or cairo needed)."""
from __future__ import annotations

import os
import re
import stat
import sys
import time
import xml.etree.ElementTree as ET
from itertools import combinations

import pytest
from hypothesis import given, settings, strategies as st

import hgraph.tools.render.layout as graph_layout
from hgraph.errors import HGraphError
from hgraph.tools.render import svg as render_svg_module
from hgraph.tools.render.graph import EDGE_COLORS, KIND_STYLES, NODE_KINDS, REdge, RGraph, RNode
from hgraph.tools.render.layout import layout_graph
from hgraph.tools.render.sample import main as sample_main, synthetic_graph
from hgraph.tools.render.svg import render_svg

NS = {"s": "http://www.w3.org/2000/svg"}


def _svg(g: RGraph) -> ET.Element:
    return ET.fromstring(render_svg(g, engine="python"))


def _rect(el: ET.Element) -> tuple[float, float, float, float]:
    r = el.find("s:rect", NS)
    return (float(r.get("x")), float(r.get("y")), float(r.get("x")) + float(r.get("width")),
            float(r.get("y")) + float(r.get("height")))


def _inside(inner, outer) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.fixture(scope="module")
def sample():
    g = synthetic_graph("1xTP2PP2+1xTP1PP1", layers=2)
    return g, _svg(g)


def test_every_node_drawn_once_with_its_kind_colour_label_and_tooltip(sample):
    g, root = sample
    groups = root.findall(".//s:g[@class='node']", NS)
    assert sorted(el.get("data-id") for el in groups) == sorted(n.id for n in g.nodes)
    by_id = {n.id: n for n in g.nodes}
    for el in groups:
        n = by_id[el.get("data-id")]
        rect = el.find("s:rect", NS)
        assert el.get("data-kind") == n.kind
        assert (rect.get("fill"), rect.get("stroke")) == (KIND_STYLES[n.kind].fill, KIND_STYLES[n.kind].stroke)
        assert el.find("s:title", NS).text == n.tooltip
        assert "".join(el.find("s:text", NS).itertext()) == n.label


def _check_geometry(g: RGraph, root: ET.Element) -> None:
    """One box per cluster path, nested like the paths; every node inside its clusters' boxes and
    outside every other box; sibling boxes and nodes never overlap; the viewBox covers everything."""
    paths = {n.cluster[:k] for n in g.nodes for k in range(1, len(n.cluster) + 1)}
    clusters = root.findall(".//s:g[@class='cluster']", NS)
    assert sorted(c.get("data-path") for c in clusters) == sorted(" / ".join(p) for p in paths)
    assert all(len(c.findall("s:rect", NS)) == 1 for c in clusters)
    box = {tuple(c.get("data-path").split(" / ")): _rect(c) for c in clusters}
    nodes = {el.get("data-id"): _rect(el) for el in root.findall(".//s:g[@class='node']", NS)}
    assert sorted(nodes) == sorted(n.id for n in g.nodes)
    for n in g.nodes:
        for k in range(1, len(n.cluster) + 1):
            assert _inside(nodes[n.id], box[n.cluster[:k]]), (n.id, n.cluster[:k])
        for path, b in box.items():  # and no box of another cluster covers it
            if path != n.cluster[:len(path)]:
                assert not _overlap(nodes[n.id], b), (n.id, path)
    for (pa, a), (pb, b) in combinations(box.items(), 2):
        if pa == pb[:len(pa)]:
            assert _inside(b, a)
        elif pb == pa[:len(pb)]:
            assert _inside(a, b)
        else:
            assert not _overlap(a, b), (pa, pb)
    for (ia, a), (ib, b) in combinations(nodes.items(), 2):
        assert not _overlap(a, b), (ia, ib)
    vx, vy, vw, vh = map(float, root.get("viewBox").split())
    for x0, y0, x1, y1 in list(nodes.values()) + list(box.values()):
        assert vx <= x0 and vy <= y0 and x1 <= vx + vw and y1 <= vy + vh
    for path in root.findall(".//s:path[@class]", NS):
        nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", path.get("d"))]
        xs, ys = nums[0::2], nums[1::2]
        assert min(xs) >= vx and max(xs) <= vx + vw and min(ys) >= vy and max(ys) <= vy + vh


def test_sample_boxes_nodes_and_viewbox(sample):
    g, root = sample
    _check_geometry(g, root)


_names = st.sampled_from(["pipeline 0", "pipeline 1", "stage 0", "stage 1", "rank 0", "rank 1", "r"])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_graphs_keep_every_geometric_promise(data):
    """Any nesting (nodes directly in a cluster beside its sub-clusters, unclustered nodes), any
    edges (cycles, self loops, between clusters)."""
    n = data.draw(st.integers(1, 14))
    nodes = [RNode(f"n{i}", data.draw(st.text("abc xyz", max_size=14)), data.draw(st.sampled_from(NODE_KINDS)),
                   tuple(data.draw(st.lists(_names, max_size=3))))
             for i in range(n)]
    pairs = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n))
    edges = [REdge(f"n{a}", f"n{b}", kind=data.draw(st.sampled_from(["data", "comm"]))) for a, b in pairs]
    g = RGraph("random", nodes, edges)
    _check_geometry(g, _svg(g))


def test_edges_drawn_in_order_comm_dashed_data_solid(sample):
    g, root = sample
    paths = [p for p in root.findall(".//s:g[@class='edges']/s:path", NS)]
    assert [(p.get("data-src"), p.get("data-dst")) for p in paths] == [(e.src, e.dst) for e in g.edges]
    for p, e in zip(paths, g.edges):
        assert p.get("class") == f"edge {e.kind}"
        assert (p.get("stroke-dasharray") is not None) == (e.kind == "comm")
        assert p.get("stroke") == EDGE_COLORS[e.kind]
    assert any(e.kind == "comm" for e in g.edges)


def test_legend_lists_each_used_kind_with_the_shared_colours(sample):
    g, root = sample
    items = root.findall(".//s:g[@class='legend']/s:g", NS)
    kinds = [i.get("data-kind") for i in items]
    assert kinds == [k for k in KIND_STYLES if any(n.kind == k for n in g.nodes)] + ["comm"]
    for item in items[:-1]:
        assert item.find("s:rect", NS).get("fill") == KIND_STYLES[item.get("data-kind")].fill


def test_data_edges_point_down_and_backward_cycles_still_draw():
    nodes = [RNode(c, c, "compute", ("rank 0",)) for c in "abcd"]
    edges = [REdge("a", "b"), REdge("b", "c"), REdge("c", "a"), REdge("c", "d"), REdge("d", "d")]
    g = RGraph("cycle", nodes, edges)
    lay = layout_graph(g)
    ys = {k: v.y for k, v in lay.nodes.items()}
    assert ys["a"] < ys["b"] < ys["c"] < ys["d"]  # the DFS back edge c->a is the one reversed
    route = next(r for r in lay.edges if (r.edge.src, r.edge.dst) == ("c", "a"))
    assert route.points[0][1] > route.points[-1][1]  # drawn upwards, from c to a
    root = _svg(g)
    assert len(root.findall(".//s:g[@class='node']", NS)) == 4
    assert len(root.findall(".//s:g[@class='edges']/s:path", NS)) == 5


def test_every_edge_of_a_dag_points_down_and_long_edges_bend_through_their_band():
    g = synthetic_graph("1xTP2PP2+1xTP1PP1", layers=2)
    lay = layout_graph(g)
    for r in lay.edges:
        assert all(p[1] < q[1] for p, q in zip(r.points, r.points[1:]))
        assert lay.nodes[r.edge.src].y < lay.nodes[r.edge.dst].y
    assert max(len(r.points) for r in lay.edges) > 4  # residual / saved-activation edges got dummies


def _curve_samples(points, steps=12):
    """Points on the drawn path: cubic segments with vertical tangents, as render_svg draws them."""
    out = []
    for (xa, ya), (xb, yb) in zip(points, points[1:]):
        dy = (yb - ya) / 2
        c = [(xa, ya), (xa, ya + dy), (xb, yb - dy), (xb, yb)]
        for k in range(1, steps):
            t = k / steps
            w = [(1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t * t * (1 - t), t ** 3]
            out.append((sum(wi * p[0] for wi, p in zip(w, c)), sum(wi * p[1] for wi, p in zip(w, c))))
    return out


@pytest.mark.parametrize("dummy_budget", [None, 0])
def test_data_edges_never_run_through_a_node(monkeypatch, dummy_budget):
    if dummy_budget is not None:  # no dummies at all: every long edge takes the gutter
        monkeypatch.setattr(graph_layout, "DUMMIES_PER_NODE", dummy_budget)
        monkeypatch.setattr(graph_layout, "DUMMY_BUDGET_BASE", dummy_budget)
    g = synthetic_graph("1xTP2PP2+1xTP1PP1", layers=2)
    lay = layout_graph(g)
    boxes = [(k, b.x - b.w / 2 + 0.5, b.y - b.h / 2 + 0.5, b.x + b.w / 2 - 0.5, b.y + b.h / 2 - 0.5)
             for k, b in lay.nodes.items()]
    long_routes = 0
    for r in lay.edges:
        if r.edge.kind != "data":
            continue
        long_routes += len(r.points) > 2
        for px, py in _curve_samples(r.points):
            hit = [k for k, x0, y0, x1, y1 in boxes if x0 < px < x1 and y0 < py < y1]
            assert not hit, (r.edge, hit)
    assert long_routes > 10


def test_barycentre_sweeps_reduce_crossings(monkeypatch):
    g = synthetic_graph("1xTP2PP2+1xTP1PP1", layers=2)
    swept = layout_graph(g).crossings
    monkeypatch.setattr(graph_layout, "BARYCENTRE_SWEEPS", 0)
    unswept = layout_graph(g).crossings
    assert swept < unswept


def test_text_is_escaped_and_invalid_xml_characters_replaced():
    nasty = 'a<b>&"c\'\x01\n]]>'
    g = RGraph(nasty, [RNode(nasty, nasty, "compute", (nasty,), tooltip=nasty),
                       RNode("ok", "x" * 200, "output")], [REdge(nasty, "ok", label=nasty, kind="comm")])
    root = _svg(g)
    node = root.find(".//s:g[@class='node']", NS)
    shown = nasty.replace("\x01", "\ufffd")
    assert node.get("data-id") == shown
    assert node.find("s:title", NS).text == shown
    assert "".join(node.find("s:text", NS).itertext()) == shown.split("\n")[0] + "]]>"
    assert root.find(".//s:g[@class='cluster']", NS).get("data-path") == shown
    long = [el for el in root.findall(".//s:g[@class='node']", NS) if el.get("data-id") == "ok"][0]
    assert "".join(long.find("s:text", NS).itertext()).endswith("\u2026")  # cut, with the full tooltip
    assert long.find("s:title", NS).text == "x" * 200


def test_empty_and_unclustered_graphs():
    assert len(_svg(RGraph("empty", [], [])).findall(".//s:g[@class='node']", NS)) == 0
    g = RGraph("flat", [RNode("a", "a", "input"), RNode("b", "b", "compute", ("rank 0",))], [REdge("a", "b")])
    root = _svg(g)
    a, b = [_rect(el) for el in root.findall(".//s:g[@class='node']", NS)]
    assert not _overlap(a, _rect(root.find(".//s:g[@class='cluster']", NS)))


def test_a_32_layer_model_on_8_ranks_lays_out_in_linear_time():
    # ~5000 nodes; measured ~0.5 s of CPU here. The bound only catches a quadratic slip, so it is
    # CPU time (not wall time) and generous.
    g = synthetic_graph("2xTP2PP2", layers=32)
    assert len(g.nodes) > 4000
    start = time.process_time()
    lay = layout_graph(g)
    assert time.process_time() - start < 8.0
    assert len(lay.nodes) == len(g.nodes) and len(lay.clusters) == 2 + 4 + 8


def test_a_thousand_node_graph_is_valid_and_complete():
    g = synthetic_graph("2xTP2PP2", layers=8)
    assert len(g.nodes) > 1000
    root = _svg(g)
    assert len(root.findall(".//s:g[@class='node']", NS)) == len(g.nodes)
    assert len(root.findall(".//s:g[@class='cluster']", NS)) == 2 + 4 + 8


# ---- engine choice ------------------------------------------------------------------------------

def _fake_dot(tmp_path, body: str) -> str:
    script = tmp_path / "dot"
    script.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_graphviz_engine_needs_the_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no dot
    with pytest.raises(HGraphError, match="not on PATH"):
        render_svg(RGraph("g", [], []), engine="graphviz")
    assert 'class="hgraph"' in render_svg(RGraph("g", [RNode("a", "a", "compute")], []), engine="auto")
    with pytest.raises(HGraphError, match="unknown SVG engine"):
        render_svg(RGraph("g", [], []), engine="neato")


def test_auto_engine_runs_graphviz_when_present(monkeypatch, tmp_path):
    folder = _fake_dot(tmp_path, "text = sys.stdin.read()\nassert sys.argv[1:] == ['-Tsvg']\n"
                                 "print('<svg xmlns=\"http://www.w3.org/2000/svg\"><text>%d %s</text></svg>'"
                                 " % (text.count('->'), text.split()[0]))")
    monkeypatch.setenv("PATH", folder + os.pathsep + os.environ.get("PATH", ""))
    g = RGraph("g", [RNode("a", "a", "compute"), RNode("b", "b", "compute")], [REdge("a", "b")])
    for engine in ("auto", "graphviz"):
        assert ET.fromstring(render_svg(g, engine=engine)).find("s:text", NS).text == "1 digraph"
    assert 'class="hgraph"' in render_svg(g, engine="python")


def test_graphviz_failure_is_one_line_error(monkeypatch, tmp_path):
    folder = _fake_dot(tmp_path, "sys.stderr.write('Error: syntax error in line 3\\nmore\\n'); sys.exit(1)")
    monkeypatch.setenv("PATH", folder)
    with pytest.raises(HGraphError) as err:
        render_svg(RGraph("g", [RNode("a", "a", "compute")], []), engine="graphviz")
    assert "syntax error in line 3" in str(err.value) and "\n" not in str(err.value)


def test_graphviz_timeout_is_reported(monkeypatch, tmp_path):
    folder = _fake_dot(tmp_path, "import time; time.sleep(5)")
    monkeypatch.setenv("PATH", folder)
    with pytest.raises(HGraphError, match="longer than"):
        render_svg_module.graphviz_svg(RGraph("g", [], []), timeout_s=0.5)


def test_sample_script_writes_three_readable_files(tmp_path, capsys):
    assert sample_main(["--out", str(tmp_path / "s"), "--layers", "1"]) == 0
    ET.parse(tmp_path / "s.svg")
    assert (tmp_path / "s.dot").read_text().startswith("digraph")
    assert "<svg" in (tmp_path / "s.html").read_text()
    assert "3 ranks" in capsys.readouterr().out
