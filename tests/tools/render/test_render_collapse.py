"""The collapsed levels behind the HTML page, in pure Python: boxes, merged edges, comm edges kept."""
from __future__ import annotations

import pytest

from hgraph.errors import HGraphError
from hgraph.tools.render.collapse import BLOCK_KIND, collapse, layering_edges
from hgraph.tools.render.graph import REdge, RGraph, RNode
from hgraph.tools.render.page_data import page_data
from hgraph.tools.render.sample import synthetic_graph

R0 = ("pipeline 0", "stage 0", "rank 0")
R1 = ("pipeline 0", "stage 1", "rank 1")


def _two_ranks() -> RGraph:
    """Rank 0: input -> a layer block (a pulled weight in its own box, two matmuls) -> send; rank 1:
    recv -> a block of the same name; one comm edge from rank 0's send to rank 1's recv."""
    layer = ("layers.0",)
    pull = layer + ("pull w",)
    nodes = [
        RNode("x", "input_ids", "input", R0),
        RNode("cast", "to bf16", "pull_parameter", R0, box=pull),
        RNode("lnk", "LNK", "pull_parameter", R0, box=pull),
        RNode("mm1", "matmul", "compute", R0, box=layer),
        RNode("mm2", "matmul", "compute", R0, box=layer),
        RNode("send", "send", "comm_activation", R0),
        RNode("recv", "recv", "comm_activation", R1, box=("layers.1",)),
        RNode("mm3", "matmul", "compute", R1, box=("layers.1",)),
    ]
    edges = [REdge("x", "mm1"), REdge("x", "mm2"), REdge("cast", "lnk"), REdge("lnk", "mm1"), REdge("lnk", "mm2"),
             REdge("mm1", "mm2"), REdge("mm2", "send"), REdge("send", "recv", "activation", "comm"),
             REdge("recv", "mm3")]
    return RGraph("two ranks", nodes, edges)


def test_boxes_nest_and_take_the_kind_of_what_they_hold():
    c = collapse(_two_ranks())
    by_path = {(b.cluster[-1],) + b.path: b for b in c.boxes.values()}
    assert list(by_path) == [("rank 0", "layers.0"), ("rank 0", "layers.0", "pull w"), ("rank 1", "layers.1")]
    block, pull = by_path[("rank 0", "layers.0")], by_path[("rank 0", "layers.0", "pull w")]
    assert block.kind == BLOCK_KIND and pull.kind == "pull_parameter" and pull.parent is block
    assert by_path[("rank 1", "layers.1")].kind == BLOCK_KIND  # a recv and a matmul: not one slot kind
    assert c.box_of["cast"] is pull and c.box_of["mm1"] is block and c.box_of["x"] is None


def test_each_level_merges_parallel_edges_and_every_edge_is_in_one_level():
    g = _two_ranks()
    c = collapse(g)
    block = next(b for b in c.boxes.values() if b.path == ("layers.0",))
    pull = next(b for b in c.boxes.values() if b.path == ("layers.0", "pull w"))
    top = c.levels[None]
    assert [n.id for n in top.graph.nodes] == ["x", block.id, "send", c.box_of["recv"].id]
    assert top.edge_counts[("x", block.id, "data")] == 2  # x -> mm1 and x -> mm2, one drawn edge
    assert top.edge_counts[(block.id, "send", "data")] == 1
    assert top.edge_counts[("send", c.box_of["recv"].id, "comm")] == 1
    inside = c.levels[block.id]
    assert [n.id for n in inside.graph.nodes] == [pull.id, "mm1", "mm2"]
    assert inside.edge_counts == {(pull.id, "mm1", "data"): 1, (pull.id, "mm2", "data"): 1, ("mm1", "mm2", "data"): 1}
    assert c.levels[pull.id].edge_counts == {("cast", "lnk", "data"): 1}
    assert sum(n for level in c.levels.values() for n in level.edge_counts.values()) == len(g.edges)
    sample = synthetic_graph("1xTP2PP2+1xTP1PP1", layers=2)
    levels = collapse(sample).levels.values()
    assert sum(n for level in levels for n in level.edge_counts.values()) == len(sample.edges)


def test_page_data_keeps_every_comm_edge_between_nodes_and_draws_data_edges_per_level():
    g = synthetic_graph("1xTP2PP2", layers=2)
    c = collapse(g)
    data = page_data(c)
    comm = [(e.src, e.dst) for e in g.edges if e.kind == "comm"]
    assert comm and [(a, b) for a, b, _ in data["comm"]] == comm
    for key, level in data["levels"].items():
        owner = key or None
        drawn = {(src, dst) for src, dst, _, _ in level["edges"]}
        data_edges = {(s, d) for (s, d, kind) in c.levels[owner].edge_counts if kind == "data"}
        assert drawn == data_edges
        for item in level["items"]:  # inside its band's rows, which the page keeps when it lays out again
            node_id, cx, cy, w, h, lines, band = item
            x, row_width, _ = level["bands"][band]
            assert x - 0.1 <= cx - w / 2 and cx + w / 2 <= x + row_width + 0.1 and lines
    # Every box's inside is laid out, and a collapsed box names its block and counts its ops.
    labels = {item[0]: item[5] for item in data["levels"][""]["items"]}
    block = next(b for b in c.boxes.values() if b.path == ("layers.0",))
    assert labels[block.id] == ["layers.0", f"{data['boxes'][block.id]['n']} ops"]


def test_layering_keeps_stage_to_stage_comm_one_way_and_drops_it_between_tp_peers():
    a, b = RNode("a", "a", "compute", ("p0", "stage 0", "rank 0")), RNode("b", "b", "compute", ("p0", "stage 0", "rank 1"))
    c = RNode("c", "c", "compute", ("p0", "stage 1", "rank 2"))
    edges = [REdge("a", "c", kind="comm"), REdge("c", "a", kind="comm"), REdge("a", "b", kind="comm"),
             REdge("b", "a", kind="comm"), REdge("a", "b")]
    assert layering_edges([a, b, c], edges) == [edges[0], edges[4]]


def test_a_bad_box_path_is_a_one_line_error():
    with pytest.raises(HGraphError, match="has box"):
        collapse(RGraph("g", [RNode("a", "a", "compute", box=("",))], []))
