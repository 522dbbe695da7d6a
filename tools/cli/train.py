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
import contextlib
import functools
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from hgraph.errors import HGraphError, RunFailed
from hgraph.frontends.zoo import ZOO_CONFIGS
from hgraph.runtime.checkpoint.run import ResumePoint, find_resume_point
from hgraph.runtime.checkpoint.manifest import latest
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.data.outlier_delay import check_resume_queues
from hgraph.runtime.data.stored import LongReport
from hgraph.runtime.data.token_store import write_documents
from hgraph.runtime.planner.cost.runtime_memory import bytes_text, least_state_bytes
from hgraph.runtime.planner.cost.shard_group import parse_shard_group
from hgraph.runtime.planner.service.iteration import parse_candidates
from hgraph.runtime.process.writable import probe_writable
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.data_setup import ready_data
from hgraph.runtime.train.devices import (backend_for, default_world_size, describe, gpu_memory_per_rank,
                                         resolve_device)
from hgraph.runtime.train.exit_signal import EXIT_CODE
from hgraph.runtime.train.launch import SpawnError, Stopped
from hgraph.runtime.train.launcher_env import LauncherEnv, default_timeout, launcher_cluster, read_launcher_env
from hgraph.runtime.process.lifetime import end_process
from hgraph.runtime.train.run_folders import Refused, RunFolders
from hgraph.runtime.train.restart import finished_before_restart, restart_config, restart_run_dir
from hgraph.runtime.train.lr_schedule import builtin_default
from hgraph.runtime.train.step_modes import parse_schedule
from hgraph.runtime.train.trainer import check_weights, record_model, run_training
from hgraph.strategy import Cluster
from hgraph.tools.cli.progress import Progress, resolve_mode
from hgraph.tools.cli.train_schema import BY_DEST, ResolvedConfig, add_arguments, help_text, resolve
from hgraph.tools.report.plots import read_metrics, summarize, write_plots
from hgraph.tools.report.run_record import write_run_record

# The built-in default run: sized so that it finishes in a few minutes with 4 processes on 2 CPU
# cores (about DEFAULT_TOKENS_PER_ITER tokens per step, a long-tail mix of short and long documents).
DEFAULT_MODEL = "llama:tiny"
DEFAULT_WORLD_SIZE = 4
DEFAULT_STEPS = 60
DEFAULT_TOKENS_PER_ITER = 8192
BUILTIN_SEED = 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train with the planner's strategy every iteration (no arguments: "
                              "the built-in default run)", description=__doc__, epilog=help_text(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)        # every flag is a key of hgraph.tools.cli.train_schema.SCHEMA (and of --config)
    return p


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, ResolvedConfig]:
    """The run's ``TrainConfig`` (every key of the schema's resolved values, byte sizes parsed) and the
    resolved values with their sources, from the parsed options and ``--config`` (bad values:
    one-line HGraphError)."""
    env = read_launcher_env()
    cfg = on_devices(launched(resolve(args), env), env)
    schedule, strategies = cfg.strategy_schedule, cfg.strategies
    if schedule is not None and cfg.sources["strategies"] != "default":
        raise HGraphError("--strategies and --strategy-schedule exclude each other: the planner chooses, "
                          "or the schedule does")
    if schedule is not None:                          # fails here, before any process starts
        for strategy in parse_schedule(schedule, cfg.world_size):
            strategy.validate(Cluster(cfg.world_size, cfg.gpus_per_node))     # TP groups inside a node
    if cfg.max_candidates is not None and (schedule is not None or strategies.strip() != "auto"):
        key, src = BY_DEST["max_candidates"], cfg.sources["max_candidates"]
        where = key.flag if src == "command line" else f"{src}: [{key.section}] {key.name}"
        raise HGraphError(f"{where} = {cfg.max_candidates}: applies to the proposed candidates of "
                          "--strategies auto only, not to a given strategy list or schedule")
    if schedule is None and strategies.strip() != "auto":
        parse_candidates(strategies, cfg.world_size)
    key, src = BY_DEST["shard_group"], cfg.sources["shard_group"]
    parse_shard_group(cfg.shard_group, cfg.world_size,      # fails here, before any process starts
                      key.flag if src in ("command line", "default") else f"{src}: [{key.section}] {key.name}")
    # the ranks that share this node's GPUs: the local processes, or the launcher's ranks per node
    ranks_here = cfg.world_size if env is None else cfg.gpus_per_node
    device_memory = device_memory_option(cfg.device_memory, cfg.data, cfg.device, ranks_here)
    if isinstance(device_memory, float):        # before any process starts, not after the planner's setup
        check_device_memory(device_memory, cfg.model, cfg.model_args, cfg.world_size, cfg.dtype)
    return TrainConfig.from_values(cfg.values, memory_budget=parse_bytes(cfg.memory_budget, "--memory-budget"),
                                   host_memory_budget=parse_bytes(cfg.host_memory_budget, "--host-memory-budget"),
                                   device_memory=device_memory), cfg


