"""Sequence parallelism benchmark: activation bytes a TP rank keeps for backward, with and without SP.

    python -m hgraph.tools.bench.sequence_parallel [--model llama:tiny] [--model-args JSON] [--tp 2]
                                                   [--tokens 2048] [--steps 2] [--json]

Default model: a small Llama (hidden 512, MLP 1408, 4 layers, 8 heads, vocabulary 8192), fp32. Two ranks
train ``1xTP2PP1`` (``--tp``) on random documents packed into one micro-batch of ``--tokens`` tokens, once
with sequence parallelism (the default) and once with ``--no-sequence-parallel``, in the same processes.
Per run: the runtime's measured activation peak (``--track-memory``: the bytes autograd saves, counted
by the executor's ``ActivationMeter``; the largest over the steps and TP ranks) and the memory model's
prediction for that micro-batch (``hgraph memory``'s activations of the rank,
``runtime_memory.measured_activation_coeffs``), side by side with the SP / no-SP ratio.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.planner.cost.memory_estimate import stage_activation_bytes
from hgraph.runtime.planner.cost.runtime_memory import measured_activation_coeffs
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.launch import spawn
from hgraph.runtime.train.trainer import Trainer
from hgraph.strategy import Scheme

MODEL_ARGS = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "num_layers": 4,
              "num_heads": 8, "num_kv_heads": 8}


def _documents(tokens: int, steps: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [tokens // 4, tokens // 2, tokens - tokens // 4 - tokens // 2]   # three documents a step
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(steps) for n in lengths]


def _worker(rank: int, world: int, model: str, model_args: dict, tokens: int, steps: int) -> dict:
    groups = GroupCache(rank, world)
    docs = _documents(tokens, steps, model_args.get("vocab_size", 512))
    out = {}
    for sp in (True, False):
        config = TrainConfig.from_values(model=model, model_args=dict(model_args), dtype="fp32",
                                         world_size=world, strategy_schedule=f"1xTP{world}PP1", steps=steps,
                                         tokens_per_iter=tokens, microbatch_tokens=tokens, docs=docs,
                                         device_memory=None, track_memory=True, sequence_parallel=sp)
        trainer = Trainer(config, rank, world, groups)
        batches = mini_batches([Document(i, tuple(d)) for i, d in enumerate(docs)], tokens, steps)
        peaks = [trainer.step(b).peak_mem_bytes for b in batches]
        out["sp" if sp else "no_sp"] = {"peak": max(p for p in peaks if p is not None),
                                        "status": trainer.sequence_parallel}
    return out


def predicted(model: str, model_args: dict, tp: int, tokens: int, sequence_parallel: bool) -> int:
    """The memory model's activation bytes of the TP rank for one micro-batch of ``tokens`` tokens."""
    with torch.device("meta"):
        cfg = resolve_model_spec(model, model_args).config
    A, other = measured_activation_coeffs(cfg, [tp], sequence_parallel=sequence_parallel)
    return stage_activation_bytes(dict(A)[tp], dict(other)[tp], cfg.hidden_size, cfg.num_layers,
                                  Scheme(tp, 1, 1), 0, tokens)


def main(argv: Any = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.sequence_parallel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama:tiny")
    ap.add_argument("--model-args", default=json.dumps(MODEL_ARGS))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model_args = json.loads(args.model_args)
    ranks = spawn(_worker, args.tp, args=(args.model, model_args, args.tokens, args.steps), timeout_s=600)
    measured = {k: max(r[k]["peak"] for r in ranks) for k in ("sp", "no_sp")}
    model = {k: predicted(args.model, model_args, args.tp, args.tokens, k == "sp") for k in ("sp", "no_sp")}
    result = {"model": args.model, "model_args": model_args, "tp": args.tp, "tokens": args.tokens,
              "sequence_parallel": ranks[0]["sp"]["status"], "measured": measured, "model_prediction": model,
              "measured_ratio": measured["sp"] / measured["no_sp"],
              "model_ratio": model["sp"] / model["no_sp"]}
    if args.json:
        print(json.dumps(result))
        return result
    mib = 2 ** 20
    print(f"{args.model} TP{args.tp}, one micro-batch of {args.tokens} tokens, fp32: activation bytes per TP "
          f"rank (sequence parallelism: {result['sequence_parallel']})")
    print(f"{'':>18} {'SP':>12} {'no SP':>12} {'SP / no SP':>11}")
    for name, figures, ratio in (("measured (runtime)", measured, result["measured_ratio"]),
                                 ("memory model", model, result["model_ratio"])):
        print(f"{name:>18} {figures['sp'] / mib:>10.2f}Mi {figures['no_sp'] / mib:>10.2f}Mi {ratio:>11.3f}")
    return result


if __name__ == "__main__":
    main()
