"""DOT output: parsed back with a small DOT parser written here (no Graphviz, no pydot needed)."""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings, strategies as st

from hgraph.errors import HGraphError
from hgraph.tools.render.graph import (KIND_STYLES, NODE_KINDS, REdge, RGraph, RNode, cluster_tree, dot_quote,
                                       render_dot)
from hgraph.tools.render.sample import synthetic_graph

# ---- a tiny DOT parser: the subset of the DOT grammar that render_dot may emit ---------------------

_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<arrow>->)|(?P<punct>[{}\[\];,=])'
                    r'|(?P<word>[A-Za-z_][A-Za-z_0-9.]*|-?[0-9.]+))', re.S)


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m and m.end() > pos, f"DOT lexer stuck at {text[pos:pos + 30]!r}"
        kind = m.lastgroup
        value = m.group(kind)
        if kind == "str":  # DOT: only \" is an escape inside quotes; everything else stays as is
            value = value[1:-1].replace('\\"', '"')
            kind = "id"
        elif kind in ("punct", "arrow"):
            kind = value
        elif kind == "word":
            kind = "id" if value.lower() not in ("digraph", "subgraph", "node", "edge", "graph") else value
        out.append((kind, value))
        pos = m.end()
    return out


def label_text(raw: str) -> str:
    """What Graphviz shows for a label after its own escapes (the ones render_dot may produce)."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\"}.get(m.group(1), "\\" + m.group(1)), raw)


@dataclass
class Sub:
    name: str
    attrs: dict = field(default_factory=dict)
    subs: list = field(default_factory=list)
    nodes: list = field(default_factory=list)


@dataclass
class Dot:
    name: str
    root: Sub
    nodes: dict  # id -> (attrs, path of subgraph labels)
    edges: list  # (src, dst, attrs)


def parse_dot(text: str) -> Dot:
    toks = _tokens(text)
    i = 0

    def peek(k=0):
        return toks[i + k] if i + k < len(toks) else ("eof", "")

    def take(kind):
        nonlocal i
        tok = peek()
        assert tok[0] == kind, f"expected {kind}, got {tok} at token {i}"
        i += 1
        return tok[1]

    def attr_list():
        attrs = {}
        take("[")
        while peek()[0] != "]":
            key = take("id")
            take("=")
            attrs[key] = take("id")
            if peek()[0] in (",", ";"):
                take(peek()[0])
        take("]")
        return attrs

    nodes: dict = {}
    edges: list = []

    def stmt_list(sub: Sub, path: tuple):
        while peek()[0] != "}":
            kind = peek()[0]
            if kind == "subgraph":
                take("subgraph")
                child = Sub(take("id"))
                take("{")
                sub.subs.append(child)
                stmt_list(child, path + (child,))
                take("}")
            elif kind in ("graph", "node", "edge"):
                take(kind)
                attrs = attr_list()
                if kind == "graph":
                    sub.attrs.update(attrs)
            else:
                a = take("id")
                if peek()[0] == "->":
                    take("->")
                    b = take("id")
                    edges.append((a, b, attr_list() if peek()[0] == "[" else {}))
                else:
                    assert a not in nodes, f"node {a!r} declared twice"
                    nodes[a] = (attr_list() if peek()[0] == "[" else {}, path)
                    sub.nodes.append(a)
            if peek()[0] == ";":  # optional in DOT
                take(";")

    take("digraph")
    name = take("id")
    take("{")
    root = Sub(name)
    stmt_list(root, ())
    take("}")
    assert peek()[0] == "eof", f"trailing tokens {toks[i:]}"
    return Dot(name, root, nodes, edges)


# ---- fixtures -----------------------------------------------------------------------------------

def _small() -> RGraph:
    c0 = ("pipeline 0: TP2PP1", "stage 0", "rank 0")
    c1 = ("pipeline 0: TP2PP1", "stage 0", "rank 1")
    nodes = [
        RNode("x", "input_ids", "input"),
        RNode("w", "layers.0.wqkv", "param", c0),
        RNode("cast", "to bf16", "pull_parameter", c0),
        RNode("mm", "matmul", "compute", c0, tooltip="matmul [T, 3H/2]"),
        RNode("ar", "all-reduce", "comm_activation", c0),
        RNode("ar1", "all-reduce", "comm_activation", c1),
        RNode("wait1", "wait", "comm_activation", c1),
        RNode("rs", "reduce-scatter", "push_gradient", c0),
        RNode("y", "loss", "output"),
    ]
    edges = [REdge("w", "cast"), REdge("cast", "mm"), REdge("x", "mm"), REdge("mm", "ar"),
             REdge("ar", "wait1", "partial sums", "comm"), REdge("ar1", "wait1"), REdge("mm", "rs"),
             REdge("wait1", "y")]
    return RGraph("tiny: TP2PP1", nodes, edges)


def _cluster_labels(path: tuple) -> tuple:
    return tuple(label_text(s.attrs["label"]) for s in path)


# ---- tests --------------------------------------------------------------------------------------

def test_every_node_declared_once_in_its_nested_cluster_with_its_kind_colour():
    g = _small()
    dot = parse_dot(render_dot(g, legend=False))
    assert set(dot.nodes) == {n.id for n in g.nodes}
    for n in g.nodes:
        attrs, path = dot.nodes[n.id]
        assert _cluster_labels(path) == n.cluster
        assert all(s.name.startswith("cluster") for s in path)
        assert attrs["fillcolor"] == KIND_STYLES[n.kind].fill
        assert attrs["color"] == KIND_STYLES[n.kind].stroke
        assert label_text(attrs["label"]) == n.label
        assert label_text(attrs["tooltip"]) == (n.tooltip or n.label)
    # one subgraph per distinct cluster path, nested (pipeline > stage > two ranks)
    assert [s.attrs["label"] for s in dot.root.subs] == ["pipeline 0: TP2PP1"]
    stage = dot.root.subs[0].subs[0]
    assert [s.attrs["label"] for s in stage.subs] == ["rank 0", "rank 1"]
    assert len({s.name for s in _all_subs(dot.root)}) == len(_all_subs(dot.root))


def _all_subs(sub: Sub) -> list:
    out = []
    for child in sub.subs:
        out += [child] + _all_subs(child)
    return out


def test_edges_kept_in_order_comm_dashed_data_plain_labels_kept():
    g = _small()
    dot = parse_dot(render_dot(g, legend=False))
    assert [(a, b) for a, b, _ in dot.edges] == [(e.src, e.dst) for e in g.edges]
    for (_, _, attrs), e in zip(dot.edges, g.edges):
        assert (attrs.get("style") == "dashed") == (e.kind == "comm")
        assert label_text(attrs.get("label", "")) == e.label


def test_legend_shows_each_used_kind_in_its_colour_and_never_collides_with_node_ids():
    g = _small()
    g.nodes.append(RNode("__legend_compute", "a node named like a legend swatch", "compute"))
    dot = parse_dot(render_dot(g))
    legend = [s for s in dot.root.subs if s.attrs.get("label") == "legend"]
    assert len(legend) == 1
    swatches = [dot.nodes[i][0] for i in legend[0].nodes if "fillcolor" in dot.nodes[i][0]]
    used = {n.kind for n in g.nodes}
    assert {(a["fillcolor"], label_text(a["label"])) for a in swatches} == {
        (KIND_STYLES[k].fill, KIND_STYLES[k].legend) for k in used}
    assert dot.nodes["__legend_compute"][1] == ()  # the user's node, outside the legend
    legend_ids = set(legend[0].nodes)
    assert [a.get("style") for src, _, a in dot.edges if src in legend_ids and a.get("style") != "invis"] == [
        "dashed"]  # the comm-edge sample, since g has a comm edge


def test_all_kinds_have_distinct_colours_and_subgraph_kinds_differ_from_compute():
    fills = [KIND_STYLES[k].fill for k in NODE_KINDS]
    assert len(set(fills)) == len(fills)
    assert set(KIND_STYLES) == set(NODE_KINDS)


_nasty = st.lists(st.sampled_from(list('ab "\\\n\r{}[];=->#<>&\'\té') + ["node", "subgraph", "\\N"]),
                  max_size=8).map("".join)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(_nasty.filter(bool), min_size=1, max_size=5, unique=True),
       labels=st.lists(_nasty, min_size=5, max_size=5), cluster=st.lists(_nasty.filter(bool), max_size=3))
def test_any_text_in_ids_labels_and_clusters_round_trips(ids, labels, cluster):
    nodes = [RNode(i, labels[k], NODE_KINDS[k % len(NODE_KINDS)], tuple(cluster), tooltip=labels[-k])
             for k, i in enumerate(ids)]
    edges = [REdge(a, b, label=labels[0], kind="comm") for a, b in zip(ids, ids[1:])]
    g = RGraph(labels[1], nodes, edges)
    dot = parse_dot(render_dot(g))
    # ids are escaped the same way everywhere (doubled backslashes), so compare through dot_quote
    by_quoted = {dot_quote(n.id)[1:-1].replace('\\"', '"'): n for n in nodes}
    for raw, (attrs, path) in dot.nodes.items():
        if raw not in by_quoted:
            continue  # legend swatch
        n = by_quoted[raw]
        assert label_text(attrs["label"]) == n.label.replace("\r\n", "\n").replace("\r", "\n")
        assert _cluster_labels(path) == tuple(c.replace("\r\n", "\n").replace("\r", "\n") for c in n.cluster)
    assert len(by_quoted) == len(nodes)
    assert {raw for raw in dot.nodes if raw in by_quoted} == set(by_quoted)
    assert label_text(dot.name) == (g.title.replace("\r\n", "\n").replace("\r", "\n") or "hgraph")


def test_trailing_backslash_and_quotes_cannot_break_out_of_a_string():
    g = RGraph('t"\\', [RNode('a\\', 'say "hi"\\', "compute"), RNode('b"', "\\N", "compute")],
               [REdge('a\\', 'b"')])
    dot = parse_dot(render_dot(g, legend=False))
    assert len(dot.nodes) == 2 and len(dot.edges) == 1
    labels = sorted(label_text(a["label"]) for a, _ in dot.nodes.values())
    assert labels == sorted(['say "hi"\\', "\\N"])


@pytest.mark.parametrize("bad, words", [
    (RGraph("g", [RNode("a", "a", "compute"), RNode("a", "b", "compute")], []), "duplicate node id 'a'"),
    (RGraph("g", [RNode("a", "a", "matmul")], []), "unknown kind 'matmul'"),
    (RGraph("g", [RNode("a", "a", "compute")], [REdge("a", "b")]), "names node 'b'"),
    (RGraph("g", [RNode("a", "a", "compute")], [REdge("a", "a", kind="p2p")]), "unknown kind 'p2p'"),
    (RGraph("g", [RNode("a", "a", "compute", ("rank 0", ""))], []), "non-empty strings"),
])
def test_bad_graphs_are_one_line_errors(bad, words):
    with pytest.raises(HGraphError) as err:
        render_dot(bad)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_cluster_tree_keeps_first_seen_order_and_direct_members():
    g = synthetic_graph("1xTP1PP2+1xTP2PP1", layers=2)
    tree = cluster_tree(g.nodes)
    assert list(tree.children) == ["pipeline 0: TP1PP2", "pipeline 1: TP2PP1"]
    p1 = tree.children["pipeline 1: TP2PP1"].children["stage 0"]
    assert list(p1.children) == ["rank 2", "rank 3"]
    assert sum(len(c.members) for c in tree.walk()) == len(g.nodes)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_graphviz_accepts_the_dot_text():
    g = synthetic_graph("1xTP2PP2+1xTP1PP1", layers=2)
    done = subprocess.run(["dot", "-Tcanon"], input=render_dot(g), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
