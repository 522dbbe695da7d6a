"""``hgraph check``'s derivation (``runtime/comm/order/derive``) knows the MoE exchanges under EP: per MoE
layer and micro-batch the count all-to-all (int64, forward only), the dispatch and the combine all-to-alls
over the ``"ep"`` binding in forward, the combine's then the dispatch's reversed all-to-all in backward,
and all three forwards again where a recomputed block replays (before the combine's backward: the block's
first saved tensor in backward order is the weighted sum's). The runtime issues them in that order
(``tests/runtime/comm/test_expert_exchange.py`` records one op, replay included).

The Programs are derived role by role (``StepDeriver.role``); the whole step's sequences of EP schedules,
checked against what the ranks record, are the MoE equivalence tests' (``--verify-collectives``).
"""
import pytest
import torch

import hgraph
from hgraph.dims import BindingKey
from hgraph.frontends.zoo import llama_moe
from hgraph.meta import CommPoint, get_meta
from hgraph.runtime.comm.order.deadlock import simulate
from hgraph.runtime.comm.order.derive import StepDeriver, derive_steps, representative_plan
from hgraph.runtime.comm.order.pipeline import one_f_one_b
from hgraph.strategy import Cluster, Strategy

FORWARD = [("all_to_all", "int64", "moe_split_exchange"), ("all_to_all", "float32", "moe_dispatch_issue"),
           ("all_to_all", "float32", "moe_combine_issue")]
BACKWARD = [("all_to_all", "float32", "moe_combine_issue backward"),
            ("all_to_all", "float32", "moe_dispatch_issue backward")]
REPLAY = [(kind, dtype, f"{label} replay") for kind, dtype, label in FORWARD]


@pytest.fixture(scope="module")
def programs():
    torch.manual_seed(0)
    compiled = hgraph.compile(llama_moe.build("tiny"))
    return {s: compiled.instantiate(s, Cluster(Strategy.parse(s).num_ranks))
            for s in ("1xTP2PP1EP2", "1xTP1PP2EP2", "1xTP1PP1EP4")}


def _moe_layers(rp):
    return sorted({get_meta(n).layer for n in rp.graph_module.graph.nodes
                   if get_meta(n).comm_point == CommPoint.EP_DISPATCH})


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("strategy", ["1xTP2PP1EP2", "1xTP1PP2EP2", "1xTP1PP1EP4"])
def test_every_rank_derives_the_ep_exchanges_of_its_moe_layers(programs, strategy, recompute):
    program = programs[strategy]
    count = 2
    deriver = StepDeriver(program, representative_plan(program.strategy, k=count, recompute=recompute))
    sequences = {}
    for rank in range(program.strategy.num_ranks):
        rp = program.rank(rank)
        layers = _moe_layers(rp)
        assert layers, f"rank {rank} of {strategy} has no MoE layer"
        per_backward = [e for _ in reversed(layers) for e in (REPLAY if recompute else []) + BACKWARD]
        want = []
        for kind, _ in one_f_one_b(count, rp.scheme.pp, rp.stage):
            want += FORWARD * len(layers) if kind == "F" else per_backward
        got = [(e.kind, e.dtype, e.label.split(" ", 1)[0] + "".join(f" {w}" for w in e.label.split()[2:]))
               for e in deriver.role(rp).events(count) if e.key == BindingKey.EP]
        assert got == want, (strategy, rank)
        sequences[rank] = [(kind, dtype) for kind, dtype, _ in got]
    # every rank of an EP group issues the group's exchanges alike
    for rank in range(program.strategy.num_ranks):
        for peer in program.rank(rank).bindings[BindingKey.EP]:
            assert sequences[peer] == sequences[rank]


@pytest.mark.parametrize("recompute", [False, True])
def test_ep_schedules_and_switches_are_deadlock_free(programs, recompute):
    """The whole steps' sequences of every rank (pull, 1F1B with the EP exchanges, push), simulated one
    operation at a time, a switch between EP strategies included."""
    steps = [(programs[s], representative_plan(programs[s].strategy, k=2, recompute=recompute))
             for s in ("1xTP2PP1EP2", "1xTP1PP2EP2", "1xTP1PP1EP4")]
    verdict = simulate(derive_steps(steps))
    assert verdict.ok, verdict.line()
