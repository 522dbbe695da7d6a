"""``hgraph propose``: candidate heterogeneous strategies for a dataset's length distribution.

Runs the data-distribution-aware strategy proposal (Hydraulis, section 7): the relaxed dynamic program over
(GPUs, length bucket), rounding to strategies of exactly ``--world-size`` GPUs, one candidate per range of
an iteration's longest document, each with its expected latency per iteration.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.lengths import read_lengths
from hgraph.runtime.planner.proposal import propose
from hgraph.tools.cli.length_options import (add_long_option, add_workload_options, limit_lengths,
                                             workload_cost_model)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("propose", help="propose candidate strategies for a length distribution",
                              description=__doc__)
    add_workload_options(p, max_len_help="context length: longer documents are truncated to L tokens")
    p.add_argument("--tokens-per-iter", type=int, default=None, metavar="T",
                   help="tokens per iteration for the expected cost (default 3125 per GPU, as Hydraulis)")
    p.add_argument("--max-candidates", type=int, default=8, metavar="C", help="most candidates kept (default 8)")
    add_long_option(p, "the largest MaxLen of the profile")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    for name in ("world_size", "gpus_per_node", "max_len", "max_candidates"):
        if getattr(args, name) < 1:
            raise HGraphError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.tokens_per_iter is not None and args.tokens_per_iter < 1:
        raise HGraphError(f"--tokens-per-iter must be a positive integer, got {args.tokens_per_iter}")
    raw = read_lengths(args.lengths)
    cost = workload_cost_model(args)
    largest = cost.largest_max_len()
    lengths, _ = limit_lengths(np.minimum(raw, args.max_len), largest, args.long,
                               f"the largest MaxLen of any scheme of {cost.name!r} on {args.world_size} GPUs")
    max_len = min(args.max_len, int(lengths.max()))  # as `hgraph plan`: no longer than the data needs
    prop = propose(lengths, cost, args.world_size, max_len, gpus_per_node=args.gpus_per_node,
                   tokens_per_iter=args.tokens_per_iter, max_candidates=args.max_candidates)
    if args.json:
        out = prop.to_json()
        out["profile"] = cost.name
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    w = sys.stdout.write
    w(f"profile {cost.name}, {args.world_size} GPUs ({args.gpus_per_node} per node), context {max_len}, "
      f"{prop.tokens_per_iter} tokens per iteration; solved in {prop.solve_ms:.0f} ms\n")
    w(f"{len(prop.candidates)} candidates" + (f" ({prop.dropped} less likely ones dropped)" if prop.dropped else "")
      + "\n")
    w(f"  {'longest doc in':<16} {'P(longest)':>10} {'expected ms':>12} {'relaxed ms':>11}  strategy\n")
    for c in prop.candidates:
        lo, hi = c.len_range
        weight = "variant" if c.variant else f"{c.weight:.3f}"
        w(f"  {f'({lo}, {hi}]':<16} {weight:>10} {c.expected_ms:>12.1f} {c.relaxed_ms:>11.1f}  {c.strategy}\n")
    return 0
