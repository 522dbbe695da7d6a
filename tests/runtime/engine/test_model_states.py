"""The model states counted from shapes (``engine.model_states``) are the bytes the runtime allocates,
and the planner's memory model (MaxLen) counts exactly them. No processes: the optimizer of any rank
of any world size is built alone, and one rank runs real steps."""
import pytest
import torch

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor, shard_dims_of
from hgraph.runtime.engine.model_states import allocated_bytes, rank_states, scheme_states
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.runtime.planner.cost.runtime_memory import with_device_memory
from hgraph.runtime.planner.service.iteration import model_cost_model
from hgraph.strategy import Cluster, Scheme, Strategy

MiB = 2 ** 20


@pytest.fixture(scope="module")
def meta():
    with torch.device("meta"):
        model = llama.build("tiny")
    return model, hgraph.compile(model)


def _optimizer(model, compiled, rank, world, shard_group=None):
    full = dict(model.named_parameters())
    return ShardedAdam([(n, full[n]) for n in compiled.hgraph.params], shard_dims_of(compiled), rank, world,
                       shard_group=shard_group)


def _working(shards, dtype):
    """The working tensors the executor gives a rank (``Executor.rank_state``), with gradients."""
    out = {}
    for name, shard in shards.items():
        w = torch.zeros(shard.shard_shape, dtype=dtype, requires_grad=True)
        w.grad = torch.zeros_like(w)
        out[name] = w
    return out


@pytest.mark.parametrize("text,world", [("1xTP2PP2", 4), ("1xTP2PP1+1xTP1PP1", 3),
                                        ("1xTP1PP2+1xTP2PP1+2xTP1PP1", 6)])
def test_every_rank_holds_what_is_counted(meta, text, world):
    model, compiled = meta
    strategy = Strategy.parse(text)
    prog = compiled.build_program(strategy, Cluster(world))
    for dtype in (torch.float32, torch.bfloat16):
        counted = rank_states(compiled, strategy, Cluster(world), dtype)
        for r in range(world):
            held = allocated_bytes(_optimizer(model, compiled, r, world), _working(prog.rank(r).params, dtype))
            c = counted[r]
            assert (held.masters, held.moments, held.working_params, held.working_grads) == \
                (c.masters, c.moments, c.working_params, c.working_grads), (text, r, dtype)
            assert c.step_transient == 2 * c.masters


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_rank_run_allocates_what_the_planner_counts(dtype):
    torch.manual_seed(0)
    model = llama.build("tiny")
    compiled = hgraph.compile(model, dtype=dtype)
    opt = _optimizer(model, compiled, 0, 1)
    ex = Executor(compiled, opt, 0, 1, GroupCache(0, 1))
    strategy = Strategy.parse("1xTP1PP1")
    prog = ex.program(strategy)
    for step in range(2):
        mb = MicroBatch.pack([list(range(1, 20)), list(range(5, 30))])
        ex.step(prog, [[mb]], 40, step)
    held = allocated_bytes(opt, ex.rank_state(prog).working)
    counted = rank_states(compiled, strategy, Cluster(1), ex.working_dtype)[0]
    assert held.resident == counted.resident and held.working_grads == counted.working_grads
    # fp32 on one rank: the working parameters are the masters (no bytes of their own)
    assert (held.working_params == 0) == (dtype == "fp32")
    working_bytes = 2 if dtype == "bf16" else 4
    cost = with_device_memory(model_cost_model("analytic", model, 1), model, 64 * MiB, working_bytes=working_bytes)
    assert cost.memory.state_bytes(cost.model, Scheme(1, 1), 1) == held.resident


def test_shard_groups_hold_and_count_the_states_of_their_group(meta):
    """With the states sharded over groups of G ranks, a rank holds (and the planner counts) what rank
    ``r % G`` of a G-rank world holds: G/N more than over the whole world."""
    model, compiled = meta
    strategy = Strategy.parse("1xTP2PP2+2xTP1PP1")
    counted = rank_states(compiled, strategy, Cluster(6, shard_group=3), torch.float32)
    for r in range(6):
        held = allocated_bytes(_optimizer(model, compiled, r, 6, shard_group=3), {})
        alone = allocated_bytes(_optimizer(model, compiled, r % 3, 3), {})
        assert counted[r].masters == held.masters == alone.masters
    states = scheme_states(compiled, [Scheme(2, 1)], 6, torch.float32, group_size=3)
    assert states == scheme_states(compiled, [Scheme(2, 1)], 3, torch.float32)
    assert states[(2, 1)][1] > scheme_states(compiled, [Scheme(2, 1)], 6, torch.float32)[(2, 1)][1]


@pytest.mark.parametrize("world", [3, 4])
def test_planner_states_are_the_fullest_rank_a_scheme_can_have(meta, world):
    model, compiled = meta
    cost = with_device_memory(model_cost_model("analytic", model, world), model, 64 * MiB)
    optimizer = max(allocated_bytes(_optimizer(model, compiled, r, world), {}).resident for r in range(world))
    schemes = {(s.tp, s.pp) for s in cost.schemes}
    assert {(2, 1), (1, 2)} <= schemes
    for tp, pp in sorted(schemes):
        prog = compiled.build_program(Strategy((Scheme(tp, pp),)), Cluster(tp * pp))
        working = max(allocated_bytes(_optimizer(model, compiled, 0, 1), _working(rp.params, torch.float32)).resident
                      - allocated_bytes(_optimizer(model, compiled, 0, 1), {}).resident for rp in prog.ranks)
        for cp in (1, 2):
            if tp * pp * cp <= world:
                assert cost.memory.state_bytes(cost.model, Scheme(tp, pp, cp), world) == optimizer + working
    # PP: a stage holds the embedding or the head, not both (the B.1 formula counted both everywhere)
    counted = scheme_states(compiled, [Scheme(1, 1), Scheme(1, 2)], world, torch.float32)
    assert counted[(1, 2)][0] < 0.7 * counted[(1, 1)][0] + 0.3 * optimizer


def test_step_transient_must_fit_beside_the_states(meta):
    model, _ = meta
    cost = with_device_memory(model_cost_model("analytic", model, 4), model, 64 * MiB)
    resident, transient = cost.memory.counted_states(Scheme(1, 1), 4)
    tight = with_device_memory(cost, model, resident + transient - 1)
    assert not tight.has(Scheme(1, 1))
    enough = with_device_memory(cost, model, resident + transient + 10 ** 5)
    assert enough.has(Scheme(1, 1))
