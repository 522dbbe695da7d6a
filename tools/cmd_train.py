"""``hgraph train``: dynamic heterogeneous training, the planner choosing every iteration's strategy.

With no arguments it runs the built-in default: ``llama:tiny`` on the built-in long-tail documents
(``hgraph.runtime.builtin_data.synthetic_documents``: real Wikipedia lengths scaled for CPU), 4 local
processes, the analytic cost model, ``auto`` candidate strategies and the planner's choice every
iteration; it prints one line per iteration and a summary, and writes ``metrics.jsonl`` and the plots
(``hgraph.tools.plots``) into ``--run-dir`` (default ``runs/<UTC timestamp>``).

Planner-driven mode (``--strategies auto|"S1;S2"``, the default): every iteration
``plan_iteration`` picks the strategy among the candidates and dispatches the mini-batch's documents
to pipelines and micro-batches with the cost model of ``--profile`` (``analytic``: the analytic prior
for the model and world size; or a built-in profile NAME or a profile FILE); rank 0 plans and
broadcasts the plan. Deterministic mode (``--strategy-schedule``): step k uses S_(k mod len).

Starts ``--world-size`` local processes (gloo on CPU) or, under ``torchrun``, runs as this process's
rank. The model is built right after ``torch.manual_seed(--seed)``; mini-batches take whole documents
of ``--data`` (JSONL with ``input_ids``) in file order up to ``--tokens-per-iter`` tokens; in
deterministic mode documents are dispatched and packed by the runtime's built-in rule
(``hgraph.runtime.trainer.dispatch_and_pack``). Optimizer defaults are
PyTorch's (Adam, no weight decay, no clipping). ``--save-final`` writes the gathered fp32 state_dict
(keyed like the original module) with ``torch.save``; ``--metrics`` one JSON line per step.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from hgraph.errors import HGraphError

# The built-in default run: sized so that it finishes in a few minutes with 4 processes on 2 CPU
# cores (about DEFAULT_TOKENS_PER_ITER tokens per step, a long-tail mix of short and long documents).
DEFAULT_MODEL = "llama:tiny"
DEFAULT_WORLD_SIZE = 4
DEFAULT_STEPS = 60
DEFAULT_TOKENS_PER_ITER = 8192
BUILTIN_SEED = 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train with the planner's strategy every iteration (no arguments: "
                              "the built-in default run)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="SPEC",
                   help=f"zoo config (tiny, llama:tiny) or FILE.py:CLASS (default {DEFAULT_MODEL})")
    p.add_argument("--model-args", default="{}", metavar="JSON", help="model config overrides / class kwargs")
    p.add_argument("--data", default=None, metavar="FILE.jsonl",
                   help="one object per line with input_ids (default: the built-in long-tail documents)")
    p.add_argument("--world-size", default=DEFAULT_WORLD_SIZE, type=int, metavar="N",
                   help=f"processes (default {DEFAULT_WORLD_SIZE})")
    p.add_argument("--strategies", default=None, metavar="auto|S1;S2;...",
                   help="planner-driven: candidate strategies, 'auto' (proposed for the data) or a list "
                        "(default auto unless --strategy-schedule is given)")
    p.add_argument("--profile", default="analytic", metavar="analytic|NAME|FILE",
                   help="cost model of the planner (default analytic: the analytic prior for the model)")
    p.add_argument("--strategy-schedule", default=None, metavar="S1;S2;...",
                   help="deterministic mode: strategies, one per step in turn, e.g. '4xTP1PP1;1xTP2PP2'")
    p.add_argument("--steps", default=DEFAULT_STEPS, type=int, metavar="K", help=f"default {DEFAULT_STEPS}")
    p.add_argument("--tokens-per-iter", default=DEFAULT_TOKENS_PER_ITER, type=int, metavar="T",
                   help=f"default {DEFAULT_TOKENS_PER_ITER}")
    p.add_argument("--optimizer", default="adam", choices=("adam", "adamw"))
    p.add_argument("--lr", default=1e-3, type=float)
    p.add_argument("--betas", default="0.9,0.999", metavar="B1,B2")
    p.add_argument("--eps", default=1e-8, type=float)
    p.add_argument("--weight-decay", default=None, type=float,
                   help="default: 0 for adam, 1e-2 for adamw (PyTorch's)")
    p.add_argument("--grad-clip", default="none", metavar="NORM|none", help="clip by global norm (default none)")
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="working precision (masters stay fp32)")
    p.add_argument("--microbatch-tokens", default=None, type=int, metavar="T",
                   help="token limit of a packed micro-batch (default: see the built-in dispatch rule)")
    p.add_argument("--memory-budget", default=None, metavar="BYTES",
                   help="activation bytes per rank (suffix K/M/G allowed): blocks are recomputed per "
                        "micro-batch, as few as fit (dynamic recomputation); default: no recomputation")
    p.add_argument("--cp-sharding", default="adaptive", choices=("adaptive", "per-document", "per-sequence"),
                   help="how CP ranks split a micro-batch (default: by the attention-kernel estimate, WLB §5.3)")
    p.add_argument("--balance", default="none", choices=("none", "dcp-inter"),
                   help="dcp-inter: homogeneous data parallelism (--strategy-schedule NxTP1PP1) with the "
                        "sequence-parallel size chosen per batch and gradient accumulation balancing the replicas")
    p.add_argument("--skip-nonfinite", action="store_true", help="skip the update of a step whose loss is NaN/inf")
    p.add_argument("--timeout", default=60.0, type=float, metavar="S",
                   help="seconds a collective may wait (a lost rank is reported within it; default 60)")
    p.add_argument("--save-final", default=None, metavar="PATH")
    p.add_argument("--metrics", default=None, metavar="PATH.jsonl",
                   help="metrics file (planner-driven default: RUN_DIR/metrics.jsonl)")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="planner-driven: where metrics.jsonl and the plots go (default runs/<UTC timestamp>)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def config_from_args(args: argparse.Namespace):
    """A ``TrainConfig`` from the parsed options (bad values: one-line HGraphError)."""
    from hgraph.runtime.trainer import TrainConfig, parse_schedule
    try:
        model_args = json.loads(args.model_args)
    except json.JSONDecodeError as exc:
        raise HGraphError(f"--model-args is not valid JSON: {exc.msg}") from None
    if not isinstance(model_args, dict):
        raise HGraphError("--model-args must be a JSON object, e.g. '{\"num_layers\": 2}'")
    try:
        betas = tuple(float(b) for b in args.betas.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2:
        raise HGraphError(f"--betas {args.betas!r}: expected two numbers B1,B2, e.g. 0.9,0.999")
    clip = None
    if args.grad_clip.lower() != "none":
        try:
            clip = float(args.grad_clip)
        except ValueError:
            clip = -1.0
        if not clip > 0 or not math.isfinite(clip):
            raise HGraphError(f"--grad-clip {args.grad_clip!r}: expected a positive number or 'none'")
    if args.world_size < 1:
        raise HGraphError(f"--world-size must be >= 1, got {args.world_size}")
    if args.steps < 1:
        raise HGraphError(f"--steps must be >= 1, got {args.steps}")
    if args.tokens_per_iter < 1:
        raise HGraphError(f"--tokens-per-iter must be >= 1, got {args.tokens_per_iter}")
    if args.timeout <= 0:
        raise HGraphError(f"--timeout must be > 0, got {args.timeout}")
    schedule, strategies = args.strategy_schedule, args.strategies
    if schedule is not None and strategies is not None:
        raise HGraphError("--strategies and --strategy-schedule exclude each other: the planner chooses, "
                          "or the schedule does")
    if schedule is not None:
        parse_schedule(schedule, args.world_size)      # fails here, before any process starts
    else:
        from hgraph.runtime.planned_dispatch import parse_candidates
        strategies = strategies or "auto"
        if strategies.strip() != "auto":
            parse_candidates(strategies, args.world_size)
    return TrainConfig(model=args.model, world_size=args.world_size,
                       schedule=schedule.split(";") if schedule is not None else (),
                       strategies=strategies, profile=args.profile,
                       steps=args.steps, tokens_per_iter=args.tokens_per_iter, data=args.data,
                       model_args=model_args, optimizer=args.optimizer, lr=args.lr, betas=betas, eps=args.eps,
                       weight_decay=args.weight_decay, grad_clip=clip, seed=args.seed, dtype=args.dtype,
                       microbatch_tokens=args.microbatch_tokens, skip_nonfinite=args.skip_nonfinite,
                       save_final=args.save_final, metrics=args.metrics,
                       memory_budget=parse_bytes(args.memory_budget, "--memory-budget"),
                       cp_sharding=args.cp_sharding, balance=args.balance)


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


def builtin_documents(model: str, model_args: dict, steps: int, tokens_per_iter: int) -> list[list[int]]:
    """The built-in long-tail documents for ``model`` (its vocabulary and context length): enough for
    ``steps`` mini-batches without wrapping around (the scaled lengths average ~62 tokens)."""
    from hgraph.runtime.builtin_data import synthetic_documents
    from hgraph.runtime.trainer import TrainConfig, build_model

    cfg = getattr(build_model(TrainConfig(model=model, world_size=1, schedule=(), steps=1, tokens_per_iter=1,
                                          model_args=model_args)), "config", None)
    vocab, max_len = getattr(cfg, "vocab_size", None), getattr(cfg, "max_seq_len", None)
    if not vocab or not max_len:
        raise HGraphError(f"--model {model}: the built-in data needs a zoo model with vocab_size and "
                          "max_seq_len; give --data FILE.jsonl")
    num_docs = max(64, math.ceil(steps * tokens_per_iter / 24))
    return synthetic_documents(num_docs, int(vocab), min(int(max_len), tokens_per_iter), BUILTIN_SEED)


def default_run_dir() -> Path:
    """``runs/<UTC timestamp>`` (with a suffix if a run of the same second exists)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _print_summary(records: list, run_dir: Path, plots) -> None:
    from hgraph.tools.plots import summarize
    s = summarize(records)
    used = ", ".join(f"{k} x{v}" for k, v in s.strategies.items())
    print(f"summary: {s.steps} steps, {s.steps_per_s:.2f} steps/s, {s.tokens_per_s:.0f} tokens/s; "
          f"{s.distinct_strategies} distinct strategies: {used}")
    loss = (f"loss {s.first_loss:.4f} -> {s.last_loss:.4f}" if s.first_loss is not None else "no finite loss")
    extra = []
    if s.mean_balance is not None:
        extra.append(f"mean balance (max/mean busy) {s.mean_balance:.2f}")
    if s.est_within_10pct is not None:
        extra.append(f"estimate within 10% of measured in {100 * s.est_within_10pct:.0f}% of steps")
    if s.planner_wait_s is not None:
        extra.append(f"planner wait {s.planner_wait_s:.2f} s in all")
    if s.cache_hit_rate is not None:
        extra.append(f"cache hit rate {100 * s.cache_hit_rate:.0f}%")
    print(f"         {loss}; " + "; ".join(extra))
    print(f"run dir: {run_dir} (metrics.jsonl, {len(plots.files)} plot files"
          + (f"; skipped: {', '.join(plots.skipped)}" if plots.skipped else "") + ")")


