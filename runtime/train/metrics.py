"""What a training step reports: its line in the metrics file and its readable line.

``MetricsWriter`` (rank 0, ``logging.metrics``) writes one JSON line per step from the step's
``StepRecord`` (``runtime.train.step_record``) and nothing else: the step's own figures
(``StepResult``: loss, tokens, times, bytes moved), its learning rate (``lr``) and, after every
``--eval-every`` steps, the validation loss (``eval_loss``) and the program cache's hits and misses; a
planner-driven step's planner figures; the documents of the step and the data position after it (a
resumed run can be checked to train every document exactly once); with outlier delay, the documents
that came from earlier steps and those still waiting; its throughput (``runtime.train.throughput``:
``tokens_per_s``, ``tflops_per_device``, ``mfu``, ``model_tflop``, ``peak_tflops``); the step's push
over all ranks (``step_push_ms``, ``step_push_exposed_ms``: seen from the rank whose backward ended
last); every rank's measured peak of the step (``rank_peak_bytes``: CUDA allocator peak or peak
RSS) and, with memory tracking, its measured and predicted activation peaks (``memory_figures``,
collective: one all-gather); with DCP-inter, its balance figures. A resumed run keeps the lines of
the steps before it and rewrites the rest.

``format_step_line``: the line rank 0 prints per step.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hgraph.runtime.checkpoint.run import rewrite_metrics_before
from hgraph.runtime.engine.executor import StepResult
from hgraph.runtime.train.step_record import CacheCounts, StepRecord


class MetricsWriter:
    """The metrics file of a run (nothing without a ``path``); ``resumed_step``: the first step of a
    resumed run (None: a fresh run, the file is started anew)."""

    def __init__(self, path: Optional[str], resumed_step: Optional[int] = None) -> None:
        self.file = None
        if path:
            if resumed_step is not None:
                rewrite_metrics_before(Path(path), resumed_step)
            self.file = open(path, "a" if resumed_step is not None else "w", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        """The line of one step, from its record alone."""
        if self.file is None:
            return
        extras, batch = record.extras, record.batch
        line = metrics_line(record.result, record.cache)
        line.update(extras.throughput)
        line.update(extras.fields())
        line.update(record.plan)
        line["documents"] = [d.index for d in batch.docs]
        line["next_document"] = batch.next_position
        if extras.outlier_delay:
            line["delayed"] = batch.delayed
            line["pending_delay"] = batch.pending
            line["delay_iters"] = list(batch.delay_iters)
        line.update(extras.memory)
        line.update(record.balance)
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def metrics_line(r: StepResult, cache: CacheCounts) -> dict:
    """The step's own figures and the cache's hits and misses so far (with ``--compile``: the
    compilations of rank 0's graph regions so far, ``region_compiles``). ``push_ms``: rank 0's push
    from its first reduction's issue to its end; ``push_exposed_ms``: the part of it after the
    backward ended (the rest ran under the backward). ``switch_s``: the step's
    lookup of its Program (with the build on a miss); ``build_s``: on a Program's first step, how long
    its build took (``built_ahead``: on the build-ahead thread, during earlier steps), else None."""
    compiles = {} if r.compiles is None else {"region_compiles": r.compiles}
    # the MoE router losses, apart from the cross-entropy ``loss`` (only when the run adds them)
    router = {k: v for k, v in (("moe_aux_loss", r.moe_aux_loss), ("moe_z_loss", r.moe_z_loss)) if v is not None}
    return {"step": r.step, "strategy": r.strategy, "loss": r.loss, "tokens": r.tokens, "time_s": r.time_s,
            "pull_s": r.pull_s, "compute_s": r.compute_s, "push_s": r.push_s, "optimizer_s": r.optimizer_s,
            "push_ms": r.push_ms, "push_exposed_ms": r.push_exposed_ms,
            "skipped": r.skipped, "grad_norm": r.grad_norm, "overlapped_update": r.overlapped_update,
            "pull_prefetched": r.pull_prefetched, "cache_hit": r.cache_hit, "switch_s": r.switch_s,
            "built_ahead": r.built_ahead, "build_s": r.build_s, "build_lead_s": r.build_lead_s,
            "cache_hits": cache.hits,
            "cache_misses": cache.misses, **router, **compiles, **{f"{k}": v for k, v in r.bytes.items()}}


def memory_figures(r: StepResult, world_size: int, device: Optional[torch.device], memory_budget: Optional[float],
                   source: str, tracked: bool = False) -> dict:
    """The step's push over all ranks (``step_push_figures``), every rank's measured peak of the step
    (``rank_peak_bytes``: CUDA allocator peak on a GPU, peak RSS on CPU, ``rank_peak_source`` says
    which, ``engine.peak_memory``) and, when activations are ``tracked``, their measured and predicted
    peaks, and what offload held in host memory (None without offload). Collective: one all-gather of
    a few numbers."""
    nan = float("nan")
    start, backward, end = r.push_times or (nan, nan, nan)
    mine = [start, backward, end, r.process_peak_bytes]
    mine += [r.peak_mem_bytes, r.predicted_mem_bytes, r.host_peak_bytes] if tracked else []
    rows = all_gather_rows([nan if v is None else float(v) for v in mine], world_size, device)
    out = step_push_figures(rows)
    out.update({"rank_peak_bytes": [None if math.isnan(row[3]) else int(row[3]) for row in rows],
                "rank_peak_source": source})
    if tracked:
        out.update({"peak_mem_bytes": [None if math.isnan(row[4]) else int(row[4]) for row in rows],
                    "predicted_mem_bytes": [None if math.isnan(row[5]) else round(row[5]) for row in rows],
                    "memory_budget": memory_budget, "recompute_layers": r.recompute_layers,
                    "offload_layers": r.offload_layers,      # this rank's, per micro-batch
                    "host_peak_bytes": [None if math.isnan(row[6]) else int(row[6]) for row in rows]})
    return out


def step_push_figures(rows: list[list[float]]) -> dict:
    """The step's push, from each rank's ``(first issue, backward end, push end)`` (wall clock, s; the
    rows' first three values), seen from the rank whose backward ended last (the step's critical
    path; a rank whose backward ended early waits in its push for the later ones' gradients, and that
    wait is the pipelines' imbalance, not the push): ``step_push_ms`` from that rank's first reduction
    to the end of the last push anywhere, ``step_push_exposed_ms`` the part after its backward ended
    (all of it when it issued nothing before). None without the times."""
    timed = [row[:3] for row in rows if not any(math.isnan(v) for v in row[:3])]
    if not timed:
        return {"step_push_ms": None, "step_push_exposed_ms": None}
    start, backward, _ = max(timed, key=lambda row: row[1])
    end = max(row[2] for row in timed)
    return {"step_push_ms": 1e3 * (end - start), "step_push_exposed_ms": 1e3 * (end - max(start, backward))}


def all_gather_rows(values: list[float], world_size: int, device: Optional[torch.device] = None) -> list[list[float]]:
    """``values`` of every rank, in rank order, in one all-gather (the row alone without a process group)."""
    if not dist.is_initialized() or world_size == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def format_step_line(r: StepResult, planned: Optional[dict] = None, extra: Optional[dict] = None,
                     mfu: Optional[float] = None) -> str:
    """The readable per-iteration line: step, strategy, estimated vs measured ms, loss, tokens/s, MFU
    (on a device with a known peak), cache hit (the planner's fields only in planner-driven mode), the
    validation loss when measured."""
    est = f"est {planned['est_latency_ms']:8.2f} ms  " if planned else ""
    hit = ("  built ahead" if r.built_ahead else "  cache hit" if r.cache_hit else "  cache miss") if planned else ""
    tps = r.tokens / r.time_s if r.time_s > 0 else 0.0
    util = f"  MFU {100 * mfu:5.1f}%" if mfu is not None else ""
    return (f"step {r.step:>4}  {r.strategy:<28} {est}measured {1e3 * r.time_s:8.1f} ms  loss {r.loss:.6f}  "
            f"{tps:8.0f} tok/s{util}{hit}" + ("  (skipped: non-finite loss)" if r.skipped else "")
            + (f"  eval_loss {extra['eval_loss']:.6f}" if extra and "eval_loss" in extra else ""))