def launched(cfg: ResolvedConfig, env: Optional[LauncherEnv]) -> ResolvedConfig:
    """``cfg`` with the launcher's world size and ranks per node (a value given otherwise: one line
    naming both, ``launcher_env.launcher_cluster``)."""
    values, sources = dict(cfg.values), dict(cfg.sources)
    if env is not None:
        def given(dest: str) -> Optional[int]:
            return values[dest] if sources[dest] != "default" else None

        def where(dest: str) -> str:
            key, src = BY_DEST[dest], sources[dest]
            return key.flag if src == "command line" else f"[{key.section}] {key.name} ({src})"
        values["world_size"], values["gpus_per_node"] = launcher_cluster(
            env, given("world_size"), given("gpus_per_node"),
            where={d: where(d) for d in ("world_size", "gpus_per_node")})
        sources["world_size"] = sources["gpus_per_node"] = env.launcher
    return ResolvedConfig(values, sources)


def on_devices(cfg: ResolvedConfig, env: Optional[LauncherEnv]) -> ResolvedConfig:
    """``cfg`` with ``--device`` resolved on this machine and, for local processes, the world size
    defaulting to the GPUs visible on CUDA (``runtime.train.devices``); more ranks than GPUs is one
    line before any process starts."""
    values = dict(cfg.values)
    values["device"] = resolve_device(values["device"])
    if env is None:
        if cfg.sources["world_size"] == "default":
            values["world_size"] = default_world_size(values["device"])
        backend_for(values["device"], values["backend"], values["world_size"])
    return ResolvedConfig(values, dict(cfg.sources))


def device_memory_option(text, data, device: str = "cpu", ranks_here: int = 1):
    """``--device-memory``: bytes, None (``none``), or ``auto``: on CUDA one GPU's memory (split
    between the ranks sharing it); on CPU sized on the ranks from the model (``"auto"``) with the
    built-in data, no limit with ``--data``."""
    t = str(text).strip().lower()
    if t == "none":
        return None
    if t == "auto":
        if device == "cuda":
            return gpu_memory_per_rank(ranks_here)
        return "auto" if data is None else None
    return parse_bytes(text, "--device-memory")


def check_device_memory(limit: float, model: str, model_args: dict, world_size: int, dtype: str) -> None:
    """``--device-memory`` smaller than the model states any rank must hold is one line, printed in the
    unit given (the model built on the meta device: nothing allocated)."""
    built = record_model(TrainConfig.from_values(model=model, model_args=model_args)).model
    parameters = sum(p.numel() for p in built.parameters())
    least = least_state_bytes(parameters, world_size, 2 if dtype == "bf16" else 4)
    if limit < least:
        raise HGraphError(f"--device-memory {bytes_text(limit)}: too small for any strategy; every rank of "
                          f"{world_size} holds at least {bytes_text(least)} of model states ({parameters:,} "
                          f"parameters: its share of the fp32 masters, Adam moments, {dtype} weights and "
                          f"gradients); give at least that plus the activations, or none for no limit")


