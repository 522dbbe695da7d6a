"""The expert-parallel MoE op (``hgraph.moe_dispatch``: the count exchange, the dispatch and combine
all-to-alls, the local experts) on 4 gloo processes, one launch for the module, equals the
single-process ``moe_layer`` on all the tokens with all the experts: the outputs, and the gradients of
the input, the router and every expert.

Cases: EP2 twice side by side (groups {0, 1} and {2, 3}: a list of expert matrices with a rank holding
no token; stacked experts with renormalised top-k), EP4 over uneven token counts with a rank holding
none (fused gate_up experts), and TP2 inside EP2 (EP groups {0, 2} and {1, 3}, each expert's
intermediate rows split over the TP pair: outputs, input and router gradients are partial sums over
the TP ranks); and, on each pair, the graph ``passes/moe_ep`` makes of a traced MoE op whose stacked
(or fused) expert tensors the rank holds whole, narrowed to its experts. Every case has an expert no
token chooses (its gradient is an exact zero on its rank).

A rank's tokens are a contiguous piece of the reference's, in rank order. Tokens whose reference top-k
margin (k-th minus (k+1)-th router probability) is below ``TIE_TOLERANCE`` are left out of the data, as
``tests/runtime/train/test_moe_train.py`` exempts them: the ranks' router logits of fewer rows may round
differently and choose the other expert. Tolerance (rtol 1e-5, atol 1e-6, on values of order one): the
same rows reach each expert in the same order, so the exchange only moves values (outputs and the input's
and experts' gradients are bitwise equal here without TP); the router's gradient is a sum of the ranks'
partial GEMMs, and TP's partial sums are added in another order.
"""
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from hgraph import moe, moe_dispatch
from hgraph.options import CompileOptions
from hgraph.passes.context import PassContext
from hgraph.passes.moe_ep import moe_ep_pass
from hgraph.program import RankRole
from hgraph.runtime.comm.context import CommContext
from hgraph.strategy import Scheme
from hgraph.runtime.train.launch import spawn
from hgraph.shard_rule import shard_bounds

H, I = 8, 6
TIE_TOLERANCE = 1e-4
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    top_k: int
    tokens: tuple[int, ...]        # per EP rank
    layout: str                    # "list", "stacked" or "fused"
    normalize: bool = False
    tp: int = 1
    seed: int = 0

    @property
    def unused(self) -> int:
        """The expert no token chooses (tokens that would are left out of the data)."""
        return self.experts - 2


CASES = {
    "ep2_list": Case("ep2_list", 4, 1, (5, 0), "list", seed=1),
    "ep2_stacked": Case("ep2_stacked", 4, 2, (7, 6), "stacked", normalize=True, seed=2),
    "ep4_fused": Case("ep4_fused", 8, 2, (3, 0, 7, 4), "fused", seed=3),
    "tp2_ep2": Case("tp2_ep2", 4, 2, (6, 5), "list", tp=2, seed=4),
    "graph_stacked": Case("graph_stacked", 6, 2, (4, 5), "stacked", seed=5),
    "graph_fused": Case("graph_fused", 4, 2, (3, 6), "fused", normalize=True, seed=6),
}


def _data(case: Case):
    """(tokens [N, H], router [E, H], gate, up [E, I, H], down [E, H, I], output weights [N, H]): tokens drawn
    at random, those that would choose the unused expert or are near-ties left out."""
    g = torch.Generator().manual_seed(case.seed)
    router = torch.randn(case.experts, H, generator=g)
    gate, up = (torch.randn(case.experts, I, H, generator=g) / H ** 0.5 for _ in range(2))   # as inits scale
    down = torch.randn(case.experts, H, I, generator=g) / I ** 0.5
    total = sum(case.tokens)
    pool = torch.randn(8 * total + 8, H, generator=g)
    top = torch.topk(torch.softmax(pool @ router.t(), -1), case.top_k + 1, -1)
    keep = (top.values[:, case.top_k - 1] - top.values[:, case.top_k] >= TIE_TOLERANCE) & \
        (top.indices[:, :case.top_k] != case.unused).all(-1)
    x = pool[keep][:total]
    assert x.shape[0] == total
    return x, router, gate, up, down, torch.randn(total, H, generator=g)


def _weights(case: Case, gate, up, down, experts: slice, rows: slice) -> list[torch.Tensor]:
    """The experts' weights in the case's layout: ``experts``, each with its intermediate ``rows``."""
    g, u, d = gate[experts, rows], up[experts, rows], down[experts, :, rows]
    if case.layout == "list":
        return [t.clone() for t in (*g.unbind(0), *u.unbind(0), *d.unbind(0))]
    if case.layout == "stacked":
        return [g.clone(), u.clone(), d.clone()]
    return [torch.cat([g, u], dim=1), d.clone()]


