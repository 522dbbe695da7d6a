"""Strategy proposal: solve time and quality against the exact integer DP.

Time of ``proposal.propose`` on one core for 64 and 1024 GPUs (Hydraulis App. E: 2.03 s and 107 s),
and, on smaller clusters where the integer DP of Eq. 4 is affordable (with the profiled <TP, PP>
schemes only, and with the cost model's derived CP schemes), the expected cost of the
proposed full-context candidate against the integer DP's strategy, both scored by the same
rebalanced estimate (``balanced_cost``) and by the simulated dispatch + packing of sampled
mini-batches (``selection.plan_iteration``).

    python -m hgraph.tools.bench.proposal [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from hgraph.runtime.data.lengths import read_lengths
from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.planner.interval_cost import (DEFAULT_TOKENS_PER_GPU, LengthHistogram, SchemeTable,
                                                  balanced_cost)
from hgraph.runtime.planner.proposal import fit_budget, order_pipelines, propose
from hgraph.runtime.planner.auto_candidates import auto_candidates, homogeneous_strategies
from hgraph.runtime.planner.selection import plan_iteration
from hgraph.runtime.research.integer_dp import integer_dp
from hgraph.runtime.research.simulator import sample_minibatches
from hgraph.strategy import Cluster


def _lengths_path() -> Path:
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "wikipedia_lengths.txt"


def timing(lengths, model: str, gpus: int, max_len: int, repeats: int) -> dict:
    cost = load_cost_model(model, gpus)
    propose(lengths, cost, gpus, max_len)  # warm caches
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        prop = propose(lengths, cost, gpus, max_len)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"model": model, "gpus": gpus, "max_len": max_len, "median_s": statistics.median(times),
            "min_s": min(times), "cpu_median_s": statistics.median(cpu), "candidates": [str(s) for s in prop.strategies]}


def against_homogeneous(lengths, model: str, gpus: int, max_len: int, samples: int) -> dict:
    """Sampled mini-batches planned (``plan_iteration``) with the proposal, with ``auto_candidates``
    and with the best single homogeneous strategy (each one alone, best total): total estimates."""
    cost = load_cost_model(model, gpus, max_cp=1)
    if cost.largest_max_len() < max_len:  # no <TP,PP> scheme holds the context: derived CP schemes
        cost = load_cost_model(model, gpus)
    tokens = DEFAULT_TOKENS_PER_GPU * gpus
    prop = propose(lengths, cost, gpus, max_len, tokens_per_iter=tokens)
    auto, _ = auto_candidates(lengths, cost, gpus, max_len, tokens)
    batches = sample_minibatches(lengths, tokens, samples, max_len, seed=7)

    def total(cands):
        return float(sum(plan_iteration(b, cands, cost).est_latency_ms for b in batches))
    homo = {str(h): total([h]) for h in homogeneous_strategies(cost, gpus, max_len)}
    best = min(homo, key=homo.get)
    holds = [max(cost.max_len(p) for p in c.strategy.pipelines) >= c.len_range[1] for c in prop.candidates]
    return {"model": model, "gpus": gpus, "max_cp": cost.max_cp, "proposal_ms": total(prop.strategies),
            "auto_ms": total(auto), "best_homogeneous": best, "best_homogeneous_ms": homo[best],
            "candidates": len(prop.strategies), "auto_candidates": len(auto),
            "candidates_holding_their_range": f"{sum(holds)}/{len(holds)}",
            "candidates_holding_the_context": sum(max(cost.max_len(p) for p in c.strategy.pipelines) >= max_len
                                                  for c in prop.candidates)}


def quality(lengths, model: str, gpus: int, max_len: int, samples: int, max_cp: int) -> dict:
    cost = load_cost_model(model, gpus, max_cp=max_cp)
    tokens = DEFAULT_TOKENS_PER_GPU * gpus
    prop = propose(lengths, cost, gpus, max_len, tokens_per_iter=tokens)
    t0 = time.perf_counter()
    ref = integer_dp(lengths, cost, gpus, max_len, tokens_per_iter=tokens)
    dp_s = time.perf_counter() - t0
    hist = LengthHistogram.from_lengths(lengths, max_len)
    table = SchemeTable.build(cost, hist, gpus, tokens / float(hist.sum1.sum()))
    t_int, dp_counts = ref[int(hist.upper[-1])]
    counts = np.zeros(len(table.schemes), dtype=np.int64)
    for s, d in dp_counts.items():
        counts[table.schemes.index(s)] = d
    idle = gpus - int((counts * table.gpus).sum())
    # The DP may leave GPUs unused ("up to n GPUs"); fill them the way the proposal's rounding does.
    need = np.where(counts > 0, table.work.sum(axis=1), 0.0)
    filled = fit_budget(counts, need, table, gpus, counts)
    if filled is not None:
        counts = filled
    dp_strategy = order_pipelines(counts, table, Cluster(gpus, cost.gpus_per_node))
    mine = prop.candidates[-1]
    # Realistic yardstick: dispatch + pack sampled mini-batches on each strategy alone.
    batches = sample_minibatches(lengths, tokens, samples, max_len, seed=7)
    sim_mine = np.mean([plan_iteration(b, [mine.strategy], cost).est_latency_ms for b in batches])
    sim_dp = np.mean([plan_iteration(b, [dp_strategy], cost).est_latency_ms for b in batches])
    sim_set = np.mean([plan_iteration(b, prop.strategies, cost).est_latency_ms for b in batches])
    return {"model": model, "gpus": gpus, "max_len": max_len, "max_cp": max_cp, "integer_dp_s": dp_s,
            "integer_dp_strategy": str(dp_strategy), "integer_dp_idle_gpus_filled": idle, "integer_dp_t": t_int,
            "integer_dp_balanced_ms": balanced_cost(counts, table, hist.num_buckets),
            "proposed_strategy": str(mine.strategy), "proposed_balanced_ms": mine.expected_ms,
            "relaxed_ms": mine.relaxed_ms,
            "sampled_ms": {"integer_dp": float(sim_dp), "proposed": float(sim_mine), "proposed_set": float(sim_set)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default=str(_lengths_path()))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--homogeneous-samples", type=int, default=20,
                    help="mini-batches of the comparison with the best homogeneous strategy (20)")
    ap.add_argument("--skip-integer-dp", action="store_true", help="leave out the integer-DP comparison (slow)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    lengths = read_lengths(args.lengths)
    times = [timing(lengths, m, g, 32768, args.repeats) for m, g in
             (("llama-7b", 64), ("llama-13b", 64), ("llama-32b", 64), ("llama-7b", 1024), ("llama-13b", 1024),
              ("llama-32b", 1024))]
    homo = [against_homogeneous(lengths, m, 64, 32768, args.homogeneous_samples)
            for m in ("llama-7b", "llama-13b", "llama-32b")]
    qual = [] if args.skip_integer_dp else [
        quality(lengths, m, g, L, args.samples, cp) for cp in (1, 8) for m, g, L in
        (("llama-7b", 8, 16384), ("llama-7b", 16, 32768), ("llama-13b", 16, 32768), ("llama-13b", 32, 32768))]
    if args.json:
        print(json.dumps({"timing": times, "against_homogeneous": homo, "quality": qual}))
        return 0
    print("proposal time (one core), 32K context:")
    for t in times:
        print(f"  {t['model']:<10} {t['gpus']:>5} GPUs: median {t['median_s']:.3f} s wall, {t['cpu_median_s']:.3f} s CPU "
              f"(min {t['min_s']:.3f} s), {len(t['candidates'])} candidates")
    print(f"planned with plan_iteration on {args.homogeneous_samples} sampled mini-batches, 64 GPUs, 200K tokens, 32K "
          f"(total estimated ms, lower is better):")
    for h in homo:
        print(f"  {h['model']} max CP {h['max_cp']}: proposal {h['proposal_ms']:.0f} ({h['candidates']} candidates, "
              f"{h['candidates_holding_their_range']} hold their range's top, {h['candidates_holding_the_context']} "
              f"hold 32K) | auto {h['auto_ms']:.0f} ({h['auto_candidates']}) | best homogeneous {h['best_homogeneous']} "
              f"{h['best_homogeneous_ms']:.0f}: proposal/best homogeneous {h['proposal_ms'] / h['best_homogeneous_ms']:.4f}")
    print("full-context candidate vs the integer DP of Eq. 4 (lower is better):")
    for q in qual:
        s = q["sampled_ms"]
        print(f"  {q['model']} {q['gpus']} GPUs {q['max_len']} max CP {q['max_cp']}: integer DP {q['integer_dp_strategy']} "
              f"({q['integer_dp_s']:.1f} s, {q['integer_dp_idle_gpus_filled']} idle GPUs filled) "
              f"balanced {q['integer_dp_balanced_ms']:.0f} ms, sampled {s['integer_dp']:.0f} ms | proposed "
              f"{q['proposed_strategy']} balanced {q['proposed_balanced_ms']:.0f} ms, sampled {s['proposed']:.0f} ms; "
              f"whole candidate set sampled {s['proposed_set']:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
