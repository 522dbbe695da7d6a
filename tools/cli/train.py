"""``hgraph train``: dynamic heterogeneous training, the planner choosing every iteration's strategy.

With no arguments it runs the built-in default: ``llama:tiny`` on the built-in long-tail documents
(real Wikipedia lengths scaled for CPU), 4 local
processes, a cost model measured on the spot by the ranks (``--profile measure``), ``auto`` candidate
strategies and the planner's choice every iteration, planned ahead in a planner process; it prints
one line per iteration (a progress bar on a terminal) and a summary, and writes ``run.json``,
``metrics.jsonl`` and the plots into ``--run-dir`` (default
``runs/<UTC timestamp>``).

Planner-driven mode (``--strategies auto|"S1;S2"``, the default): every iteration
``plan_iteration`` picks the strategy among the candidates and dispatches the mini-batch's documents
to pipelines and micro-batches with the cost model of ``--profile`` (``measure``: timed on this
machine at the start; ``analytic``: the analytic prior for the
model and world size; or a built-in profile NAME or a profile FILE). A planner process started by
the launcher (under ``torchrun``: by rank 0) plans ``--plan-ahead`` iterations ahead;
rank 0 takes its plans and broadcasts them; if it dies, rank 0 warns
once and plans inline. Estimates are scaled by the median measured/estimated ratio of the last steps.
Deterministic mode (``--strategy-schedule``): step k uses S_(k mod len).

Starts ``--world-size`` local processes on ``--device`` (on a machine with CUDA one rank per GPU over
NCCL by default, more ranks than GPUs being one line that names ``--device cpu`` and ``--backend
gloo``, the shared-device mode; else 4 CPU processes over gloo) or, under ``torchrun`` or as a SLURM
task, runs as this process's rank: the world size and ranks per node are the launcher's (a given
other value is one line naming both), global rank 0 alone prints and writes the run folder, every
rank's error names its rank and host, and an attempt the launcher restarted resumes from the newest
checkpoint by itself. The model is built
right after ``torch.manual_seed(--seed)``, or starts from pretrained weights: ``--model hf:DIR`` (a
local Hugging Face folder: its ``config.json`` and safetensors) or ``--init-from PATH`` (safetensors,
an hgraph checkpoint or a torch state_dict, for any model), checked here against the model before
any process starts; mini-batches take whole documents of
``--data`` (a token store of ``hgraph prepare-data``, JSONL with ``input_ids``, raw text with
``--tokenizer`` tokenized here into the run folder, or a mixture ``"0.7:A,0.3:B"``)
in file order or, with ``--shuffle``, a seeded permutation per epoch,
up to ``--tokens-per-iter`` tokens
(``--outlier-queues K``: long documents wait in WLB-LLM's K queues and are all trained by the run's
last step); in deterministic mode documents are dispatched
and packed by the runtime's built-in rule.
Optimizer defaults are PyTorch's (Adam, no weight decay, no clipping), at a constant learning
rate unless ``--lr-schedule`` says otherwise (the built-in default run: 10% warmup, cosine to
lr/10); ``--eval-data SRC --eval-every K`` adds ``eval_loss``.
``--save-final`` writes the gathered fp32 state_dict (keyed like the original module) with
``torch.save``; ``--metrics`` one JSON line per step.

Every option is also a key of a TOML file (``--config RUN.toml``, sections as in the option groups
below); flags given on the command line override the file. ``--checkpoint-dir DIR
--checkpoint-every K`` saves strategy-independent checkpoints; ``--resume`` continues from the newest
one up to ``--steps`` (the run's total), also on another ``--world-size``; the checkpoint is chosen and
checked here, before any process starts. With a checkpoint folder, SIGTERM (a scheduler's preemption)
finishes the step, saves a checkpoint, says where and exits with code 143 (``--no-exit-signal-handler``:
it stops at once). Every process a run starts ends with it: Ctrl-C exits 130, SIGTERM 143, a killed
launcher takes its ranks along. Step lines are printed as the steps finish, in every mode. One run per
folder: the run holds its checkpoint and run folders from its start to its end (a lock file in each);
a second run on either is one line naming the holder, exit 2.
"""
from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
from pathlib import Path

