"""``hgraph pack``: pack global batches of a dataset into micro-batches (WLB-LLM Table 2 methods).

A global batch holds whole documents in file order up to ``--micro-batches x --max-len`` tokens
(``--tokens-per-iter`` overrides). ``wlb`` is WLB-LLM's variable-length packing with outlier delay
queues (a delayed document is trained in a later batch; the final flush emits every one left);
``fixed-greedy`` and ``fixed-solver`` are the fixed-length baselines (greedy, and CP-SAT time-boxed
per batch). Micro-batch latency is ``sum(a l^2 + b l) + c`` from a cost profile's scheme, or from
``--coeffs``. Document indices are 0-based positions in the file; after the flush every document
appears exactly once.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.lengths import minibatches, read_lengths
from hgraph.runtime.data.wlb_packing import DocLatency, imbalance_degree
from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.research.fixed_length import make_packer
from hgraph.strategy import Scheme
from hgraph.tools.cli.length_options import add_long_option, limit_lengths

DEFAULT_PROFILE = "llama-7b"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("pack", help="pack global batches into micro-batches (wlb, fixed-greedy, fixed-solver)",
                              description=__doc__)
    p.add_argument("--lengths", required=True, metavar="FILE",
                   help="document lengths: one integer per line, or JSONL objects with input_ids")
    p.add_argument("--method", required=True, choices=("wlb", "fixed-greedy", "fixed-solver"))
    p.add_argument("--max-len", required=True, type=int, metavar="L", help="context length (longest document)")
    p.add_argument("--micro-batches", required=True, type=int, metavar="N", help="micro-batches per global batch")
    p.add_argument("--queues", type=int, default=2, metavar="K", help="wlb: outlier delay queues (default 2)")
    p.add_argument("--capacity", type=int, default=None, metavar="T",
                   help="wlb: tokens a micro-batch may hold (its memory limit; default --max-len)")
    p.add_argument("--pp", type=int, default=None, metavar="P",
                   help="pipeline depth: the N micro-batches run on N/P pipelines of P each, and the imbalance is "
                        "WLB's max x P / total of the worst pipeline (default P = N)")
    p.add_argument("--profile", default=None, metavar="NAME|FILE",
                   help=f"cost profile for micro-batch latency (default {DEFAULT_PROFILE} unless --coeffs)")
    p.add_argument("--scheme", default=None, metavar="TPxPPy",
                   help="scheme of the profile whose coefficients to use (default: the smallest that holds --max-len)")
    p.add_argument("--coeffs", default=None, metavar="A,B[,C]",
                   help="latency coefficients in ms instead of a profile: a l^2 + b l per document, c per micro-batch")
    p.add_argument("--tokens-per-iter", type=int, default=None, metavar="T",
                   help="tokens per global batch (default micro-batches x max-len)")
    p.add_argument("--solver-time-limit", type=float, default=1.0, metavar="S",
                   help="fixed-solver: CP-SAT seconds per batch (default 1)")
    add_long_option(p, "--max-len")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _latency(args) -> tuple[DocLatency, str]:
    if args.coeffs is not None:
        if args.profile is not None or args.scheme is not None:
            raise HGraphError("give either --coeffs or --profile/--scheme, not both")
        try:
            vals = [float(x) for x in args.coeffs.split(",")]
        except ValueError:
            raise HGraphError(f"--coeffs {args.coeffs!r}: expected numbers A,B or A,B,C") from None
        if len(vals) not in (2, 3):
            raise HGraphError(f"--coeffs {args.coeffs!r}: expected A,B or A,B,C")
        return DocLatency(*vals), f"coefficients {args.coeffs}"

    profile = args.profile or DEFAULT_PROFILE
    if args.scheme is not None:
        scheme = Scheme.parse(args.scheme)
        cost = load_cost_model(profile, world_size=scheme.num_ranks, gpus_per_node=max(scheme.tp, 8))
    else:
        cost = load_cost_model(profile, world_size=64)
        holders = [s for s in cost.schemes if cost.max_len(s) >= args.max_len]
        if not holders:
            raise HGraphError(f"no scheme of profile {cost.name!r} holds {args.max_len} tokens (largest MaxLen "
                              f"{cost.largest_max_len()}); choose --scheme or --coeffs")
        scheme = min(holders, key=lambda s: (s.num_ranks, s.pp, s.seq))
    return DocLatency.from_cost_model(cost, scheme), f"profile {cost.name} scheme {scheme}"


def _imbalance(latencies: list[float], pp: int) -> float:
    groups = len(latencies) // pp
    if groups <= 1:
        return imbalance_degree(latencies)
    return max(imbalance_degree(latencies[g::groups]) for g in range(groups))


def run(args: argparse.Namespace) -> int:
    for name in ("max_len", "micro_batches"):
        if getattr(args, name) < 1:
            raise HGraphError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.queues < 0:
        raise HGraphError(f"--queues must be >= 0, got {args.queues}")
    pp = args.pp if args.pp is not None else args.micro_batches
    if pp < 1 or args.micro_batches % pp:
        raise HGraphError(f"--pp {pp} must be a positive divisor of --micro-batches {args.micro_batches}")
    if args.capacity is not None and args.method != "wlb":
        raise HGraphError("--capacity applies to --method wlb only (fixed-length packing is bounded by --max-len)")
    tokens = args.tokens_per_iter if args.tokens_per_iter is not None else args.micro_batches * args.max_len
    if tokens < 1:
        raise HGraphError(f"--tokens-per-iter must be a positive integer, got {tokens}")
    latency, source = _latency(args)
    raw = read_lengths(args.lengths)
    lengths, index = limit_lengths(raw, args.max_len, args.long, "--max-len")
    packer = make_packer(args.method, latency, args.micro_batches, args.max_len, capacity=args.capacity,
                         num_queues=args.queues, solver_time_limit_s=args.solver_time_limit)
    batches = []
    for ids in minibatches(lengths, tokens):
        batches.append(packer.push(lengths[ids], index[ids]))
    batches += packer.flush()
    out = {"batches": [{"index": b.index, "microbatches": b.microbatches, "imbalance": _imbalance(b.latencies_ms, pp),
                        "pack_ms": b.pack_ms} for b in batches],
           "mean_delay_iters": packer.stats.mean_delay()}
    if args.json:
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    w = sys.stdout.write
    full = [b for b in out["batches"]]
    w(f"{args.method}: {len(lengths)} documents, {len(batches)} batches of {args.micro_batches} micro-batches "
      f"({source})\n")
    w(f"mean imbalance {np.mean([b['imbalance'] for b in full]):.3f}, max {max(b['imbalance'] for b in full):.3f}; "
      f"mean pack time {np.mean([b['pack_ms'] for b in full]):.2f} ms; mean delay {out['mean_delay_iters']:.3f} "
      f"batches ({packer.stats.delayed_fraction() * 100:.1f}% of documents delayed)\n")
    for b in batches:
        sizes = [len(mb) for mb in b.microbatches]
        w(f"  batch {b.index:>4}{' (flush)' if b.from_flush else '':8} imbalance {_imbalance(b.latencies_ms, pp):.3f}  "
          f"docs per micro-batch {sizes}\n")
    return 0
