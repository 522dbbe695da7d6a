"""The MoE router losses of a step on one rank, against hand computations (``runtime/engine/router_losses``;
the strategies: ``tests/runtime/train/test_moe_train.py``): their values per target, the gradient they add
to the router logits, Hugging Face's form, and the global-batch form over split micro-batches."""
import torch

from hgraph import moe
from hgraph.runtime.comm.context import CommContext
from hgraph.runtime.engine.router_losses import MoeOps, RouterLossConfig, RouterLosses, counts_routing
from hgraph.runtime.kernels.dropout import TokenKeys

E, K = 6, 2
SIZES = (5, 3, 4)                       # three documents packed in one micro-batch
NUM_TARGETS = 40                        # the mini-batch's (more documents than this micro-batch)


def _run(form, aux_coef, z_coef, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(SIZES), E, generator=g, dtype=torch.float64).float().requires_grad_()
    y = torch.randn(sum(SIZES), 8, generator=g).requires_grad_()
    doc_ids = (17, 4, 9)                 # corpus indices, not sorted: a token's document is found by its id
    documents = torch.tensor([d for d, n in zip(doc_ids, SIZES) for _ in range(n)])
    positions = torch.cat([torch.arange(n) for n in SIZES])
    losses = RouterLosses(RouterLossConfig(form, aux_coef, z_coef))
    comm = CommContext.single(router_losses=losses).for_microbatch(
        token_keys=TokenKeys(0, 0, documents, positions, doc_ids), num_targets=NUM_TARGETS)
    out = comm.moe_router_losses(y, logits, K)
    assert torch.equal(out, y)
    out.sum().backward()
    assert torch.equal(y.grad, torch.ones_like(y))       # the op's own gradient passes unchanged
    return logits, losses.values()


def _hand_per_document(logits):
    """Each document's Switch loss ``E * sum_e f_e * P_e`` times its tokens, and its z-loss sum."""
    aux = z = 0.0
    for part in logits.split(SIZES):
        aux = aux + moe.load_balancing_loss(part, K, form="document") * part.shape[0]
        z = z + torch.logsumexp(part, -1).square().sum()
    return aux, z


def test_per_document_losses_and_their_gradient_equal_the_hand_computation():
    logits, (aux, z) = _run("per-document", 0.3, 0.02)
    ref = logits.detach().clone().requires_grad_()
    hand_aux, hand_z = _hand_per_document(ref)
    torch.testing.assert_close(aux, float(hand_aux.detach()) / NUM_TARGETS, rtol=1e-6, atol=0)
    torch.testing.assert_close(z, float(hand_z.detach()) / NUM_TARGETS, rtol=1e-6, atol=0)
    ((0.3 * hand_aux + 0.02 * hand_z) / NUM_TARGETS).backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-9)


def test_hf_form_is_the_product_of_means_over_the_tokens_held_here_token_weighted():
    logits, (aux, z) = _run("hf", 0.1, 0.0)
    hand = moe.load_balancing_loss(logits.detach(), K, form="hf") * sum(SIZES) / NUM_TARGETS
    torch.testing.assert_close(aux, float(hand), rtol=1e-6, atol=0)
    assert z == 0.0


def test_no_losses_leave_the_output_and_its_gradient_alone():
    logits, values = _run("none", 0.01, 0.0)
    assert logits.grad is None and values == (0.0, 0.0)


def _global_step(parts, layers=2, coef=0.3):
    """The global form through ``RouterLosses`` on one rank: the counting pass over the micro-batches
    ``parts`` (each a list of one router-logits tensor per MoE op), then the step's forwards; returns
    the logged value. Gradients land in the logits."""
    ops = MoeOps(rows=tuple(range(layers)), layers=tuple(range(1, layers + 1)), num_rows=layers, num_experts=E)
    losses = RouterLosses(RouterLossConfig("global-batch", coef, 0.0))
    comm = CommContext.single(router_losses=losses)
    with losses.counting(ops, 0, 0, torch.device("cpu")) as counts, torch.no_grad():
        for mb in parts:
            view = comm.for_microbatch(num_targets=NUM_TARGETS)
            for logits in mb:
                assert view.moe_router_losses(logits, logits, K) is logits      # counted, output alone
    losses.use_global_counts(counts)
    for mb in parts:
        view = comm.for_microbatch(num_targets=NUM_TARGETS)
        sum(view.moe_router_losses(torch.zeros(1, requires_grad=True), logits, K).sum() for logits in mb).backward()
    return losses.values()[0], counts


