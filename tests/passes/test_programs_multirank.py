"""Compiled per-rank programs run on 4 gloo processes: forward and backward equal the original module.

Each pipeline gets the same packed micro-batch of three documents (split over the CP ranks by a
per-document or per-sequence plan when the scheme has CP); its logits must equal the module's run on
each document alone, and the gradients of its
working parameters, put back together from the TP shards and PP stages, must equal the module's
gradients. Pull/Push are not exercised here (a pass-through parameter sync stands in for them; the
runtime tests cover them): this checks the TP collectives (sequence parallelism's reduce-scatter / all-gather under TP > 1, the
replicated parameters whose TP ranks' gradients the push sums), vocabulary padding, KV-head replication,
PP send/recv and the CP all-gather / per-document attention that the compiler inserted, for the zoo
models (fx frontend; the MoE one with its routed and shared experts' partial sums reduced together) and,
when transformers is installed, Hugging Face Llama, GPT-2 and Qwen2-MoE (export frontend; its
sigmoid-gated shared expert reduced with the experts).

fp32 tolerances: logits atol 2e-5; gradients rtol 1e-4 and atol 1e-6 x the tensor's largest |gradient|
(TP sums partial products in a different order than the single-device matmul, so an element that
nearly cancels keeps an absolute error of a few ulps of the tensor's scale).
"""
import importlib.util

import pytest
import torch

import hgraph
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.runtime.comm.context import CommContext
from hgraph.runtime.train.launch import spawn

# (model spec, config overrides, strategy, CP sharding of the packed documents)
CASES = [
    ("llama:tiny", {}, "1xTP2PP1+1xTP1PP2", None),
    ("llama:tiny", {}, "1xTP2PP2", None),
    ("llama:tiny", {}, "1xTP4PP1", None),                        # TP4 > 2 KV heads: replicated KV heads
    ("llama:tiny-tied", {"vocab_size": 509}, "2xTP2PP1", None),  # vocabulary not divisible by TP: padded
    ("llama:tiny-tied", {}, "1xTP1PP2+1xTP2PP1", None),          # tied embedding split across stages
    ("llama:tiny", {}, "1xTP1PP1CP2+2xTP1PP1", "per-document"),  # CP next to pipelines without CP
    ("llama:tiny", {}, "1xTP2PP1CP2", "per-sequence"),
    ("llama:tiny-tied", {}, "1xTP1PP2CP2", "per-document"),      # CP inside a pipeline with two stages
    # MoE with a shared expert: the routed and shared partial sums reduced together (one per layer)
    ("llama-moe:tiny", {}, "1xTP2PP1+1xTP1PP2", None),
]
if importlib.util.find_spec("transformers") is not None:   # Hugging Face models, through torch.export
    HF_LLAMA = ("hf:llama", {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 64,
                             "num_attention_heads": 4, "num_key_value_heads": 2})
    HF_GPT2 = ("hf:gpt2", {"vocab_size": 61, "n_embd": 32, "n_head": 4})
    CASES += [
        (*HF_LLAMA, "1xTP2PP1+1xTP1PP2", None),   # vocabulary 61 not divisible by TP2: padded
        (*HF_LLAMA, "1xTP2PP2", None),
        (*HF_GPT2, "1xTP2PP1+1xTP1PP2", None),    # Conv1D weights split on their [in, out] dims; tied head
        (*HF_GPT2, "1xTP2PP2", None),
        ("hf:qwen2_moe", {}, "2xTP2PP1", None),   # the sigmoid-gated shared expert fused with the experts
        ("hf:qwen2_moe", {}, "1xTP2PP1+2xTP1PP1", None),   # the same without sequence parallelism
    ]
#: (spec, strategy) of the cases compiled without sequence parallelism
WITHOUT_SP = {("hf:qwen2_moe", "1xTP2PP1+2xTP1PP1")}
DOCS = [7, 5, 9]   # packed documents; 21 tokens, not divisible by 2 x CP


class _PassThroughSync:
    def pull_issue(self, name):
        pass

    def pull_wait(self, name):
        pass

    def push_gradient(self, w, name, eager):
        return w


def _model(spec, args):
    torch.manual_seed(0)
    return resolve_model_spec(spec, args)


def _logits(model, ids, pos):
    out = model(ids, position_ids=pos)
    return getattr(out, "logits", out)   # Hugging Face models return an output object


