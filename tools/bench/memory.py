"""Memory benchmark: every rank's measured peak of real training runs, against the bound of issue 14 and
``hgraph memory``'s prediction.

    python -m hgraph.tools.bench.memory [--model llama:tiny] [--model-args JSON] [--steps 4]
                                        [--tokens 1024] [--shared-spawn] [--json]

Default model: the 168M Llama of issue 14 (``llama:tiny`` with vocabulary 32000, hidden 1024, MLP 2816,
8 layers, 16 heads), fp32, ``--tokens`` tokens a step (random documents of 384, 256, 128 and 256 tokens).
Runs: 8 ranks ``1xTP4PP2``; 4 ranks the schedule ``1xTP2PP2;2xTP2PP1;1xTP1PP2+1xTP2PP1;1xTP2PP2``
and each of its strategies alone. Each run starts fresh processes (``--shared-spawn``: the runs of one
world size one after another in the same processes, as the test does).

Per rank: the measured peak (peak RSS on CPU, the largest ``process_peak_bytes`` of its steps; the
first step's includes the set-up), the bound ``16 B x parameters / N + 3 x its largest working
layout in fp32 + 1 GiB``, and ``hgraph memory``'s peak (model states + activations of micro-batches
of ``--tokens`` tokens, the largest over the run's strategies; the process itself, about half a
GiB of framework, is not in it). Then the ratio of the schedule's peak to its largest
single-strategy peak (target <= 1.10).
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

import hgraph
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.engine import host_heap
from hgraph.runtime.engine.model_states import rank_states
from hgraph.runtime.engine.peak_memory import PeakMemory
from hgraph.runtime.planner.cost.memory_estimate import estimate_memory
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.trainer import Trainer
from hgraph.strategy import Cluster, parse_strategy_list

MODEL_ARGS_168M = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_layers": 8,
                   "num_heads": 16}
SCHEDULE = "1xTP2PP2;2xTP2PP1;1xTP1PP2+1xTP2PP1;1xTP2PP2"
DOC_LENGTHS = (384, 256, 128, 256)       # 1024 tokens: one step's mini-batch
GiB = 2 ** 30


@dataclass(frozen=True)
class Run:
    """One training run: its name, world size and strategy schedule."""

    name: str
    world_size: int
    schedule: str


def default_runs() -> list[Run]:
    alone = list(dict.fromkeys(s.strip() for s in SCHEDULE.split(";")))
    return ([Run("1xTP4PP2", 8, "1xTP4PP2")] + [Run(s, 4, s) for s in alone]
            + [Run("four-strategy schedule", 4, SCHEDULE)])


def documents(tokens: int, steps: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random documents, ``tokens`` per step for ``steps`` steps (``DOC_LENGTHS`` scaled to it)."""
    g = torch.Generator().manual_seed(seed)
    scale = tokens / sum(DOC_LENGTHS)
    lengths = [max(int(n * scale), 2) for n in DOC_LENGTHS]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(steps) for n in lengths]


def run_config(run: Run, model: str, model_args: dict, steps: int, tokens: int, docs: Sequence) -> TrainConfig:
    return TrainConfig.from_values(model=model, model_args=dict(model_args), dtype="fp32", world_size=run.world_size,
                                   steps=steps, tokens_per_iter=tokens, docs=[list(d) for d in docs],
                                   strategy_schedule=run.schedule, device_memory=None)


def runs_worker(rank: int, world_size: int, configs: Sequence[TrainConfig]) -> list[dict]:
    """Spawn target: train each config in turn on this rank; per run, its peak (the largest
    ``process_peak_bytes`` of its steps) and seconds. The peak is restarted before each run."""
    out = []
    for config in configs:
        gc.collect()
        host_heap.trim()       # a run's peak does not start from what an earlier one left cached
        PeakMemory(torch.device("cpu")).read()          # the next reading covers this run only
        t0 = time.perf_counter()
        summary = Trainer(config, rank, world_size).run()
        out.append({"peak": max(s.process_peak_bytes for s in summary.steps),
                    "seconds": time.perf_counter() - t0})
        del summary
    return out


