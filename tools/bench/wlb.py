"""WLB-LLM packing: imbalance degree, packing time and delay (WLB-LLM Table 2 on real lengths).

Global batches of ``N x 128K`` tokens of the Wikipedia lengths in file order (documents truncated to
the 128K context), micro-batch latency from the LLaMA-7B profile's TP8PP2CP2 scheme (the cost model's
closest to WLB's 7B-128K <TP8, CP2, PP4> setting). Rows: the original packing (documents in order,
a micro-batch closed when the next document would pass 128K), fixed-length greedy and CP-SAT solver
(one global batch window; the solver runs on the first ``--solver-batches`` only, next to the greedy
on the same batches), and WLB-LLM with 1-3 outlier queues, with micro-batches limited to the
context (128K) and to the scheme's memory limit (WLB's L_max).

    python -m hgraph.tools.bench.wlb [--batches 200] [--micro-batches 4] [--shape pareto] [--json]

``--shape`` replaces the Wikipedia lengths by a seeded synthetic long tail the packer has not been
tuned on: ``pareto`` (``l = 256 * (1 + X)``, ``X`` Pareto with index 1.1: a power-law tail, 0.5% of
documents past 32K, 0.1% at the 128K context) or ``lognormal`` (median 1024, sigma 1.6: a heavier
body, 1.5% past 32K).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from hgraph.runtime.data.lengths import minibatches, read_lengths
from hgraph.runtime.data.wlb_packing import DocLatency, WLBPacker, imbalance_degree
from hgraph.runtime.planner.cost.cost_model import load_cost_model
from hgraph.runtime.research.fixed_length import FixedLengthPacker
from hgraph.runtime.research.simulator import fixed_length_pack
from hgraph.strategy import Scheme

CONTEXT = 131072


def _lengths_path() -> Path:
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "wikipedia_lengths.txt"


def synthetic_lengths(shape: str, seed: int, size: int = 400_000) -> np.ndarray:
    """Seeded long-tailed document lengths (module docstring), at least 1 token each."""
    rng = np.random.default_rng(seed)
    if shape == "pareto":
        x = 256 * (1 + rng.pareto(1.1, size=size))
    elif shape == "lognormal":
        x = rng.lognormal(np.log(1024), 1.6, size=size)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return np.maximum(x.astype(np.int64), 1)


def wlb_default(lengths: np.ndarray, batches: int, n: int = 4) -> dict:
    """The headline WLB row (the packer's default two outlier queues, at L/2 and 3L/4 of the 128K
    context, micro-batches up to the memory limit) on the first ``batches`` global batches of
    ``n x 128K`` tokens of ``lengths`` (truncated to 128K)."""
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), CONTEXT)
    scheme = Scheme(8, 2, 2)
    cost = load_cost_model("llama-7b", 64)
    lat = DocLatency.from_cost_model(cost, scheme)
    upto = int(np.searchsorted(np.cumsum(lengths), batches * n * CONTEXT * 2)) + 1
    picked = minibatches(lengths[:upto], n * CONTEXT)[:batches]
    return run_packer(WLBPacker(lat, n, CONTEXT, capacity=cost.max_len(scheme)),
                      picked, lengths)


def original_imbalance(lengths: np.ndarray, lat: DocLatency, n: int) -> float:
    mbs = fixed_length_pack(lengths, CONTEXT)
    return imbalance_degree([lat.microbatch(m) for m in mbs[:n]] + [0.0] * max(0, n - len(mbs)))


def run_packer(packer, batches, lengths) -> dict:
    imb, ms = [], []
    for ids in batches:
        b = packer.push(lengths[ids], ids)
        imb.append(b.imbalance)
        ms.append(b.pack_ms)
    tail = packer.flush()
    return {"imbalance": float(np.mean(imb)), "pack_ms_mean": float(np.mean(ms)),
            "pack_ms_median": float(statistics.median(ms)), "pack_ms_p95": float(np.percentile(ms, 95)),
            "mean_delay_iters": packer.stats.mean_delay(), "token_weighted_delay_iters": packer.stats.token_weighted_delay(),
            "delayed_docs_pct": 100 * packer.stats.delayed_fraction(), "flush_batches": len(tail)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default=str(_lengths_path()))
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--solver-batches", type=int, default=10, help="batches for the (slow) CP-SAT row")
    ap.add_argument("--solver-time-limit", type=float, default=2.0)
    ap.add_argument("--shape", choices=("wikipedia", "pareto", "lognormal"), default="wikipedia",
                    help="lengths: the Wikipedia file (--lengths) or a seeded synthetic long tail")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic lengths")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    n = args.micro_batches
    if args.batches < 1 or n < 1:
        ap.error("--batches and --micro-batches must be positive")
    lengths = np.minimum(synthetic_lengths(args.shape, args.seed) if args.shape != "wikipedia"
                         else read_lengths(args.lengths), CONTEXT)
    scheme = Scheme(8, 2, 2)
    cost = load_cost_model("llama-7b", 64)
    lat = DocLatency.from_cost_model(cost, scheme)
    memory = cost.max_len(scheme)
    need = args.batches * n * CONTEXT * 2
    upto = int(np.searchsorted(np.cumsum(lengths), need)) + 1
    batches = minibatches(lengths[:upto], n * CONTEXT)[: args.batches]
    rows = {"original": {"imbalance": float(np.mean([original_imbalance(lengths[b], lat, n) for b in batches])),
                         "pack_ms_mean": 0.0, "mean_delay_iters": 0.0}}
    rows["fixed-greedy"] = run_packer(FixedLengthPacker(lat, n, CONTEXT), batches, lengths)
    rows["fixed-greedy (solver batches)"] = run_packer(FixedLengthPacker(lat, n, CONTEXT),
                                                       batches[: args.solver_batches], lengths)
    rows["fixed-solver"] = run_packer(FixedLengthPacker(lat, n, CONTEXT, method="solver",
                                                        time_limit_s=args.solver_time_limit),
                                      batches[: args.solver_batches], lengths)
    for q in (1, 2, 3):
        rows[f"wlb q={q} cap=context"] = run_packer(WLBPacker(lat, n, CONTEXT, num_queues=q), batches, lengths)
        rows[f"wlb q={q} cap=memory"] = run_packer(WLBPacker(lat, n, CONTEXT, capacity=memory, num_queues=q),
                                                   batches, lengths)
    if args.json:
        print(json.dumps({"context": CONTEXT, "micro_batches": n, "scheme": str(scheme), "memory_limit": memory,
                          "batches": len(batches), "rows": rows}))
        return 0
    print(f"{len(batches)} global batches of {n} x {CONTEXT} tokens, latency of llama-7b {scheme} "
          f"(memory limit {memory} tokens per micro-batch)")
    print(f"  {'method':<30} {'imbalance':>9} {'pack ms':>8} {'p95 ms':>7} {'delay':>6} {'tok-delay':>9} {'delayed%':>8}")
    for name, r in rows.items():
        print(f"  {name:<30} {r['imbalance']:>9.3f} {r['pack_ms_mean']:>8.2f} {r.get('pack_ms_p95', 0.0):>7.2f} "
              f"{r['mean_delay_iters']:>6.3f} {r.get('token_weighted_delay_iters', 0.0):>9.3f} "
              f"{r.get('delayed_docs_pct', 0.0):>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
