"""Step time of one rank with ``--compile on`` (inductor) against eager, side by side in one process.

Two executors train the same Llama from the same initial weights on the same packed micro-batches
(random documents, a different packed length every step), their steps interleaved so that the
machine's load falls on both alike. Per model: the first compiled step (inductor's compile of every
region, forward and backward), the median steady step of each (after ``--warmup`` steps), the
eager/compiled ratio, the regions and their compilations, and the largest loss difference.

Models: ``tiny`` (the zoo's) and a 4-layer 1024-wide one (``--models tiny,4x1024``: ``LxW`` builds a
Llama of L layers of width W, 16 heads of 64, vocabulary ``--vocab``).

    python -m hgraph.tools.bench.torch_compile [--models tiny,4x1024] [--tokens 512] [--steps 6]
        [--warmup 2] [--threads N] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor, shard_dims_of
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.strategy import Strategy


def _model(spec: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if spec in llama.CONFIGS:
        return llama.build(spec)
    layers, width = (int(x) for x in spec.split("x"))
    return llama.build("tiny", num_layers=layers, hidden_size=width, intermediate_size=width * 11 // 4,
                       num_heads=width // 64, vocab_size=vocab)


def _executor(model: torch.nn.Module, mode: str) -> tuple[Executor, object]:
    compiled = hgraph.compile(model)
    params = dict(model.named_parameters())
    opt = ShardedAdam([(n, params[n].detach().clone()) for n in compiled.hgraph.params],
                      shard_dims_of(compiled), 0, 1, lr=1e-4)
    ex = Executor(compiled, opt, 0, 1, GroupCache(0, 1), compile_mode=mode)
    return ex, ex.program(Strategy.parse("1xTP1PP1"))


def _microbatches(steps: int, tokens: int, vocab: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        budget = tokens - int(torch.randint(0, tokens // 4, (1,), generator=g))    # lengths vary per step
        docs = []
        while budget > 1:
            n = min(budget, int(torch.randint(2, max(3, tokens // 3), (1,), generator=g)))
            docs.append(torch.randint(0, vocab, (n,), generator=g).tolist())
            budget -= n
        out.append(MicroBatch.pack(docs))
    return out


def bench(spec: str, tokens: int, steps: int, warmup: int, vocab: int) -> dict:
    model = _model(spec, vocab)
    runs = {mode: _executor(model, mode) for mode in ("off", "on")}
    times: dict[str, list[float]] = {"off": [], "on": []}
    losses: dict[str, list[float]] = {"off": [], "on": []}
    for k, mb in enumerate(_microbatches(steps, tokens, model.config.vocab_size)):
        for mode, (ex, program) in runs.items():
            t0 = time.perf_counter()
            r = ex.step(program, [[mb]], mb.tokens - len(mb.doc_lengths), k)
            times[mode].append(time.perf_counter() - t0)
            losses[mode].append(r.loss)
    eager = statistics.median(times["off"][warmup:])
    compiled = statistics.median(times["on"][warmup:])
    counts = runs["on"][0].region_compiles
    return {"model": spec, "params": sum(p.numel() for p in model.parameters()), "tokens_per_step": tokens,
            "first_compiled_step_s": times["on"][0], "first_eager_step_s": times["off"][0],
            "eager_step_s": eager, "compiled_step_s": compiled, "speedup": eager / compiled,
            "regions": len(counts.counts), "compiles": counts.total, "eager_regions": counts.eager,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["off"], losses["on"]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.torch_compile",
                                description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,4x1024")
    p.add_argument("--tokens", type=int, default=512, help="tokens per packed micro-batch (at most)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the LxW models")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    specs = [s.strip() for s in args.models.split(",") if s.strip()]
    bad = [s for s in specs if s not in llama.CONFIGS and not
           (len(s.split("x")) == 2 and all(x.isdigit() and int(x) > 0 for x in s.split("x"))
            and int(s.split("x")[1]) % 64 == 0)]
    if bad or not specs or args.tokens < 8 or args.steps <= args.warmup or args.warmup < 1:
        print(f"torch_compile bench: models are zoo names or LxW (W a multiple of 64), got {bad or specs}; "
              "--tokens >= 8, --steps > --warmup >= 1", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [bench(s, args.tokens, args.steps, args.warmup, args.vocab) for s in specs]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}))
        return 0
    print(f"one rank, {torch.get_num_threads()} threads, steps {args.steps} (median of the last "
          f"{args.steps - args.warmup}), up to {args.tokens} packed tokens a step")
    print(f"{'model':>8} {'params':>10} {'eager ms':>9} {'compiled ms':>12} {'speedup':>8} "
          f"{'1st compiled s':>15} {'regions':>8} {'compiles':>9} {'max |dloss|':>12}")
    for r in rows:
        print(f"{r['model']:>8} {r['params']:>10,} {1e3 * r['eager_step_s']:>9.1f} "
              f"{1e3 * r['compiled_step_s']:>12.1f} {r['speedup']:>7.2f}x "
              f"{r['first_compiled_step_s']:>15.1f} "
              f"{r['regions']:>8} {r['compiles']:>9} {r['max_loss_diff']:>12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
