"""``hgraph simulate``: simulated iterations of a length distribution, hgraph against the baselines.

Every system trains the same mini-batches (a seeded shuffle of the dataset cut into
``--tokens-per-iter`` token mini-batches; documents longer than ``--max-len`` are truncated, or
dropped with ``--long drop``) under the cost model of ``--profile``: hgraph (proposed candidates,
per-iteration dispatch + packing), Megatron-LM (static homogeneous, fixed-length packing, even
dispatch), Megatron-LM with context parallelism (megatron-cp: the best homogeneous scheme with CP),
DeepSpeed-Ulysses (static homogeneous Ulysses), FlexSP (heterogeneous Ulysses groups per step, no
CP), HotSPa (a few homogeneous
strategies per iteration with switching cost), WLB-LLM (var-length packing with outlier delay on a
homogeneous 4D strategy) and DCP, the Data-Centric Parallel paper's system (per-length
sequence-parallel groups). Each baseline is tuned over
its own strategy space, under the same cost model. A baseline that cannot hold the context in this
setting (megatron-cp without derived CP, flexsp without a Ulysses scheme that holds it) is named as
skipped. For a model with experts (``--profile analytic:llama-moe:16b``) two more: the best
homogeneous EP strategy planned every iteration (homogeneous-ep) and Megatron-LM's MoE setup, a static
EP8 scheme with fixed-length packing (megatron-ep). The speedup of hgraph over each baseline closes the report. A profile with a ``push``
section prices each pipeline's gradient push, the part its last backward does not hide.
"""
from __future__ import annotations

import argparse
import json
import sys

from hgraph.errors import HGraphError
from hgraph.runtime.data.lengths import read_lengths
from hgraph.runtime.research.moe_baselines import MOE_SYSTEMS
from hgraph.runtime.research.simulator import SYSTEMS, simulate
from hgraph.tools.cli.length_options import add_workload_options, workload_cost_model


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="simulate training iterations: hgraph vs Megatron (and with CP), "
                              "DeepSpeed-Ulysses, FlexSP, HotSPa, WLB-LLM, Data-Centric Parallel (dcp)",
                              description=__doc__)
    add_workload_options(p, max_len_help="context length")
    p.add_argument("--tokens-per-iter", required=True, type=int, metavar="T", help="tokens per iteration")
    p.add_argument("--iters", required=True, type=int, metavar="K", help="iterations to simulate")
    p.add_argument("--systems", default=None, metavar="LIST",
                   help=f"comma-separated systems (default all: {','.join(SYSTEMS)}, and for a model with experts "
                        f"{','.join(MOE_SYSTEMS)})")
    p.add_argument("--seed", type=int, default=0, help="seed of the data shuffle (default 0)")
    p.add_argument("--long", choices=("truncate", "drop"), default="truncate",
                   help="documents longer than --max-len: truncate (default) or drop")
    p.add_argument("--max-cp", type=int, default=None, metavar="C",
                   help="largest context-parallel degree the cost model derives (1: only the profiled <TP,PP> "
                        "schemes, the papers' setting; default: the profile's own, 8, or more until a scheme holds "
                        "--max-len); the Ulysses degree follows it unless --max-ul")
    p.add_argument("--max-ul", type=int, default=None, metavar="U",
                   help="largest Ulysses degree the cost model derives (1: none; default: as --max-cp)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    for name in ("world_size", "gpus_per_node", "max_len", "tokens_per_iter", "iters"):
        if getattr(args, name) < 1:
            raise HGraphError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    known = SYSTEMS + MOE_SYSTEMS
    systems = [s.strip() for s in (args.systems or "").split(",") if s.strip()]
    if args.systems is not None and not systems:
        raise HGraphError(f"--systems is empty; choose from {','.join(known)}")
    unknown = [s for s in systems if s not in known]
    if unknown:
        raise HGraphError(f"unknown system(s) {', '.join(unknown)} in --systems; choose from {','.join(known)}")
    lengths = read_lengths(args.lengths)
    if args.max_cp is not None and args.max_cp < 1:
        raise HGraphError(f"--max-cp must be a positive integer, got {args.max_cp}")
    if args.max_ul is not None and args.max_ul < 1:
        raise HGraphError(f"--max-ul must be a positive integer, got {args.max_ul}")
    cost = workload_cost_model(args, max_cp=args.max_cp, max_ul=args.max_ul)
    if args.systems is None:
        systems = list(SYSTEMS + (MOE_SYSTEMS if cost.model.experts is not None else ()))
    if cost.largest_max_len() < args.max_len:
        raise HGraphError(f"--max-len {args.max_len} is longer than the largest MaxLen {cost.largest_max_len()} of "
                          f"any scheme of {cost.name!r} on {args.world_size} GPUs; lower --max-len or add GPUs")
    sim = simulate(lengths, cost, args.world_size, args.max_len, args.tokens_per_iter, args.iters, systems=systems,
                   seed=args.seed, gpus_per_node=args.gpus_per_node, long=args.long)
    if args.json:
        out = sim.to_json()
        out["profile"] = cost.name
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    w = sys.stdout.write
    w(f"profile {cost.name}, {args.world_size} GPUs, context {args.max_len}, {args.tokens_per_iter} tokens per "
      f"iteration, {args.iters} iterations\n")
    # every system trains the same documents; one that holds some back (WLB's outlier delay) runs more,
    # lighter iterations, so its mean step can be shorter while its total time is longer: the speedups
    # compare tokens/s, i.e. the total time of the same tokens
    w(f"  {'system':<12} {'iters':>5} {'mean ms':>9} {'std ms':>8} {'total s':>8} {'tokens/s':>10} {'spread':>7}  "
      "configuration\n")
    for name, r in sim.results.items():
        j = r.to_json()
        w(f"  {name:<12} {j['iterations']:>5} {j['mean_latency_ms']:>9.1f} {j['std_latency_ms']:>8.1f} "
          f"{r.total_ms / 1e3:>8.2f} {j['throughput_tokens_per_s']:>10.0f} {j['mean_spread']:>7.2f}  {r.config}\n")
    for name, r in sim.results.items():
        extra = len(r.iterations) - args.iters
        if extra > 0:
            w(f"  {name}: {len(r.iterations)} iterations for the {args.iters} mini-batches: its outlier delay holds "
              f"documents back and trains them in {extra} more at the end, so its mean iteration is lighter; "
              "compare tokens/s (the same tokens in all)\n")
    if "hgraph" in sim.results:
        h = sim.results["hgraph"]
        w(f"hgraph candidates: {', '.join(h.notes['candidates'])}\n")
        w("hgraph chose: " + ", ".join(f"{s} x{n}" for s, n in h.notes["chosen"].items()) + "\n")
    for name, why in sim.skipped.items():
        w(f"  {name:<12} skipped: {why}\n")
    if sim.speedups():
        w("speedup of hgraph over (tokens/s): " + ", ".join(f"{s} {x:.2f}x" for s, x in sim.speedups().items())
          + "\n")
    sp = sim.speedup()
    if sp is not None:
        w(f"speedup of hgraph over the best baseline ({sim.best_baseline().system}, tokens/s): {sp:.2f}x\n")
    return 0
