"""``hgraph report RUN_DIR``: the plots and summary of a training run, from its ``metrics.jsonl``.

Writes ``strategy_latency``, ``est_vs_measured``, ``rank_busy``, ``loss`` and ``overheads`` as PNG
and SVG into the run folder (``--out`` elsewhere; figures whose fields the run did not record are
skipped and named), then prints the run's summary: steps, strategies used and how often, step time,
mean balance, share of steps whose estimate was within 10% of the measured time, planner wait.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from hgraph.tools.report.plots import metrics_path, read_metrics, summarize, write_plots


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="plots and summary of a training run (from metrics.jsonl)",
                              description=__doc__)
    p.add_argument("run_dir", metavar="RUN_DIR", help="run folder holding metrics.jsonl (or the .jsonl file)")
    p.add_argument("--out", default=None, metavar="DIR", help="folder for the plots (default: RUN_DIR)")
    p.add_argument("--formats", default="png,svg", metavar="png,svg", help="image formats (default png,svg)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _fmt_opt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def run(args: argparse.Namespace) -> int:

    path = metrics_path(args.run_dir)
    records = read_metrics(path)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    out_dir = Path(args.out) if args.out else path.parent
    result = write_plots(records, out_dir, formats)
    summary = summarize(records)
    if args.json:
        print(json.dumps({"metrics": str(path), "plots": [str(p) for p in result.files],
                          "skipped": result.skipped, "summary": summary.as_dict()}))
        return 0
    print(f"{summary.steps} steps from {path}: {summary.steps_per_s:.2f} steps/s, "
          f"{summary.tokens_per_s:.0f} tokens/s, mean step {1e3 * summary.mean_step_s:.1f} ms")
    used = ", ".join(f"{s} x{n}" for s, n in summary.strategies.items())
    print(f"strategies ({summary.distinct_strategies}): {used}")
    print(f"loss {_fmt_opt(summary.first_loss, '.4f')} -> {_fmt_opt(summary.last_loss, '.4f')}; "
          f"mean balance {_fmt_opt(summary.mean_balance, '.3f')}; estimate within 10%: "
          f"{_fmt_opt(None if summary.est_within_10pct is None else 100 * summary.est_within_10pct, '.0f', '%')}; "
          f"planner wait {_fmt_opt(summary.planner_wait_s, '.3f', ' s')}; graph cache hits "
          f"{_fmt_opt(None if summary.cache_hit_rate is None else 100 * summary.cache_hit_rate, '.0f', '%')}"
          + (f"; {summary.skipped_steps} steps skipped (non-finite loss)" if summary.skipped_steps else "")
          + (f"; builds {summary.build_s:.2f} s ({summary.built_ahead} ahead)" if summary.build_s is not None else ""))
    for p in result.files:
        print(f"wrote {p}")
    for name, reason in result.skipped.items():
        print(f"skipped {name}: {reason}")
    return 0
