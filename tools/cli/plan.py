"""``hgraph plan``: choose the strategy and micro-batches of the first K iterations of a dataset.

Reads document lengths (one integer per line, or JSONL with ``input_ids``), truncates them to the
context length ``--max-len``, forms mini-batches of whole documents up to ``--tokens-per-iter``,
and for each runs the two-stage assignment (dispatch + packing) over the candidate strategies.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.lengths import minibatches, read_lengths
from hgraph.runtime.planner.auto_candidates import auto_candidates
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.strategy import Cluster, Strategy
from hgraph.tools.cli.length_options import add_workload_options, workload_cost_model


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="plan strategies and micro-batches for the first iterations of a dataset",
                              description=__doc__)
    add_workload_options(p, max_len_help="context length: longer documents are truncated to L tokens")
    p.add_argument("--tokens-per-iter", required=True, type=int, metavar="T", help="tokens per mini-batch")
    p.add_argument("--iters", type=int, default=1, metavar="K", help="number of iterations to plan (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the randomized methods (default 0)")
    p.add_argument("--strategies", default="auto", metavar='"S1;S2"|auto',
                   help="candidate strategies separated by ';' (e.g. '4xTP2PP1;1xTP8PP1'), or auto (default)")
    p.add_argument("--method", choices=("fast", "greedy", "cpsat"), default="fast",
                   help="dispatch method: fast (default), greedy (Hydraulis Alg. 1), cpsat (time-boxed exact)")
    p.add_argument("--time-limit", type=float, default=10.0, metavar="S",
                   help="CP-SAT seconds per candidate with --method cpsat (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _candidates(text: str, lengths: np.ndarray, cost, gpus: int, max_len: int,
                tokens_per_iter: int) -> tuple[list[Strategy], str]:
    if text.strip().lower() == "auto":
        return auto_candidates(lengths, cost, gpus, max_len, tokens_per_iter)
    cluster = Cluster(gpus, cost.gpus_per_node)
    out = []
    for part in text.split(";"):
        if not part.strip():
            continue
        s = Strategy.parse(part)
        s.validate(cluster)
        out.append(s)
    if not out:
        raise HGraphError("--strategies is empty: give strategies separated by ';' or auto")
    return out, "given"


def _ranks_text(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def run(args: argparse.Namespace) -> int:
    for name in ("world_size", "gpus_per_node", "max_len", "tokens_per_iter", "iters"):
        if getattr(args, name) < 1:
            raise HGraphError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    raw = read_lengths(args.lengths)
    cost = workload_cost_model(args)
    lengths = np.minimum(raw, args.max_len)
    batches = minibatches(lengths, args.tokens_per_iter)[: args.iters]
    largest = cost.largest_max_len()
    planned = np.concatenate(batches)
    if int(lengths[planned].max()) > largest:
        i = int(planned[np.argmax(lengths[planned])])
        raise HGraphError(
            f"document {i} has {int(lengths[i])} tokens (after truncation to --max-len {args.max_len}), more than "
            f"the largest MaxLen {largest} of any scheme of {cost.name!r} on {args.world_size} GPUs; lower --max-len")
    candidates, source = _candidates(args.strategies, lengths, cost, args.world_size, min(args.max_len, int(lengths.max())),
                                     args.tokens_per_iter)
    if args.time_limit <= 0:
        raise HGraphError(f"--time-limit must be positive, got {args.time_limit}")
    plans = []
    for k, ids in enumerate(batches):
        plans.append(plan_iteration(lengths[ids], candidates, cost, method=args.method, seed=args.seed, doc_ids=ids,
                                    index=k, time_limit_s=args.time_limit,
                                    previous=plans[-1].strategy if plans else None))
    if args.json:
        json.dump({"candidates": [str(s) for s in candidates], "iterations": [p.to_json() for p in plans]},
                  sys.stdout)
        sys.stdout.write("\n")
        return 0
    out = sys.stdout
    out.write(f"profile {cost.name}, {args.world_size} GPUs ({args.gpus_per_node} per node), context {args.max_len}, "
              f"{args.tokens_per_iter} tokens per iteration, method {args.method}\n")
    out.write(f"{len(candidates)} candidate strategies ({source}): {', '.join(map(str, candidates))}\n")
    if len(batches) < args.iters:
        out.write(f"the data holds {len(batches)} mini-batches; planned all of them\n")
    for p in plans:
        out.write(f"\niteration {p.index}: {p.num_docs} docs, {p.tokens} tokens -> {p.strategy}  "
                  f"est {p.est_latency_ms:.1f} ms  (solved in {p.solve_ms:.1f} ms; "
                  f"{p.candidates_evaluated} evaluated, {p.candidates_pruned} pruned by bound"
                  + (f", {len(p.candidates_skipped)} cannot hold the longest" if p.candidates_skipped else "") + ")\n")
        out.write(f"  {'pipe':>4}  {'scheme':<12} {'ranks':<9} {'mbs':>4} {'docs':>5} {'tokens':>8} {'max mb':>7} "
                  f"{'est ms':>9}\n")
        for j, pp in enumerate(p.pipelines):
            docs = sum(len(mb) for mb in pp.microbatches)
            toks = [sum(p.doc_lengths[d] for d in mb) for mb in pp.microbatches]
            out.write(f"  {j:>4}  {str(pp.scheme):<12} {_ranks_text(pp.ranks):<9} {len(pp.microbatches):>4} {docs:>5} "
                      f"{sum(toks):>8} {max(toks, default=0):>7} {pp.est_latency_ms:>9.1f}\n")
    return 0
