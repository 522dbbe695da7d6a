"""Compiled TP2 / PP2 programs of Hugging Face models (Llama, GPT-2) on 4 gloo processes.

As ``tests/passes/test_programs_multirank.py`` for the zoo model: each pipeline runs a packed
micro-batch of two documents; its logits must equal the HF model run on each document alone and the
gradients of its working parameters, reassembled from TP shards and PP stages, must equal the HF
model's gradients. Pull/Push are a pass-through here (the runtime tests cover them).

fp32 tolerances as there: logits atol 2e-5; gradients rtol 1e-4, atol 1e-6 x the tensor's largest |grad|.
"""
import pytest
import torch

pytest.importorskip("transformers")

import hgraph  # noqa: E402
from hgraph.frontends.zoo import resolve_model_spec  # noqa: E402
from hgraph.runtime.comm_ops import CommContext  # noqa: E402
from hgraph.runtime.launch import spawn  # noqa: E402

LLAMA = ("hf:llama", {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                      "num_key_value_heads": 2})
GPT2 = ("hf:gpt2", {"vocab_size": 61, "n_embd": 32, "n_head": 4})
CASES = [
    (*LLAMA, "1xTP2PP1+1xTP1PP2"),   # vocabulary 61 not divisible by TP2: padded
    (*LLAMA, "1xTP2PP2"),
    (*GPT2, "1xTP2PP1+1xTP1PP2"),    # Conv1D weights split on their [in, out] dims; tied head
    (*GPT2, "1xTP2PP2"),
]


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


def _batch(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, 12), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    weights = torch.randn(1, 12, vocab, generator=g)
    return ids, pos, weights


def _worker(rank, world, cases):
    out = []
    compiled = {}
    for spec, args, text in cases:
        key = (spec, tuple(sorted(args.items())))
        if key not in compiled:
            model = _model(spec, args)
            compiled[key] = (model, hgraph.compile(model))
        model, cm = compiled[key]
        prog = cm.instantiate(text)
        comm = CommContext.from_default_group()
        comm.groups.ensure(sorted({tuple(g) for rp in prog.ranks for g in rp.bindings.values() if len(g) > 1}))
        rp = prog.rank(rank)
        comm.bindings = dict(rp.bindings)
        comm.param_sync = _PassThroughSync()
        full = dict(model.named_parameters())
        gm = rp.graph_module
        params = {}
        for pname, shard in rp.params.items():
            *path, leaf = pname.split(".")
            mod = gm
            for p in path:
                mod = getattr(mod, p)
            param = torch.nn.Parameter(shard.take(full[pname].detach()))
            setattr(mod, leaf, param)
            params[pname] = param
        ids, pos, weights = _batch(model.config.vocab_size)
        result = gm(ids, pos, comm)
        logits = None
        if rp.stage == rp.scheme.pp - 1:
            logits = result.detach()
            (result * weights).sum().backward()
        else:
            torch.autograd.backward(list(result))
        comm.wait_all()
        grads = {n: (s, params[n].grad.detach())
                 for n, s in rp.params.items()}
        out.append({"stage": rp.stage, "tp_rank": rp.tp_rank, "logits": logits, "grads": grads,
                    "frontend": cm.frontend})
    return out


def _reference(spec, args):
    model = _model(spec, args)
    ids, pos, weights = _batch(model.config.vocab_size)
    logits = torch.cat([model(ids[:, :7], position_ids=pos[:, :7], use_cache=False).logits,
                        model(ids[:, 7:], position_ids=pos[:, 7:], use_cache=False).logits], dim=1)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, args=(CASES,), timeout_s=300)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_and_backward_match_the_hf_model(results, case):
    spec, args, text = CASES[case]
    ref_logits, ref_grads = _reference(spec, args)
    per_rank = [r[case] for r in results]
    assert {r["frontend"] for r in per_rank} == {"export"}
    strategy = hgraph.Strategy.parse(text)
    for i in range(len(strategy.pipelines)):
        ranks = [per_rank[r] for r in strategy.pipeline_ranks(i)]
        assert any(r["logits"] is not None for r in ranks)
        for r in ranks:
            if r["logits"] is not None:
                torch.testing.assert_close(r["logits"], ref_logits, atol=2e-5, rtol=0)
        rebuilt = {n: torch.zeros_like(g) for n, g in ref_grads.items()}
        for r in ranks:
            for n, (shard, grad) in r["grads"].items():
                if shard.tp_sharded:
                    shard.add_into(rebuilt[n], grad)
                    assert torch.count_nonzero(shard.padding_of(grad)) == 0
                elif r["tp_rank"] == 0:     # replicated: identical on every TP rank
                    rebuilt[n] += grad
        for n in ref_grads:
            atol = 1e-6 * float(ref_grads[n].abs().max())
            torch.testing.assert_close(rebuilt[n], ref_grads[n], rtol=1e-4, atol=atol, msg=lambda m: f"{n}: {m}")
