"""``hgraph dump``: the instantiated per-rank programs of a model and strategy, in several formats."""
from __future__ import annotations

import argparse
import json
import sys

import torch

import hgraph
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.planner.cost.shard_group import parse_shard_group
from hgraph.strategy import Cluster, Strategy
from hgraph.tools.cli.common_options import add_gpus_per_node, add_shard_group, add_world_size, shard_group_cluster
from hgraph.tools.report.dump import FORMATS, render_program
from hgraph.tools.report.run_dump import dump_run


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("dump", help="dump the instantiated per-rank programs of a model for a strategy",
                       description="Trace MODEL, instantiate STRATEGY and print the programs. MODEL is a zoo "
                                   "name (llama:tiny), FILE.py:CLASS or package.module:CLASS. The model is "
                                   "built on the meta device: no weights are allocated.")
    p.add_argument("model", nargs="?", default=None, help="llama:tiny | FILE.py:CLASS | package.module:CLASS")
    p.add_argument("--model-args", default=None, help="JSON object of config overrides / constructor kwargs")
    p.add_argument("--strategy", default=None, help='e.g. "1xTP2PP2+2xTP1PP1"')
    p.add_argument("--run-dir", default=None, metavar="RUN_DIR",
                   help="dump every strategy a training run used (model and world size from its run.json, "
                        "strategies from its metrics.jsonl); -o names a folder, one file per strategy")
    add_world_size(p, help="number of ranks (default: what the strategy uses)")
    add_gpus_per_node(p)
    add_shard_group(p)
    p.add_argument("--rank", type=int, default=None, help="only this rank (default: all)")
    p.add_argument("--format", choices=FORMATS + ("report",), default="text",
                   help="report: which parameters TP shards under the strategy and why the others are whole")
    p.add_argument("--dtype", default="fp32", help="working precision of the propagation phase (fp32|bf16)")
    p.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: the json format (every subcommand's --json; --format json is the same)")
    return p


def model_args_option(text):
    """``--model-args JSON`` -> dict (``{}`` when not given); not a JSON object: one-line error."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HGraphError(f"--model-args is not valid JSON ({exc.msg} at column {exc.colno}); "
                          "expected an object like '{\"num_layers\": 8}'") from None
    if not isinstance(value, dict):
        raise HGraphError("--model-args must be a JSON object like '{\"num_layers\": 8}'")
    return value


def run(args: argparse.Namespace) -> int:
    if args.json:
        if args.format not in ("text", "json"):
            raise HGraphError(f"--json prints the json format; it excludes --format {args.format}")
        args.format = "json"
    if args.run_dir is not None:
        if args.model is not None or args.strategy is not None:
            raise HGraphError("--run-dir takes the model and strategies from the run: give no MODEL or --strategy")
        return dump_run(args)
    if args.model is None or args.strategy is None:
        raise HGraphError("give MODEL and --strategy, or --run-dir RUN_DIR")

    strategy = Strategy.parse(args.strategy)
    cluster = Cluster(args.world_size or strategy.num_ranks, args.gpus_per_node)
    parse_shard_group(args.shard_group, cluster.world_size)       # a bad value fails before the model is built
    with torch.device("meta"):
        model = resolve_model_spec(args.model, model_args_option(args.model_args))
    # the Pull / Push plans of the optimizer's shard groups (auto: without a memory budget, a node)
    cluster, _ = shard_group_cluster(args.shard_group, cluster.world_size, cluster.gpus_per_node,
                                     sum(p.numel() for p in model.parameters()))
    compiled = hgraph.compile(model, dtype=args.dtype)
    if args.format == "report":
        text = compiled.sharding_report(strategy).text()
    else:
        text = compiled.dump(strategy, cluster=cluster, rank=args.rank, format=args.format, model=args.model,
                             renderer=render_program)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.format} dump of {strategy} ({cluster.world_size} ranks) to {args.output}",
              file=sys.stderr)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0
