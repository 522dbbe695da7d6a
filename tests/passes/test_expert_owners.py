"""Which experts an EP rank holds, pulls and pushes (``passes/expert_owners``, ``ParamLayouts.params``), planned
without processes on ``llama-moe:tiny`` (8 experts in layers 1 and 2, a list of expert matrices each).

EP rank r of n holds experts ``[r*8/n, (r+1)*8/n)``, TP-sharded inside; it neither pulls nor pushes the
other experts' parameters, and an expert's gradient is reduced over the ranks that hold it: the same EP
place and TP place of every EP pipeline, and every rank of a pipeline without EP. Dense parameters are
pushed by every EP rank (each its own documents' gradient).
"""
import pytest
import torch

import hgraph
from hgraph import StrategyError
from hgraph.frontends.zoo import llama_moe

MOE_LAYERS = (1, 2)
EXPERTS = 8


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    with torch.device("meta"):
        return hgraph.compile(llama_moe.build("tiny"))


def _experts_held(rp):
    return {(int(n.split(".")[1]), int(n.split(".experts.")[1].split(".")[0]))
            for n in rp.params if ".experts." in n}


def _expert(layer, e, w="gate"):
    return f"layers.{layer}.mlp.experts.{e}.{w}_proj.weight"


def test_an_ep_rank_holds_pulls_and_pushes_only_its_experts_tp_sharded(compiled):
    program = compiled.instantiate("1xTP2PP1EP2")
    for rank in range(4):
        rp = program.rank(rank)
        ep, tp = divmod(rank, 2)
        assert (rp.doc_rank, rp.tp_rank) == (ep, tp)
        assert _experts_held(rp) == {(layer, e) for layer in MOE_LAYERS for e in range(4 * ep, 4 * ep + 4)}
        gate = rp.params[_expert(1, 4 * ep)]
        assert gate.tp_sharded and gate.ranges == ((16 * tp, 16 * tp + 16),)      # [32, 64]: TP2 halves
        assert "layers.1.mlp.gate.weight" in rp.params and "layers.0.mlp.gate_proj.weight" in rp.params
        # the rank's own ops: it exchanges rows of no other EP rank's expert, except as their optimizer owner
        pulled = {name for name, ops in rp.pull_by_param.items()
                  if any(getattr(op, "dst", None) == rank or getattr(op, "rank", None) == rank for op in ops)}
        assert not any(".experts." in n and n not in rp.params for n in pulled)
    for e in range(EXPERTS):
        owners = [r for r in range(4) if r // 2 == e // 4]
        pull, push = program.pull_plans[_expert(2, e, "down")], program.push_plans[_expert(2, e, "down")]
        assert sorted(pull.needs) == owners and sorted(push.contributions) == owners
        # down [64, 32] is TP-split on its columns; each TP rank pushes its own half
        assert [push.contributions[r] for r in owners] == [((0, 16),), ((16, 32),)]
    dense = program.push_plans["layers.0.mlp.down_proj.weight"]
    assert sorted(dense.contributions) == [0, 1, 2, 3]
    router = program.push_plans["layers.1.mlp.gate.weight"]
    assert sorted(router.contributions) == [0, 1, 2, 3]


def test_an_expert_is_pushed_over_the_ranks_that_hold_it_beside_pipelines_without_ep(compiled):
    """``1xTP1PP1EP2+2xTP1PP1``: expert 5 is held by EP rank 1 of the first pipeline (rank 1) and by the two
    plain pipelines (ranks 2, 3), who reduce its gradient; rank 0 has no part in it."""
    program = compiled.instantiate("1xTP1PP1EP2+2xTP1PP1")
    assert _experts_held(program.rank(0)) == {(layer, e) for layer in MOE_LAYERS for e in range(4)}
    assert _experts_held(program.rank(1)) == {(layer, e) for layer in MOE_LAYERS for e in range(4, 8)}
    assert _experts_held(program.rank(2)) == {(layer, e) for layer in MOE_LAYERS for e in range(8)}
    push = program.push_plans[_expert(1, 5, "up")]
    assert sorted(push.contributions) == [1, 2, 3]
    assert all(ranges == ((0, 32),) for ranges in push.contributions.values())
    assert sorted(map(tuple, push.replica_groups)) == [(1, 2, 3)]
    assert sorted(program.push_plans[_expert(1, 2, "up")].contributions) == [0, 2, 3]
    assert sorted(program.pull_plans[_expert(1, 5, "up")].needs) == [1, 2, 3]
    assert sorted(program.push_plans["layers.1.self_attn.q_proj.weight"].contributions) == [0, 1, 2, 3]


def test_an_ep_degree_that_does_not_divide_the_experts_is_one_line(compiled):
    with pytest.raises(StrategyError, match=r"scheme TP1PP1EP3: EP3 does not divide the 8 experts of the MoE op "
                                            r"\w+; allowed EP degrees: 1, 2, 4, 8") as err:
        compiled.instantiate("1xTP1PP1EP3")
    assert "\n" not in str(err.value)
    with pytest.raises(StrategyError, match="EP16 does not divide the 8 experts"):
        compiled.instantiate("1xTP1PP1EP16")
