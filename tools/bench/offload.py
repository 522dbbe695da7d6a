"""Activation offload on one rank: the host link's bandwidth, and the same steps with every block
offloaded (``--offload on``) against none, on this machine's device.

Prints the host link (``measure_host_link``: device to pinned host memory and back on CUDA, a memcpy
on CPU), and per run the median step time over the steps after the first, the device's peak (CUDA's
allocator peak; on CPU the saved-tensor count) and the host peak, and whether the losses and the
final parameters are bitwise those of the run without offload.

    python -m hgraph.tools.bench.offload [--device cpu|cuda] [--steps 4] [--tokens-per-iter 2048] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.planner.cost.profiler import measure_host_link
from hgraph.runtime.train.trainer import Trainer
from hgraph.runtime.train.config import TrainConfig

SEED = 7
MODES = ("off", "on")


def measure(device: str, steps: int, tokens: int, model: str = "tiny") -> dict:
    """The host link and one run per offload mode (module docstring)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise HGraphError("--device cuda: this machine has no CUDA device")
    docs = synthetic_documents(max(64, steps * tokens // 20), 512, min(1024, tokens), SEED)
    batches = list(mini_batches([Document(i, tuple(d)) for i, d in enumerate(docs)], tokens, steps))
    runs = {}
    for mode in MODES:
        cfg = TrainConfig.from_values(model=model, world_size=1, strategy_schedule="1xTP1PP1", steps=steps,
                                      tokens_per_iter=tokens, docs=docs, offload=mode, track_memory=True,
                                      device=device, compile="off")
        trainer = Trainer(cfg, 0, 1, None)
        res = [trainer.step(b) for b in batches]
        runs[mode] = {"losses": [r.loss for r in res], "final": trainer.final_state_dict(),
                      "median_step_ms": 1e3 * statistics.median([r.time_s for r in res[1:]] or [res[0].time_s]),
                      "peak_bytes": max(r.peak_mem_bytes or 0 for r in res),
                      "host_peak_bytes": max((r.host_peak_bytes or 0) for r in res),
                      "offloaded_blocks": [r.offload_layers for r in res]}
    off, on = runs["off"], runs["on"]
    bitwise = on["losses"] == off["losses"] and all(torch.equal(on["final"][k], v) for k, v in off["final"].items())
    link = measure_host_link(device)
    return {"device": device, "host_link": link, "bitwise_equal": bitwise,
            "runs": {m: {k: v for k, v in r.items() if k != "final"} for m, r in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.offload", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="tiny", help="a zoo llama config (default tiny)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tokens-per-iter", type=int, default=2048)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.steps < 1 or args.tokens_per_iter < 1:
            raise HGraphError("--steps and --tokens-per-iter must be positive")
        out = measure(args.device, args.steps, args.tokens_per_iter, args.model)
    except HGraphError as exc:
        print(f"bench_offload: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
        return 0
    link = out["host_link"]
    print(f"host link on {out['device']}: {link['bytes_per_s'] / 1e9:.2f} GB/s "
          f"(to host {link['to_host_bytes_per_s'] / 1e9:.2f}, to device {link['to_device_bytes_per_s'] / 1e9:.2f}); "
          f"{link['source']}")
    print(f"{'offload':>8} {'step ms':>9} {'device peak':>12} {'host peak':>12}")
    for mode, r in out["runs"].items():
        print(f"{mode:>8} {r['median_step_ms']:>9.1f} {r['peak_bytes']:>12} {r['host_peak_bytes']:>12}")
    print(f"bitwise equal with and without offload: {out['bitwise_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
