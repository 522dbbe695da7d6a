"""Compile at cluster scale: what one rank's Program costs, and what that rank exchanges.

    python -m hgraph.tools.bench.cluster_scale [--quick] [--models 70b,32b] [--worlds 64,1024,12288]
                                              [--shard-groups 8,64,world] [--gpus-per-node 8] [--rank R]
                                              [--dtype D] [--json]

For each zoo Llama (built on the meta device), world size and strategy (a homogeneous one and a
heterogeneous one, derived from the largest TP degree the model's heads allow within a node), one
process per row compiles the model (working dtype ``--dtype``, bf16 by default), then builds one
rank's Program: ``build_program(S, cluster)``, ``program.rank(r)`` (its LNK ops, bindings) and
``program.rank(r).graph_module``. It prints the CPU time of the plans and of the graph, the memory
that build added to the process (peak RSS over the RSS before it, sampled), the CPU time of the
rank's runtime state that needs no process group (``runtime s``: its Pull/Push bookkeeping over meta
tensors, as ``ParamSync`` builds it, and its list of process groups), the process groups the rank
creates (``groups created``: each an NCCL communicator; ``new_group calls``: pads included, one per
creation round, ``runtime/comm/process_groups``; ``groups ms``: the CPU time of that list), and per
step what the
rank exchanges at each shard group G of the optimizer states (``--shard-group``; G = world is one copy
sharded over all ranks): Pull and Push peers and bytes (point-to-point sent and received, and its
reduce-scatters' input; with G < world the Push adds the all-reduce of its fp32 shards among its
``replicas``, one per group, counted as a ring moves it), and the process groups it belongs to (its
TP / CP / Ulysses groups, the replica groups of its reduce-scatters and, with G < world, its shard
group and its replicas; the PP neighbours are point-to-point). ``shard_fanout`` adds the message
counts of the same exchanges.

``--counts`` prints instead the other costs that grow with the cluster: the plan broadcast, the data
index and the checkpoint manifest (``scale_counts``).

``--quick`` runs the zoo's tiny Llama at 16 and 64 GPUs (a smoke test); ``--in-process`` measures
every row in this process instead of one child each (faster, memory figures less clean). Columns
are declared once (``COLUMNS``); a measurement that fills another key only needs a column for it.

Goal (issue "cluster scale"): 70B, one rank's Program <= 3 s CPU at 1,024 GPUs and <= 5 s at 12,288,
<= 300 MB added.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

import hgraph
from hgraph import dims
from hgraph.compiled import COMPILER_MODULES
from hgraph.errors import HGraphError, StrategyError
from hgraph.frontends.zoo import llama
from hgraph.runtime.comm.pull import PullParameter
from hgraph.runtime.comm.push import PushGradient
from hgraph.runtime.comm.rank_params import RankParams, SyncStats
from hgraph.runtime.engine.executor import program_rounds
from hgraph.runtime.engine.model_states import optimizer_elements
from hgraph.runtime.process.lifetime import die_with_parent
from hgraph.shard_rule import ShardLayout, group_shard_bounds, replica_ranks, shard_group_ranks
from hgraph.strategy import Cluster, Scheme
from hgraph.tools.bench import scale_counts

#: (key, header, format) of the table, in order; a measurement is a dict holding these keys.
COLUMNS: list[tuple[str, str, str]] = [
    ("model", "model", "{}"),
    ("gpus", "GPUs", "{:,}"),
    ("kind", "strategy", "{}"),
    ("rank", "rank", "{}"),
    ("shard_group", "G", "{}"),
    ("plans_s", "plans s", "{:.2f}"),
    ("graph_s", "graph s", "{:.2f}"),
    ("cpu_s", "total s", "{:.2f}"),
    ("added_mb", "added MB", "{:,.0f}"),
    ("runtime_s", "runtime s", "{:.2f}"),
    ("rank_groups", "groups created", "{:,}"),
    ("group_calls", "new_group calls", "{:,}"),
    ("groups_ms", "groups ms", "{:.1f}"),
    ("pull_peers", "Pull peers", "{:,}"),
    ("pull_mb", "Pull MB", "{:,.1f}"),
    ("push_peers", "Push peers", "{:,}"),
    ("push_mb", "Push MB", "{:,.1f}"),
    ("replicas", "replicas", "{:,}"),
    ("groups", "groups", "{}"),
]

QUICK = dict(models=["tiny"], worlds=[16, 64])


@dataclass
class Case:
    model: str
    world: int
    kind: str           # "homogeneous" / "heterogeneous"
    strategy: str
    shard_group: Optional[int] = None     # None: the world


def largest_tp(compiled: Any, gpus_per_node: int) -> int:
    """The largest power-of-two TP degree within a node that the model's heads and hidden size allow."""
    tp = 1
    while tp * 2 <= gpus_per_node:
        try:
            compiled.param_shards(Scheme(tp * 2, 1))
        except StrategyError:
            break
        tp *= 2
    return tp


