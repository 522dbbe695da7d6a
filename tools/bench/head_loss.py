"""Peak memory and time of the last stage's loss, forward + backward: whole logits vs the chunked head.

A 128K-vocabulary head (``--vocab 131072``) on ``--tokens 4096`` tokens of one micro-batch: the loss the
runtime computed before (``ops.output_head`` returns the ``[tokens, vocab]`` logits, then
``F.cross_entropy`` of their fp32 copy) and the one it computes now (the head's inputs, the loss made
``chunk`` tokens at a time: ``runtime/kernels/head_cross_entropy``), each in a fresh process, measured
as the rise of the process's peak resident set over what the inputs already hold (``peak_memory``: on
CPU the peak RSS, on CUDA the allocator's peak). Both give the same loss and gradients (checked here
against each other on the same inputs).

    python -m hgraph.tools.bench.head_loss [--vocab 131072] [--tokens 4096] [--hidden 512] [--dtype fp32]
        [--json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from hgraph import ops
from hgraph.runtime.engine.loss import IGNORE_INDEX, stage_loss_sum
from hgraph.runtime.engine.peak_memory import PeakMemory
from hgraph.runtime.kernels.head_cross_entropy import chunk_tokens

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("whole-logits", "chunked")


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _inputs(vocab: int, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(1, tokens, hidden, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    targets[0, -1] = IGNORE_INDEX
    return h, w, targets


def measure(variant: str, vocab: int, tokens: int, hidden: int, dtype: torch.dtype,
            device: torch.device) -> dict:
    """One variant in this process: peak bytes above the inputs, seconds, loss and gradient norms."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    h, w, targets = _inputs(vocab, tokens, hidden, dtype, device)
    peak = PeakMemory(device)
    held = int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else _rss()
    peak.read()                       # start a new period: the inputs are held, nothing else yet
    t0 = time.perf_counter()
    if variant == "chunked":
        out = ops.HeadInputs(h, w, None, 0, vocab, vocab)
    else:
        out = ops.output_head(None, h, w, None)
    loss = stage_loss_sum(out, targets)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return {"variant": variant, "peak_bytes": peak.read() - held, "seconds": seconds, "loss": float(loss),
            "grad_h": h.grad.float().norm().item(), "grad_w": w.grad.float().norm().item()}


def _child(args: argparse.Namespace, variant: str) -> dict:
    cmd = [sys.executable, "-m", "hgraph.tools.bench.head_loss", "--child", variant,
           "--vocab", str(args.vocab), "--tokens", str(args.tokens), "--hidden", str(args.hidden),
           "--dtype", args.dtype, "--device", args.device]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"head_loss: the {variant} run failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.head_loss",
                                description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.vocab, args.tokens, args.hidden) < 1:
        print("head_loss: --vocab, --tokens and --hidden must be positive", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(measure(args.child, args.vocab, args.tokens, args.hidden, DTYPES[args.dtype],
                                 torch.device(args.device))))
        return 0
    runs = {v: _child(args, v) for v in VARIANTS}
    whole, chunked = runs["whole-logits"], runs["chunked"]
    result = {"vocab": args.vocab, "tokens": args.tokens, "hidden": args.hidden, "dtype": args.dtype,
              "device": args.device, "chunk_tokens": chunk_tokens(args.vocab),
              "logits_fp32_bytes": 4 * args.vocab * args.tokens, "runs": runs,
              "peak_ratio": whole["peak_bytes"] / max(chunked["peak_bytes"], 1),
              "loss_rel_diff": abs(whole["loss"] - chunked["loss"]) / abs(whole["loss"])}
    if args.json:
        print(json.dumps(result))
        return 0
    mib = 2 ** 20
    print(f"loss of a {args.vocab}-vocabulary head on {args.tokens} tokens (hidden {args.hidden}, "
          f"{args.dtype}, {args.device}); whole fp32 logits {result['logits_fp32_bytes'] / mib:.0f} MiB; "
          f"chunk "
          f"{result['chunk_tokens']} tokens")
    for v in VARIANTS:
        r = runs[v]
        print(f"  {v:13s} peak {r['peak_bytes'] / mib:8.0f} MiB above the inputs   {r['seconds']:6.2f} s   "
              f"loss {r['loss']:.6f}   |grad h| {r['grad_h']:.6f}   |grad w| {r['grad_w']:.6f}")
    print(f"peak memory ratio (whole / chunked): {result['peak_ratio']:.1f}x; loss relative difference "
          f"{result['loss_rel_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