def parse_bytes(text, option: str):
    """``123``, ``1.5e6``, ``512K``, ``64M``, ``2G`` (powers of 1024) -> bytes; None stays None."""
    if text is None:
        return None
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    t = str(text).strip().upper().removesuffix("B")
    scale = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in units else t) * scale
    except ValueError:
        value = -1.0
    if not value > 0 or not math.isfinite(value):
        raise HGraphError(f"{option} {text!r}: expected a positive number of bytes, e.g. 512M")
    return value


def builtin_documents(model: str, model_args: dict, steps: int, tokens_per_iter: int,
                      num_docs: Optional[int] = None, scale: Optional[float] = None) -> list[list[int]]:
    """The built-in long-tail documents for ``model`` (its vocabulary and context length): ``num_docs``
    of them, by default enough for ``steps`` mini-batches without wrapping around (the scaled lengths
    average ~62 tokens); ``scale``: the length scale (default the generator's)."""
    # the model on the meta device: only its config is read (a pretrained hf:DIR is never allocated here)
    cfg = getattr(record_model(TrainConfig.from_values(model=model, model_args=model_args)).model, "config", None)
    vocab, max_len = getattr(cfg, "vocab_size", None), getattr(cfg, "max_seq_len", None)
    if not vocab or not max_len:
        raise HGraphError(f"--model {model}: the built-in data needs a zoo model with vocab_size and "
                          "max_seq_len; give --data FILE.jsonl")
    num_docs = num_docs or max(64, math.ceil(steps * tokens_per_iter / 24))
    extra = {} if scale is None else {"scale": scale}
    return synthetic_documents(num_docs, int(vocab), min(int(max_len), tokens_per_iter), BUILTIN_SEED, **extra)


def default_run_dir() -> Path:
    """``runs/<UTC timestamp>`` (with a suffix if a run of the same second exists)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


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


def run(args: argparse.Namespace, outcome: Optional[dict] = None) -> int:
    """The run of ``args``; under a launcher every rank's error names its global rank and host (one
    line; bad input exit 2, a failed run exit 1, so that the launcher may restart it). ``outcome``
    (``hgraph.train``) receives this process's result, run folder and metrics file."""
    env = read_launcher_env()
    if env is None:
        return _run(args, None, outcome)
    try:
        return _run(args, env, outcome)
    except Refused:              # every rank said the same line already
        return 2
    except HGraphError as exc:      # the same kind: bad input exits 2, a failed run 1
        raise (RunFailed if isinstance(exc, RunFailed) else HGraphError)(f"{env.where()}: {exc}") from None
    except Exception as exc:     # noqa: BLE001 - a failed collective, a lost peer: one line, not a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        sys.stderr.write(f"hgraph train: error: {env.where()}: {type(exc).__name__}: {first}\n")
        return 1


def _held_folders(config: TrainConfig, env: Optional[LauncherEnv]) -> RunFolders:
    """The run's hold on its folders (``runtime.train.run_folders``): a holder silent for the heartbeat
    timeout is gone; a launched rank waits for rank 0's verdict as long as for its peers."""
    cluster = config.cluster
    timeout = cluster.timeout if cluster.timeout is not None else default_timeout(env)

    def line(kind: str) -> Callable[[str], None]:
        return lambda text: print(f"hgraph train: {kind}{text}", file=sys.stderr, flush=True)
    return RunFolders(env, cluster.heartbeat_timeout, timeout, say=line("error: "), warn=line("warning: "),
                      on_lost=end_process)


def _run(args: argparse.Namespace, env: Optional[LauncherEnv], outcome: Optional[dict] = None) -> int:
    with contextlib.ExitStack() as held:          # the run's folders, held to its end (run_folders)
        return _run_holding(args, env, outcome, held)


