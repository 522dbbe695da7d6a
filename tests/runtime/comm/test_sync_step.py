"""``ParamSync.step``: the step object owns the pull's and push's phases and their order. One rank, no
process group."""
import pytest
import torch

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.comm.param_sync import ParamSync
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.engine.executor import shard_dims_of
from hgraph.runtime.engine.optimizer import ShardedAdam


@pytest.fixture()
def setup():
    compiled = hgraph.compile(llama.build("tiny"), dtype="bf16")
    prog = compiled.instantiate("1xTP1PP1")
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randint(-8, 8, tuple(p.shape), generator=gen).float()
            for n, p in compiled.hgraph.params.items()}
    opt = ShardedAdam(list(full.items()), shard_dims_of(compiled), 0, 1)
    rp = prog.rank(0)
    working = {n: torch.zeros(s.shard_shape, dtype=torch.bfloat16) for n, s in rp.params.items()}
    sync = ParamSync(prog, 0, opt.params, working, rp.params, GroupCache(0, 1), torch.bfloat16)
    return sync, {n: g.to(torch.bfloat16) for n, g in full.items()}, full


def test_finish_runs_the_flush_then_the_loss_then_the_push(setup, monkeypatch):
    sync, grads, full = setup
    calls = []
    for name in ("flush", "complete"):
        real = getattr(sync.pushes, name)
        monkeypatch.setattr(sync.pushes, name, lambda g, real=real, name=name: (calls.append(name), real(g))[1])

    def loss():
        calls.append("loss")
        return torch.tensor([6.0], dtype=torch.float64), None
    with sync.step() as s:
        s.backward_starts(6.0)
        s.complete_pulls()
        outcome = s.finish(grads, loss)
    assert calls[:3] == ["flush", "loss", "complete"]     # (complete flushes what is left: nothing)
    assert outcome.loss_sum == 6.0 and not s.overlapped and not s.pull_prefetched
    assert all(torch.equal(outcome.grad_shards[n], full[n]) for n in full)
    assert s.bytes_moved() == dict(vars(sync.stats))
    with sync.step() as again:          # the step ended on leaving: the next one begins
        again.complete_pulls()


def test_a_phase_out_of_order_is_refused_and_a_failed_step_is_not_ended(setup):
    sync, grads, _ = setup
    no_loss = lambda: (torch.zeros(1, dtype=torch.float64), None)    # noqa: E731
    with sync.step() as s:
        s.finish(grads, no_loss)
        with pytest.raises(hgraph.HGraphError, match="finish called twice"):
            s.finish(grads, no_loss)
        with pytest.raises(hgraph.HGraphError, match="after finish"):
            s.backward_starts(0.0)
    with pytest.raises(RuntimeError, match="lost"):
        with sync.step():
            raise RuntimeError("a peer was lost")
    # a failed step is left as it was (its collectives are not waited for again): no new step on it
    with pytest.raises(hgraph.HGraphError, match="called twice"):
        with sync.step():
            pass
