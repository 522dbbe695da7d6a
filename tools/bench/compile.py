"""Compile-time benchmark: trace + slot, instantiate for 64 ranks, cache hit.

    python -m hgraph.tools.bench.compile [--layers 32] [--strategy S] [--world-size 64]

Targets (issue "compiler core"): tracing + slotting the 32-layer tiny-width model < 1 s;
instantiating one strategy for 64 ranks < 1 s; a second instantiate of the same strategy < 1 ms.
"""
from __future__ import annotations

import argparse
import time

import hgraph
from hgraph.frontends.zoo import llama

DEFAULT_64 = "1xTP8PP4+2xTP4PP2+2xTP2PP2+2xTP1PP2+4xTP1PP1"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--strategy", default=DEFAULT_64)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    # tiny width with 8 heads so TP8 divides the heads
    cfg = dict(num_layers=args.layers, num_heads=8, num_kv_heads=8, hidden_size=128)
    model = llama.build("tiny", **cfg)
    trace_s, shape_s, inst_s, hit_s, build_s, rank_s = [], [], [], [], [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        compiled = hgraph.compile(model)
        trace_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        compiled.symbolic_shapes()   # strategy-agnostic, once per model (first instantiate does it)
        shape_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        prog = compiled.instantiate(args.strategy, world_size=args.world_size)
        inst_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        again = compiled.instantiate(args.strategy, world_size=args.world_size)
        hit_s.append(time.perf_counter() - t)
        assert again is prog
        t = time.perf_counter()
        prog.rank(0).pull_by_param       # one rank's LNK ops, planned when first read
        rank_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for role in prog.roles():
            role.graph_module
        build_s.append(time.perf_counter() - t)
    roles = len(prog.roles())
    best = min
    print(f"model: llama tiny-width, {args.layers} layers, {sum(p.numel() for p in model.parameters())} parameters")
    print(f"trace + slot                        : {best(trace_s) * 1e3:8.1f} ms (best of {args.repeat}; target < 1000 ms)")
    print(f"symbolic shape analysis (once/model): {best(shape_s) * 1e3:8.1f} ms")
    print(f"instantiate {args.strategy} on {args.world_size} ranks: {best(inst_s) * 1e3:8.1f} ms "
          "(checks, stage split, layout per role; target < 1000 ms)")
    print(f"rank 0's LNK ops (its pulls and pushes)  : {best(rank_s) * 1e3:8.1f} ms")
    print(f"compile all {roles} distinct rank-role graphs (each process builds only its own): "
          f"{best(build_s) * 1e3:8.1f} ms, {best(build_s) / roles * 1e3:.1f} ms per rank")
    print(f"second instantiate (cache hit)      : {best(hit_s) * 1e6:8.1f} us (target < 1000 us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