def run(args: argparse.Namespace) -> int:
    from hgraph.runtime.data import read_jsonl
    from hgraph.runtime.launch import SpawnError
    from hgraph.runtime.trainer import run_training

    config = config_from_args(args)
    planned = config.strategies is not None
    run_dir = None
    if planned or args.run_dir is not None:
        run_dir = Path(args.run_dir) if args.run_dir is not None else default_run_dir()
        run_dir.mkdir(parents=True, exist_ok=True)
        if config.metrics is None:
            config.metrics = str(run_dir / "metrics.jsonl")
    if config.data is not None:
        read_jsonl(config.data)                          # a malformed line fails before the launch
    else:
        config.docs = builtin_documents(config.model, config.model_args, config.steps, config.tokens_per_iter)
    config.log_steps = planned and not args.json
    if config.log_steps:
        source = args.data or "built-in long-tail documents"
        print(f"hgraph train: {config.model} on {config.world_size} processes, {source}, "
              f"{config.steps} steps of {config.tokens_per_iter} tokens, strategies {config.strategies}, "
              f"profile {config.profile}", flush=True)
    try:
        result = run_training(config, timeout_s=args.timeout)
    except SpawnError as exc:
        sys.stderr.write(f"hgraph train: error: {str(exc).splitlines()[0]}\n")
        return 1
    if result.get("rank", 0) != 0:
        return 0                                          # under torchrun only rank 0 reports
    steps = result["steps"]
    plots = None
    if run_dir is not None and config.metrics is not None:
        from hgraph.tools.plots import read_metrics, write_plots
        records = read_metrics(config.metrics)
        plots = write_plots(records, run_dir)
    if args.json:
        print(json.dumps({"steps": steps, "planned": result.get("planned", []), "cache": result["cache"],
                          "save_final": config.save_final, "metrics": config.metrics,
                          "run_dir": str(run_dir) if run_dir is not None else None,
                          "plots": [str(f) for f in plots.files] if plots is not None else []}))
        return 0
    if not planned:
        for s in steps:
            print(f"step {s['step']:>4}  {s['strategy']:<28} loss {s['loss']:.6f}  tokens {s['tokens']:>6}  "
                  f"{1e3 * s['time_s']:.1f} ms" + ("  (skipped: non-finite loss)" if s["skipped"] else ""))
    c = result["cache"]
    print(f"graph cache: {c['hits']} hits, {c['misses']} misses, switch on a hit "
          f"<= {c['max_hit_switch_ms']:.3f} ms")
    if plots is not None:
        _print_summary(records, run_dir, plots)
    return 0
