"""``hgraph memory``: every rank's memory under a strategy, before anything runs.

Per rank (ranks with the same figures on one row): the fp32 master and Adam moment segments it owns
(1/N of the model, or 1/G with ``--shard-group G``: sharded within groups of G ranks, as ``hgraph train``
shards them), its working weights and gradients in the strategy's layout, the optimizer step's
transient, the activations of its pipeline stage for micro-batches of ``--tokens`` tokens, and the
peak against ``--device-memory`` (which ranks exceed it). The model is built on the meta device and
activations are counted on fake tensors: nothing is allocated, so ``llama:70b`` on 64 ranks prints in
seconds. The figures are the ones the planner and the runtime use.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

import hgraph
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.engine.compiled_regions import compile_wanted
from hgraph.runtime.engine.offload import rank_host_budget
from hgraph.runtime.planner.cost.memory_estimate import MemoryEstimate, estimate_memory
from hgraph.runtime.planner.cost.shard_group import parse_shard_group
from hgraph.runtime.planner.service.iteration import bounded_cost_model, model_cost_model
from hgraph.strategy import Cluster, Strategy
from hgraph.tools.cli.dump import model_args_option
from hgraph.tools.cli.common_options import (DEVICE_MEMORY_FORMS, add_device_memory, add_gpus_per_node, add_shard_group,
                                             add_world_size, shard_group_cluster, shard_group_text)
from hgraph.runtime.train.run_config import parse_bytes


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("memory", help="every rank's memory under a strategy, before anything runs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="MODEL",
                   help="llama:tiny (or tiny), llama:70b, hf:llama, FILE.py:CLASS or package.module:CLASS")
    p.add_argument("--model-args", default=None, metavar="JSON", help="config overrides / constructor kwargs")
    p.add_argument("--strategy", required=True, metavar="S", help='e.g. "1xTP2PP2+2xTP1PP1"')
    add_world_size(p, help="number of ranks (default: what the strategy uses; must equal it)")
    add_gpus_per_node(p)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="working precision (default fp32)")
    p.add_argument("--tokens", type=int, default=None, metavar="T",
                   help="tokens of one packed micro-batch (default: the model's context length)")
    add_device_memory(p, help=f"memory of one rank: {DEVICE_MEMORY_FORMS}, or auto (the limit that hgraph train "
                              "--device-memory auto sizes from the model); reports the ranks that exceed it and "
                              "each scheme's longest micro-batch")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="count the activations of a step compiled as hgraph train --compile compiles it "
                        "(auto: on when this machine has CUDA, as train's default)")
    p.add_argument("--offload", choices=("off", "on"), default="off",
                   help="on: every block's saved activations wait in host memory, as hgraph train --offload on "
                        "without a memory budget (a host column; default off)")
    p.add_argument("--host-memory-budget", default=None, metavar="BYTES",
                   help="host bytes of offloaded activations per rank (default: half this host's RAM over the "
                        "ranks of a node, as hgraph train); reports the ranks that exceed it")
    add_shard_group(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _spec(model: str) -> str:
    return model if ":" in model else f"llama:{model}"


def run(args: argparse.Namespace) -> int:
    strategy = Strategy.parse(args.strategy)
    if args.world_size is not None and args.world_size < 1:
        raise HGraphError(f"--world-size must be a positive integer, got {args.world_size}")
    if args.gpus_per_node < 1:
        raise HGraphError(f"--gpus-per-node must be a positive integer, got {args.gpus_per_node}")
    cluster = Cluster(args.world_size or strategy.num_ranks, args.gpus_per_node)
    strategy.validate(cluster)                 # rank count and node boundaries, before the model is built
    parse_shard_group(args.shard_group, cluster.world_size)       # a bad value fails before the model is built
    if args.tokens is not None and args.tokens < 1:
        raise HGraphError(f"--tokens must be a positive integer, got {args.tokens}")
    limit_arg = args.device_memory
    if limit_arg is not None and str(limit_arg).strip().lower() != "auto":
        limit_arg = parse_bytes(limit_arg, "--device-memory")
    with torch.device("meta"):
        model = resolve_model_spec(_spec(args.model), model_args_option(args.model_args))
    cluster, why = shard_group_cluster(args.shard_group, cluster.world_size, cluster.gpus_per_node,
                                       sum(p.numel() for p in model.parameters()), limit_arg)
    cfg = getattr(model, "config", None)
    tokens = args.tokens or int(getattr(cfg, "max_seq_len", 0) or getattr(cfg, "max_position_embeddings", 0) or 0)
    if not tokens:
        raise HGraphError("the model names no context length (max_seq_len): give --tokens T")
    compiled = hgraph.compile(model, dtype=args.dtype)
    compiled_step = compile_wanted(args.compile, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    cost, limit = _bounded(model, compiled, cluster, limit_arg, args.dtype, compiled_step)
    host = None
    if args.offload == "on":
        host = rank_host_budget(parse_bytes(args.host_memory_budget, "--host-memory-budget"),
                                cluster.gpus_per_node, cluster.world_size)
    estimate = estimate_memory(compiled, strategy, cluster, tokens, device_memory=limit, cost=cost,
                               compiled_step=compiled_step, offload=args.offload == "on", host_memory=host)
    if args.json:
        json.dump({"model": _spec(args.model), **estimate.to_json(), "shard_group": cluster.group_size,
                   "shard_group_auto": why or None}, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_estimate(estimate, _spec(args.model)) + shard_group_text(cluster, why) + "\n")
    return 0


def _bounded(model, compiled, cluster: Cluster, device_memory, dtype: str, compiled_step: bool = False):
    """The planner's cost model under ``device_memory`` (for MaxLen; a zoo Llama only) and the limit."""
    if device_memory is None:
        return None, None
    try:
        cost = model_cost_model("analytic", model, cluster.world_size, cluster.gpus_per_node)
    except HGraphError:
        if device_memory == "auto":
            raise HGraphError("--device-memory auto is sized from the memory model of a zoo Llama-style model; "
                              "give BYTES for this model") from None
        return None, float(device_memory)
    return bounded_cost_model(cost, model, device_memory, 2 if dtype == "bf16" else 4, compiled, compiled_step,
                              cluster.shard_group)


