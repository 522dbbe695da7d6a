"""Comm ops on 4 gloo processes: 2-way TP MLP (f, g; and with sequence parallelism's all-gather /
reduce-scatter over uneven token slices), uneven all-gather, 2-stage 1F1B pipeline.

Every check compares with the unsharded computation done locally in fp32. Tolerance: the sharded
sums only reorder fp32 additions, so values and gradients agree to rtol 1e-5, atol 1e-6.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hgraph import ops
from hgraph.errors import HGraphError
from hgraph.runtime.comm import p2p
from hgraph.runtime.comm.collectives import (comm_wait, pp_recv, pp_send, sp_gather_issue, sp_scatter_issue,
                                             tp_copy_issue, tp_gather_issue, tp_reduce_issue)
from hgraph.runtime.comm.context import CommContext
from hgraph.runtime.engine.loss import IGNORE_INDEX, stage_loss_sum
from hgraph.runtime.train.launch import spawn
from hgraph.shard_rule import shard_bounds

RTOL, ATOL = 1e-5, 1e-6
B, T, D, H = 2, 3, 8, 12


def _close(a, b):
    return bool(torch.allclose(a, b, rtol=RTOL, atol=ATOL))


def _mlp_weights():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(H, D, generator=g), torch.randn(D, H, generator=g),
            torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g))


def _tp_mlp(comm, rank):
    """Column-parallel then row-parallel linear; TP groups {0,1} and {2,3} run side by side."""
    w1, w2, x, r = _mlp_weights()
    tp = [0, 1] if rank < 2 else [2, 3]
    i = tp.index(rank)
    rows = slice(i * H // 2, (i + 1) * H // 2)
    w1_i = w1[rows].clone().requires_grad_()
    w2_i = w2[:, rows].clone().requires_grad_()
    x_i = x.clone().requires_grad_()
    h = F.gelu(tp_copy_issue(comm, x_i, tp) @ w1_i.t())
    y_issued = tp_reduce_issue(comm, h @ w2_i.t(), tp)
    busy = (x_i * 2).sum()  # work placed between issue and wait
    y = comm_wait(comm, y_issued)
    (y * r).sum().backward()

    w1f, w2f, xf = (t.clone().requires_grad_() for t in (w1, w2, x))
    yf = F.gelu(xf @ w1f.t()) @ w2f.t()
    (yf * r).sum().backward()
    return {"y": _close(y, yf), "dx": _close(x_i.grad, xf.grad),
            "dw1": _close(w1_i.grad, w1f.grad[rows]), "dw2": _close(w2_i.grad, w2f.grad[:, rows]),
            "busy": busy.item() == (x * 2).sum().item(), "pending": comm.num_pending()}


def _sp_mlp(comm, rank):
    """The MLP above under sequence parallelism: each TP rank holds its slice of 5 tokens (2 and 3: uneven)
    before the all-gather and after the reduce-scatter; a norm weight-like ``s`` used on the slices
    gets a partial gradient per rank, whose sum over the TP group is the whole gradient."""
    w1, w2, _, _ = _mlp_weights()
    g = torch.Generator().manual_seed(2)
    x, r, s = torch.randn(1, 5, D, generator=g), torch.randn(1, 5, D, generator=g), torch.randn(D, generator=g)
    tp = [0, 1] if rank < 2 else [2, 3]
    i = tp.index(rank)
    lo, hi = shard_bounds(5, i, 2)
    rows = slice(i * H // 2, (i + 1) * H // 2)
    w1_i, w2_i = w1[rows].clone().requires_grad_(), w2[:, rows].clone().requires_grad_()
    x_i, s_i = x[:, lo:hi].clone().requires_grad_(), s.clone().requires_grad_()
    whole = comm_wait(comm, sp_gather_issue(comm, x_i * s_i, tp, 1, 5))
    y_i = comm_wait(comm, sp_scatter_issue(comm, F.gelu(whole @ w1_i.t()) @ w2_i.t(), tp, 1))
    (y_i * r[:, lo:hi]).sum().backward()
    ds = s_i.grad.clone()
    dist.all_reduce(ds, group=comm.groups.get(tuple(tp)))

    w1f, w2f, xf, sf = (t.clone().requires_grad_() for t in (w1, w2, x, s))
    yf = F.gelu((xf * sf) @ w1f.t()) @ w2f.t()
    (yf * r).sum().backward()
    return {"shape": tuple(y_i.shape) == (1, hi - lo, D), "y": _close(y_i, yf[:, lo:hi]),
            "dx": _close(x_i.grad, xf.grad[:, lo:hi]), "dw1": _close(w1_i.grad, w1f.grad[rows]),
            "dw2": _close(w2_i.grad, w2f.grad[:, rows]), "ds_summed": _close(ds, sf.grad),
            "ds_partial": not _close(s_i.grad, sf.grad), "pending": comm.num_pending()}


def _gather(comm, rank):
    """All-gather along dim 1 with uneven pieces, over all 4 ranks and over a reversed pair."""
    g = torch.Generator().manual_seed(1)
    sizes = [1, 2, 3, 4]
    full = torch.randn(2, sum(sizes), 5, generator=g)
    w = torch.randn(2, sum(sizes), 5, generator=g)
    lo = sum(sizes[:rank])
    x = full[:, lo:lo + sizes[rank]].clone().requires_grad_()
    y = comm_wait(comm, tp_gather_issue(comm, x, [0, 1, 2, 3], dim=1, sizes=sizes))
    (y * w).sum().backward()
    out = {"gather": torch.equal(y, full), "grad": torch.equal(x.grad, w[:, lo:lo + sizes[rank]])}
    pair = [1, 0] if rank < 2 else [3, 2]  # pieces follow the order of the list, not rank order
    piece = torch.full((3,), float(rank))
    got = comm_wait(comm, tp_gather_issue(comm, piece, pair, dim=0))
    out["pair_order"] = got.tolist() == [float(pair[0])] * 3 + [float(pair[1])] * 3
    return out


def _stage_model():
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, H),
                               torch.nn.Tanh(), torch.nn.Linear(H, 1))


def _pipeline(comm, rank, staged=None):
    """Stage 0 = layers 0-3 on ranks 0/2, stage 1 = layer 4 on ranks 1/3; 2 micro-batches, 1F1B.
    ``staged``: activations and gradients through host buffers (``p2p``; None: as the backend needs)."""
    g = torch.Generator().manual_seed(3)
    mbs = [(torch.randn(4, D, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2)]
    model = _stage_model()
    first = rank % 2 == 0
    stage = model[:4] if first else model[4:]
    peer = rank + 1 if first else rank - 1
    n = sum(len(t) for _, t in mbs)
    if first:
        tokens = [pp_send(comm, stage(x), peer, tag=7, stage=staged) for x, _ in mbs]  # warm-up: F0, F1
        for token in tokens:                                               # cool-down: B0, B1
            token.backward()
            comm_wait(comm, token)
    else:
        for x, t in mbs:                                                   # F_i then B_i
            act = pp_recv(comm, peer, (4, H), torch.float32, tag=7, stage=staged)
            (F.mse_loss(stage(act), t, reduction="sum") / n).backward()
    comm.wait_all()
    ref = _stage_model()
    loss = sum(F.mse_loss(ref(x), t, reduction="sum") for x, t in mbs) / n
    loss.backward()
    ref_stage = ref[:4] if first else ref[4:]
    return {"grads": all(_close(p.grad, q.grad) for p, q in
                         zip(stage.parameters(), ref_stage.parameters())),
            "pending": comm.num_pending()}


def _issue_does_not_block(comm, rank):
    """Rank 1 joins the all-reduce only after rank 0 says, through the store, that its issue returned:
    an issue that waited for the collective would never return (spawn's timeout would fail the module)."""
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank == 1:
        store.wait(["issued"])
    issued = tp_reduce_issue(comm, torch.ones(4), [0, 1]) if rank < 2 else None
    if rank == 0:
        store.set("issued", "1")
    out = comm_wait(comm, issued) if rank < 2 else None
    return {"sum": None if out is None else out.tolist()}


def _vocab_parallel_loss(comm, rank, parallel):
    """The output head's loss over a vocabulary of 13 split 4 ways (padded to 16: the last rank holds
    1 real row and 3 of padding), in chunks of 3 tokens, against the whole head's cross-entropy;
    vocabulary-parallel or gathering each chunk's logits."""
    g = torch.Generator().manual_seed(4)
    vocab, tokens, sizes = 13, 7, (4, 4, 4, 4)
    x, w = torch.randn(tokens, D, generator=g), torch.randn(vocab, D, generator=g)
    b = torch.randn(vocab, generator=g)
    targets = torch.randint(0, vocab, (1, tokens), generator=g)
    targets[0, 3] = IGNORE_INDEX
    targets[0, 0] = vocab - 1           # held by the last rank, beside its padding
    rows = slice(4 * rank, min(4 * rank + 4, vocab))
    pad = 4 - (rows.stop - rows.start)
    w_i = torch.cat([w[rows], torch.zeros(pad, D)]).requires_grad_()
    b_i = torch.cat([b[rows], torch.zeros(pad)]).requires_grad_()
    x_i = x.clone().requires_grad_()
    comm = dataclasses.replace(comm, bindings={"tp": (0, 1, 2, 3)}, head_inputs=True, vocab_parallel_loss=parallel)
    head = ops.output_head(comm, tp_copy_issue(comm, x_i, [0, 1, 2, 3])[None], w_i, b_i, "tp", sizes, vocab)
    loss = stage_loss_sum(head, targets, comm, chunk=3)
    loss.backward()
    comm = dataclasses.replace(comm, head_inputs=False)
    logits = ops.output_head(comm, x[None], w_i.detach(), b_i.detach(), "tp", sizes, vocab)
    xf, wf, bf = (t.clone().requires_grad_() for t in (x, w, b))
    ref = F.cross_entropy(F.linear(xf, wf, bf), targets[0], ignore_index=IGNORE_INDEX, reduction="sum")
    ref.backward()
    return {"start": head.vocab_start == 4 * rank, "real": head.vocab_local == rows.stop - rows.start,
            "logits": _close(logits[0], F.linear(x, w, b)), "loss": _close(loss, ref),
            "dx": _close(x_i.grad, xf.grad), "dw": _close(w_i.grad[:4 - pad], wf.grad[rows]),
            "db": _close(b_i.grad[:4 - pad], bf.grad[rows]), "pad_grad": not w_i.grad[4 - pad:].any()}


def _staged_transfers(rank):
    """The LNK pulls' and pushes' batched point-to-point through host buffers (shared-device mode's
    path, on CPU tensors): ranks 0 <-> 1 and 2 <-> 3 swap two tensors each; a receive is written into
    its tensor when waited for."""
    peer = rank ^ 1
    mine = [torch.full((3, 2), 10.0 * rank + i) for i in range(2)]
    got = [torch.zeros(3, 2) for _ in range(2)]
    works = p2p.batch_isend_irecv([*(p2p.PeerOp(True, t, peer, 20 + i) for i, t in enumerate(mine)),
                                   *(p2p.PeerOp(False, t, peer, 20 + i) for i, t in enumerate(got))], stage=True)
    for w in works:
        w.wait()
    one = torch.zeros(4)
    if rank % 2 == 0:
        p2p.isend(torch.arange(4.0) + rank, peer, tag=30, stage=True).wait()
    else:
        p2p.irecv(one, peer, tag=30, stage=True).wait()
    return {"batch": all(torch.equal(g, torch.full((3, 2), 10.0 * peer + i)) for i, g in enumerate(got)),
            "single": rank % 2 == 0 or torch.equal(one, torch.arange(4.0) + peer),
            "staged_work": all(isinstance(w, p2p.StagedWork) for w in works),
            "decides": (p2p.host_staged(torch.device("cuda", 0)), p2p.host_staged(torch.device("cpu")))}


def _worker(rank, world_size):
    comm = CommContext.from_default_group()
    comm.groups.ensure([[0, 1], [2, 3]])
    return {"tp": _tp_mlp(comm, rank), "sp": _sp_mlp(comm, rank), "gather": _gather(comm, rank), "pp": _pipeline(comm, rank),
            "pp_staged": _pipeline(comm, rank, staged=True), "staged": _staged_transfers(rank),
            "async": _issue_does_not_block(comm, rank),
            "head": [_vocab_parallel_loss(comm, rank, parallel) for parallel in (True, False)]}


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=60)


