"""Step time of the sharded optimizer on a model with many parameters: per-parameter loop vs foreach vs fused.

A Llama of ``--layers`` layers of ``--hidden`` width (9 parameters a layer: a few hundred tensors) on
one rank, the same gradients every step, side by side in one process:

* ``torch.optim.Adam(foreach=False)``: torch's per-parameter Python loop (the single-tensor path);
* ``torch.optim.Adam(foreach=True)``: torch's multi-tensor path;
* ``ShardedAdam(impl="exact")``: hgraph's bitwise-equal path (torch's single-tensor arithmetic, one
  ``torch._foreach_*`` call per operation over the rank's shards, views into its flat buffers);
* ``ShardedAdam(impl="fused")``: hgraph's default, torch's fused Adam kernel over the same views.

Per variant the median step time over ``--steps`` steps after one warm-up, and the largest difference
of the parameters from the per-parameter loop's after those steps (exact: 0, bitwise).

    python -m hgraph.tools.bench.optimizer [--layers 32] [--hidden 256] [--steps 10] [--threads N] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hgraph.frontends.zoo import llama
from hgraph.runtime.engine.optimizer import ShardedAdam


def _model_params(layers: int, hidden: int) -> dict[str, torch.Tensor]:
    cfg = llama.make_config("tiny", num_layers=layers, hidden_size=hidden,
                            intermediate_size=hidden * 11 // 4, num_heads=max(1, hidden // 64),
                            num_kv_heads=max(1, hidden // 128), vocab_size=8192)
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in llama.build(cfg).named_parameters()}


def _grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(p.shape, generator=g) * 1e-2 for n, p in params.items()}


def _time_torch(params, grads, steps: int, foreach: bool) -> tuple[list[float], dict]:
    ps = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    for n, p in ps.items():
        p.grad = grads[n]
    opt = torch.optim.Adam(ps.values(), lr=1e-3, foreach=foreach)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[1:], {n: p.detach() for n, p in ps.items()}


def _time_sharded(params, grads, steps: int, impl: str) -> tuple[list[float], dict]:
    opt = ShardedAdam(params.items(), {}, 0, 1, lr=1e-3, impl=impl)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        opt.step(grads)
        times.append(time.perf_counter() - t0)
    return times[1:], opt.full_state_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.optimizer",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.layers, args.hidden, args.steps) < 1 or args.hidden % 64:
        print("optimizer bench: --layers and --steps must be >= 1, --hidden a multiple of 64",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    params = _model_params(args.layers, args.hidden)
    grads = _grads(params)
    variants = {
        "torch loop (foreach=False)": lambda: _time_torch(params, grads, args.steps, False),
        "torch foreach": lambda: _time_torch(params, grads, args.steps, True),
        "ShardedAdam exact": lambda: _time_sharded(params, grads, args.steps, "exact"),
        "ShardedAdam fused": lambda: _time_sharded(params, grads, args.steps, "fused"),
    }
    runs, reference = {}, None
    for name, fn in variants.items():
        times, final = fn()
        reference = reference if reference is not None else final
        diff = max((final[n] - reference[n]).abs().max().item() for n in reference)
        runs[name] = {"median_ms": 1e3 * statistics.median(times), "max_abs_diff_vs_loop": diff}
    loop = runs["torch loop (foreach=False)"]["median_ms"]
    result = {"tensors": len(params), "elements": sum(t.numel() for t in params.values()),
              "threads": torch.get_num_threads(), "steps": args.steps, "runs": runs,
              "speedup_vs_loop": {n: loop / r["median_ms"] for n, r in runs.items()}}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Adam step on {result['tensors']} tensors, {result['elements'] / 1e6:.1f}M fp32 elements, "
          f"{result['threads']} threads, median of {args.steps} steps")
    for name, r in runs.items():
        print(f"  {name:28s} {r['median_ms']:9.2f} ms   {result['speedup_vs_loop'][name]:5.2f}x the loop   "
              f"max |diff| vs the loop {r['max_abs_diff_vs_loop']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
