"""A bf16 training step runs every matmul on bf16 inputs, and casts each fp32 master once.

On a GPU an fp32 GEMM in a bf16 step runs without tensor cores (a SIMT kernel, ~10x slower than the
bf16 one, which accumulates in fp32 anyway). One step of a tiny Llama (one rank, two micro-batches)
runs under a ``TorchDispatchMode`` that records the dtypes of every matmul-like op's operands and
every fp32 -> bf16 copy: no GEMM or attention above a few elements may see an fp32 operand, and the
pull casts each fp32 master to the working dtype at most once per step (not once per use).
"""
from __future__ import annotations

import collections
import os
import tempfile

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hgraph
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor
from hgraph.runtime.train.trainer import TrainConfig, build_model, make_optimizer

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.addmm_.default, aten.bmm.default, aten.baddbmm.default,
         aten.linear.default, aten.matmul.default}
SMALL = 256          # operands of fewer elements are not worth a GEMM kernel either way


def _is_attention(func) -> bool:
    return "scaled_dot_product" in func.__name__ or "flash_attention" in func.__name__ \
        or "efficient_attention" in func.__name__ or "cudnn_attention" in func.__name__


class PrecisionWatch(TorchDispatchMode):
    """Records matmul-like ops with an fp32 operand and the fp32 sources of bf16 copies."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms = 0
        self.fp32_gemms: list[str] = []
        self.cast_sources: collections.Counter = collections.Counter()   # data_ptr -> fp32 -> bf16 copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS or _is_attention(func):
            # GEMM operands are matrices (addmm's bias is not); attention's are the 4-D q, k, v, out
            # and their gradients (its log-sum-exp is fp32 by design)
            rank = 4 if _is_attention(func) else 2
            operands = [t for t in tree_flatten((args, kwargs))[0]
                        if isinstance(t, torch.Tensor) and t.dim() >= rank and t.is_floating_point()]
            self.gemms += 1
            if any(t.dtype == torch.float32 and t.numel() >= SMALL for t in operands):
                self.fp32_gemms.append(f"{func.__name__}{[(t.dtype, tuple(t.shape)) for t in operands]}")
        out = func(*args, **kwargs)
        if func.__name__.startswith(("_to_copy", "copy_", "_foreach_copy_")):
            if func.__name__.startswith("_to_copy"):
                pairs = [(out, args[0])]
            else:
                dests, srcs = args[0], args[1]
                pairs = list(zip(dests, srcs)) if isinstance(dests, (list, tuple)) else [(dests, srcs)]
            for dst, src in pairs:
                if src.dtype == torch.float32 and dst.dtype == torch.bfloat16:
                    self.cast_sources[src.data_ptr()] += 1
        return out


def test_a_bf16_step_runs_every_matmul_in_bf16_and_casts_each_master_once():
    store = os.path.join(tempfile.mkdtemp(prefix="hgraph-bf16-"), "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    try:
        cfg = TrainConfig.from_values(model="tiny", model_args={"num_layers": 2}, world_size=1,
                                      strategy_schedule="1xTP1PP1", steps=1, tokens_per_iter=256,
                                      lr=1e-4, dtype="bf16")
        compiled = hgraph.compile(build_model(cfg), dtype="bf16")
        optimizer = make_optimizer(cfg, compiled, 0, 1)
        ex = Executor(compiled, optimizer, 0, 1, GroupCache(0, 1))
        program = compiled.instantiate("1xTP1PP1")
        g = torch.Generator().manual_seed(0)
        docs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (30, 50, 20)]
        mbs = [[MicroBatch.pack(docs[:2]), MicroBatch.pack(docs[2:])]]
        watch = PrecisionWatch()
        with watch:
            result = ex.step(program, mbs, sum(len(d) - 1 for d in docs))
    finally:
        dist.destroy_process_group()
    assert torch.isfinite(torch.tensor(result.loss))
    assert watch.gemms > 50 and not watch.fp32_gemms, "\n".join(watch.fp32_gemms)
    masters = {p.data_ptr(): name for name, p in optimizer.params.items() if p.numel()}
    pulled = {masters[ptr]: n for ptr, n in watch.cast_sources.items() if ptr in masters}
    assert pulled and max(pulled.values()) == 1, pulled
