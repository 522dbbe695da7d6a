"""What each rank's DCP save plan holds: rank 0 gathers every rank's plan at each save, so a plan may
not carry what every rank holds alike.

DCP's default plan has every rank add its plain entries (step counts, Adam's parameter group) and the
coordinator drop the duplicates: with the zoo's 70B (723 parameters) that was 1.4 GB of plans gathered
on rank 0 at 12,288 ranks. Counted here without processes, from the state dict ``dcp_format.save``
hands DCP and DCP's own local planner.
"""
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from hgraph.frontends.zoo import llama
from hgraph.runtime.checkpoint import dcp_format
from hgraph.runtime.engine.optimizer import ShardedAdam


def _plan_keys(rank: int, world_size: int, monkeypatch) -> list[str]:
    # without a process group a rank's rows stay a plain tensor (each is one entry either way)
    monkeypatch.setattr(dcp_format, "_chunked", lambda local, *args, **kwargs: local)
    model = llama.build("tiny")
    opt = ShardedAdam(list(model.named_parameters()), None, rank, world_size)
    state = dcp_format.save_state(opt, rank, world_size, {"torch": torch.get_rng_state()})
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=rank == 0)
    return [item.index.fqn for item in planner.create_local_plan().items]


def test_only_rank_0_writes_the_step_counts_and_the_parameter_group(monkeypatch):
    names = [n for n, _ in llama.build("tiny").named_parameters()]
    shared = {f"optim.state.{n}.step" for n in names}
    rank0, rank1 = _plan_keys(0, 4, monkeypatch), _plan_keys(1, 4, monkeypatch)
    assert shared <= set(rank0) and any(k.startswith("optim.param_groups") for k in rank0)
    assert not shared & set(rank1) and not any(k.startswith("optim.param_groups") for k in rank1)
    # what rank 1 still writes: its rows of each master and moment, and its own RNG states
    assert sorted(rank1) == sorted([f"model.{n}" for n in names]
                                   + [f"optim.state.{n}.{m}" for n in names for m in ("exp_avg", "exp_avg_sq")]
                                   + ["rng.rank-00001"])