def strategies(tp: int, world: int) -> list[tuple[str, str]]:
    """A homogeneous strategy (TP ``tp``, one stage) and a heterogeneous one (half the ranks at TP
    ``tp`` in two stages, a quarter at ``tp/2`` in two, a quarter at ``tp/4`` in one), largest
    pipelines first so every TP group stays in a node; ``[]`` entries a world cannot hold are left out."""
    out = []
    if world % tp == 0:
        out.append(("homogeneous", f"{world // tp}xTP{tp}PP1"))
    t2, t4 = max(1, tp // 2), max(1, tp // 4)
    if world % 4 == 0 and (world // 2) % (2 * tp) == 0 and (world // 4) % (2 * t2) == 0 and (world // 4) % t4 == 0:
        out.append(("heterogeneous", f"{world // 2 // (2 * tp)}xTP{tp}PP2+{world // 4 // (2 * t2)}xTP{t2}PP2+"
                                     f"{world // 4 // t4}xTP{t4}PP1"))
    return out


class PeakRSS:
    """The largest resident set size seen while running, sampled every few milliseconds (bytes)."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:                       # no procfs: the high-water mark (kilobytes on Linux)
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self._stop.wait(self.every_s)

    def __enter__(self) -> "PeakRSS":
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def exchanges(rp: Any) -> dict:
    """What rank ``rp`` moves per step in its Pull and Push (every parameter's ops, owners' included),
    and the process groups it belongs to."""
    out = {}
    for kind, by_param in (("pull", rp.pull_by_param), ("push", rp.push_by_param)):
        peers, nbytes = set(), 0
        for ops in by_param.values():
            for op in ops:
                group = getattr(op, "group", None)
                if group is not None:                     # a reduce-scatter: its input, once per member
                    peers.update(group)
                    nbytes += op.bytes
                elif hasattr(op, "src"):
                    peers.update((op.src, op.dst))
                    nbytes += op.bytes
        peers.discard(rp.rank)
        out[f"{kind}_peers"], out[f"{kind}_mb"] = len(peers), nbytes / 2**20
    out["groups"] = len(rank_groups(rp))
    return out


def rank_groups(rp: Any) -> set[tuple[int, ...]]:
    """The process groups rank ``rp`` belongs to: its TP, CP and Ulysses groups (bindings) and the
    replica groups of its reduce-scatters."""
    groups = {tuple(g) for d in dims.GROUPED for g in [rp.bindings.get(d.key, ())] if len(g) > 1}
    groups.update(op.group for ops in rp.push_by_param.values() for op in ops
                  if len(getattr(op, "group", ())) > 1)
    return groups


class _NoGroups:
    """Stands for the ``GroupCache`` where no process group exists: building the state asks for none."""

    def get(self, ranks: Any) -> None:
        return None


def meta_rank_state(program: Any, rank: int, dtype: torch.dtype,
                    all_to_all: bool = False) -> tuple[RankParams, PullParameter, PushGradient]:
    """Rank ``rank``'s Pull and Push bookkeeping of ``program`` as the executor builds it before any
    collective (``RankParams``, ``PullParameter``, ``PushGradient``), over meta tensors: its fp32
    master shards (the optimizer layout, ``ShardLayout``) and its working shards in ``dtype``."""
    rp = program.rank(rank)
    masters = {}
    for name in program.param_names:
        layout = program.param_layout(name)
        lo, hi = group_shard_bounds(layout.size, rank, program.cluster.group_size)
        shard = ShardLayout(name, layout.shape, layout.shard_dim if layout.shape else 0, lo, hi)
        masters[name] = torch.empty(shard.shard_shape, device="meta")
    working = {n: torch.empty(s.shard_shape, dtype=dtype, device="meta") for n, s in rp.params.items()}
    params = RankParams(program, rank, masters, working, rp.params, dtype, frozenset())
    stats = SyncStats()
    pull = PullParameter(params, stats, all_to_all=all_to_all)
    push = PushGradient(params, stats, _NoGroups(), torch.device("meta"))
    return params, pull, push


def runtime_setup(program: Any, rank: int, dtype: torch.dtype) -> dict:
    """Build what rank ``rank``'s runtime makes of ``program`` before any collective: its Pull and Push
    bookkeeping (``meta_rank_state``) and the process groups it creates (``rank_group_rounds``);
    returns the CPU seconds of both together, and the groups' figures."""
    t0 = time.process_time()
    meta_rank_state(program, rank, dtype)
    groups = rank_group_rounds(program, rank)
    return {"runtime_s": time.process_time() - t0, **groups}


def rank_group_rounds(program: Any, rank: int) -> dict:
    """The process groups rank ``rank`` creates for ``program`` (the executor's ``program_rounds``: one
    ``new_group`` per round, its own part, or a single-rank pad where its part is itself or a group it
    already holds; each group of more than one rank and fewer than the world an NCCL communicator of
    its own), its ``new_group`` calls (a round whose one part is the world makes none), and the CPU
    milliseconds of computing that list."""
    t0 = time.process_time()
    rounds = program_rounds(program, rank)
    ms = (time.process_time() - t0) * 1e3
    world = program.cluster.world_size
    created = {r.part for r in rounds if 1 < len(r.part) < world}
    return {"rank_groups": len(created), "group_calls": sum(len(r.part) < world for r in rounds), "groups_ms": ms}


def across_groups(compiled: Any, rank: int, cluster: Cluster) -> dict:
    """What the Push adds when the optimizer shards inside groups of G < world ranks: the all-reduce of
    the rank's fp32 shards among its replicas (a ring moves ``2 (R-1)/R`` of them), and its groups."""
    size, world = cluster.group_size, cluster.world_size
    replicas = replica_ranks(rank, size, world)
    dims = {n: (tuple(int(d) for d in p.shape), p.shard_dim if p.shape else 0) for n, p in compiled.hgraph.params.items()}
    shard_bytes = 4 * optimizer_elements(dims, rank, world, size)       # fp32 shards
    ring = 2 * (len(replicas) - 1) * shard_bytes // len(replicas)
    return {"replicas": len(replicas), "ring_mb": ring / 2**20,
            "groups": {g for g in (shard_group_ranks(rank, size), replicas) if len(g) > 1}}


def measure(model: str, world: int, strategy: str, rank: int, gpus_per_node: int, dtype: str = "bfloat16",
            shard_group: Optional[int] = None) -> dict:
    """One row, in this process: compile ``model`` on meta (working ``dtype``), then time and size rank
    ``rank``'s Program with the optimizer states sharded over groups of ``shard_group`` ranks (None:
    the world)."""
    for name in COMPILER_MODULES:        # imported once per process, not per strategy: not counted
        importlib.import_module(name)
    with torch.device("meta"):
        compiled = hgraph.compile(llama.build(model), dtype=getattr(torch, dtype))
    compiled.symbolic_shapes()            # once per model, before any strategy
    with PeakRSS() as rss:
        before = PeakRSS.now()
        t0 = time.process_time()
        cluster = Cluster(world, gpus_per_node, shard_group=shard_group)
        program = compiled.build_program(strategy, cluster)
        rp = program.rank(rank)
        rp.pull_by_param                  # its LNK ops are planned on first use
        t1 = time.process_time()
        rp.graph_module
        t2 = time.process_time()
    row = {"model": model, "gpus": world, "strategy": strategy, "rank": rank,
           "shard_group": "world" if cluster.shard_group is None else cluster.shard_group, "plans_s": t1 - t0,
           "graph_s": t2 - t1, "cpu_s": t2 - t0, "added_mb": max(0, rss.peak - before) / 2**20,
           **runtime_setup(program, rank, getattr(torch, dtype)), **exchanges(rp)}
    if cluster.shard_group is not None:
        extra = across_groups(compiled, rank, cluster)
        row["push_mb"] += extra["ring_mb"]
        row["replicas"] = extra["replicas"]
        row["groups"] = len(rank_groups(rp) | extra["groups"])
    return row


def run_isolated(case: Case, rank: int, gpus_per_node: int, dtype: str, timeout_s: float) -> dict:
    """``measure`` in a child process of its own (its memory is its own; it dies with this one)."""
    argv = [sys.executable, "-m", "hgraph.tools.bench.cluster_scale", "--measure", case.model, str(case.world),
            case.strategy, str(rank), str(gpus_per_node), dtype, str(case.shard_group or 0), str(os.getpid())]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{case.model} at {case.world} GPUs, {case.strategy}, G {case.shard_group or 'world'}: "
                           f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "kind": case.kind}


def cases(models: list[str], worlds: list[int], gpus_per_node: int,
          shard_groups: tuple[Optional[int], ...] = (None,)) -> list[Case]:
    """Each model, world and strategy at each shard group that divides the world and is smaller than it
    (None: the world, always)."""
    out = []
    for model in models:
        with torch.device("meta"):
            compiled = hgraph.compile(llama.build(model))
        tp = largest_tp(compiled, gpus_per_node)
        out += [Case(model, w, kind, s, g) for w in worlds for kind, s in strategies(tp, w)
                for g in shard_groups if g is None or (g < w and w % g == 0)]
    return out


def _shard_groups(text: str) -> tuple[Optional[int], ...]:
    """``8,64,world`` -> (8, 64, None); a positive integer or ``world``."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "world":
            out.append(None)
        elif item.isdigit() and int(item) > 0:
            out.append(int(item))
        else:
            raise ValueError(item)
    return tuple(out)


def table(rows: list[dict], columns: list[tuple[str, str, str]] = COLUMNS) -> str:
    """The rows as a Markdown table of ``columns`` (a column no row fills is left out)."""
    shown = [c for c in columns if any(c[0] in r for r in rows)]
    lines = ["| " + " | ".join(h for _, h, _ in shown) + " |", "|" + "---|" * len(shown)]
    for r in rows:
        lines.append("| " + " | ".join(f.format(r[k]) if k in r else "" for k, _, f in shown) + " |")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny Llama at 16 and 64 GPUs (smoke test)")
    ap.add_argument("--models", default="70b,32b", help="zoo Llama configs, comma-separated (default 70b,32b)")
    ap.add_argument("--worlds", default="64,1024,12288", help="GPU counts, comma-separated")
    ap.add_argument("--shard-groups", default="8,64,world",
                    help="optimizer shard groups G, comma-separated: positive integers or world (default "
                         "8,64,world; a G that does not divide a world, or is not smaller, is skipped)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0, help="the rank whose Program is built (default 0)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one row may take")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--in-process", action="store_true",
                    help="measure every row in this process (faster; a row's memory then counts on what "
                         "earlier rows left)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the working dtype Pull casts to (default bfloat16)")
    ap.add_argument("--measure", nargs=8, help=argparse.SUPPRESS)   # a row's child process
    ap.add_argument("--counts", action="store_true",
                    help="instead: the plan broadcast, the data index and the checkpoint manifest at each world "
                         "and shard group (scale_counts)")
    ap.add_argument("--data-docs", type=int, default=10_000_000,
                    help="--counts: documents of the token store the data index is measured on, and half as many "
                         "(default 10,000,000: both past the length scan's chunk)")
    args = ap.parse_args(argv)

    if args.measure:
        model, world, strategy, rank, gpn, dtype, group, parent = args.measure
        die_with_parent(int(parent))
        print(json.dumps(measure(model, int(world), strategy, int(rank), int(gpn), dtype, int(group) or None)))
        return 0

    try:
        models = QUICK["models"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
        worlds = QUICK["worlds"] if args.quick else _int_list(args.worlds)
    except ValueError:
        print(f"cluster_scale: --worlds {args.worlds!r}: expected GPU counts separated by commas", file=sys.stderr)
        return 2
    try:
        groups = _shard_groups(args.shard_groups)
    except ValueError as e:
        print(f"cluster_scale: --shard-groups {args.shard_groups!r}: {e} is not a positive integer or world",
              file=sys.stderr)
        return 2
    try:
        todo = cases(models, worlds, args.gpus_per_node, groups)
    except HGraphError as e:
        print(f"cluster_scale: {e}", file=sys.stderr)
        return 2
    if args.counts:
        return scale_counts.report(models, worlds, groups, args.gpus_per_node, args.data_docs, args.json)
    bad = [w for w in worlds if not 0 <= args.rank < w]
    if bad or not todo:
        print(f"cluster_scale: rank {args.rank} must lie in every world ({worlds}) and each world must hold a "
              "strategy", file=sys.stderr)
        return 2
    rows = []
    for case in todo:
        if args.in_process:
            rows.append({**measure(case.model, case.world, case.strategy, args.rank, args.gpus_per_node,
                                   args.dtype, case.shard_group), "kind": case.kind})
        else:
            rows.append(run_isolated(case, args.rank, args.gpus_per_node, args.dtype, args.timeout))
        if not args.json:
            print(f"{case.model} {case.world:>6} GPUs {case.kind:<13} G {case.shard_group or 'world'} {case.strategy}: "
                  f"{rows[-1]['cpu_s']:.2f} s, +{rows[-1]['added_mb']:.0f} MB", file=sys.stderr)
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    print(table(rows))
    print()
    for kind, s in dict.fromkeys((r["kind"], f"{r['gpus']:,} GPUs ({r['model']}): {r['strategy']}") for r in rows):
        print(f"{kind:<13} {s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
