"""A bf16 training step runs every matmul on bf16 inputs, and casts each fp32 master once, in batches.

On a GPU an fp32 GEMM in a bf16 step runs without tensor cores (a SIMT kernel, ~10x slower than the
bf16 one, which accumulates in fp32 anyway). One step of a tiny Llama (one rank, two micro-batches)
runs under a ``TorchDispatchMode`` that records the dtypes of every matmul-like op's operands and
every fp32 -> bf16 copy: no GEMM or attention above a few elements may see an fp32 operand, and the
pull casts each fp32 master to the working dtype at most once per step (not once per use). The pull's
and the push's casts (fp32 masters to bf16, bf16 gradients to fp32) are batched: a few
``_foreach_copy_`` calls carry every parameter (one fused kernel each on CUDA), not one op per
parameter, whose launches kept a GPU waiting for the host.
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hgraph
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor
from hgraph.runtime.train.model_setup import build_model, make_optimizer
from hgraph.runtime.train.config import TrainConfig

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.addmm_.default, aten.bmm.default, aten.baddbmm.default,
         aten.linear.default, aten.matmul.default}
SMALL = 256          # operands of fewer elements are not worth a GEMM kernel either way


def _is_attention(func) -> bool:
    return "scaled_dot_product" in func.__name__ or "flash_attention" in func.__name__ \
        or "efficient_attention" in func.__name__ or "cudnn_attention" in func.__name__


class PrecisionWatch(TorchDispatchMode):
    """Records matmul-like ops with an fp32 operand and the fp32 sources of bf16 copies."""

    def __init__(self, masters: frozenset = frozenset(), grad_storages=lambda: set()) -> None:
        super().__init__()
        self.masters = masters                            # the fp32 masters' data pointers
        self.grad_storages = grad_storages                # the working gradients' storages, when asked
        self.grad_casts: collections.Counter = collections.Counter()    # op index -> gradients it cast
        self.master_casts: collections.Counter = collections.Counter()  # op index -> masters it cast
        self.ops = 0
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
            grads = self.grad_storages()
            for dst, src in pairs:
                if src.dtype == torch.float32 and dst.dtype == torch.bfloat16:
                    self.cast_sources[src.data_ptr()] += 1
                    if src.data_ptr() in self.masters:
                        self.master_casts[self.ops] += 1
                elif (src.dtype == torch.bfloat16 and dst.dtype == torch.float32
                      and src.untyped_storage().data_ptr() in grads):
                    self.grad_casts[self.ops] += 1
        self.ops += 1
        return out


def test_a_bf16_step_runs_every_matmul_in_bf16_and_casts_each_master_once(one_rank):
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
    state = ex.rank_state(program)
    masters = {p.data_ptr(): name for name, p in optimizer.params.items() if p.numel()}
    watch = PrecisionWatch(frozenset(masters), lambda: {w.grad.untyped_storage().data_ptr()
                                                        for w in state.working.values() if w.grad is not None})
    with watch:
        result = ex.step(program, mbs, sum(len(d) - 1 for d in docs))
    assert torch.isfinite(torch.tensor(result.loss))
    assert watch.gemms > 50 and not watch.fp32_gemms, "\n".join(watch.fp32_gemms)
    pulled = {masters[ptr]: n for ptr, n in watch.cast_sources.items() if ptr in masters}
    assert pulled and max(pulled.values()) == 1, pulled
    # batched: every parameter's cast, each way, in one of a few ops (the pull's and push's buckets)
    assert len(pulled) >= 10 and len(watch.master_casts) <= 2, dict(watch.master_casts)
    assert sum(watch.grad_casts.values()) >= 10 and len(watch.grad_casts) <= 2, dict(watch.grad_casts)
