"""LNK planning benchmark: pull / push plans for every parameter of a Llama config under strategies.

    python -m hgraph.tools.bench.lnk [--model 7b] [--world-size 64] [--gpus-per-node 8]
                                     [--strategy S ...] [--working-bytes 2] [--json]

For each strategy prints: planning time, pull bytes against the minimum (rows a rank needs and does not
own), push LNK and reduce-scatter bytes against the minimum an owner must receive in total (rows of its
segment contributed by others), the inter-node share, op counts,
how many parameters degenerate to an all-gather / a plain reduce-scatter, and the number of mutual
slices planned against the paper's uniform LCM grid. Parameters are described from the config's
shapes (no model is built); layers are split evenly over each pipeline's PP stages.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from hgraph.comm_plan import ParamLayout
from hgraph.errors import HGraphError
from hgraph.frontends.zoo.llama import make_config
from hgraph.passes.lnk.mutual_slices import lcm_granularity, propagation_contributions, propagation_needs
from hgraph.passes.lnk.plans import min_pull_bytes, min_push_bytes, pull_plan, push_plan
from hgraph.strategy import Cluster, Strategy

DEFAULT_STRATEGIES = ("8xTP8PP1", "16xTP4PP1", "1xTP8PP4+2xTP4PP2+2xTP2PP2+4xTP1PP2")


@dataclass(frozen=True)
class BenchParam:
    """One parameter of the model: its layout, where it lives, how TP splits it."""

    layout: ParamLayout
    layer: int | None          # None: embedding (first stage) or head / final norm (last stage)
    first: bool
    tp_sharded: bool
    units: int | None = None


def llama_params(model: str, master_bytes: int = 4) -> tuple[list[BenchParam], int]:
    """The parameters of a zoo Llama config (vocabulary-parallel embedding and head)."""
    c = make_config(model)
    hd = c.head_dim or c.hidden_size // c.num_heads
    kv = c.num_kv_heads or c.num_heads
    h, inter = c.hidden_size, c.intermediate_size
    out = [BenchParam(ParamLayout("embed", (c.vocab_size, h), 0, master_bytes), None, True, True)]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        out += [
            BenchParam(ParamLayout(p + "attn_norm", (h,), 0, master_bytes), i, False, False),
            BenchParam(ParamLayout(p + "q", (c.num_heads * hd, h), 0, master_bytes), i, False, True),
            BenchParam(ParamLayout(p + "k", (kv * hd, h), 0, master_bytes), i, False, True, kv),
            BenchParam(ParamLayout(p + "v", (kv * hd, h), 0, master_bytes), i, False, True, kv),
            BenchParam(ParamLayout(p + "o", (h, c.num_heads * hd), 1, master_bytes), i, False, True),
            BenchParam(ParamLayout(p + "mlp_norm", (h,), 0, master_bytes), i, False, False),
            BenchParam(ParamLayout(p + "gate", (inter, h), 0, master_bytes), i, False, True),
            BenchParam(ParamLayout(p + "up", (inter, h), 0, master_bytes), i, False, True),
            BenchParam(ParamLayout(p + "down", (h, inter), 1, master_bytes), i, False, True),
        ]
    out += [BenchParam(ParamLayout("norm", (h,), 0, master_bytes), None, False, False),
            BenchParam(ParamLayout("lm_head", (c.vocab_size, h), 0, master_bytes), None, False, True)]
    return out, c.num_layers


def bench_strategy(strategy: Strategy, params: list[BenchParam], num_layers: int, cluster: Cluster,
                   working_bytes: int) -> dict:
    """Plan every parameter for ``strategy``; return the figures."""
    strategy.validate(cluster)
    n = cluster.world_size
    fig = dict(strategy=str(strategy), params=len(params), pull_ms=0.0, push_ms=0.0, pull_bytes=0,
               pull_min_bytes=0, pull_inter_bytes=0, pull_transfers=0, all_gathers=0, push_bytes=0,
               push_min_bytes=0, push_inter_bytes=0, push_transfers=0, reduce_scatter_bytes=0,
               plain_reduce_scatters=0, mutual_slices=0, lcm_grid_slices=0)
    dp = len(strategy.pipelines)
    for bp in params:
        def stage_of(_i, scheme, bp=bp):
            if bp.layer is None:
                return 0 if bp.first else scheme.pp - 1
            return bp.layer * scheme.pp // num_layers
        size = bp.layout.size
        needs = propagation_needs(strategy, size, stage_of=stage_of, tp_sharded=bp.tp_sharded, units=bp.units)
        contrib = propagation_contributions(strategy, size, stage_of=stage_of, tp_sharded=bp.tp_sharded,
                                            units=bp.units)
        t = time.perf_counter()
        pull = pull_plan(bp.layout, needs, n, cluster.gpus_per_node, working_dtype_bytes=working_bytes)
        fig["pull_ms"] += (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        push = push_plan(bp.layout, contrib, n, cluster.gpus_per_node, grad_dtype_bytes=working_bytes)
        fig["push_ms"] += (time.perf_counter() - t) * 1e3
        fig["pull_bytes"] += pull.total_bytes
        fig["pull_min_bytes"] += sum(min_pull_bytes(bp.layout, needs, n, working_dtype_bytes=working_bytes).values())
        fig["pull_inter_bytes"] += pull.inter_node_bytes
        fig["pull_transfers"] += len(pull.transfers)
        fig["all_gathers"] += pull.is_all_gather
        fig["push_bytes"] += push.total_bytes
        fig["push_min_bytes"] += sum(min_push_bytes(bp.layout, contrib, n, grad_dtype_bytes=working_bytes).values())
        fig["push_inter_bytes"] += push.inter_node_bytes
        fig["push_transfers"] += len(push.transfers)
        fig["reduce_scatter_bytes"] += push.reduce_scatter_bytes
        fig["plain_reduce_scatters"] += push.is_plain_reduce_scatter
        fig["mutual_slices"] += len(pull.slices)
        fig["lcm_grid_slices"] += min(size, lcm_granularity(n, strategy.tp_max) if bp.tp_sharded else n)
    fig["pull_ms"], fig["push_ms"] = round(fig["pull_ms"], 2), round(fig["push_ms"], 2)
    fig["num_pipelines"] = dp
    return fig


def _gib(x: int) -> str:
    return f"{x / 2**30:8.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="7b", help="zoo Llama config name (default 7b)")
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--strategy", action="append", help="strategy text; repeat for several")
    ap.add_argument("--working-bytes", type=int, default=2, help="bytes per element pulled / pushed (bf16: 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        cluster = Cluster(args.world_size, args.gpus_per_node)
        params, layers = llama_params(args.model)
        results = [bench_strategy(Strategy.parse(s), params, layers, cluster, args.working_bytes)
                   for s in (args.strategy or DEFAULT_STRATEGIES)]
    except HGraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "world_size": args.world_size,
                          "gpus_per_node": args.gpus_per_node, "results": results}))
        return 0
    print(f"model llama:{args.model}, {args.world_size} ranks, {args.gpus_per_node} per node, "
          f"{args.working_bytes}-byte working dtype; bytes in GiB summed over ranks")
    for r in results:
        print(f"\n{r['strategy']}  ({r['params']} parameters, {r['num_pipelines']} pipelines)")
        print(f"  plan time        pull {r['pull_ms']:9.1f} ms   push {r['push_ms']:9.1f} ms")
        print(f"  pull   bytes {_gib(r['pull_bytes'])}  min {_gib(r['pull_min_bytes'])}  inter-node "
              f"{_gib(r['pull_inter_bytes'])}  transfers {r['pull_transfers']:7d}  all-gathers {r['all_gathers']}")
        print(f"  push   LNK   {_gib(r['push_bytes'])}  + reduce-scatter {_gib(r['reduce_scatter_bytes'])}  "
              f"min {_gib(r['push_min_bytes'])}")
        print(f"         LNK inter-node {_gib(r['push_inter_bytes'])}  transfers {r['push_transfers']:7d}  "
              f"plain RS {r['plain_reduce_scatters']}")
        print(f"  mutual slices (pull) {r['mutual_slices']}  vs paper LCM grid {r['lcm_grid_slices']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
