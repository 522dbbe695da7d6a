"""A collective that times out inside a step ends it with one line saying where each rank's sequence of
collectives stopped (the executor asks its ``CollectiveIssuer``); another error passes unchanged."""
import pytest
import torch

import hgraph
from hgraph.errors import RunFailed
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.engine.executor import Executor
from hgraph.runtime.train.model_setup import build_model, make_optimizer
from hgraph.runtime.train.config import TrainConfig


def _executor():
    cfg = TrainConfig.from_values(model="tiny", model_args={"num_layers": 1}, world_size=1,
                                  strategy_schedule="1xTP1PP1", steps=1, tokens_per_iter=64, lr=1e-4)
    compiled = hgraph.compile(build_model(cfg))
    return Executor(compiled, make_optimizer(cfg, compiled, 0, 1), 0, 1, GroupCache(0, 1))


class _Done:
    def wait(self):
        return True


def test_a_timed_out_collective_names_where_each_ranks_sequence_stopped(one_rank, monkeypatch):
    ex = _executor()
    assert ex.optimizer.issuer is ex.issuer          # the optimizer's norm goes through the same choke point

    def step_that_times_out(program, state, lookup, microbatches, num_targets, step, prefetch, t0):
        ex.issuer.begin_step(step)
        ex.issuer.issue("all_reduce", None, torch.zeros(2), _Done, "push bucket 0")
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv "
                           "operation to complete")

    monkeypatch.setattr(ex, "_step", step_that_times_out)
    with pytest.raises(RunFailed) as info:
        ex.step("1xTP1PP1", [[]], 1, step=3)
    assert str(info.value) == (
        "step 3: a collective timed out on rank 0 ([gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "60000ms for recv operation to complete); where the ranks' collectives stopped: rank 0: stopped after "
        "1 operations, the last all_reduce on [0] float32[2] (push bucket 0)")

    def step_that_fails_otherwise(*args):
        raise RuntimeError("a shape mismatch")

    monkeypatch.setattr(ex, "_step", step_that_fails_otherwise)
    with pytest.raises(RuntimeError, match="^a shape mismatch$"):
        ex.step("1xTP1PP1", [[]], 1, step=4)
