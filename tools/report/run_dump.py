"""``hgraph dump --run-dir RUN_DIR``: the programs of every strategy a training run actually used.

The model, its arguments, the world size, GPUs per node and dtype come from the run's ``run.json``
(written by ``hgraph train``); the strategies, in the order first used, with their steps, from its
``metrics.jsonl``. Without ``-o`` text, python and json go to stdout (json: one object for all
strategies); with ``-o DIR`` one file per strategy, ``DIR/<strategy>.<ext>``. svg, html and dot need
``-o`` when the run used more than one strategy (one document per file).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import hgraph
from hgraph.errors import HGraphError
from hgraph.runtime.data.jsonl import jsonl_values
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.planner.cost.shard_group import resolve_shard_group
from hgraph.strategy import Cluster, Strategy
from hgraph.runtime.train.run_record import read_run_record
from hgraph.tools.report.dump import render_program

EXTENSIONS = {"text": "txt", "python": "py", "dot": "dot", "svg": "svg", "html": "html", "json": "json"}


def strategies_used(metrics_path: Path) -> dict[str, list[int]]:
    """``{strategy: [steps]}`` in the order first used (HGraphError naming the file when unusable)."""
    used: dict[str, list[int]] = {}
    if not metrics_path.exists():
        raise HGraphError(f"{metrics_path} does not exist: the run wrote no metrics")
    for where, record in jsonl_values(metrics_path, expect="each line must be one step's JSON object"):
        try:
            used.setdefault(str(record["strategy"]), []).append(int(record["step"]))
        except (KeyError, TypeError, ValueError):
            raise HGraphError(f"{where}: not a metrics line with 'strategy' and 'step'") from None
    if not used:
        raise HGraphError(f"{metrics_path} has no steps")
    return used


def dump_run(args: argparse.Namespace) -> int:

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise HGraphError(f"--run-dir {run_dir}: no such directory")
    record = read_run_record(run_dir)
    used = strategies_used(run_dir / "metrics.jsonl")
    if args.output is None and args.format in ("svg", "html", "dot") and len(used) > 1:
        raise HGraphError(f"--format {args.format} with {len(used)} strategies needs -o DIR (one file per strategy)")
    spec = record["model"] if ":" in record["model"] else f"llama:{record['model']}"
    world, per_node = int(record["world_size"]), int(record.get("gpus_per_node") or 8)
    with torch.device("meta"):
        model = resolve_model_spec(spec, record.get("model_args") or {})
    compiled = hgraph.compile(model, dtype=args.dtype if args.dtype != "fp32" else record.get("dtype", "fp32"))
    # the run's world with the optimizer shard group given (--shard-group; run.json does not keep it)
    g, _ = resolve_shard_group(getattr(args, "shard_group", None), world, per_node,
                               sum(p.numel() for p in model.parameters()), None)
    cluster = Cluster(world, per_node, shard_group=g if g < world else None)
    texts = {}
    for text in used:
        strategy = Strategy.parse(text)
        texts[text] = compiled.dump(strategy, cluster=cluster, rank=args.rank, format=args.format, model=spec,
                                    renderer=render_program)
    if args.output is not None:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        for text, body in texts.items():
            path = out / f"{text}.{EXTENSIONS[args.format]}"
            path.write_text(body, encoding="utf-8")
            print(f"wrote {args.format} dump of {text} (steps {_steps(used[text])}) to {path}", file=sys.stderr)
        return 0
    if args.format == "json":
        print(json.dumps({"run_dir": str(run_dir), "model": spec, "world_size": world,
                          "strategies": [{"strategy": t, "steps": used[t], "dump": json.loads(b)}
                                         for t, b in texts.items()]}))
        return 0
    comment = "#" if args.format in ("text", "python") else "//"
    for text, body in texts.items():
        sys.stdout.write(f"{comment} ==== {text}: {len(used[text])} steps ({_steps(used[text])}) of run "
                         f"{run_dir}, {spec} on {world} ranks\n")
        sys.stdout.write(body if body.endswith("\n") else body + "\n")
    return 0


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