def _run_holding(args: argparse.Namespace, env: Optional[LauncherEnv], outcome: Optional[dict],
                 held: contextlib.ExitStack) -> int:
    config, _ = config_from_args(args)
    log, data = config.logging, config.data
    # one run per folder: taken before anything reads a checkpoint or writes into a folder
    folders = held.enter_context(_held_folders(config, env))
    ckpt_dir = config.checkpointing.checkpoint_dir
    if config.checkpointing.resume and ckpt_dir is not None and not Path(ckpt_dir).is_dir():
        ckpt_dir = None                # not made here: the resume says that it does not exist
    folders.hold([("checkpoint folder", ckpt_dir), ("run folder", log.run_dir)], "start")
    planned = config.planner_driven
    speaker = env is None or env.rank == 0       # global rank 0 prints and writes the run folder
    finished = finished_before_restart(config, env)
    if finished is not None:
        if speaker:
            print(f"hgraph train: {finished}", file=sys.stderr if log.json else sys.stdout, flush=True)
        return 0
    config, restart_note = restart_config(config, env)
    if restart_note is not None and speaker:       # stdout stays one JSON object with --json
        print(f"hgraph train: {restart_note}", file=sys.stderr if log.json else sys.stdout, flush=True)
    point = _resume_point(config, quiet=log.json, speaker=speaker)
    if config.model.init_from is not None or _is_hf_dir(config.model.model):
        check_weights(config)             # bad weights: one line, before any process starts
    run_dir, metrics = None, log.metrics
    if planned or log.run_dir is not None:
        if log.run_dir is not None:
            run_dir = Path(log.run_dir)
        else:       # a restart continues in its checkpoint's run folder
            run_dir = restart_run_dir(point, env) or default_run_dir()
            folders.hold([("run folder", run_dir)], "run folder")
    probe_folders(config, run_dir, env)      # an unwritable folder: one line now, not at the first save
    if run_dir is not None:
        if speaker:
            run_dir.mkdir(parents=True, exist_ok=True)
        if metrics is None:       # every rank knows that there are metrics (their figures are collective)
            metrics = str(run_dir / "metrics.jsonl")
    docs = None
    # data files are written into the run folder by a local run; under a launcher every rank runs this
    # command, so each prepares its own in a temporary folder (run_training) instead of racing here
    data_dir = run_dir / "data" if run_dir is not None and env is None else None
    if data.data is not None:
        # raw text tokenized into the run folder, stores verified, vocabulary and --long checked: one
        # line before the launch (without a run folder, run_training does it in a temporary one)
        if data_dir is not None:
            config = ready_data(config, record_model(config).model, data_dir,
                                say=None if log.json else (lambda line: print(line, flush=True)))
    else:
        # a resumed run regenerates the same built-in documents as the run it continues
        saved_n = point.data_position.get("num_documents") if point is not None else None
        docs = builtin_documents(config.model.model, config.model.model_args, data.steps, data.tokens_per_iter,
                                 data.builtin_docs or saved_n, data.builtin_scale)
        if data_dir is not None:
            # kept as a token store in the run folder: every rank maps it instead of holding the tokens
            prefix = data_dir / f"builtin-{len(docs)}"
            vocab = record_model(config).model.config.vocab_size
            config = config.with_values(data_sources=str(write_documents(prefix, docs, vocab).prefix))
            docs = None
        if config.optimizer.lr_schedule == "auto":      # the built-in default run's recipe
            opt = config.optimizer
            config = config.with_values(**builtin_default(opt.lr, data.steps, opt.warmup_steps, opt.min_lr))
        if data.eval_data is not None and data_dir is not None:
            config = ready_data(config, record_model(config).model, data_dir)
    # rank 0 prints each step's line as it finishes (flushed), in every mode: a failed or stopped
    # run's log keeps the steps it did; with --json stdout is the one object at the end
    log_steps = not log.json
    config = config.with_values(
        metrics=metrics, docs=docs, run_dir=str(run_dir) if run_dir is not None else None,
        resume_from=str(point.folder) if point is not None else None,
        log_steps=log_steps,
        # rank 0's bars: drawn on a terminal with the step lines, else plain lines (runtime.train.progress)
        progress_bars=functools.partial(Progress, enabled=log_steps and resolve_mode(log.progress)))
    if run_dir is not None and speaker:
        write_run_record(run_dir, config)
    if log_steps and planned and speaker:
        source = data.data or "built-in long-tail documents"
        c = config.cluster
        where = (describe(c.device, c.world_size, backend_for(c.device, c.backend, c.world_size))
                 if env is None else f"{c.world_size} processes")
        print(f"hgraph train: {config.model.model} on {where}, {source}, "
              f"{data.steps} steps of {data.tokens_per_iter} tokens, strategies {config.planner.strategies}, "
              f"profile {config.planner.profile}", flush=True)
    try:
        result = run_training(config, timeout_s=config.cluster.timeout)
    except SpawnError as exc:
        sys.stderr.write(f"hgraph train: error: {str(exc).splitlines()[0]}{_resume_hint(config)}\n")
        return 1
    except (KeyboardInterrupt, Stopped) as exc:     # every process of the run has ended
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        sys.stderr.write(f"hgraph train: stopped by {signal.Signals(signum).name}{_resume_hint(config)}\n")
        return 128 + signum
    if outcome is not None:
        outcome.update(result=result, run_dir=str(run_dir) if run_dir is not None else None, metrics=metrics)
    stopped = result.get("stopped")
    if stopped is not None:            # every rank exits with the code; global rank 0 says where
        if speaker:
            if log.json:
                print(json.dumps({"stopped": stopped, "steps": result["steps"]}))
            sys.stderr.write(f"hgraph train: stopped by {stopped['signal']} after step {stopped['step']} of "
                             f"{data.steps}; checkpoint {stopped['checkpoint']} saved; --resume continues "
                             "from it\n")
        return EXIT_CODE
    steps = result["steps"]
    if result.get("rank", 0) != 0:                        # under torchrun only rank 0 reports
        _check_trained(steps)
        return 0
    plots = None
    if run_dir is not None and metrics is not None and log.plots:
        records = read_metrics(metrics)
        plots = write_plots(records, run_dir)
    if log.json:
        print(json.dumps({"steps": steps, "planned": result.get("planned", []), "cache": result["cache"],
                          "step_extra": result.get("step_extra", []),
                          "long_documents": result.get("long_documents", {}),
                          "dropout": result.get("dropout", "none"),
                          "sequence_parallel": result.get("sequence_parallel", "on"),
                          "shard_group": result.get("shard_group", {}),
                          "checkpoints": result.get("checkpoints", []), "resumed_from": result.get("resumed_from"),
                          "save_final": config.checkpointing.save_final, "metrics": metrics,
                          "run_dir": str(run_dir) if run_dir is not None else None,
                          "plots": [str(f) for f in plots.files] if plots is not None else []}))
        _check_trained(steps)
        return 0
    extra = {e["step"]: e for e in result.get("step_extra", [])}
    print(f"dropout: {result.get('dropout', 'none')}")
    print(f"sequence parallelism: {result.get('sequence_parallel', 'on')}")
    group = result.get("shard_group") or {}
    if group:
        why = f" (--shard-group auto: {group['auto']})" if group.get("auto") else ""
        over = f"the world ({group['size']} ranks)" if group.get("world") else f"groups of {group['size']} ranks"
        print(f"optimizer states: sharded over {over}{why}")
    if result.get("long_documents", {}).get("mode", "error") != "error":
        print(LongReport(**result["long_documents"]).summary())
    evals = [(k, e["eval_loss"]) for k, e in sorted(extra.items()) if "eval_loss" in e]
    if evals:
        print(f"validation: eval_loss {evals[0][1]:.4f} (step {evals[0][0]}) -> {evals[-1][1]:.4f} "
              f"(step {evals[-1][0]}) in {len(evals)} evaluations")
    c = result["cache"]
    print(f"graph cache: {c['hits']} hits ({c['ahead']} built ahead), {c['misses']} misses, switch on a hit "
          f"<= {c['max_hit_switch_ms']:.3f} ms; builds {c['build_s']:.2f} s in all, <= {c['max_build_s']:.2f} s each")
    saved = result.get("checkpoints", [])
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
    _check_trained(steps)
    return 0


