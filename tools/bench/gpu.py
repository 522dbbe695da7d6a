"""GPU benchmark: one training step of the compiled model on one GPU (NCCL group of one, bf16 working
precision, packed varlen attention) against the same step in eager PyTorch on the same GPU.

``python -m hgraph.tools.bench.gpu [--model-args JSON] [--tokens 16384] [--steps 10] [--dtype bf16]``

Both sides train the same documents (long-tail lengths from the built-in Wikipedia sample) with Adam
and fp32 master weights. Eager runs each document alone under ``torch.autocast`` (bf16) — what
plain PyTorch does without a varlen kernel. The compiled step packs all documents into one row and uses the varlen
attention backend this machine has (flash-attn, PyTorch's varlen kernel, or the SDPA loop). Prints
median step times of alternated runs, tokens/s, and the ratios. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hgraph
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.engine.executor import Executor, MicroBatch
from hgraph.runtime.train.trainer import TrainConfig, build_model, make_optimizer
from hgraph.varlen_attention import available_backend

DEFAULT_MODEL_ARGS = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_layers": 8,
                      "num_heads": 16, "num_kv_heads": 8, "head_dim": 64, "max_seq_len": 8192}


def _documents(tokens: int, vocab: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Whole documents of built-in long-tail lengths (scaled to ``max_len``) summing to about ``tokens``."""
    docs = synthetic_documents(4 * tokens // 64 + 64, vocab, max_len, seed, scale=1.0)
    out, total = [], 0
    for d in docs:
        if total + len(d) > tokens:
            continue
        out.append(list(d))
        total += len(d)
    return out


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-args", default=json.dumps(DEFAULT_MODEL_ARGS), metavar="JSON")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: error: needs a CUDA GPU", file=sys.stderr)
        return 2

    model_args = json.loads(args.model_args)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = os.path.join(tempfile.mkdtemp(prefix="hgraph-bench-gpu-"), "s")
    dist.init_process_group("nccl", init_method="file://" + store, rank=0, world_size=1)
    try:
        cfg = TrainConfig.from_values(model="tiny", model_args=model_args, world_size=1, strategy_schedule="1xTP1PP1",
                                      steps=1, tokens_per_iter=args.tokens, lr=1e-4, dtype=args.dtype)
        model = build_model(cfg).to(dev)              # built right after manual_seed(cfg.seed)
        docs = _documents(args.tokens, model.config.vocab_size, min(model.config.max_seq_len, args.tokens))
        targets = sum(len(d) - 1 for d in docs)
        compiled = hgraph.compile(model, dtype=args.dtype)
        ex = Executor(compiled, make_optimizer(cfg, compiled, 0, 1), 0, 1, GroupCache(0, 1), device=dev)
        prog = compiled.instantiate("1xTP1PP1")
        mbs = [[MicroBatch.pack(docs)]]

        ref = build_model(cfg).to(dev)                # the same initial weights
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-4, fused=True)
        amp = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        tensors = [torch.tensor([d], device=dev) for d in docs]

        def eager_step():
            ref_opt.zero_grad(set_to_none=True)
            for ids in tensors:
                with torch.autocast("cuda", dtype=amp, enabled=args.dtype == "bf16"):
                    logits = ref(ids)
                (F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum") / targets).backward()
            ref_opt.step()

        def compiled_step():
            ex.step(prog, mbs, targets)

        for _ in range(3):
            compiled_step()
            eager_step()
        tc, te = [], []
        for _ in range(args.steps):
            tc.append(_timed(compiled_step))
            te.append(_timed(eager_step))
        q = torch.randn(1, 4, 8, 16, device=dev, dtype=amp)
        out = {"device": torch.cuda.get_device_name(dev), "dtype": args.dtype, "docs": len(docs),
               "tokens": sum(len(d) for d in docs), "longest": max(len(d) for d in docs),
               "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
               "varlen_backend": available_backend(q),
               "compiled_ms": 1e3 * statistics.median(tc), "eager_per_doc_ms": 1e3 * statistics.median(te),
               "ratio": statistics.median(a / b for a, b in zip(tc, te))}
        out["compiled_tokens_per_s"] = out["tokens"] / (out["compiled_ms"] / 1e3)
    finally:
        dist.destroy_process_group()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['device']}, {out['dtype']}, {out['params_m']:.1f} M parameters, {out['docs']} documents, "
          f"{out['tokens']} tokens (longest {out['longest']}), varlen backend {out['varlen_backend']}")
    print(f"compiled step {out['compiled_ms']:.1f} ms ({out['compiled_tokens_per_s']:.0f} tokens/s), eager "
          f"(each document alone) {out['eager_per_doc_ms']:.1f} ms; ratio compiled/eager {out['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
