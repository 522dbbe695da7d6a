"""Compiled per-rank programs run on 4 gloo processes: forward and backward equal the original module.

Each pipeline gets the same packed micro-batch of two documents; its logits must equal the module's
run on each document alone, and the gradients of its
working parameters, put back together from the TP shards and PP stages, must equal the module's
gradients. Pull/Push are not exercised here (a pass-through parameter sync stands in for them; the
runtime tests cover them): this checks the TP collectives, vocabulary padding, KV-head replication and
PP send/recv that the compiler inserted.

fp32 tolerances: logits atol 2e-5; gradients rtol 1e-4 and atol 1e-6 x the tensor's largest |gradient|
(TP sums partial products in a different order than the single-device matmul, so an element that
nearly cancels keeps an absolute error of a few ulps of the tensor's scale).
"""
import pytest
import torch

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.comm_ops import CommContext
from hgraph.runtime.launch import spawn

CASES = [
    ("tiny", {}, "1xTP2PP1+1xTP1PP2"),
    ("tiny", {}, "1xTP2PP2"),
    ("tiny", {}, "1xTP4PP1"),                        # TP4 > 2 KV heads: replicated KV heads
    ("tiny-tied", {"vocab_size": 509}, "2xTP2PP1"),  # vocabulary not divisible by TP: padded
    ("tiny-tied", {}, "1xTP1PP2+1xTP2PP1"),          # tied embedding split across stages
]


class _PassThroughSync:
    def pull_issue(self, name):
        pass

    def pull_wait(self, name):
        pass

    def push_gradient(self, w, name, eager):
        return w


def _model(name, args):
    torch.manual_seed(0)
    return llama.build(name, **args)


def _worker(rank, world, cases):
    out = []
    for name, args, text in cases:
        model = _model(name, args)
        compiled = hgraph.compile(model)
        prog = compiled.instantiate(text)
        comm = CommContext.from_default_group()
        comm.groups.ensure(sorted({tuple(g) for rp in prog.ranks for g in rp.bindings.values() if len(g) > 1}))
        rp = prog.rank(rank)
        comm.bindings = dict(rp.bindings)
        comm.param_sync = _PassThroughSync()
        params = rp.load_full(dict(model.named_parameters()))
        gm = rp.graph_module
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=g)
        pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
        weights = torch.randn(1, 12, model.config.vocab_size, generator=g)
        result = gm(ids, pos, comm)
        logits = None
        if rp.stage == rp.scheme.pp - 1:
            logits = result.detach()
            (result * weights).sum().backward()
        else:
            torch.autograd.backward(list(result))
        comm.wait_all()
        grads = {n: (s.ranges, s.pad, s.tp_sharded, s.shard_dim, params[n].grad.detach())
                 for n, s in rp.params.items()}
        out.append({"pipeline": rp.pipeline, "stage": rp.stage, "tp_rank": rp.tp_rank,
                    "logits": logits, "grads": grads})
    return out


def _reference(name, args):
    model = _model(name, args)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    weights = torch.randn(1, 12, model.config.vocab_size, generator=g)
    logits = torch.cat([model(ids[:, :7], pos[:, :7]), model(ids[:, 7:], pos[:, 7:])], dim=1)   # each document alone
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, args=(CASES,), timeout_s=240)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_and_backward_match_the_module(results, case):
    name, args, text = CASES[case]
    ref_logits, ref_grads = _reference(name, args)
    per_rank = [r[case] for r in results]
    strategy = hgraph.Strategy.parse(text)
    for i in range(len(strategy.pipelines)):
        ranks = [per_rank[r] for r in strategy.pipeline_ranks(i)]
        for r in ranks:
            if r["logits"] is not None:
                torch.testing.assert_close(r["logits"], ref_logits, atol=2e-5, rtol=0)
        rebuilt = {n: torch.zeros_like(g) for n, g in ref_grads.items()}
        for r in ranks:
            for n, (ranges, pad, sharded, dim, grad) in r["grads"].items():
                if not sharded:
                    if r["tp_rank"] == 0:     # replicated: identical on every TP rank
                        rebuilt[n] += grad
                    continue
                offset = 0
                for lo, hi in ranges:
                    rebuilt[n].narrow(dim, lo, hi - lo).add_(grad.narrow(dim, offset, hi - lo))
                    offset += hi - lo
                if pad:
                    assert torch.count_nonzero(grad.narrow(dim, offset, pad)) == 0
        for n in ref_grads:
            atol = 1e-6 * float(ref_grads[n].abs().max())
            torch.testing.assert_close(rebuilt[n], ref_grads[n], rtol=1e-4, atol=atol, msg=lambda m: f"{n}: {m}")