def _check_trained(steps: list) -> None:
    """A run whose every step was skipped (non-finite loss) trained nothing: it failed (exit 1)."""
    if steps and all(s["skipped"] for s in steps):
        raise RunFailed(f"every one of the {len(steps)} steps was skipped (non-finite loss): nothing was trained; "
                        "check the initial weights and the data, or lower the learning rate")


def probe_folders(config: TrainConfig, run_dir: Optional[Path], env: Optional[LauncherEnv]) -> None:
    """The folders this node writes, probed before any rank starts (``runtime/process/writable.py``):
    by a local run's launcher, or by each node's local rank 0 under a launcher (every node writes
    checkpoint shards; global rank 0 the run folder, the metrics and the final state)."""
    if env is not None and env.local_rank != 0:
        return
    ckpts, log = config.checkpointing, config.logging
    folders = [("--checkpoint-dir", ckpts.checkpoint_dir)]
    if env is None or env.rank == 0:
        folders += [("--run-dir", run_dir),
                    ("--metrics", Path(log.metrics).parent if log.metrics else None),
                    ("--save-final", Path(ckpts.save_final).parent if ckpts.save_final else None)]
    probe_writable(folders)


def _resume_hint(config: TrainConfig) -> str:
    """``; --resume continues from DIR`` when the run has a checkpoint to continue from."""
    if config.checkpointing.checkpoint_dir is None:
        return ""
    last = latest(config.checkpointing.checkpoint_dir)
    return f"; --resume continues from {last}" if last is not None else ""


