"""The MoE router losses of a step on one rank, against hand computations (``runtime/engine/router_losses``;
the strategies: ``tests/runtime/train/test_moe_train.py``): their values per target, the gradient they add
to the router logits, Hugging Face's form, and the refused global-batch form."""
import pytest
import torch

from hgraph import moe
from hgraph.errors import HGraphError
from hgraph.runtime.comm.context import CommContext
from hgraph.runtime.engine.router_losses import RouterLossConfig, RouterLosses
from hgraph.runtime.kernels.dropout import TokenKeys
from hgraph.runtime.train.run_config import config_from_options

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


def test_global_batch_is_refused_in_one_line_naming_the_option():
    with pytest.raises(HGraphError, match=r"--moe-aux-loss = global-batch: not built yet .*allowed: per-document"):
        config_from_options({"model": "llama-moe:tiny", "world_size": 1, "steps": 1, "moe_aux_loss": "global-batch"},
                            env=None)


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