from hgraph.runtime.data.stored import LongReport
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.config_keys import ResolvedConfig
from hgraph.runtime.train.exit_signal import EXIT_CODE
from hgraph.runtime.train.launch import Stopped
from hgraph.runtime.train.launcher_env import read_launcher_env
from hgraph.runtime.train.run import PreparedRun, RunSummary, errors_named, prepare, resume_hint
from hgraph.runtime.train.run_config import config_from_options
from hgraph.runtime.train.run_folders import Refused
from hgraph.tools.cli.progress import Progress, resolve_mode
from hgraph.tools.cli.train_schema import add_arguments, help_text
from hgraph.tools.report.plots import read_metrics, summarize, write_plots


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train with the planner's strategy every iteration (no arguments: "
                              "the built-in default run)", description=__doc__, epilog=help_text(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)        # every flag is a key of hgraph.runtime.train.config_keys.SCHEMA (and of --config)
    return p


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, ResolvedConfig]:
    """The run's ``TrainConfig`` and the resolved values with their sources, from the parsed options
    and ``--config`` (``runtime.train.run_config``; bad values: one-line HGraphError)."""
    return config_from_options(vars(args))


def run(args: argparse.Namespace) -> int:
    """The run of ``args`` (``runtime.train.run``: ``prepare``, then ``execute``), reported for a person
    or as one JSON object; under a launcher every rank's error names its global rank and host (one
    line; bad input exit 2, a failed run exit 1, so that the launcher may restart it)."""
    env = read_launcher_env()
    try:
        with errors_named(env):
            config, _ = config_from_args(args)
            log = config.logging
            # rank 0's bars: drawn on a terminal with the step lines, else plain lines (runtime.train.progress)
            bars = functools.partial(Progress, enabled=not log.json and resolve_mode(log.progress))
            with prepare(config, progress_bars=bars, env=env) as prepared:
                try:
                    summary = prepared.execute()
                except (KeyboardInterrupt, Stopped) as exc:     # every process of the run has ended
                    signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
                    sys.stderr.write(f"hgraph train: stopped by {signal.Signals(signum).name}"
                                     f"{resume_hint(prepared.config)}\n")
                    return 128 + signum
                return report(prepared, summary)
    except Refused:              # every rank said the same line already
        return 2