def _expert_grads(case: Case, grads: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(gate, up, down) gradients stacked per expert, from ``grads`` in the case's layout."""
    if case.layout == "list":
        e = len(grads) // 3
        return tuple(torch.stack(grads[i * e:(i + 1) * e]) for i in range(3))
    if case.layout == "stacked":
        return tuple(grads)
    gate_up, down = grads
    inter = down.shape[-1]
    return gate_up[:, :inter], gate_up[:, inter:], down


def _ep_run(comm: CommContext, case: Case, ep_ranks: list[int], tp_ranks: list[int],
            recomputed: bool = False) -> dict:
    """This rank's part of ``case``: its EP rank's tokens, its experts (its TP slice of them); with
    ``recomputed`` the op runs as a recomputed block does (non-reentrant checkpoint, replayed whole in
    backward); what it issued is recorded."""
    x, router, gate, up, down, r = _data(case)
    ep, tp = ep_ranks.index(comm.rank), tp_ranks.index(comm.rank)
    lo = sum(case.tokens[:ep])
    hi = lo + case.tokens[ep]
    first, last = shard_bounds(case.experts, ep, len(ep_ranks))
    rows = slice(*shard_bounds(I, tp, case.tp))
    mine = x[lo:hi].clone().requires_grad_()
    router_w = router.clone().requires_grad_()
    weights = [w.requires_grad_() for w in _weights(case, gate, up, down, slice(first, last), rows)]
    view = comm.for_microbatch()

    def layer(tokens):
        return moe_dispatch.moe_layer_ep(view, tokens, router_w, *weights, top_k=case.top_k,
                                         normalize_top_k=case.normalize, key="ep")

    comm.issuer.start_recording()
    if recomputed:
        with set_checkpoint_early_stop(False):          # as engine/recompute runs a block
            y = checkpoint(layer, mine.unsqueeze(0), use_reentrant=False)
            (y[0] * r[lo:hi]).sum().backward()
    else:
        y = layer(mine.unsqueeze(0))
        (y[0] * r[lo:hi]).sum().backward()
    return {"y": y[0].detach(), "dx": mine.grad, "router": router_w.grad,
            "experts": _expert_grads(case, [w.grad for w in weights]), "pending": comm.num_pending(),
            "issued": [(c.kind, c.dtype, c.label) for c in comm.issuer.sequence]}


class _Experts(torch.nn.Module):
    """A traced MoE op over whole stacked (or fused) expert tensors: what ``moe_ep_pass`` narrows."""

    def __init__(self, case: Case, router, gate, up, down):
        super().__init__()
        self.router = torch.nn.Parameter(router.clone())
        self.weights = torch.nn.ParameterList(_weights(case, gate, up, down, slice(None), slice(None)))
        self.case = case

    def forward(self, x):
        return moe.moe_layer(x, self.router, *self.weights, top_k=self.case.top_k,
                             normalize_top_k=self.case.normalize)


def _graph_run(comm: CommContext, case: Case, ep_ranks: list[int]) -> dict:
    """``case`` through the graph ``moe_ep_pass`` makes of a traced MoE op for this rank's EP rank (its
    stacked expert tensors whole, narrowed by the pass to its experts)."""
    x, router, gate, up, down, r = _data(case)
    ep = ep_ranks.index(comm.rank)
    lo = sum(case.tokens[:ep])
    hi = lo + case.tokens[ep]
    module = _Experts(case, router, gate, up, down)
    gm = fx.symbolic_trace(module)
    (x_in,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(x_in):
        gm.graph.placeholder("comm")
    role = RankRole(Scheme.parse(f"TP1PP1EP{len(ep_ranks)}"), 0, 0, 0, 0, ep)
    params = {"router": SimpleNamespace(shape=router.shape)}
    gm = moe_ep_pass(gm, PassContext(SimpleNamespace(params=params), role, (), {}, CompileOptions(), {}))
    mine = x[lo:hi].clone().requires_grad_()
    y = gm(mine.unsqueeze(0), comm.for_microbatch())
    (y[0] * r[lo:hi]).sum().backward()
    first, last = shard_bounds(case.experts, ep, len(ep_ranks))
    grads = _expert_grads(case, [w.grad for w in module.weights])
    return {"y": y[0].detach(), "dx": mine.grad, "router": module.router.grad,
            "experts": tuple(g[first:last] for g in grads),
            "others_zero": all(torch.equal(torch.cat([g[:first], g[last:]]), torch.zeros_like(torch.cat([g[:first], g[last:]])))
                               for g in grads),
            "code": gm.code, "pending": comm.num_pending()}


def _worker(rank, world_size):
    comm = CommContext.from_default_group()
    comm.groups.ensure([[0, 1], [2, 3]])
    comm.groups.ensure([[0, 2], [1, 3]])
    pair = [0, 1] if rank < 2 else [2, 3]
    out = {}
    case = CASES["ep2_list"] if rank < 2 else CASES["ep2_stacked"]
    out[case.name] = _ep_run(CommContext.from_default_group(groups=comm.groups, bindings={"ep": pair}), case,
                             pair, [rank])
    case = CASES["ep4_fused"]
    out[case.name] = _ep_run(CommContext.from_default_group(groups=comm.groups, bindings={"ep": [0, 1, 2, 3]}),
                             case, [0, 1, 2, 3], [rank])
    case, ep = CASES["tp2_ep2"], [rank % 2, rank % 2 + 2]
    out[case.name] = _ep_run(CommContext.from_default_group(groups=comm.groups, bindings={"ep": ep}), case,
                             ep, pair)
    out["replayed"] = _ep_run(CommContext.from_default_group(groups=comm.groups, bindings={"ep": [0, 1, 2, 3]}),
                              CASES["ep4_fused"], [0, 1, 2, 3], [rank], recomputed=True)
    case = CASES["graph_stacked"] if rank < 2 else CASES["graph_fused"]
    out[case.name] = _graph_run(CommContext.from_default_group(groups=comm.groups, bindings={"ep": pair}), case,
                                pair)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=120)


def _reference(case: Case) -> dict:
    x, router, gate, up, down, r = _data(case)
    x, router = x.clone().requires_grad_(), router.clone().requires_grad_()
    weights = [w.requires_grad_() for w in _weights(case, gate, up, down, slice(None), slice(None))]
    y, logits = moe.moe_layer_with_logits(x, router, *weights, top_k=case.top_k, normalize_top_k=case.normalize)
    (y * r).sum().backward()
    chosen = torch.topk(logits, case.top_k, -1).indices
    return {"y": y.detach(), "dx": x.grad, "router": router.grad, "counts": torch.bincount(chosen.flatten(),
                                                                                          minlength=case.experts),
            "experts": _expert_grads(case, [w.grad for w in weights])}


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _check(case: Case, runs: list[dict]) -> None:
    """``runs``: the case's ranks' results in rank order (EP outer, TP inner)."""
    want = _reference(case)
    assert int(want["counts"][case.unused]) == 0 and int(want["counts"].min()) == 0
    tp, ep = case.tp, len(case.tokens)
    by_ep = [runs[e * tp:(e + 1) * tp] for e in range(ep)]
    # the TP ranks' partial sums of each EP rank's tokens, in token order
    _close(torch.cat([sum(r["y"] for r in group) for group in by_ep]), want["y"], f"{case.name} y")
    _close(torch.cat([sum(r["dx"] for r in group) for group in by_ep]), want["dx"], f"{case.name} dx")
    _close(sum(r["router"] for r in runs), want["router"], f"{case.name} router gradient")
    for e, group in enumerate(by_ep):
        first, last = shard_bounds(case.experts, e, ep)
        for t, run in enumerate(group):
            rows = slice(*shard_bounds(I, t, tp))
            for name, got, full in zip(("gate", "up", "down"), run["experts"], want["experts"]):
                part = full[first:last, rows] if name != "down" else full[first:last, :, rows]
                _close(got, part, f"{case.name} EP rank {e} TP rank {t} {name} gradients")
            if first <= case.unused < last:           # no row reached it: an exact zero, not None
                assert all(torch.equal(g[case.unused - first], torch.zeros_like(g[case.unused - first]))
                           for g in run["experts"])
        assert all(r["pending"] == 0 for r in group)


def test_two_ep_groups_side_by_side_match_one_process(results):
    _check(CASES["ep2_list"], [r["ep2_list"] for r in results[:2]])
    _check(CASES["ep2_stacked"], [r["ep2_stacked"] for r in results[2:]])


def test_ep4_over_uneven_tokens_with_an_empty_rank_matches_one_process(results):
    _check(CASES["ep4_fused"], [r["ep4_fused"] for r in results])


FORWARD = [("all_to_all", "int64", "moe_counts"), ("all_to_all", "float32", "moe_dispatch"),
           ("all_to_all", "float32", "moe_combine")]
BACKWARD = [("all_to_all", "float32", "moe_combine backward"), ("all_to_all", "float32", "moe_dispatch backward")]


def test_each_rank_issues_the_counts_dispatch_and_combine_then_their_reverses(results):
    """The order ``runtime/comm/order/derive`` claims (``test_derive_expert_exchange``): a recomputed
    block's replay issues the three forwards again before the combine's backward."""
    for r in results:
        assert r["ep4_fused"]["issued"] == FORWARD + BACKWARD
        assert r["replayed"]["issued"] == FORWARD + FORWARD + BACKWARD
    _check(CASES["ep4_fused"], [r["replayed"] for r in results])


def test_tp_inside_ep_matches_one_process(results):
    # rank layout: TP innermost, EP outer (ranks 0, 1: EP rank 0's TP pair)
    _check(CASES["tp2_ep2"], [r["tp2_ep2"] for r in results])


def test_the_pass_graph_narrows_whole_stacked_experts_and_matches_one_process(results):
    for name, runs in (("graph_stacked", results[:2]), ("graph_fused", results[2:])):
        runs = [r[name] for r in runs]
        _check(CASES[name], runs)
        assert all(r["others_zero"] for r in runs)          # the other EP rank's experts: zero gradient rows
        assert all("moe_dispatch_issue" in r["code"] and "torch.narrow" in r["code"] for r in runs)