def test_tp_mlp_matches_unsharded(results):
    for out in results:
        assert out["tp"] == {"y": True, "dx": True, "dw1": True, "dw2": True, "busy": True,
                             "pending": 0}


def test_sequence_parallel_mlp_on_uneven_token_slices_matches_unsharded(results):
    for out in results:
        assert out["sp"] == {"shape": True, "y": True, "dx": True, "dw1": True, "dw2": True, "ds_summed": True,
                             "ds_partial": True, "pending": 0}


def test_issue_returns_before_the_collective_completes(results):
    assert [r["async"]["sum"] for r in results] == [[2.0] * 4, [2.0] * 4, None, None]


def test_uneven_gather_and_its_backward(results):
    for out in results:
        assert out["gather"] == {"gather": True, "grad": True, "pair_order": True}


def test_pipeline_and_transfers_staged_through_host_memory_carry_the_same_values(results):
    """Shared-device mode (ranks on one GPU over gloo, which aborts on send/recv of CUDA tensors)
    stages point-to-point through host buffers; the same code on CPU tensors, forced on."""
    for out in results:
        assert out["pp_staged"] == {"grads": True, "pending": 0}
        assert out["staged"] == {"batch": True, "single": True, "staged_work": True, "decides": (True, False)}


def test_two_stage_1f1b_pipeline_matches_unsplit_model(results):
    for out in results:
        assert out["pp"] == {"grads": True, "pending": 0}


