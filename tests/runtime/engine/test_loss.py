"""Packed loss: sum over a packed row / mini-batch targets == mean over documents run alone.

A tiny attention model (token + position embeddings, one GQA attention through varlen_attention,
LM head) runs once on the packed row and once per document; fp32, the losses and every parameter
gradient agree to atol 1e-6 / rtol 1e-5 (only the summation order differs).
"""
import pytest
import torch
import torch.nn.functional as F

from hgraph.errors import HGraphError
from hgraph.runtime.engine.loss import IGNORE_INDEX, num_targets, packed_loss_sum, packed_targets
from hgraph.varlen_attention import cu_seqlens_for, position_ids_for, varlen_attention

V, E, HQ, HKV, DH, MAXPOS = 11, 16, 4, 2, 4, 32
TOL = dict(atol=1e-6, rtol=1e-5)
LENGTHS = [5, 1, 7, 3, 4]  # a one-token document has no target


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(V, E)
        self.pos = torch.nn.Embedding(MAXPOS, E)
        self.q = torch.nn.Linear(E, HQ * DH)
        self.kv = torch.nn.Linear(E, 2 * HKV * DH)
        self.o = torch.nn.Linear(HQ * DH, E)
        self.head = torch.nn.Linear(E, V)

    def forward(self, ids, position_ids, cu):
        x = self.tok(ids) + self.pos(position_ids)
        t = ids.shape[1]
        q = self.q(x).view(1, t, HQ, DH).transpose(1, 2)
        k, v = self.kv(x).view(1, t, 2, HKV, DH).permute(2, 0, 3, 1, 4)
        a = varlen_attention(q, k, v, cu, enable_gqa=True).transpose(1, 2).reshape(1, t, HQ * DH)
        return self.head(x + self.o(a))


def _docs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]


def _packed_step(model, docs, n):
    ids = torch.cat(docs).unsqueeze(0)
    cu = cu_seqlens_for([len(d) for d in docs])
    return packed_loss_sum(model(ids, position_ids_for(cu), cu), ids, cu) / n


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_packed_sum_over_targets_equals_mean_over_documents_run_alone():
    docs = _docs()
    n = num_targets(LENGTHS)
    packed = TinyLM()
    loss = _packed_step(packed, docs, n)
    loss.backward()

    alone = TinyLM()
    total = 0.0
    for d in docs:
        if len(d) < 2:
            continue
        ids = d.unsqueeze(0)
        logits = alone(ids, torch.arange(len(d)).unsqueeze(0), [0, len(d)])
        per_doc = F.cross_entropy(logits[0, :-1], d[1:])  # this document's mean
        (per_doc * (len(d) - 1) / n).backward()
        total = total + per_doc.detach() * (len(d) - 1)
    torch.testing.assert_close(loss.detach(), total / n, **TOL)
    for name, g in _grads(packed).items():
        torch.testing.assert_close(g, _grads(alone)[name], **TOL)


def test_micro_batch_split_gives_the_same_gradient():
    docs = _docs()
    n = num_targets(LENGTHS)
    whole = TinyLM()
    _packed_step(whole, docs, n).backward()
    split = TinyLM()
    for part in (docs[:2], docs[2:]):  # two micro-batches, each divided by the mini-batch's n
        _packed_step(split, part, n).backward()
    for name, g in _grads(whole).items():
        torch.testing.assert_close(g, _grads(split)[name], **TOL)


def test_targets_and_counts():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert packed_targets(ids, [0, 2, 3, 6]).tolist() == [[2, IGNORE_INDEX, IGNORE_INDEX, 5, 6,
                                                           IGNORE_INDEX]]
    assert num_targets([2, 1, 3]) == 3 and num_targets([]) == 0 and num_targets([0, 1]) == 0


def test_bad_shapes_are_clear_errors():
    with pytest.raises(HGraphError, match=r"logits \[1, 4, 3\] must be \[1, T, V\]"):
        packed_loss_sum(torch.zeros(1, 4, 3), torch.zeros(1, 5, dtype=torch.long), [0, 5])
    with pytest.raises(HGraphError, match="must start at 0"):
        packed_loss_sum(torch.zeros(1, 5, 3), torch.zeros(1, 5, dtype=torch.long), [0, 4])