def bounds_and_predictions(model: str, model_args: dict, run: Run, tokens: int) -> tuple[list[int], list[int], int]:
    """Per rank, the bound and ``hgraph memory``'s peak, and the parameter count."""
    with torch.device("meta"):
        module = resolve_model_spec(model, model_args)
    compiled = hgraph.compile(module, dtype="fp32")
    cluster = Cluster(run.world_size)
    strategies = list(dict.fromkeys(parse_strategy_list(run.schedule, run.world_size, "schedule")))
    params = sum(p.numel() for p in module.parameters())
    layouts = [max(rank_states(compiled, s, cluster, torch.float32)[r].working_params for s in strategies)
               for r in range(run.world_size)]
    bounds = [int(16 * params / run.world_size + 3 * w + GiB) for w in layouts]
    estimates = [estimate_memory(compiled, s, cluster, tokens) for s in strategies]
    predicted = [max(e.ranks[r].peak for e in estimates) for r in range(run.world_size)]
    return bounds, predicted, params


def run_benchmark(model: str, model_args: dict, steps: int, tokens: int, shared_spawn: bool = False,
                  runs: Sequence[Run] = ()) -> dict[str, Any]:
    runs = list(runs) or default_runs()
    vocab = resolve_vocab(model, model_args)
    docs = documents(tokens, steps, vocab)
    measured: dict[str, list[dict]] = {}
    by_size: dict[int, list[Run]] = {}
    for run in runs:
        by_size.setdefault(run.world_size, []).append(run)
    for size, group in by_size.items():
        batches = [group] if shared_spawn else [[r] for r in group]
        for batch in batches:
            configs = [run_config(r, model, model_args, steps, tokens, docs) for r in batch]
            per_rank = spawn(runs_worker, size, args=(configs,), timeout_s=3600)
            for i, r in enumerate(batch):
                measured[r.name] = [per_rank[rank][i] for rank in range(size)]
    out_runs = []
    for run in runs:
        bounds, predicted, params = bounds_and_predictions(model, model_args, run, tokens)
        peaks = [m["peak"] for m in measured[run.name]]
        out_runs.append({**asdict(run), "peaks": peaks, "bounds": bounds, "predicted": predicted,
                         "within_bound": all(p <= b for p, b in zip(peaks, bounds)),
                         "seconds": max(m["seconds"] for m in measured[run.name])})
    schedule = next((r for r in out_runs if r["schedule"] == SCHEDULE), None)
    alone = [r for r in out_runs if r["world_size"] == 4 and r["schedule"] != SCHEDULE]
    ratio = (max(schedule["peaks"]) / max(max(r["peaks"]) for r in alone)) if schedule and alone else None
    return {"model": model, "model_args": model_args, "parameters": params, "steps": steps, "tokens": tokens,
            "shared_spawn": shared_spawn, "runs": out_runs, "schedule_ratio": ratio}


def resolve_vocab(model: str, model_args: dict) -> int:
    with torch.device("meta"):
        return int(resolve_model_spec(model, model_args).config.vocab_size)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.memory", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama:tiny")
    p.add_argument("--model-args", default=json.dumps(MODEL_ARGS_168M), metavar="JSON")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--shared-spawn", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        model_args = json.loads(args.model_args)
    except ValueError as exc:
        raise SystemExit(f"bench_memory: error: --model-args: {exc}")
    if args.steps < 1 or args.tokens < 8:
        raise SystemExit("bench_memory: error: --steps must be >= 1 and --tokens >= 8")
    try:
        res = run_benchmark(args.model, model_args, args.steps, args.tokens, args.shared_spawn)
    except HGraphError as exc:
        raise SystemExit(f"bench_memory: error: {exc}")
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{res['model']} {json.dumps(res['model_args'])}: {res['parameters'] / 1e6:.1f} M parameters, fp32, "
          f"{res['tokens']} tokens a step, {res['steps']} steps; peak RSS per rank in GiB "
          f"({'runs of a world size share processes' if res['shared_spawn'] else 'fresh processes per run'})")
    for r in res["runs"]:
        print(f"{r['name']} ({r['world_size']} ranks, {r['seconds']:.0f} s)"
              + ("" if r["name"] == r["schedule"] else f": {r['schedule']}"))
        print("  rank       " + " ".join(f"{i:>6}" for i in range(r["world_size"])))
        for label, key in (("peak", "peaks"), ("bound", "bounds"), ("predicted", "predicted")):
            print(f"  {label:<10} " + " ".join(f"{_gib(v):>6}" for v in r[key]))
        print(f"  within the bound: {'yes' if r['within_bound'] else 'NO'}")
    if res["schedule_ratio"] is not None:
        print(f"four-strategy schedule peak / largest single-strategy peak: {res['schedule_ratio']:.3f} (target <= 1.10)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