def _inputs(vocab):
    g = torch.Generator().manual_seed(1)
    T = sum(DOCS)
    ids = torch.randint(0, vocab, (1, T), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    weights = torch.randn(1, T, vocab, generator=g)
    return ids, pos, weights


def _worker(rank, world, cases):
    from hgraph.runtime.kernels.cp_attention import CPLayout
    from hgraph.runtime.kernels.cp_layout import per_document_plan, per_sequence_plan

    out = []
    traced = {}     # one trace per model (torch.export of an HF model takes seconds): its strategies share it
    for spec, args, text, sharding in cases:
        sp = (spec, text) not in WITHOUT_SP
        key = (spec, tuple(sorted(args.items())), sp)
        if key not in traced:
            model = _model(spec, args)
            traced[key] = model, hgraph.compile(model, sequence_parallel=sp)
        model, compiled = traced[key]
        prog = compiled.instantiate(text)
        rp = prog.rank(rank)
        comm = CommContext.from_default_group(bindings=dict(rp.bindings), param_sync=_PassThroughSync())
        comm.groups.ensure(sorted({tuple(g) for r in prog.ranks for g in r.bindings.values() if len(g) > 1}))
        params = rp.load_full(dict(model.named_parameters()))
        gm = rp.graph_module
        ids, pos, weights = _inputs(model.config.vocab_size)
        idx = list(range(ids.shape[1]))
        if rp.scheme.cp > 1:   # this rank's tokens of the packed micro-batch
            plan = (per_document_plan if sharding == "per-document" else per_sequence_plan)(DOCS, rp.scheme.cp)
            comm = comm.for_microbatch(cp_layout=CPLayout.from_plan(plan, DOCS, rp.cp_rank))
            idx = list(comm.cp_layout.local_tokens)
        ids, pos, weights = ids[:, idx], pos[:, idx], weights[:, idx]
        result = gm(ids, pos, comm)
        logits = None
        if rp.stage == rp.scheme.pp - 1:
            logits = result.detach()
            (result * weights).sum().backward()
        else:
            torch.autograd.backward(list(result))
        comm.wait_all()
        # what the push sums: the rows of its gradient each rank contributes (a replicated parameter's TP
        # ranks each their share of the same gradient, or each its whole per-rank partial gradient: read on
        # TP-sharded values, or under sequence parallelism on the rank's tokens)
        grads = {n: (s, params[n].grad.detach(), prog.push_plans[n].contributions.get(rank, ()))
                 for n, s in rp.params.items()}
        out.append({"pipeline": rp.pipeline, "stage": rp.stage, "tp_rank": rp.tp_rank, "tokens": idx,
                    "logits": logits, "grads": grads, "frontend": compiled.frontend})
    return out


def _reference(spec, args):
    model = _model(spec, args)
    ids, pos, weights = _inputs(model.config.vocab_size)
    bounds = [0] + torch.tensor(DOCS).cumsum(0).tolist()
    logits = torch.cat([_logits(model, ids[:, a:b], pos[:, a:b]) for a, b in zip(bounds, bounds[1:])],
                       dim=1)  # each document alone
    (logits * weights).sum().backward()
    # an expert no token chose has no gradient here and an exact zero on the ranks
    return logits.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad
                             for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, args=(CASES,), timeout_s=240)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_and_backward_match_the_module(results, case):
    spec, args, text, _ = CASES[case]
    ref_logits, ref_grads = _reference(spec, args)
    per_rank = [r[case] for r in results]
    assert {r["frontend"] for r in per_rank} == {"export" if spec.startswith("hf:") else "fx"}
    strategy = hgraph.Strategy.parse(text)
    for i in range(len(strategy.pipelines)):
        ranks = [per_rank[r] for r in strategy.pipeline_ranks(i)]
        for r in ranks:
            if r["logits"] is not None:
                torch.testing.assert_close(r["logits"], ref_logits[:, r["tokens"]], atol=2e-5, rtol=0)
        rebuilt = {n: torch.zeros_like(g) for n, g in ref_grads.items()}
        seen = sorted(t for r in ranks if r["logits"] is not None and r["tp_rank"] == 0 for t in r["tokens"])
        assert seen == list(range(sum(DOCS))), "the CP ranks of the last stage cover every token once"
        for r in ranks:
            for n, (shard, grad, contributed) in r["grads"].items():
                if shard.tp_sharded:
                    shard.add_into(rebuilt[n], grad)
                    assert torch.count_nonzero(shard.padding_of(grad)) == 0
                elif grad.dim() == 0:
                    rebuilt[n] += grad if contributed else 0
                else:                                  # the rows the push takes from this rank
                    for lo, hi in contributed:
                        rebuilt[n].narrow(shard.shard_dim, lo, hi - lo).add_(grad.narrow(shard.shard_dim, lo, hi - lo))
        for n in ref_grads:
            atol = 1e-6 * float(ref_grads[n].abs().max())
            torch.testing.assert_close(rebuilt[n], ref_grads[n], rtol=1e-4, atol=atol, msg=lambda m: f"{n}: {m}")