def test_global_batch_on_split_micro_batches_sums_to_the_whole_batchs_loss_and_gradient():
    """Two MoE layers, the mini-batch's tokens in three micro-batches: the counting pass's counts are
    the whole batch's, and the per-micro-batch losses and gradients add up to ``E * sum_e f_e * P_e`` of
    each layer over all tokens at once (times its token count, over the mini-batch's targets)."""
    g = torch.Generator().manual_seed(5)
    whole = [torch.randn(12, E, generator=g, dtype=torch.float64).float() for _ in range(2)]
    split = [w.clone().requires_grad_() for w in whole]
    parts = [[s[lo:hi] for s in split] for lo, hi in ((0, 5), (5, 6), (6, 12))]
    value, counts = _global_step(parts)
    ref = [w.clone().requires_grad_() for w in whole]
    hand = sum(moe.load_balancing_loss(r, K, form="global") * r.shape[0] for r in ref)
    for layer, r in enumerate(ref):
        top = torch.topk(torch.softmax(r.detach(), -1), K, -1).indices
        assert torch.equal(counts[layer], torch.bincount(top.reshape(-1), minlength=E))
    torch.testing.assert_close(value, float(hand.detach()) / NUM_TARGETS, rtol=1e-6, atol=0)
    (0.3 * hand / NUM_TARGETS).backward()
    for s, r in zip(split, ref):
        torch.testing.assert_close(s.grad, r.grad, rtol=1e-5, atol=1e-9)
    # each micro-batch alone (its own counts: no counting pass) is another loss: the global counts matter
    alone = sum(moe.load_balancing_loss(p[0].detach(), K, form="global") * p[0].shape[0] for p in parts)
    assert abs(float(alone) - float(moe.load_balancing_loss(whole[0], K, form="global")) * 12) > 1e-3


def test_a_global_batch_replay_reads_its_layers_row():
    """A recomputed block's replay (``replaying(layer)``) reads the counts of its own layer's op, not
    the next op of a forward: its gradient is the forward's."""
    g = torch.Generator().manual_seed(6)
    logits = [torch.randn(6, E, generator=g).requires_grad_() for _ in range(2)]
    ops = MoeOps(rows=(0, 1), layers=(1, 2), num_rows=2, num_experts=E)
    losses = RouterLosses(RouterLossConfig("global-batch", 0.3, 0.0))
    comm = CommContext.single(router_losses=losses)
    with losses.counting(ops, 0, 0, torch.device("cpu")) as counts, torch.no_grad():
        view = comm.for_microbatch(num_targets=NUM_TARGETS)
        for t in logits:
            view.moe_router_losses(t, t, K)
    counts[1] = counts[1].flip(0)        # the second layer's counts unlike its own tokens'
    losses.use_global_counts(counts)
    view = comm.for_microbatch(num_targets=NUM_TARGETS)
    y = torch.zeros(1, requires_grad=True)
    for t in logits:
        view.moe_router_losses(y, t, K).sum().backward()
    forward = [t.grad.clone() for t in logits]
    for t in logits:
        t.grad = None
    with losses.replaying(2):
        view.moe_router_losses(y, logits[1], K).sum().backward()
    assert torch.equal(logits[1].grad, forward[1]) and not torch.equal(forward[0], forward[1])


def test_who_counts_routing_in_the_global_counts():
    """Each token once: the first weight rank (unless the op runs on its token slice) and replica."""
    assert counts_routing(0, 0, sliced=False) and counts_routing(1, 0, sliced=True)
    assert not counts_routing(1, 0, sliced=False) and not counts_routing(0, 1, sliced=True)


def test_a_recomputed_blocks_replay_adds_its_gradient_but_not_its_value_again():
    logits = torch.randn(4, E, generator=torch.Generator().manual_seed(2)).requires_grad_()
    y = torch.zeros(4, 3, requires_grad=True)
    values = []
    for replay in (False, True):
        losses = RouterLosses(RouterLossConfig("per-document", 0.3, 0.0))
        comm = CommContext.single(router_losses=losses).for_microbatch(num_targets=NUM_TARGETS)
        comm.moe_router_losses(y, logits, K)
        if replay:
            with losses.replaying():
                comm.moe_router_losses(y, logits, K).sum().backward()
            assert logits.grad is not None
        values.append(losses.values())
    assert values[0][0] > 0 and values[1] == values[0]     # the forward's value alone
