"""Checkpoint benchmark: save and load times of the strategy-independent checkpoints, on gloo ranks.

    python -m hgraph.tools.bench.checkpoint [--model llama:tiny] [--model-args JSON]
                                            [--world-size 4] [--load-world-sizes 4,2,3] [--repeats 3]
                                            [--json]

Builds the model's parameters once per rank, a ``ShardedAdam`` over ``--world-size`` ranks, and
measures (median of ``--repeats``, rank 0's wall time, which includes waiting for the slowest rank):
the collective ``save`` (shard files + manifest, fsync), a ``load`` with the same world size and
re-sharding loads for each other world size (every new rank loads in turn, in one process, with and
without SHA-256 verification). Prints the checkpoint size, MB/s and milliseconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.checkpoint import manifest
from hgraph.runtime.checkpoint import shards as checkpoint
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.runtime.train.launch import spawn


def _optimizer(spec: str, model_args: dict, rank: int, world_size: int):
    torch.manual_seed(0)
    model = resolve_model_spec(spec, model_args)
    return ShardedAdam(model.named_parameters(), {}, rank, world_size)


def _save_worker(rank: int, world_size: int, spec: str, model_args: dict, root: str, repeats: int) -> list:
    opt = _optimizer(spec, model_args, rank, world_size)
    times = []
    for k in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        checkpoint.save(root, k, opt, rank=rank, world_size=world_size,
                        data_position={"next_doc": k}, keep_last=2)
        times.append(time.perf_counter() - t0)
    return times


def _load_times(root: str, world_size: int, repeats: int, verify: bool) -> float:
    """Median time for all ``world_size`` ranks to load (sequentially here: the total work)."""
    totals = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for r in range(world_size):
            checkpoint.load(root, r, world_size, verify=verify)
        totals.append(time.perf_counter() - t0)
    return statistics.median(totals)


def run_benchmark(spec: str, model_args: dict, world_size: int, load_sizes: list[int], repeats: int) -> dict:
    """The figures as a dict."""
    with tempfile.TemporaryDirectory(prefix="hgraph-ckpt-bench-") as root:
        per_rank = spawn(_save_worker, world_size, args=(spec, model_args, root, repeats), timeout_s=600)
        folder = manifest.latest(root)
        size = sum(p.stat().st_size for p in Path(folder).iterdir())
        save_s = statistics.median(per_rank[0])
        loads = {}
        for n in load_sizes:
            loads[n] = {"verify_s": _load_times(root, n, repeats, True),
                        "no_verify_s": _load_times(root, n, repeats, False),
                        "resharded": n != world_size}
    label = spec + (f" {json.dumps(model_args)}" if model_args else "")
    return {"model": label, "world_size": world_size, "bytes": size, "save_s": save_s,
            "save_mb_per_s": size / save_s / 1e6, "loads": loads}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama:tiny")
    p.add_argument("--model-args", default="{}", metavar="JSON")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--load-world-sizes", default="4,2,3", metavar="N,N,...")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        model_args = json.loads(args.model_args)
        load_sizes = [int(x) for x in args.load_world_sizes.split(",") if x.strip()]
    except ValueError as exc:
        raise SystemExit(f"bench_checkpoint: error: {exc}")
    if args.world_size < 1 or args.repeats < 1 or any(n < 1 for n in load_sizes):
        raise SystemExit("bench_checkpoint: error: world sizes and --repeats must be >= 1")
    try:
        res = run_benchmark(args.model, model_args, args.world_size, load_sizes, args.repeats)
    except HGraphError as exc:
        raise SystemExit(f"bench_checkpoint: error: {exc}")
    if args.json:
        print(json.dumps(res))
        return 0
    mb = res["bytes"] / 1e6
    print(f"{res['model']}: checkpoint {mb:.2f} MB on {res['world_size']} ranks (fp32 masters + 2 moments)")
    print(f"save  {1e3 * res['save_s']:8.1f} ms  ({res['save_mb_per_s']:.0f} MB/s, collective, incl. fsync)")
    for n, f in res["loads"].items():
        kind = "re-sharded" if f["resharded"] else "same size "
        print(f"load -> {n} ranks ({kind}): {1e3 * f['verify_s']:8.1f} ms with SHA-256, "
              f"{1e3 * f['no_verify_s']:8.1f} ms without (all ranks, one after another)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
