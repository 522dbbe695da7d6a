"""``hgraph check``: can the ranks of a strategy (or a schedule of strategies) issue one step's
collectives in an order that cannot deadlock?

Builds the Program of each strategy on the meta device (no weights), derives every rank's collective
sequence of one step for a representative plan (``runtime/comm/order/derive``: every pipeline runs
``--microbatches`` micro-batches, and with several pipelines the last one none), and runs the
sequences one operation of a rank at a time, NCCL's strictest reading (``order/deadlock``). Prints
``deadlock-free: N ranks, K collectives`` or the first cycle: each rank, the operation it waits in and
the rank it waits for. Exit 0 when deadlock-free, 1 when not, 2 for bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import hgraph
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.comm.order.deadlock import simulate
from hgraph.runtime.comm.order.derive import BACKENDS, MOE_AUX_LOSSES, derive_steps, representative_plan
from hgraph.runtime.planner.cost.shard_group import parse_shard_group
from hgraph.strategy import Strategy
from hgraph.tools.cli.common_options import add_gpus_per_node, add_shard_group, add_world_size, shard_group_cluster
from hgraph.tools.cli.dump import model_args_option


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="check that a strategy's collectives cannot deadlock (static, no GPU)",
                       description=__doc__)
    p.add_argument("--model", required=True, help="llama:tiny | FILE.py:CLASS | package.module:CLASS")
    p.add_argument("--model-args", default=None, help="JSON object of config overrides / constructor kwargs")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--strategy", default=None, help='e.g. "1xTP2PP2+2xTP1PP1"')
    which.add_argument("--strategy-schedule", default=None, metavar="A,B,...",
                       help="strategies of consecutive steps (switches), comma- or semicolon-separated")
    add_world_size(p, help="number of ranks (default: what the strategies use)")
    add_gpus_per_node(p)
    add_shard_group(p)
    p.add_argument("--microbatches", type=int, default=None, metavar="K",
                   help="micro-batches per pipeline in the plan (default: the deepest pipeline's stages)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per micro-batch in the plan (default 32)")
    p.add_argument("--backend", choices=BACKENDS, default="nccl",
                   help="nccl (default; all-gathers and reduce-scatters) or gloo (their all-to-alls)")
    p.add_argument("--recompute", action="store_true",
                   help="a memory budget: every block recomputes (the agreement all-reduce and the replays)")
    p.add_argument("--grad-clip", action="store_true", help="global-norm clipping (its all-reduce)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="working precision (bf16: the vocabulary-parallel loss, as training's auto)")
    p.add_argument("--moe-aux-loss", choices=MOE_AUX_LOSSES, default="none",
                   help=("an MoE model's load-balancing form, as training's: per-document (the routing counts' "
                         "all-reduces over the sequence ranks, per MoE layer and micro-batch), global-batch (a "
                         "forward-only counting pass, then one all-reduce of the counts over the world), hf, none"))
    p.add_argument("--moe-z-loss", action="store_true",
                   help="an MoE model's router z-loss (its value rides on the loss's all-reduce)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _strategies(args: argparse.Namespace) -> list[Strategy]:
    text = args.strategy if args.strategy is not None else args.strategy_schedule
    parts = [s.strip() for s in text.replace(";", ",").split(",") if s.strip()]
    if not parts:
        raise HGraphError("--strategy-schedule names no strategy; expected e.g. '4xTP1PP1,1xTP2PP2'")
    return [Strategy.parse(s) for s in parts]


def run(args: argparse.Namespace) -> int:
    if args.microbatches is not None and args.microbatches < 0:
        raise HGraphError(f"--microbatches {args.microbatches}: expected 0 or more")
    if args.tokens < 1:
        raise HGraphError(f"--tokens {args.tokens}: expected 1 or more")
    strategies = _strategies(args)
    world = args.world_size or strategies[0].num_ranks
    for s in strategies:
        if s.num_ranks != world:
            raise HGraphError(f"strategy {s} uses {s.num_ranks} ranks; the world has {world} "
                              "(every strategy of a schedule must use all of them)")
    parse_shard_group(args.shard_group, world)          # a bad value fails before the model is built
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = resolve_model_spec(args.model, model_args_option(args.model_args))
    # resolved as hgraph train resolves it (auto without a device memory: a node)
    cluster, _ = shard_group_cluster(args.shard_group, world, args.gpus_per_node,
                                     sum(p.numel() for p in model.parameters()))
    compiled = hgraph.compile(model, dtype=args.dtype)
    steps = []
    for s in strategies:
        program = compiled.instantiate(s, cluster)      # one Program per strategy: a repeat is the same
        steps.append((program, representative_plan(s, k=args.microbatches, tokens=args.tokens, backend=args.backend,
                                                   recompute=args.recompute, grad_clip=args.grad_clip,
                                                   moe_aux_loss=args.moe_aux_loss, moe_z_loss=args.moe_z_loss,
                                                   working_dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype])))
    t1 = time.perf_counter()
    sequences = derive_steps(steps)
    t2 = time.perf_counter()
    verdict = simulate(sequences)
    t3 = time.perf_counter()
    if args.json:
        print(json.dumps({"ok": verdict.ok, "line": verdict.line(), "ranks": verdict.ranks,
                          "collectives": verdict.collectives,
                          "strategies": [str(s) for s in strategies],
                          "plans": [plan.describe() for _, plan in steps],
                          "waits": [{"rank": r, "operation": op.describe(), "waits_for": m}
                                    for r, op, m in verdict.waits],
                          "seconds": {"build": round(t1 - t0, 3), "derive": round(t2 - t1, 3),
                                      "simulate": round(t3 - t2, 3)}}))
    else:
        for s, (_, plan) in zip(strategies, steps):
            print(f"{s}: {plan.describe()}", file=sys.stderr)
        print(verdict.line())
    return 0 if verdict.ok else 1