def _is_hf_dir(model: str) -> bool:
    """``hf:DIR`` (or a name that is neither a zoo name nor a directory: its one-line error)."""
    return model.startswith("hf:") and model[3:] not in ZOO_CONFIGS["hf"]


def _resume_point(config: TrainConfig, quiet: bool, speaker: bool = True) -> Optional[ResumePoint]:
    """With ``--resume``: the checkpoint to continue from, checked before any process starts (the
    ranks then all load it); its warnings go to stderr (``speaker``: this rank says them). None for a
    fresh run."""
    ckpts, steps, world_size = config.checkpointing, config.data.steps, config.cluster.world_size
    if not ckpts.resume:
        return None
    point = find_resume_point(ckpts.checkpoint_dir, fallback=ckpts.resume_fallback)
    for w in point.warnings if speaker else ():
        sys.stderr.write(f"hgraph train: warning: {w}\n")
    if point.step >= steps:
        raise HGraphError(f"--resume: {str(point.folder)!r} is at step {point.step} and --steps is "
                          f"{steps}: nothing left to train (--steps is the run's total)")
    check_resume_queues(point.manifest.get("delay_queues", {}), config.planner.outlier_queues, point.folder)
    if speaker and not quiet and point.manifest.get("foreign"):
        print(f"resuming from {point.folder}, a DCP checkpoint of another program: its Adam step count "
              f"{point.step} is taken as the steps done ({point.step} of {steps}); the data goes on after this "
              f"run's first {point.step} mini-batches", flush=True)
    elif speaker and not quiet:
        pos = point.data_position
        resharded = (f", resharded from {point.world_size} to {world_size} ranks"
                     if point.world_size != world_size else "")
        print(f"resuming from {point.folder}: {point.step} of {steps} steps done, next document "
              f"{pos.get('next_document')} (epoch {pos.get('epoch')}){resharded}", flush=True)
    return point
