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


def test_a_dump_names_the_ranks_ep_place(compiled):
    from hgraph.program_text import program_json

    program = compiled.instantiate("1xTP2PP1EP2")
    assert "tp_rank 1, cp_rank 0, ep_rank 1  [strategy 1xTP2PP1EP2]" in compiled.dump("1xTP2PP1EP2", rank=3)
    ranks = program_json(program, [program.rank(r) for r in range(4)])["ranks"]
    assert [(r["tp_rank"], r["ep_rank"]) for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert "ep_rank" not in compiled.dump("1xTP2PP1", rank=1).splitlines()[0]


@pytest.fixture(scope="module")
def hf_moe():
    """``hf:qwen2_moe`` and ``hf:qwen3_moe`` compiled (8 experts; fused ``gate_up [8, 64, 64]``,
    ``down [8, 64, 32]``)."""
    pytest.importorskip("transformers")
    from hgraph.frontends.zoo import resolve_model_spec

    out = {}
    for spec in ("hf:qwen2_moe", "hf:qwen3_moe"):
        torch.manual_seed(0)
        out[spec] = hgraph.compile(resolve_model_spec(spec))
    return out


@pytest.mark.parametrize("spec", ["hf:qwen2_moe", "hf:qwen3_moe"])
def test_a_fused_expert_tensor_is_held_pulled_and_pushed_only_for_the_ranks_experts(hf_moe, spec):
    """At ``1xTP2PP1EP2`` rank ``2 e + t`` (EP rank e, TP rank t) holds experts ``[4e, 4e + 4)`` of the fused
    ``gate_up [E, 2I, H]`` / ``down [E, H, I]``, TP-sharded inside (gate_up part by part along 2I, down
    along I): a quarter of each tensor's bytes, 1/(TP x EP). The tensor is planned as its 8 experts: the
    rank needs, and contributes the gradient of, only its own, each reduced over the ranks holding it (no
    narrowing of the whole tensor in its graph). On the old layout every rank held and pushed every expert
    (half of each tensor)."""
    compiled = hf_moe[spec]
    program = compiled.instantiate("1xTP2PP1EP2")
    for layer, w, full in (("0", "gate_up_proj", (8, 64, 64)), ("1", "down_proj", (8, 64, 32))):
        name = f"model.layers.{layer}.mlp.experts.{w}"
        assert tuple(compiled.hgraph.params[name].shape) == full
        for rank in range(4):
            rp = program.rank(rank)
            ep, tp = divmod(rank, 2)
            shard = rp.params[name]
            tp_rows = ((16 * tp, 16 * tp + 16), (32 + 16 * tp, 48 + 16 * tp)) if w == "gate_up_proj" \
                else ((16 * tp, 16 * tp + 16),)
            assert (shard.experts, shard.ranges) == ((4 * ep, 4 * ep + 4), tp_rows)
            held = shard.shard_shape
            assert held[0] * held[1] * held[2] * 4 == 8 * 64 * (64 if w == "gate_up_proj" else 32)   # 1/4
            assert not [n for n in rp.graph_module.graph.nodes if n.target is torch.narrow]
            mine = {e for e in range(8) if f"{name}[{e}]" in rp.contributions}
            assert mine == set(range(4 * ep, 4 * ep + 4))
            assert all(rp.contributions[f"{name}[{e}]"] == tp_rows for e in mine)
            received = {int(p.rsplit("[", 1)[1][:-1]) for p, ops in rp.pull_by_param.items() if p.startswith(name + "[")
                        and any(getattr(op, "dst", None) == rank or getattr(op, "rank", None) == rank for op in ops)}
            assert received == mine
        for e in range(8):
            holders = [r for r in range(4) if r // 2 == e // 4]
            pull, push = program.pull_plans[f"{name}[{e}]"], program.push_plans[f"{name}[{e}]"]
            assert pull.param.shape == full[1:] and sorted(pull.needs) == holders
            assert sorted(push.contributions) == holders
            assert sorted(map(tuple, push.replica_groups)) == [(holders[0],), (holders[1],)]   # TP halves apart
    assert "experts 4:8, split on dim 1 [(0, 16), (32, 48)]" in compiled.dump("1xTP2PP1EP2", rank=2)
    # without an EP pipeline the tensor is planned whole, as before
    assert "model.layers.0.mlp.experts.gate_up_proj" in compiled.instantiate("2xTP2PP1").push_plans


def test_switching_the_ep_degree_leaves_a_fused_tensors_optimizer_shard_where_it_was(hf_moe):
    """A piece's optimizer segment is the stacked tensor's along its shard dimension, whatever the strategy:
    the piece's pull plan sends rows ``shard_bounds(64, r, 4)`` of expert e from rank r at EP2 and at EP4."""
    from hgraph.shard_rule import shard_bounds

    compiled = hf_moe["hf:qwen2_moe"]
    name = "model.layers.0.mlp.experts.gate_up_proj[6]"
    for strategy in ("1xTP2PP1EP2", "1xTP1PP1EP4"):
        plan = compiled.instantiate(strategy).pull_plans[name]
        sent = {}
        for op in plan.transfers:
            sent.setdefault(op.src, []).append((op.lo, op.hi))
        for c in plan.local_copies:
            sent.setdefault(c.rank, []).append((c.lo, c.hi))
        for rank, spans in sent.items():
            lo, hi = shard_bounds(64, rank, 4)
            assert all(lo <= a < b <= hi for a, b in spans)
