"""A synthetic per-rank training graph for a strategy, drawn to DOT, SVG and HTML files.

``python -m hgraph.tools.render.sample`` writes ``hgraph_sample.{dot,svg,html}`` for a 2-pipeline,
3-rank strategy so a person can look at the renderers, and prints the time each step took; with
``--layers 32 --strategy 2xTP2PP2`` it is the size benchmark (a 32-layer model on 8 ranks).

The graph imitates what the compiler emits (Fig. 2c of the Hydraulis paper): per rank, every weight
use goes through a Pull Parameter subgraph (parameter -> to bf16 -> LNK), row-parallel matmuls are
followed by a TP all-reduce (Communicate Activation, issue and wait, with comm edges between the TP
ranks), stage boundaries send and receive activations and gradients, and every weight's gradient
leaves through a Push Gradient subgraph (reduce-scatter -> LNK).  Nodes sit in layer-block boxes
(``embed``, ``layers.N``, ``head``) and each slot subgraph in a box of its own inside them, as the
HTML page draws them.  It is a drawing fixture, not the compiler's output.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional, Sequence

from hgraph.strategy import Strategy
from hgraph.tools.render.graph import REdge, RGraph, RNode, render_dot
from hgraph.tools.render.html import render_html
from hgraph.tools.render.svg import render_svg

_WEIGHTS = (("wqkv", "matmul qkv", False), ("wo", "matmul o", True),
            ("w_up", "matmul up", False), ("w_down", "matmul down", True))


class _RankBuilder:
    """Adds the nodes and data edges of one rank's program; ``block`` is the layer block (a box of
    the HTML page) the next nodes belong to."""

    def __init__(self, graph: RGraph, rank: int, cluster: tuple[str, ...]):
        self.graph, self.rank, self.cluster = graph, rank, cluster
        self.count = 0
        self.block: tuple[str, ...] = ()

    def node(self, label: str, kind: str, after: Sequence[str] = (), tooltip: str = "",
             subgraph: str = "") -> str:
        """A node in the current block, or in its slot subgraph box ``subgraph`` when given."""
        self.count += 1
        node_id = f"r{self.rank}.{self.count}"
        box = self.block + (subgraph,) if subgraph else self.block
        self.graph.nodes.append(RNode(node_id, label, kind, self.cluster,
                                      tooltip or f"rank {self.rank}: {label}", box))
        for src in after:
            self.graph.edges.append(REdge(src, node_id))
        return node_id

    def pulled(self, name: str, tp: int) -> str:
        """Pull Parameter subgraph for one weight; returns the node holding the working copy."""
        param = self.node(name, "param", tooltip=f"fp32 shard of {name} (optimizer layout)")
        cast = self.node("to bf16", "pull_parameter", [param], subgraph=f"pull {name}")
        how = "LNK" if tp > 1 else "all-gather"
        return self.node(how, "pull_parameter", [cast], tooltip=f"{how}: {name} into the TP{tp} layout",
                         subgraph=f"pull {name}")

    def pushed(self, name: str, grad_src: str) -> None:
        """Push Gradient subgraph for one weight."""
        rs = self.node("reduce-scatter", "push_gradient", [grad_src], tooltip=f"gradient of {name}",
                       subgraph=f"push {name}")
        self.node("LNK", "push_gradient", [rs], tooltip=f"gradient of {name} into the optimizer layout",
                  subgraph=f"push {name}")


def synthetic_graph(strategy: "Strategy | str", layers: int = 2, *, backward: bool = True) -> RGraph:
    """A renderer fixture: per-rank forward (and backward) programs of a ``layers``-block decoder
    under ``strategy``, clustered as pipeline / stage / rank, with comm edges between ranks."""
    s = Strategy.of(strategy)
    g = RGraph(f"{s}: {layers}-layer decoder, {s.num_ranks} ranks", [], [])
    # (pipeline, stage, tp) -> ids that other ranks connect to
    sends: dict[tuple[int, int, int], str] = {}
    grad_sends: dict[tuple[int, int, int], str] = {}
    ar_issues: dict[tuple[int, int, str], list[str]] = {}
    ar_waits: dict[tuple[int, int, str], list[str]] = {}
    for coord in s.coords():
        p, st, t = coord.pipeline, coord.stage, coord.tp_rank
        scheme = s.pipelines[p]
        if coord.cp_rank:
            continue  # CP ranks mirror CP rank 0 here; not needed for a drawing fixture
        first = st * layers // scheme.pp
        last = (st + 1) * layers // scheme.pp
        cluster = (f"pipeline {p}: {scheme}", f"stage {st}", f"rank {coord.rank}")
        b = _RankBuilder(g, coord.rank, cluster)
        # (weight name, forward op id, its label, its block), forward order
        grads: list[tuple[str, str, str, tuple[str, ...]]] = []
        if st == 0:
            tokens = b.node("input_ids", "input")
            b.block = ("embed",)
            emb_w = b.pulled("embed.weight", scheme.tp)
            x = b.node("embedding", "compute", [tokens, emb_w])
            grads.append(("embed.weight", x, "embedding", b.block))
        else:
            x = b.node("recv activation", "comm_activation", tooltip="recv from the previous stage")
            g.edges.append(REdge(sends[(p, st - 1, t)], x, "act", "comm"))
        for layer in range(first, last):
            b.block = (f"layers.{layer}",)
            residual = x
            for half, ops in (("attn", _WEIGHTS[:2]), ("mlp", _WEIGHTS[2:])):
                h = b.node("rmsnorm", "compute", [x])
                for name, op, row_parallel in ops:
                    w = b.pulled(f"layers.{layer}.{name}", scheme.tp)
                    h = b.node(op, "compute", [h, w])
                    grads.append((f"layers.{layer}.{name}", h, op, b.block))
                    if op == "matmul qkv":
                        h = b.node("attention", "compute", [h])
                    elif op == "matmul up":
                        h = b.node("silu * gate", "compute", [h])
                    if row_parallel and scheme.tp > 1:
                        key = (p, st, f"{layer}.{half}")
                        comm = f"all-reduce {half}"
                        issue = b.node("all-reduce", "comm_activation", [h], tooltip="TP all-reduce issue",
                                       subgraph=comm)
                        h = b.node("wait", "comm_activation", [issue], tooltip="TP all-reduce wait",
                                   subgraph=comm)
                        ar_issues.setdefault(key, []).append(issue)
                        ar_waits.setdefault(key, []).append(h)
                x = b.node("add", "compute", [residual, h])
                residual = x
        if st == scheme.pp - 1:
            b.block = ("head",)
            head = b.pulled("lm_head.weight", scheme.tp)
            logits = b.node("lm_head", "compute", [x, head])
            grads.append(("lm_head.weight", logits, "lm_head", b.block))
            loss = b.node("cross entropy", "compute", [logits])
            b.block = ()
            b.node("loss", "output", [loss])
            grad = loss
        else:
            b.block = ()
            sends[(p, st, t)] = b.node("send activation", "comm_activation", [x],
                                       tooltip="send to the next stage")
            grad = b.node("recv gradient", "comm_activation", tooltip="recv from the next stage")
            grad_sends[(p, st, t)] = grad
        if backward:
            for name, fwd, label, block in reversed(grads):
                b.block = block
                grad = b.node(f"backward {label}", "compute", [grad, fwd])
                b.pushed(name, grad)
            b.block = ()
            if st > 0:
                send = b.node("send gradient", "comm_activation", [grad], tooltip="send to the previous stage")
                g.edges.append(REdge(send, grad_sends[(p, st - 1, t)], "grad", "comm"))
    for key, issues in ar_issues.items():
        for i, issue in enumerate(issues):
            for j, wait in enumerate(ar_waits[key]):
                if i != j:
                    g.edges.append(REdge(issue, wait, kind="comm"))
    return g


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Write the sample drawings and print timings."""

    parser = argparse.ArgumentParser(prog="python -m hgraph.tools.render.sample", description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="1xTP1PP2+1xTP1PP1",
                        help="parallel strategy (default 1xTP1PP2+1xTP1PP1: 2 pipelines on 3 ranks)")
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks (default 2)")
    parser.add_argument("--engine", default="python", choices=("auto", "python", "graphviz"))
    parser.add_argument("--out", default="hgraph_sample", help="output path prefix (default hgraph_sample)")
    parser.add_argument("--no-backward", action="store_true", help="forward programs only")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    g = synthetic_graph(args.strategy, args.layers, backward=not args.no_backward)
    t1 = time.perf_counter()
    dot = render_dot(g)
    t2 = time.perf_counter()
    svg = render_svg(g, engine=args.engine)
    t3 = time.perf_counter()
    page = render_html(g)
    t4 = time.perf_counter()
    out = Path(args.out)
    for suffix, text in ((".dot", dot), (".svg", svg), (".html", page)):
        out.with_suffix(suffix).write_text(text, encoding="utf-8")
    print(f"{g.title}: {len(g.nodes)} nodes, {len(g.edges)} edges")
    print(f"build {1e3 * (t1 - t0):.0f} ms, dot {1e3 * (t2 - t1):.0f} ms, svg ({args.engine}) "
          f"{1e3 * (t3 - t2):.0f} ms, html {1e3 * (t4 - t3):.0f} ms")
    print("wrote " + ", ".join(str(out.with_suffix(s)) for s in (".dot", ".svg", ".html")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
