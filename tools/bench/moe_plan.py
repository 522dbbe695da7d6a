"""MoE planner benchmark: the 16B-class MoE (``llama-moe:16b``, DeepSeek-MoE 16B's shape) planned and
simulated at 1,024 GPUs on the Wikipedia lengths at 128K context.

    python -m hgraph.tools.bench.moe_plan [--iters 5] [--quick] [--json]

Cost model: the analytic prior of the model's shape (``--profile analytic:llama-moe:16b``: A800-class
GPUs, 8 per node, 80 GiB; its EP schemes from ``planner/cost/moe_cost``), as the dense 1,024-GPU runs
use the analytic prior of the zoo's 70B. Figures printed:

1. planning time per iteration (``plan_iteration`` over the ``auto`` candidates, each iteration told
   the previous one's strategy, one core; wall and CPU time, the CPU figure not counting the time the
   shared core ran others; goal 200 ms), the candidates and how many hold EP schemes;
2. the simulated iterations (``research/simulator``) of hgraph against the best homogeneous EP strategy
   (``homogeneous-ep``) and the Megatron-style EP baseline (``megatron-ep``: a static EP8 scheme sized
   for the context, fixed-length packing), and Megatron-LM's dense setup (``megatron``) for scale:
   tokens/s and hgraph's speedup over each.

``--quick`` is the small form (16 GPUs, 16K context, 2 iterations) a test runs so the bench cannot rot.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from hgraph.runtime.data.lengths import minibatches, read_lengths
from hgraph.runtime.planner.auto_candidates import auto_candidates
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.runtime.research.simulator import simulate
from hgraph.tools.bench.planner import _pin_one_core, default_lengths_path
from hgraph.tools.cli.length_options import profile_cost_model

PROFILE = "analytic:llama-moe:16b"
SYSTEMS = ("hgraph", "homogeneous-ep", "megatron-ep", "megatron")
FULL = {"gpus": 1024, "max_len": 131072, "tokens": 4_500_000}     # DeepSeekMoE 16B's 4.5M-token batch
QUICK = {"gpus": 16, "max_len": 16384, "tokens": 120_000}


def plan_times(lengths: np.ndarray, cost, gpus: int, max_len: int, tokens: int, iters: int) -> dict:
    """Candidates and per-iteration planning time of the first ``iters`` mini-batches."""
    lengths = np.minimum(lengths, max_len)
    t0 = time.perf_counter()
    cands, source = auto_candidates(lengths, cost, gpus, max_len, tokens)
    proposal_s = time.perf_counter() - t0
    wall, cpu, chosen, previous = [], [], [], None
    for k, ids in enumerate(minibatches(lengths, tokens)[:iters]):
        t, c = time.perf_counter(), time.process_time()
        plan = plan_iteration(lengths[ids], cands, cost, doc_ids=ids, index=k, previous=previous)
        wall.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
        previous = plan.strategy
        chosen.append(str(plan.strategy))
    return {"candidates": [str(s) for s in cands], "candidate_source": source, "proposal_s": proposal_s,
            "ep_candidates": sum(any(p.ep > 1 for p in s.pipelines) for s in cands),
            "plan_ms": {"mean": statistics.mean(wall), "max": max(wall)},
            "plan_cpu_ms": {"mean": statistics.mean(cpu), "max": max(cpu)}, "chosen": chosen}


def run(lengths: np.ndarray, gpus: int, max_len: int, tokens: int, iters: int) -> dict:
    cost = profile_cost_model(PROFILE, world_size=gpus, gpus_per_node=8)
    planning = plan_times(lengths, cost, gpus, max_len, tokens, iters)
    sim = simulate(lengths, cost, gpus, max_len, tokens, iters, systems=SYSTEMS)
    systems = {name: {"config": r.config, "tokens_per_s": r.throughput, "mean_ms": r.to_json()["mean_latency_ms"]}
               for name, r in sim.results.items()}
    return {"profile": PROFILE, "gpus": gpus, "max_len": max_len, "tokens_per_iter": tokens, "iterations": iters,
            "ep_schemes": sum(s.ep > 1 for s in cost.schemes), "schemes": len(cost.schemes), **planning,
            "systems": systems, "skipped": sim.skipped, "speedup": sim.speedups(),
            "hgraph_chose": sim.results["hgraph"].notes["chosen"] if "hgraph" in sim.results else {}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default=str(default_lengths_path()))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="16 GPUs, 16K context, 2 iterations (the test's form)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin this process to one core")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    setting = QUICK if args.quick else FULL
    iters = 2 if args.quick else args.iters
    pinned = "not pinned" if args.no_pin else _pin_one_core()
    out = run(read_lengths(args.lengths), setting["gpus"], setting["max_len"], setting["tokens"], iters)
    out["pinned"] = pinned
    if args.json:
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    w = sys.stdout.write
    w(f"{out['profile']} on {out['gpus']} GPUs, context {out['max_len']}, {out['tokens_per_iter']} tokens per "
      f"iteration, {iters} iterations ({pinned}); {out['schemes']} schemes, {out['ep_schemes']} with EP\n")
    w(f"candidates: {len(out['candidates'])} ({out['ep_candidates']} with EP pipelines), proposed in "
      f"{out['proposal_s']:.1f} s\n")
    w(f"planning time per iteration: {out['plan_ms']['mean']:.1f} ms mean, {out['plan_ms']['max']:.1f} ms max wall; "
      f"CPU {out['plan_cpu_ms']['mean']:.1f} ms mean, {out['plan_cpu_ms']['max']:.1f} ms max (goal 200 ms)\n")
    for name, r in out["systems"].items():
        w(f"  {name:<15} {r['tokens_per_s']:>10.0f} tokens/s  {r['mean_ms']:>9.1f} ms/iter  {r['config']}\n")
    for name, why in out["skipped"].items():
        w(f"  {name:<15} skipped: {why}\n")
    w("hgraph chose: " + ", ".join(f"{s} x{n}" for s, n in out["hgraph_chose"].items()) + "\n")
    w("speedup of hgraph over (tokens/s): " + ", ".join(f"{s} {x:.2f}x" for s, x in out["speedup"].items()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