def test_vocab_parallel_chunked_loss_matches_the_whole_head(results):
    for out in results:
        for mode in out["head"]:
            assert mode == {"start": True, "real": True, "logits": True, "loss": True, "dx": True,
                            "dw": True, "db": True, "pad_grad": True}


def test_single_rank_ops_are_identity():
    comm = CommContext.single()
    x = torch.randn(3, 4, requires_grad=True)
    assert tp_copy_issue(comm, x, [0]) is x
    assert comm_wait(comm, tp_reduce_issue(comm, x, [0])) is x
    assert comm_wait(comm, tp_gather_issue(comm, x, [0], dim=1)) is x
    assert comm.num_pending() == 0


def test_bad_peers_and_sizes_are_clear_errors():
    comm = CommContext.single()
    x = torch.randn(3, 4)
    with pytest.raises(HGraphError, match="not one of them"):
        tp_copy_issue(comm, x, [1, 2])
    with pytest.raises(HGraphError, match="holds 4 along dim 1 but sizes say 5"):
        tp_gather_issue(comm, x, [0], dim=1, sizes=[5])
    with pytest.raises(HGraphError, match="peer rank 0 is not another rank"):
        pp_send(comm, x, 0)
    with pytest.raises(HGraphError, match="peer rank 3 is not another rank"):
        pp_recv(comm, 3, (3, 4), torch.float32)
