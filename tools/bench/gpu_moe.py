"""GPU benchmark of a mixture-of-experts step: hgraph's compiled one-GPU step of ``llama-moe`` against
the same model in plain PyTorch, its experts run by ``torch._grouped_mm``, behind ``torch.compile``.

``python -m hgraph.tools.bench.gpu_moe [--model-args JSON] [--tokens 16384] [--steps 10] [--dtype bf16]
[--compile on|off] [--profile] [--device cuda|cpu] [--json]``

The model (``MOE_MODEL_ARGS``, 0.96B parameters, 0.21B of them activated per token): 12 layers of
hidden size 1024 (16 heads of 64, 4 KV heads), the first dense, the other 11 with 64 routed experts of
width 384, top-6, and 2 shared experts: DeepSeek-MoE's fine-grained routing (the ``llama-moe:16b``
shape) at a size that one H100 / H200 trains in tens of ms a step. Fine-grained routing is the hard
case for a compiler around the experts: each layer sorts 6 assignments per token into 64 groups of
about 1,500 rows, so the routing's gathers and the host work per layer weigh most against the GEMMs.

Both sides train one packed row of whole documents of real lengths (``gpu.bench_documents``) with Adam
and fp32 master weights, from the same initial weights:

* hgraph: ``Executor.step`` of ``1xTP1PP1``, the model's MoE blocks (a loop over experts, as people
  write them) recognised and replaced by hgraph's MoE op (``hgraph.moe``: ``torch._grouped_mm`` on
  bf16 CUDA of compute capability >= 8.0, a loop elsewhere), the rank graph compiled region by region;
* plain PyTorch (``GroupedMoe``): the MoE block as a careful user writes it, the experts' weights
  stacked ``[E, I, H]`` / ``[E, H, I]``, the token-expert assignments sorted by expert with static
  shapes (no host read), one grouped GEMM per projection over all of them, no loop over experts; the
  whole model behind one ``torch.compile`` (dynamic) under ``torch.autocast``, its attention varlen on
  the row's documents given on the host (``DocumentBounds``: no read-back per layer), the loss on the
  whole logits, torch's fused Adam.

Prints median step times of alternated steps, MFU by activated FLOPs (the routed experts counted
``top_k`` times of ``num_experts``: ``activated_flops``), the ratio hgraph/plain (goal <= 1.05), both
sides' losses (their largest relative difference; in fp32 they must agree within ``LOSS_RTOL``, else
the exit status is 1), and with ``--profile`` the top kernels of two steps of each side, where hgraph's
GPU waits for the host and where an hgraph step waits for the GPU (as ``gpu.py``). ``--device cpu``
(fp32, eager, the experts' loop on both sides) is its smoke test; its times say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hgraph
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import llama_moe
from hgraph.frontends.zoo.llama import configure
from hgraph.moe import grouped_gemm_supported
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.model_setup import build_model, make_optimizer
from hgraph.runtime.train.throughput import ModelFlops, device_peak_tflops, step_throughput
from hgraph.tools.bench.gpu import alternate, bench_documents, sync_sites, top_kernels, varlen_sdpa
from hgraph.tools.bench.gpu_idle import idle_lines
from hgraph.varlen_attention import DocumentBounds, available_backend

#: overrides of ``llama-moe:tiny`` making the bench's model (module docstring)
MOE_MODEL_ARGS = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_layers": 12,
                  "num_heads": 16, "num_kv_heads": 4, "head_dim": 64, "max_seq_len": 8192, "num_experts": 64,
                  "top_k": 6, "moe_intermediate_size": 384, "num_shared_experts": 2, "first_dense_layers": 1}
LOSS_RTOL = 1e-5        # fp32: the same model and the same Adam; only summation orders differ
GOAL_RATIO = 1.05


class GroupedMoe(nn.Module):
    """A ``llama_moe.MoeBlock`` as a careful PyTorch user writes it for speed, on that block's weights
    (copied): the router and shared experts as they are, the experts stacked (``gate_proj`` / ``up_proj``
    ``[E, I, H]``, ``down_proj`` ``[E, H, I]``). Routing is the block's (softmax in fp32, top-k, the
    weights in ``x``'s dtype); the assignments are sorted by expert (stable: a token's order inside an
    expert is its order in the batch) and counted by a scatter, so no shape depends on the data and
    ``torch.compile`` captures the block whole. ``grouped``: one ``torch._grouped_mm`` per projection
    over all rows, in ``compute_dtype`` (autocast does not cover it); else a loop over the experts'
    row ranges (CPU and devices without the kernel; it reads the counts on the host)."""

    def __init__(self, block: llama_moe.MoeBlock, grouped: bool, compute_dtype: torch.dtype):
        super().__init__()
        self.top_k, self.normalize_top_k = block.top_k, block.normalize_top_k
        self.grouped, self.compute_dtype = grouped, compute_dtype
        self.gate, self.shared_experts = block.gate, block.shared_experts
        self.num_experts = len(block.experts)
        for name in ("gate_proj", "up_proj", "down_proj"):
            stacked = torch.stack([getattr(e, name).weight.detach() for e in block.experts])
            setattr(self, name, nn.Parameter(stacked.clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        chosen = selected.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        token = order // self.top_k
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, chosen, torch.ones_like(chosen))
        rows = flat.index_select(0, token)
        y = self._grouped(rows, counts) if self.grouped else self._loop(rows, counts)
        y = y.to(flat.dtype) * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        out = flat.new_zeros(flat.shape).index_add_(0, token, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(b, t, h)

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs, dt = rows.to(self.compute_dtype), self.compute_dtype
        hidden = F.silu(torch._grouped_mm(xs, self.gate_proj.to(dt).transpose(-2, -1), offs=offs)) \
            * torch._grouped_mm(xs, self.up_proj.to(dt).transpose(-2, -1), offs=offs)
        return torch._grouped_mm(hidden, self.down_proj.to(dt).transpose(-2, -1), offs=offs)

    def _loop(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        pieces = [F.linear(F.silu(F.linear(part, self.gate_proj[e])) * F.linear(part, self.up_proj[e]),
                           self.down_proj[e])
                  for e, part in enumerate(rows.split(counts.tolist()))]
        return torch.cat(pieces)


def plain_moe_model(model: nn.Module, grouped: bool, compute_dtype: torch.dtype) -> nn.Module:
    """``model`` (a ``llama-moe``, changed in place) with every MoE block replaced by its ``GroupedMoe``."""
    for layer in model.layers:
        if isinstance(layer.mlp, llama_moe.MoeBlock):
            layer.mlp = GroupedMoe(layer.mlp, grouped, compute_dtype)
    return model


def activated_flops(config: llama_moe.LlamaMoeConfig) -> ModelFlops:
    """The model FLOPs terms of a token's activated weights (``runtime/train/throughput``): every matmul
    weight a token multiplies (the routed experts ``top_k`` of them, the router, the shared experts, the
    head; not the embedding lookup nor the norms) and every layer's attention width."""
    c = config
    norms = c.hidden_size * (2 * c.num_layers + 1)
    lookup = 0 if c.tie_embeddings else c.vocab_size * c.hidden_size
    return ModelFlops(c.activated_parameters() - norms - lookup, c.num_layers * c.num_heads * c.head_dim)


