"""``hgraph train --model llama-moe:tiny`` equals single-device PyTorch training of the same MoE model:
on one rank, and under a schedule mixing TP (the routed and shared experts sharded inside, the router whole,
and under Megatron sequence parallelism every TP rank routing the gathered tokens, the experts' partial
sums reduce-scattered), PP, CP, Ulysses, expert parallelism (EP<n>: each EP rank its own documents and
experts) and several data-parallel pipelines on 4 gloo ranks, and pipelines of different EP degrees side
by side on 6, there with the router losses added
(``--moe-aux-loss per-document`` or ``global-batch``, and a z-loss: the reference adds each document's
losses, or each layer's over the whole mini-batch at once, by hand, and the logged values equal its own).

Reference semantics: a parameter no token reached in a step (an expert no token chose) has an exact-zero
gradient, as in Megatron's and DDP's gradient buffers, so Adam still steps it with its moments; PyTorch's
``zero_grad(set_to_none=True)`` would leave it ``None`` and skip it, so the reference fills such gradients
with zeros.

Near-ties: two correct runs differ by rounding (the noise-aware comparison), and a token whose router
probabilities at ranks k and k+1 differ by less than ``TIE_TOLERANCE`` may choose the other expert under
another strategy. The reference records those tokens; a parameter of an expert involved in one (ranked k
or k+1 there) or of that layer's router that differs beyond the noise-aware bounds is reported, not
failed, and the test fails when the reference has more than ``MAX_NEAR_TIES`` such tokens.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from tests.runtime.reference_training import (ReferenceRun, assert_losses_like, assert_params_like,
                                              write_random_documents)

from hgraph.frontends.zoo import llama_moe
from hgraph.runtime.data.document_split import split_documents
from hgraph.runtime.data.documents import mini_batches, read_jsonl
from hgraph.tools.cli import main

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2, 9, 6, 14, 3, 7, 5]
AUX_COEF, Z_COEF = 0.5, 0.01        # large enough that the router losses move the weights visibly
TIE_TOLERANCE = 1e-4            # router probability margin between the k-th and (k+1)-th expert
MAX_NEAR_TIES = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_random_documents(tmp_path_factory.mktemp("moe") / "docs.jsonl", LENGTHS, seed=3)


def _router_losses(logits, k):
    """The load-balancing sum and z-loss sum of one layer's router ``logits`` (a document's, or the whole
    mini-batch's), by hand: ``E * sum_e f_e * sum_t p_te`` with ``f_e`` their share of the assignments, and
    ``sum_t logsumexp(logits_t)^2`` (``runtime/engine/router_losses``)."""
    probs = torch.softmax(logits.float(), -1)
    num_experts = logits.shape[-1]
    f = F.one_hot(torch.topk(probs, k, -1).indices, num_experts).sum((0, 1)).float() / (k * logits.shape[0])
    return num_experts * (f * probs.sum(0)).sum(), torch.logsumexp(logits.float(), -1).square().sum()


def _reference(path, steps, lr=1e-3, router_losses=None):
    """The PyTorch run (zero gradients for unreached experts; with ``router_losses`` "per-document" or
    "global-batch" that load-balancing loss and the z-loss added, coefficients AUX_COEF and Z_COEF) and
    its near-tie tokens: ``{(layer, expert)}`` of the experts ranked k and k+1 at each token closer than
    TIE_TOLERANCE."""
    torch.manual_seed(0)
    model = llama_moe.build("tiny")
    k = model.config.top_k
    near: list[tuple[int, int, int]] = []
    seen: list[torch.Tensor] = []

    def watch(index):
        def hook(module, inputs, logits):
            seen.append((index, logits))
            probs = torch.softmax(logits.detach().float(), -1)
            top = torch.topk(probs, k + 1, -1)
            for t in (top.values[:, k - 1] - top.values[:, k] < TIE_TOLERANCE).nonzero().flatten().tolist():
                near.append((index, int(top.indices[t, k - 1]), int(top.indices[t, k])))
        return hook

    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, llama_moe.MoeBlock):
            layer.mlp.gate.register_forward_hook(watch(i))
    first: dict = {}
    routers: list[list[float]] = []     # per step: the load-balancing and z-loss sums per target
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for batch in mini_batches(read_jsonl(path), 30, steps):
        opt.zero_grad()
        total, ce, router = torch.zeros(()), 0.0, [0.0, 0.0]
        layers: dict[int, list[torch.Tensor]] = {}      # the whole mini-batch's router logits per layer
        for d in batch.docs:
            ids = torch.tensor([d.input_ids])
            seen.clear()
            doc = F.cross_entropy(model(ids)[0, :-1], ids[0, 1:], reduction="sum")
            total, ce = total + doc, ce + float(doc.detach())
            for index, logits in seen:
                logits = logits.reshape(-1, logits.shape[-1])
                layers.setdefault(index, []).append(logits)
                if router_losses == "per-document":
                    aux, z = _router_losses(logits, k)
                    total = total + AUX_COEF * aux + Z_COEF * z
                    router = [router[0] + float(aux.detach()), router[1] + float(z.detach())]
        if router_losses == "global-batch":
            for logits in layers.values():      # each layer's losses over all its tokens at once
                aux, z = _router_losses(torch.cat(logits), k)
                total = total + AUX_COEF * aux + Z_COEF * z
                router = [router[0] + float(aux.detach()), router[1] + float(z.detach())]
        (total / batch.num_targets).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not first:
            first.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(ce / batch.num_targets)
        routers.append([v / batch.num_targets for v in router])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ReferenceRun(losses, state, first, lr), near, routers


def _train(data, tmp_path, capsys, world, schedule, steps, *extra):
    final = tmp_path / f"final{world}.pt"
    rc = main(["train", "--model", "llama-moe:tiny", "--data", str(data), "--tokens-per-iter", "30",
               "--world-size", str(world), "--strategy-schedule", schedule, "--steps", str(steps),
               "--save-final", str(final), "--json", *extra])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    return [s["loss"] for s in out["steps"]], torch.load(final), out


def _assert_like_with_near_ties(losses, state, reference, near):
    assert len(near) <= MAX_NEAR_TIES, f"{len(near)} near-tie tokens (margin < {TIE_TOLERANCE}): {near}"
    assert_losses_like(losses, reference.losses)
    involved = {f"layers.{layer}.mlp.experts.{e}." for layer, a, b in near for e in (a, b)} | \
               {f"layers.{layer}.mlp.gate." for layer, _, _ in near}
    exempt = [n for n in reference.state if any(n.startswith(p) for p in involved)]
    held = [n for n in reference.state if n not in exempt]
    assert_params_like(state, reference.state, lr=reference.lr, first_grads=reference.first_grads, names=held)
    for name in exempt:
        try:
            assert_params_like(state, reference.state, lr=reference.lr, first_grads=reference.first_grads,
                               names=[name])
        except AssertionError as exc:
            print(f"near-tie: {name} differs, reported not failed: {exc}")


def test_single_rank_run_equals_pytorch(data, tmp_path, capsys):
    losses, state, out = _train(data, tmp_path, capsys, 1, "1xTP1PP1", 3)
    reference, near, _ = _reference(data, 3)
    _assert_like_with_near_ties(losses, state, reference, near)


#: 4 ranks: TP, PP, CP, Ulysses and data-parallel pipelines, then expert parallelism (EP<n>: each EP rank its
#: own documents and experts, the tokens exchanged by all-to-all) with each of them, EP4 leaving an EP rank
#: without a document in its first step, and an EP pipeline beside plain ones
SCHEDULE_4 = ("1xTP2PP2;2xTP1PP1CP2;1xTP1PP1UL4;1xTP2PP1+2xTP1PP1;4xTP1PP1;"
              "1xTP1PP1EP4;1xTP2PP1EP2;1xTP1PP2EP2;1xTP1PP1UL2EP2;1xTP1PP1EP2+2xTP1PP1;1xTP1PP1CP2EP2")
#: the global-batch form's schedule (a second launch: kept shorter), TP/PP/CP/UL/DP and EP beside them
SCHEDULE_4_GLOBAL = "1xTP2PP2;2xTP1PP1CP2;1xTP1PP1UL4;1xTP1PP1EP4;1xTP2PP1EP2;1xTP1PP1EP2+2xTP1PP1"
#: 6 ranks: pipelines of different EP degrees (and TP, PP, CP, UL) side by side
SCHEDULE_6 = ("1xTP1PP1EP2+1xTP2PP1EP2;1xTP1PP1CP2EP2+1xTP2PP1;1xTP1PP2EP2+2xTP1PP1;1xTP1PP1EP4+1xTP1PP1UL2;"
              "1xTP2PP1EP2+1xTP1PP1EP2")


def _router_loss_args(form: str) -> tuple[str, ...]:
    return ("--moe-aux-loss", form, "--moe-aux-loss-coef", str(AUX_COEF), "--moe-z-loss-coef", str(Z_COEF))


@pytest.mark.parametrize("form,schedule", [("per-document", SCHEDULE_4), ("global-batch", SCHEDULE_4_GLOBAL)])
def test_tp_pp_cp_ul_ep_and_data_parallel_pipelines_equal_pytorch_with_the_router_losses(data, tmp_path, capsys,
                                                                                          form, schedule):
    steps = len(schedule.split(";"))
    if schedule == SCHEDULE_4:
        # the EP4 step's one micro-batch holds 3 documents: its fourth EP rank runs none (a placeholder)
        ep4 = schedule.split(";").index("1xTP1PP1EP4")
        lengths = [len(d) for d in list(mini_batches(read_jsonl(data), 30, steps))[ep4].docs]
        assert len(lengths) == 3 and split_documents(lengths, 4)[3] == ()
    losses, state, out = _train(data, tmp_path, capsys, 4, schedule, steps, *_router_loss_args(form))
    assert [s["strategy"] for s in out["steps"]] == schedule.split(";")
    # the TP2 pipelines ran Megatron SP: every TP rank routed all the micro-batch's tokens through its
    # slices of the experts, the router's gradient a partial sum over the TP ranks; per document, the CP
    # and Ulysses ranks summed each document's routing counts; over the global batch, a counting pass
    # before each step's 1F1B counted every rank's micro-batches (each token once: the first TP rank)
    # and one all-reduce summed them: either loss is the one-device one
    assert out["sequence_parallel"] == "on"
    reference, near, routers = _reference(data, steps, router_losses=form)
    # step 3 of this data leaves expert 5 of layer 1 without a token: its exact-zero gradient is what
    # the reference's zero-filled one must equal (Adam moves it by its moments)
    _assert_like_with_near_ties(losses, state, reference, near)
    got = [[s["moe_aux_loss"], s["moe_z_loss"]] for s in out["steps"]]
    for column in range(2):      # each router loss step by step, by the rule every logged loss keeps
        assert_losses_like([g[column] for g in got], [r[column] for r in routers])
    print(f"near-tie tokens in the reference: {len(near)}; router losses per step {got}")


def test_pipelines_of_different_ep_degrees_side_by_side_equal_pytorch_on_six_ranks(data, tmp_path, capsys):
    """EP pipelines beside pipelines of another EP degree, TP, PP, CP and Ulysses on 6 ranks, under NCCL's
    strictest collective order (each collective completed before the next) and the ranks' recorded
    sequences checked after each new strategy."""
    steps = len(SCHEDULE_6.split(";"))
    losses, state, out = _train(data, tmp_path, capsys, 6, SCHEDULE_6, steps, *_router_loss_args("per-document"),
                                "--collective-order", "strict", "--verify-collectives")
    assert [s["strategy"] for s in out["steps"]] == SCHEDULE_6.split(";")
    reference, near, routers = _reference(data, steps, router_losses="per-document")
    _assert_like_with_near_ties(losses, state, reference, near)
    got = [[s["moe_aux_loss"], s["moe_z_loss"]] for s in out["steps"]]
    for column in range(2):
        assert_losses_like([g[column] for g in got], [r[column] for r in routers])
