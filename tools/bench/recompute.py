"""Dynamic recomputation (DCP-intra) on the ``tiny`` model on CPU: step time and peak activation bytes.

The same mini-batches (built-in long-tail documents, ``--tokens-per-iter`` tokens each) are trained
with ``--strategy`` under several activation budgets per rank: none (no recomputation), fractions of
the peak measured without recomputation (the executor then recomputes as few blocks as fit, per
micro-batch), and 1 byte (every block recomputed). Per budget: median step time over the steps after
the first (the first step of a program always recomputes everything: nothing is measured yet),
measured peak of live activation bytes (the runtime's saved-tensor accounting, max over ranks and
steps), the memory model's prediction for the same steps, and the mean number of recomputed blocks
per micro-batch. The losses of every budget are checked to be bitwise equal.

CPU timings on a shared machine are noisy: compare the columns of one run, not across runs.

    python -m hgraph.tools.bench.recompute [--strategy 1xTP1PP1] [--steps 8] [--tokens-per-iter 1024] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.trainer import Trainer
from hgraph.runtime.train.config import TrainConfig
from hgraph.strategy import Strategy

SEED = 7


def _run(rank: int, world: int, strategy: str, steps: int, tokens: int, budgets: list) -> list[dict]:

    torch.set_num_threads(1)
    groups = GroupCache(rank, world) if world > 1 else None
    docs = synthetic_documents(max(64, steps * tokens // 20), 512, min(1024, tokens), SEED)
    batches = list(mini_batches([Document(i, tuple(d)) for i, d in enumerate(docs)], tokens, steps))
    out = []
    for budget in budgets:
        cfg = TrainConfig.from_values(model="tiny", world_size=world, strategy_schedule=strategy, steps=steps,
                                      tokens_per_iter=tokens, docs=docs, memory_budget=budget, track_memory=True)
        trainer = Trainer(cfg, rank, world, groups)
        res = [trainer.step(b) for b in batches]
        out.append({"budget": budget, "times": [r.time_s for r in res], "losses": [r.loss for r in res],
                    "peaks": [r.peak_mem_bytes for r in res], "predicted": [r.predicted_mem_bytes for r in res],
                    "recompute": [r.recompute_layers for r in res]})
    return out


def _measure(world: int, strategy: str, steps: int, tokens: int, budgets: list) -> list[list[dict]]:
    if world == 1:
        return [_run(0, 1, strategy, steps, tokens, budgets)]
    return spawn(_run, world, args=(strategy, steps, tokens, budgets), timeout_s=900)


def summarise(per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    for k in range(len(per_rank[0])):
        runs = [r[k] for r in per_rank]
        later = range(1, len(runs[0]["times"]))
        times = [max(r["times"][s] for r in runs) for s in later]
        peaks = [max(r["peaks"][s] for r in runs) for s in later]
        preds = [max(r["predicted"][s] for r in runs) for s in later if all(r["predicted"][s] is not None for r in runs)]
        layers = [n for r in runs for s in later for n in r["recompute"][s]]
        rows.append({"budget": runs[0]["budget"], "median_step_ms": 1e3 * statistics.median(times),
                     "peak_bytes": max(peaks), "predicted_bytes": max(preds) if preds else None,
                     "mean_recomputed_blocks": statistics.mean(layers) if layers else 0.0,
                     "losses": runs[0]["losses"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.recompute", description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="1xTP1PP1")
    p.add_argument("--world-size", type=int, default=None, help="default: the strategy's ranks")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens-per-iter", type=int, default=1024)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.75, 0.5],
                   help="budgets as fractions of the peak measured without recomputation")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        world = args.world_size or Strategy.parse(args.strategy).num_ranks
        if args.steps < 2 or args.tokens_per_iter < 2 or any(not 0 < f < 1 for f in args.fractions):
            raise HGraphError("--steps >= 2, --tokens-per-iter >= 2 and fractions in (0, 1) please")
        base = summarise(_measure(world, args.strategy, args.steps, args.tokens_per_iter, [None]))[0]
        budgets = [round(f * base["peak_bytes"]) for f in args.fractions] + [1]
        rows = [base] + summarise(_measure(world, args.strategy, args.steps, args.tokens_per_iter, budgets))
    except HGraphError as exc:
        print(f"bench_recompute: error: {exc}", file=sys.stderr)
        return 2
    same = all(r["losses"] == base["losses"] for r in rows)
    out = {"strategy": args.strategy, "world_size": world, "tokens_per_iter": args.tokens_per_iter,
           "steps": args.steps, "bitwise_equal_losses": same,
           "rows": [{k: v for k, v in r.items() if k != "losses"} for r in rows]}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"tiny, {args.strategy} on {world} CPU process(es), {args.tokens_per_iter} tokens/step, "
          f"median of steps 1..{args.steps - 1} (noisy shared CPU)")
    print(f"{'budget (B)':>12} {'step ms':>9} {'peak act. B':>12} {'predicted B':>12} {'blocks recomp.':>15}")
    for r in out["rows"]:
        budget = "none" if r["budget"] is None else str(r["budget"])
        pred = "-" if r["predicted_bytes"] is None else f"{r['predicted_bytes']:.0f}"
        print(f"{budget:>12} {r['median_step_ms']:>9.1f} {r['peak_bytes']:>12} {pred:>12} {r['mean_recomputed_blocks']:>15.2f}")
    print(f"losses bitwise equal across budgets: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
