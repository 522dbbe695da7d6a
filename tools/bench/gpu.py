"""GPU benchmark: hgraph's compiled single-pipeline training step against the same model in plain
PyTorch with ``torch.compile`` and varlen attention, on one device, with MFU and a kernel profile.

``python -m hgraph.tools.bench.gpu [--model-args JSON] [--tokens 16384] [--steps 10] [--dtype bf16]
[--compile on|off] [--profile] [--device cuda|cpu] [--json]``

Both sides train one packed row of whole documents of real lengths (the built-in Wikipedia length
sample, scaled to the model's context) with Adam and fp32 master weights:

* hgraph: ``Executor.step`` of ``1xTP1PP1`` (NCCL group of one), its rank graph compiled region by
  region (``--compile``), packed varlen attention and the chunked loss;
* plain PyTorch: the same weights under ``torch.autocast``, the whole model behind one
  ``torch.compile`` (dynamic), its attention the same varlen kernel on the same row's documents
  (flash-attn, PyTorch's varlen kernel, or the SDPA loop), the loss on the whole logits, torch's fused Adam.

Prints median step times of alternated steps, tokens/s, model TFLOP/s and MFU (``runtime/train/
throughput``: the device's dense bf16 peak) of both, the ratio hgraph/plain (goal <= 1.03), and with
``--profile`` the top kernels of two hgraph steps (``torch.profiler``), where in them the GPU waits
for the host between kernels (``gpu_idle``), and where one hgraph step waits for the GPU
(``torch.cuda.set_sync_debug_mode``). ``--device cpu`` (gloo, fp32)
runs the same code as a smoke test; its times say nothing about a GPU. The default model is a Llama of
1.1B parameters (TinyLlama's shape).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import hgraph
import hgraph.frontends
import hgraph.passes
import hgraph.runtime
import hgraph.tools
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor
from hgraph.runtime.train.throughput import ModelFlops, device_peak_tflops, step_throughput
from hgraph.runtime.train.model_setup import build_model, make_optimizer
from hgraph.runtime.train.config import TrainConfig
from hgraph.tools.bench.gpu_idle import gpu_idle, idle_lines
from hgraph.varlen_attention import available_backend, cu_seqlens_for, varlen_attention

DEFAULT_MODEL_ARGS = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22,
                      "num_heads": 32, "num_kv_heads": 4, "head_dim": 64, "max_seq_len": 8192}


def bench_documents(tokens: int, vocab: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Whole documents of built-in long-tail lengths (scaled to ``max_len``) summing to about ``tokens``."""
    docs = synthetic_documents(4 * tokens // 64 + 64, vocab, max_len, seed, scale=1.0)
    out, total = [], 0
    for d in docs:
        if total + len(d) > tokens:
            continue
        out.append(list(d))
        total += len(d)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def alternate(hgraph_step, plain_step, steps: int, device: torch.device, warmup: int = 3
              ) -> tuple[float, list[float], list[float]]:
    """Both steps ``warmup`` times (compiles, allocator warm-up), then ``steps`` timed steps of each in
    turn: (the warm-up's seconds, hgraph's step times, plain PyTorch's)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        hgraph_step()
        plain_step()
    warmup_s = time.perf_counter() - t0
    th, tp = [], []
    for _ in range(steps):
        th.append(timed(hgraph_step, device))
        tp.append(timed(plain_step, device))
    return warmup_s, th, tp


@contextlib.contextmanager
def varlen_sdpa(cu):
    """The plain model's ``F.scaled_dot_product_attention(..., is_causal=True)`` as varlen attention on
    the documents ``cu`` of the packed row (a device tensor, or ``DocumentBounds``: known on the host,
    nothing read back per layer; one function object for the run: dynamo guards on it)."""
    sdpa = F.scaled_dot_product_attention
    inside = []       # the SDPA loop backend calls SDPA per document: those calls are the real one

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if inside:
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        inside.append(True)
        try:
            return varlen_attention(q, k, v, cu, scale=scale, enable_gqa=enable_gqa)
        finally:
            inside.pop()

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def top_kernels(step, device: torch.device, rows: int = 12) -> tuple[str, dict]:
    """The kernels (or CPU ops) taking the most time over two steps, and where the GPU waited for the
    host between kernels in them (``gpu_idle``; per step)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:     # with_stack: Python frames
        for _ in range(2):
            step()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            events = json.load(f).get("traceEvents", [])
    return table, gpu_idle(events, _package_dirs()).per_step(2)


def _package_dirs() -> tuple[str, ...]:
    """The folders of hgraph's code (its packages map to several folders of the tree)."""
    return tuple(os.path.dirname(m.__file__) + os.sep
                 for m in (hgraph, hgraph.frontends, hgraph.passes, hgraph.runtime, hgraph.tools))


def sync_sites(step, device: torch.device, rows: int = 12) -> list[list]:
    """Where one step waits for the GPU: torch's sync debug mode warns at every synchronising call;
    each is counted at the innermost frame of hgraph's own code (``file:line function``)."""
    if device.type != "cuda":
        return []
    ours = _package_dirs()
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(ours)]
        where = frames[-1] if frames else None
        sites[f"{os.path.relpath(where.filename, os.path.dirname(ours[0]))}:{where.lineno} {where.name}"
              if where else f"{filename}:{lineno}"] += 1

    _sync(device)
    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            _sync(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    return [[site, n] for site, n in sites.most_common(rows)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--model-args", default=json.dumps(DEFAULT_MODEL_ARGS), metavar="JSON")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--compile", default="on", choices=("on", "off"), help="hgraph's --compile")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of two hgraph steps")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (MFU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench gpu: error: needs a CUDA GPU (--device cpu runs it as a smoke test)", file=sys.stderr)
        return 2
    try:
        model_args = json.loads(args.model_args)
    except json.JSONDecodeError as exc:
        print(f"bench gpu: error: --model-args is not JSON: {exc}", file=sys.stderr)
        return 2
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype = args.dtype if dev.type == "cuda" else "fp32"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = os.path.join(tempfile.mkdtemp(prefix="hgraph-bench-gpu-"), "s")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method="file://" + store,
                            rank=0, world_size=1)
    try:
        cfg = TrainConfig.from_values(model="tiny", model_args=model_args, world_size=1,
                                      strategy_schedule="1xTP1PP1", steps=1, tokens_per_iter=args.tokens,
                                      lr=1e-4, dtype=dtype,
                                      compile=args.compile)
        model = build_model(cfg).to(dev)              # built right after manual_seed(cfg.model.seed)
        docs = bench_documents(args.tokens, model.config.vocab_size, min(model.config.max_seq_len, args.tokens))
        targets = sum(len(d) - 1 for d in docs)
        compiled = hgraph.compile(model, dtype=dtype)
        ex = Executor(compiled, make_optimizer(cfg, compiled, 0, 1), 0, 1, GroupCache(0, 1), device=dev,
                      compile_mode=args.compile)
        prog = compiled.instantiate("1xTP1PP1")
        mbs = [[MicroBatch.pack(docs)]]

        ref = build_model(cfg).to(dev)                # the same initial weights
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-4, fused=dev.type == "cuda")
        amp = torch.bfloat16 if dtype == "bf16" else torch.float32
        row = torch.tensor([[t for d in docs for t in d]], device=dev)
        positions = torch.cat([torch.arange(len(d)) for d in docs])[None].to(dev)
        # no target across documents
        labels = torch.cat([torch.tensor(d[1:] + [-100]) for d in docs]).to(dev)
        cu = cu_seqlens_for([len(d) for d in docs], dev)
        plain = torch.compile(ref, dynamic=True)

        def plain_step():
            ref_opt.zero_grad(set_to_none=True)
            with varlen_sdpa(cu), torch.autocast(dev.type, dtype=amp, enabled=dtype == "bf16"):
                logits = plain(row, positions)
            loss = F.cross_entropy(logits[0].float(), labels, ignore_index=-100, reduction="sum") / targets
            loss.backward()
            ref_opt.step()

        def hgraph_step():
            ex.step(prog, mbs, targets)

        warmup_s, th, tp = alternate(hgraph_step, plain_step, args.steps, dev)
        flops = ModelFlops.of(compiled).step_flops([len(d) for d in docs])
        peak = device_peak_tflops(dev, args.peak_tflops)
        tokens = sum(len(d) for d in docs)
        q = torch.randn(1, 4, 8, 16, device=dev, dtype=amp)
        out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": dtype,
               "compile": args.compile, "docs": len(docs), "tokens": tokens,
               "longest": max(len(d) for d in docs),
               "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
               "varlen_backend": available_backend(q), "warmup_s": warmup_s,
               "hgraph_ms": 1e3 * statistics.median(th), "plain_ms": 1e3 * statistics.median(tp),
               "ratio": statistics.median(a / b for a, b in zip(th, tp)),
               "region_compiles": ex.region_compiles.total, "eager_regions": ex.region_compiles.eager}
        for side in ("hgraph", "plain"):
            t = step_throughput(flops, tokens, out[f"{side}_ms"] / 1e3, 1, peak)
            out[f"{side}_tokens_per_s"], out[f"{side}_tflops"], out[f"{side}_mfu"] = \
                t["tokens_per_s"], t["tflops_per_device"], t["mfu"]
        profile, out["gpu_idle"] = top_kernels(hgraph_step, dev) if args.profile else (None, None)
        out["sync_sites"] = sync_sites(hgraph_step, dev) if args.profile else []
    finally:
        dist.destroy_process_group()
    if args.json:
        print(json.dumps({**out, "profile": profile}))
        return 0
    mfu = (lambda m: f", MFU {100 * m:.1f}%" if m is not None else "")
    print(f"{out['device']}, {out['dtype']}, {out['params_m']:.1f} M parameters, {out['docs']} documents, "
          f"{out['tokens']} tokens (longest {out['longest']}), varlen backend {out['varlen_backend']}, "
          f"--compile {out['compile']} ({out['region_compiles']} region compiles, "
          f"warm-up {out['warmup_s']:.1f} s)")
    for side, name in (("hgraph", "hgraph step"), ("plain", "plain PyTorch + torch.compile")):
        print(f"{name}: {out[f'{side}_ms']:.1f} ms, {out[f'{side}_tokens_per_s']:.0f} tokens/s, "
              f"{out[f'{side}_tflops']:.1f} TFLOP/s{mfu(out[f'{side}_mfu'])}")
    print(f"ratio hgraph/plain {out['ratio']:.3f} (goal <= 1.03)")
    if profile:
        print(profile)
    for line in idle_lines(out["gpu_idle"]):
        print(line)
    if out["sync_sites"]:
        print("where an hgraph step waits for the GPU (calls per step):")
        for site, n in out["sync_sites"]:
            print(f"  {n:4d}  {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