def size_text(n: Optional[float]) -> str:
    """``1.23 GiB``, ``456.7 MiB``, ``12.0 KiB``; ``n/a`` for None."""
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def format_estimate(e: MemoryEstimate, model: str) -> str:
    dtype = str(e.dtype).replace("torch.", "")
    lines = [f"{model} ({e.parameters / 1e6:,.1f} M parameters), {e.strategy} on {e.cluster.world_size} ranks "
             f"({e.cluster.gpus_per_node} per node), {dtype} working weights, micro-batches of {e.tokens} tokens"]
    head = ("ranks", "scheme", "stage", "masters", "moments", "weights", "grads", "activations", "step", "peak")
    head += ("host",) if e.offload else ()
    rows = []
    for ranks, r in e.groups():
        s = r.states
        rows.append((ranks_text(ranks) + (f" (x{len(ranks)})" if len(ranks) > 1 else ""), str(r.scheme),
                     str(r.stage), *(size_text(v) for v in (s.masters, s.moments, s.working_params,
                                                              s.working_grads, r.activations,
                                                              s.step_transient, r.peak)))
                    + ((size_text(r.host_activations),) if e.offload else ()))
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    lines.append("peak = masters + moments + weights + grads + max(activations, step: the optimizer step's "
                 "gradient segments and denominator); communication buffers and the process come on top")
    if e.offload:
        over = e.host_exceeding()
        lines.append("offload on: every block's stash in host memory (host); activations = the rest of the stage "
                     "and the two layers a backward brings back"
                     + (f"; host budget {size_text(e.host_memory)} per rank: "
                        + (f"rank(s) {ranks_text(over)} exceed it" if over else "every rank fits")
                        if e.host_memory is not None else ""))
    if e.activations_from is None:
        lines.append("activations: not known for this model (the runtime's memory model covers zoo Llama models)")
    if e.device_memory is not None:
        over = e.exceeding()
        if over:
            worst = max(r.peak for r in e.ranks)
            lines.append(f"device memory {size_text(e.device_memory)} per rank: rank(s) {ranks_text(over)} exceed it "
                         f"(largest peak {size_text(worst)})")
        else:
            lines.append(f"device memory {size_text(e.device_memory)} per rank: every rank fits")
        if e.max_len:
            lines.append("MaxLen under it: " + ", ".join(f"{s} <= {n} tokens" for s, n in e.max_len.items()))
    return "\n".join(lines) + "\n"