def report(prepared: PreparedRun, summary: RunSummary) -> int:
    """The run's end for a person (the summary lines) or as one JSON object; the exit code."""
    if summary.finished is not None:
        return 0
    config, run_dir, metrics = prepared.config, summary.run_dir, summary.metrics
    run_dir = Path(run_dir) if run_dir is not None else None
    log, data, speaker = config.logging, config.data, prepared.speaker
    stopped = summary.stopped
    if stopped is not None:            # every rank exits with the code; global rank 0 says where
        if speaker:
            if log.json:
                print(json.dumps({"stopped": stopped, "steps": list(summary.steps)}))
            sys.stderr.write(f"hgraph train: stopped by {stopped['signal']} after step {stopped['step']} of "
                             f"{data.steps}; checkpoint {stopped['checkpoint']} saved; --resume continues "
                             "from it\n")
        return EXIT_CODE
    steps = list(summary.steps)
    if summary.rank != 0:                        # under torchrun only rank 0 reports
        summary.check_trained()
        return 0
    plots = None
    if run_dir is not None and metrics is not None and log.plots:
        records = read_metrics(metrics)
        plots = write_plots(records, run_dir)
    if log.json:
        print(json.dumps({"steps": steps, "planned": list(summary.planned), "cache": dict(summary.cache),
                          "step_extra": list(summary.step_extra),
                          "long_documents": dict(summary.long_documents),
                          "dropout": summary.dropout,
                          "sequence_parallel": summary.sequence_parallel,
                          "shard_group": dict(summary.shard_group),
                          "checkpoints": list(summary.checkpoints), "resumed_from": summary.resumed_from,
                          "save_final": config.checkpointing.save_final, "metrics": metrics,
                          "run_dir": str(run_dir) if run_dir is not None else None,
                          "plots": [str(f) for f in plots.files] if plots is not None else []}))
        summary.check_trained()
        return 0
    extra = {e["step"]: e for e in summary.step_extra}
    print(f"dropout: {summary.dropout}")
    print(f"sequence parallelism: {summary.sequence_parallel}")
    group = summary.shard_group or {}
    if group:
        why = f" (--shard-group auto: {group['auto']})" if group.get("auto") else ""
        over = f"the world ({group['size']} ranks)" if group.get("world") else f"groups of {group['size']} ranks"
        print(f"optimizer states: sharded over {over}{why}")
    if summary.long_documents.get("mode", "error") != "error":
        print(LongReport(**summary.long_documents).summary())
    evals = [(k, e["eval_loss"]) for k, e in sorted(extra.items()) if "eval_loss" in e]
    if evals:
        print(f"validation: eval_loss {evals[0][1]:.4f} (step {evals[0][0]}) -> {evals[-1][1]:.4f} "
              f"(step {evals[-1][0]}) in {len(evals)} evaluations")
    c = summary.cache
    print(f"graph cache: {c['hits']} hits ({c['ahead']} built ahead), {c['misses']} misses, switch on a hit "
          f"<= {c['max_hit_switch_ms']:.3f} ms; builds {c['build_s']:.2f} s in all, <= {c['max_build_s']:.2f} s each")
    saved = summary.checkpoints
    if saved:
        print(f"checkpoints: {', '.join(Path(c['path']).name for c in saved)} in "
              f"{config.checkpointing.checkpoint_dir} ({saved[-1]['bytes'] / 1e6:.2f} MB each, "
              f"save <= {1e3 * max(c['save_s'] for c in saved):.0f} ms)")
    if plots is not None:
        _print_summary(records, run_dir, plots)
    elif run_dir is not None:
        print(f"run dir: {run_dir} (metrics.jsonl)")
    skipped = sum(bool(s["skipped"]) for s in steps)
    if skipped and plots is None:       # the summary counts them otherwise
        print(f"skipped: {skipped} of {len(steps)} steps (non-finite loss, --skip-nonfinite)")
    summary.check_trained()
    return 0


def _print_summary(records: list, run_dir: Path, plots) -> None:
    s = summarize(records)
    used = ", ".join(f"{k} x{v}" for k, v in s.strategies.items())
    print(f"summary: {s.steps} steps, {s.steps_per_s:.2f} steps/s, {s.tokens_per_s:.0f} tokens/s; "
          f"{s.distinct_strategies} distinct strategies: {used}")
    loss = (f"loss {s.first_loss:.4f} -> {s.last_loss:.4f}" if s.first_loss is not None else "no finite loss")
    if s.skipped_steps:
        loss += f"; {s.skipped_steps} steps skipped (non-finite loss)"
    extra = []
    if s.mean_balance is not None:
        extra.append(f"mean balance (max/mean busy) {s.mean_balance:.2f}")
    if s.est_within_10pct is not None:
        extra.append(f"estimate within 10% of measured in {100 * s.est_within_10pct:.0f}% of steps")
    if s.planner_wait_s is not None:
        queue = [r["planner_queue_wait_s"] for r in records if r.get("planner_source") == "ahead"]
        extra.append(f"planner wait {s.planner_wait_s:.2f} s in all"
                     + (f" ({sum(queue):.2f} s blocked on the planner process in {len(queue)} planned-ahead "
                        f"steps)" if queue else ""))
    if s.cache_hit_rate is not None:
        extra.append(f"cache hit rate {100 * s.cache_hit_rate:.0f}%")
    print(f"         {loss}; " + "; ".join(extra))
    delays = [d for r in records for d in r.get("delay_iters", ())]
    if any("delayed" in r for r in records):   # --outlier-queues: show that nothing was left behind
        print(f"outlier delay: {sum(d > 0 for d in delays)} of {len(delays)} documents delayed, mean delay "
              f"{sum(delays) / max(len(delays), 1):.3f} steps (max {max(delays, default=0)}); "
              f"{records[-1].get('pending_delay', 0)} waiting at the end")
    print(f"run dir: {run_dir} (metrics.jsonl, {len(plots.files)} plot files"
          + (f"; skipped: {', '.join(plots.skipped)}" if plots.skipped else "") + ")")