def rel_diff(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two loss sequences (inf when they differ in length)."""
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.gpu_moe", description=__doc__.splitlines()[0])
    ap.add_argument("--model-args", default=json.dumps(MOE_MODEL_ARGS), metavar="JSON",
                    help="overrides of llama-moe:tiny (default: the bench's 0.96B model)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--compile", default="on", choices=("on", "off"),
                    help="hgraph's --compile, and torch.compile of the plain model")
    ap.add_argument("--profile", action="store_true", help="the top kernels of two steps of each side")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (MFU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", action="store_true")
    return ap


def model_config(text: str) -> llama_moe.LlamaMoeConfig:
    """The bench's model config from ``--model-args``; bad JSON or a bad field -> HGraphError."""
    try:
        args = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HGraphError(f"--model-args is not JSON: {exc}") from None
    if not isinstance(args, dict):
        raise HGraphError(f"--model-args must be a JSON object of llama-moe config fields, got {text}")
    return configure("llama-moe", llama_moe.CONFIGS, llama_moe.LlamaMoeConfig, "tiny", args)


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench gpu_moe: error: needs a CUDA GPU (--device cpu runs it as a smoke test)", file=sys.stderr)
        return 2
    try:
        config = model_config(args.model_args)
        if args.tokens <= 0 or args.steps <= 0:
            raise HGraphError(f"--tokens and --steps must be positive, got {args.tokens} and {args.steps}")
    except HGraphError as exc:
        print(f"bench gpu_moe: error: {exc}", file=sys.stderr)
        return 2
    model_args = json.loads(args.model_args)
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype = args.dtype if dev.type == "cuda" else "fp32"
    compile_mode = args.compile if dev.type == "cuda" else "off"     # the smoke test runs eager
    amp = torch.bfloat16 if dtype == "bf16" else torch.float32
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = os.path.join(tempfile.mkdtemp(prefix="hgraph-bench-gpu-moe-"), "s")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method="file://" + store,
                            rank=0, world_size=1)
    try:
        cfg = TrainConfig.from_values(model="llama-moe:tiny", model_args=model_args, world_size=1,
                                      strategy_schedule="1xTP1PP1", steps=1, tokens_per_iter=args.tokens,
                                      lr=1e-4, dtype=dtype, compile=compile_mode)
        model = build_model(cfg).to(dev)              # built right after manual_seed(cfg.model.seed)
        docs = bench_documents(args.tokens, config.vocab_size, min(config.max_seq_len, args.tokens))
        lengths = [len(d) for d in docs]
        targets = sum(n - 1 for n in lengths)
        compiled = hgraph.compile(model, dtype=dtype)
        ex = Executor(compiled, make_optimizer(cfg, compiled, 0, 1), 0, 1, GroupCache(0, 1), device=dev,
                      compile_mode=compile_mode)
        prog = compiled.instantiate("1xTP1PP1")
        mbs = [[MicroBatch.pack(docs)]]

        grouped = grouped_gemm_supported(dev, amp)     # where hgraph's op runs it too: the same kernels
        ref = plain_moe_model(build_model(cfg), grouped, amp).to(dev)      # the same initial weights
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-4, fused=dev.type == "cuda")
        row = torch.tensor([[t for d in docs for t in d]], device=dev)
        positions = torch.cat([torch.arange(n) for n in lengths])[None].to(dev)
        labels = torch.cat([torch.tensor(d[1:] + [-100]) for d in docs]).to(dev)    # no target across documents
        bounds = DocumentBounds.of(lengths, dev)
        plain = torch.compile(ref, dynamic=True) if compile_mode == "on" else ref
        h_losses: list[float] = []
        p_losses: list[torch.Tensor] = []             # read once at the end: no wait per step

        def plain_step():
            ref_opt.zero_grad(set_to_none=True)
            with varlen_sdpa(bounds), torch.autocast(dev.type, dtype=amp, enabled=dtype == "bf16"):
                logits = plain(row, positions)
            loss = F.cross_entropy(logits[0].float(), labels, ignore_index=-100, reduction="sum") / targets
            loss.backward()
            ref_opt.step()
            p_losses.append(loss.detach())

        def hgraph_step():
            h_losses.append(ex.step(prog, mbs, targets).loss)

        warmup_s, th, tp = alternate(hgraph_step, plain_step, args.steps, dev)
        losses = {"hgraph": list(h_losses), "plain": [float(v) for v in p_losses]}
        peak = device_peak_tflops(dev, args.peak_tflops)
        flops = activated_flops(config).step_flops(lengths)
        out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": dtype,
               "compile": compile_mode, "docs": len(docs), "tokens": sum(lengths), "longest": max(lengths),
               "params_m": config.num_parameters() / 1e6, "activated_params_m": config.activated_parameters() / 1e6,
               "experts": f"{config.num_experts} top-{config.top_k}",
               "plain_experts": "grouped_mm" if grouped else "loop",
               "varlen_backend": available_backend(torch.randn(1, 4, 8, 16, device=dev, dtype=amp)),
               "warmup_s": warmup_s, "hgraph_ms": 1e3 * statistics.median(th), "plain_ms": 1e3 * statistics.median(tp),
               "ratio": statistics.median(a / b for a, b in zip(th, tp)),
               "region_compiles": ex.region_compiles.total, "eager_regions": ex.region_compiles.eager,
               "losses": losses, "loss_rel_diff": rel_diff(losses["hgraph"], losses["plain"])}
        out["losses_agree"] = out["loss_rel_diff"] <= LOSS_RTOL if dtype == "fp32" else None
        for side in ("hgraph", "plain"):
            t = step_throughput(flops, out["tokens"], out[f"{side}_ms"] / 1e3, 1, peak)
            out[f"{side}_tokens_per_s"], out[f"{side}_tflops"], out[f"{side}_mfu"] = \
                t["tokens_per_s"], t["tflops_per_device"], t["mfu"]
        profile, out["gpu_idle"] = top_kernels(hgraph_step, dev) if args.profile else (None, None)
        plain_profile = top_kernels(plain_step, dev)[0] if args.profile else None
        out["sync_sites"] = sync_sites(hgraph_step, dev) if args.profile else []
    finally:
        dist.destroy_process_group()
    rc = 1 if out["losses_agree"] is False else 0
    if args.json:
        print(json.dumps({**out, "profile": profile, "plain_profile": plain_profile}))
        return rc
    _report(out, profile, plain_profile)
    return rc


