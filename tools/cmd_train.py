"""``hgraph train``: deterministic training with a fixed strategy schedule (step k uses S_(k mod len)).

Starts ``--world-size`` local processes (gloo on CPU) or, under ``torchrun``, runs as this process's
rank. The model is built right after ``torch.manual_seed(--seed)``; mini-batches take whole documents
of ``--data`` (JSONL with ``input_ids``) in file order up to ``--tokens-per-iter`` tokens; inside a
mini-batch documents are dispatched and packed by the runtime's built-in rule
(``hgraph.runtime.trainer.dispatch_and_pack``) until the planner is wired in. Optimizer defaults are
PyTorch's (Adam, no weight decay, no clipping). ``--save-final`` writes the gathered fp32 state_dict
(keyed like the original module) with ``torch.save``; ``--metrics`` one JSON line per step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from hgraph.errors import HGraphError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train with a fixed strategy schedule (deterministic mode)",
                              description=__doc__)
    p.add_argument("--model", required=True, metavar="SPEC", help="zoo config (tiny, llama:tiny) or FILE.py:CLASS")
    p.add_argument("--model-args", default="{}", metavar="JSON", help="model config overrides / class kwargs")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="one object per line with input_ids")
    p.add_argument("--world-size", required=True, type=int, metavar="N")
    p.add_argument("--strategy-schedule", required=True, metavar="S1;S2;...",
                   help="strategies, one per step in turn, e.g. '4xTP1PP1;1xTP2PP2'")
    p.add_argument("--steps", required=True, type=int, metavar="K")
    p.add_argument("--tokens-per-iter", required=True, type=int, metavar="T")
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
    p.add_argument("--skip-nonfinite", action="store_true", help="skip the update of a step whose loss is NaN/inf")
    p.add_argument("--timeout", default=60.0, type=float, metavar="S",
                   help="seconds a collective may wait (a lost rank is reported within it; default 60)")
    p.add_argument("--save-final", default=None, metavar="PATH")
    p.add_argument("--metrics", default=None, metavar="PATH.jsonl")
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
    schedule = args.strategy_schedule
    parse_schedule(schedule, args.world_size)          # fails here, before any process starts
    return TrainConfig(model=args.model, world_size=args.world_size, schedule=schedule.split(";"),
                       steps=args.steps, tokens_per_iter=args.tokens_per_iter, data=args.data,
                       model_args=model_args, optimizer=args.optimizer, lr=args.lr, betas=betas, eps=args.eps,
                       weight_decay=args.weight_decay, grad_clip=clip, seed=args.seed, dtype=args.dtype,
                       microbatch_tokens=args.microbatch_tokens, skip_nonfinite=args.skip_nonfinite,
                       save_final=args.save_final, metrics=args.metrics)


def run(args: argparse.Namespace) -> int:
    from hgraph.runtime.data import read_jsonl
    from hgraph.runtime.launch import SpawnError
    from hgraph.runtime.trainer import run_training

    config = config_from_args(args)
    read_jsonl(config.data)                              # a malformed line fails before the launch
    try:
        result = run_training(config, timeout_s=args.timeout)
    except SpawnError as exc:
        sys.stderr.write(f"hgraph train: error: {str(exc).splitlines()[0]}\n")
        return 1
    if result.get("rank", 0) != 0:
        return 0                                          # under torchrun only rank 0 reports
    steps = result["steps"]
    if args.json:
        print(json.dumps({"steps": steps, "cache": result["cache"],
                          "save_final": config.save_final, "metrics": config.metrics}))
    else:
        for s in steps:
            print(f"step {s['step']:>4}  {s['strategy']:<28} loss {s['loss']:.6f}  tokens {s['tokens']:>6}  "
                  f"{1e3 * s['time_s']:.1f} ms" + ("  (skipped: non-finite loss)" if s["skipped"] else ""))
        c = result["cache"]
        print(f"graph cache: {c['hits']} hits, {c['misses']} misses, switch on a hit "
              f"<= {c['max_hit_switch_ms']:.3f} ms")
    return 0