def _report(out: dict, profile: Optional[str], plain_profile: Optional[str]) -> None:
    mfu = (lambda m: f", MFU {100 * m:.1f}% (activated)" if m is not None else "")
    print(f"{out['device']}, {out['dtype']}, {out['params_m']:.1f} M parameters ({out['activated_params_m']:.1f} M "
          f"activated; experts {out['experts']}, plain side's {out['plain_experts']}), {out['docs']} documents, "
          f"{out['tokens']} tokens (longest {out['longest']}), varlen backend {out['varlen_backend']}, --compile "
          f"{out['compile']} ({out['region_compiles']} region compiles, warm-up {out['warmup_s']:.1f} s)")
    plain = ("plain PyTorch" + (" + torch.compile" if out["compile"] == "on" else " (eager)")
             + (", grouped GEMMs" if out["plain_experts"] == "grouped_mm" else ", experts' loop"))
    for side, name in (("hgraph", "hgraph step"), ("plain", plain)):
        print(f"{name}: {out[f'{side}_ms']:.1f} ms, {out[f'{side}_tokens_per_s']:.0f} tokens/s, "
              f"{out[f'{side}_tflops']:.1f} TFLOP/s{mfu(out[f'{side}_mfu'])}")
    print(f"ratio hgraph/plain {out['ratio']:.3f} (goal <= {GOAL_RATIO})")
    agree = {True: f"agree (<= {LOSS_RTOL:g})", False: f"DIFFER (> {LOSS_RTOL:g})", None: "(bf16: reported only)"}
    print(f"losses hgraph {out['losses']['hgraph'][:3]} plain {out['losses']['plain'][:3]}: largest relative "
          f"difference {out['loss_rel_diff']:.2e} {agree[out['losses_agree']]}")
    if profile:
        print("hgraph, two steps:")
        print(profile)
    if plain_profile:
        print("plain PyTorch, two steps:")
        print(plain_profile)
    for line in idle_lines(out["gpu_idle"]):
        print(line)
    if out["sync_sites"]:
        print("where an hgraph step waits for the GPU (calls per step):")
        for site, n in out["sync_sites"]:
            print(f"  {n:4d}  {site}")


if __name__ == "__main__":
    raise SystemExit(main())
