"""The overlapped update of plain data parallelism on 4 gloo ranks (``ParamSync.can_overlap_update``).

* ParamSync level, several reduction buckets (so shards are updated while backward still runs):
  the masters after an overlapped step equal, bit for bit, those of the plain path (``push`` + one
  optimizer step) on the same integer-valued gradients (every sum exact); the prefetched working
  tensors equal the updated masters; the loss carried in the first reduction is the exact sum; a
  non-finite loss updates nothing; values carried beside the loss (the MoE router losses) are summed
  alike. The same run over reduce_scatter_tensor (NCCL's path, forced
  on gloo with ``all_to_all=False``), with the loss carried or in an all-reduce of its own (a large
  world's way), is bit for bit the all-to-all one.
* Executor level: the next step of the same Program reuses the prefetched pull, a checkpoint load
  in between makes it pull afresh (the step then equals a step from the loaded state), a NaN loss
  is skipped (``skip_nonfinite``) or raises naming the step on every rank, and global-norm clipping
  takes the plain path.
"""
import math

import pytest
import torch

import hgraph
from hgraph.frontends.zoo import llama
from hgraph.runtime.train.launch import spawn

WORLD = 4


def EXTRA(rank):
    """A rank's values carried beside its loss share (exact halves: their sums are exact)."""
    return (0.5 * rank, 1.0 + rank)


def _ints(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).float()


def _param_sync_worker(rank, world):
    from hgraph.runtime.comm.param_sync import ParamSync
    from hgraph.runtime.comm.process_groups import GroupCache
    from hgraph.runtime.engine.executor import shard_dims_of
    from hgraph.runtime.engine.optimizer import ShardedAdam
    groups = GroupCache(rank, world)
    torch.manual_seed(0)
    compiled = hgraph.compile(llama.build("tiny"))
    prog = compiled.instantiate("4xTP1PP1")
    rp = prog.rank(rank)
    full = {n: _ints(tuple(p.shape), i) for i, (n, p) in enumerate(compiled.hgraph.params.items())}
    opt_a = ShardedAdam(list(full.items()), shard_dims_of(compiled), rank, world)
    opt_b = ShardedAdam(list(full.items()), shard_dims_of(compiled), rank, world)
    working = {n: torch.nn.Parameter(torch.zeros(s.shard_shape)) for n, s in rp.params.items()}
    plain = {n: torch.zeros(s.shard_shape) for n, s in rp.params.items()}
    # 64 KB reduction buckets: the tiny model's ~1 MB of gradients travel in several
    overlapped = ParamSync(prog, rank, opt_a.params, working, rp.params, groups, update=opt_a.step,
                           push_bucket_bytes=64 * 1024)
    reference = ParamSync(prog, rank, opt_b.params, plain, rp.params, groups)
    # NCCL's path on gloo: the reductions as reduce_scatter_tensor, the loss carried in its chunks
    opt_c = ShardedAdam(list(full.items()), shard_dims_of(compiled), rank, world)
    working_c = {n: torch.nn.Parameter(torch.zeros(s.shard_shape)) for n, s in rp.params.items()}
    scattered = ParamSync(prog, rank, opt_c.params, working_c, rp.params, groups, update=opt_c.step,
                          push_bucket_bytes=64 * 1024, all_to_all=False)
    # and with the loss in an all-reduce of its own (what a large world does: ``CARRY_MAX_BYTES``)
    opt_d = ShardedAdam(list(full.items()), shard_dims_of(compiled), rank, world)
    working_d = {n: torch.nn.Parameter(torch.zeros(s.shard_shape)) for n, s in rp.params.items()}
    separate = ParamSync(prog, rank, opt_d.params, working_d, rp.params, groups, update=opt_d.step,
                         push_bucket_bytes=64 * 1024, all_to_all=False)
    carried_by_default = separate.overlapped.carry_loss
    separate.overlapped.carry_loss = False
    out = {"can_overlap": overlapped.can_overlap_update, "reference_can_overlap": reference.can_overlap_update,
           "scattered_can_overlap": scattered.can_overlap_update, "carried_by_default": carried_by_default,
           "steps": []}

    from hgraph.runtime.comm import grad_buckets
    scatters = []
    issue = grad_buckets.reduce_scatter_single

    def counted(*args, **kwargs):
        scatters.append(1)
        return issue(*args, **kwargs)

    grad_buckets.reduce_scatter_single = counted

    extras = []         # each overlapped step's sums of the values beside the loss

    def overlapped_step(sync, working, grads, loss_share):
        scatters.clear()
        sync.begin_step(overlap_update=True, prefetch=True)
        sync.finish_pulls()
        sync.set_loss(loss_share, EXTRA(rank))     # values summed with the loss (the MoE router losses)
        sync.arm_push()
        # backward finishes the gradients one by one: the hooks issue and take reductions
        sum((w * grads[n]).sum() for n, w in working.items()).backward()
        in_backward = sync.updates_in_backward
        total = sync.finish_update({n: w.grad for n, w in working.items()})
        extras.append(sync.overlapped.global_extra)
        sync.end_step()
        for w in working.values():
            w.grad = None
        return total, in_backward, len(scatters)

    for step, loss_share in enumerate([1.5 + rank, float("nan"), 0.25]):
        grads = {n: _ints(tuple(full[n].shape), 1000 + 37 * rank + 11 * step + i)
                 for i, n in enumerate(rp.params)}
        before = {n: m.clone() for n, m in opt_a.params.items()}
        total, in_backward, a2a_scatters = overlapped_step(overlapped, working, grads, loss_share)
        scattered_total, scattered_in_backward, scatters_run = overlapped_step(scattered, working_c, grads, loss_share)
        separate_total = overlapped_step(separate, working_d, grads, loss_share)[0]
        record = {"loss": total, "extras": extras[-3:], "in_backward": in_backward, "reused": overlapped.pull_reused,
                  "buckets": len(overlapped._buckets.buckets),
                  "scatters": (a2a_scatters, scatters_run),
                  "scattered": (scattered_total, scattered_in_backward, scattered.pull_reused,
                                all(torch.equal(opt_a.params[n].view(torch.int32), opt_c.params[n].view(torch.int32))
                                    for n in full),
                                all(torch.equal(working[n], working_c[n]) for n in working)),
                  "separate": (separate_total,
                               all(torch.equal(opt_a.params[n].view(torch.int32), opt_d.params[n].view(torch.int32))
                                   for n in full))}
        if math.isfinite(total):
            reference.begin_step()
            reference.finish_pulls()
            opt_b.step(reference.push(grads))
            reference.end_step()
            record["masters_equal"] = all(torch.equal(opt_a.params[n], opt_b.params[n]) for n in full)
            # the working tensors hold the updated parameters (the next step's pull)
            updated = opt_a.full_state_dict()
            record["prefetched_current"] = all(torch.equal(working[n].detach(), rp.params[n].take(updated[n]))
                                               for n in rp.params)
        else:
            record["unchanged"] = all(torch.equal(opt_a.params[n], before[n]) for n in full)
        out["steps"].append(record)
    return out


@pytest.fixture(scope="module")
def param_sync_results():
    return spawn(_param_sync_worker, WORLD, timeout_s=240)


def test_overlapped_update_equals_push_then_step_and_prefetches_the_next_pull(param_sync_results):
    for rank, r in enumerate(param_sync_results):
        assert r["can_overlap"] and not r["reference_can_overlap"]   # no ``update`` given: plain path
        first, nan_step, third = r["steps"]
        assert first["buckets"] >= 3
        assert first["in_backward"] >= 1          # shards updated while backward still ran
        assert first["masters_equal"] and first["prefetched_current"]
        assert first["loss"] == sum(1.5 + k for k in range(WORLD))    # exact: integers and halves
        assert not first["reused"]                # the very first step pulls
        # a NaN loss on one rank: every rank sees it and updates nothing
        assert math.isnan(nan_step["loss"]) and nan_step["unchanged"]
        assert nan_step["reused"]                 # step 0's prefetch was still current
        # after the skipped step nothing was prefetched: step 2 pulls afresh and matches again
        assert not third["reused"]
        assert third["masters_equal"] and third["prefetched_current"]
        assert third["loss"] == 0.25 * WORLD
        # the values beside the loss are summed alike, carried, over reduce_scatter_tensor or in the
        # loss's own all-reduce, whatever the loss
        want = tuple(sum(EXTRA(k)[j] for k in range(WORLD)) for j in range(2))
        assert all(record["extras"] == [want] * 3 for record in r["steps"]), r["steps"]


def test_overlapped_update_over_reduce_scatter_equals_the_all_to_all_path(param_sync_results):
    """The backend-neutral path (reduce_scatter_tensor, which NCCL has) forced on gloo: the same loss,
    the same reductions taken in backward, bit-identical masters and prefetched parameters."""
    for r in param_sync_results:
        assert r["scattered_can_overlap"]
        for record in r["steps"]:
            assert record["scatters"] == (0, record["buckets"])   # gloo's all-to-all, then one per bucket
            loss, in_backward, reused, masters_equal, working_equal = record["scattered"]
            assert loss == record["loss"] or (math.isnan(loss) and math.isnan(record["loss"]))
            assert (in_backward, reused) == (record["in_backward"], record["reused"])
            assert masters_equal and working_equal


def test_overlapped_update_with_the_loss_in_its_own_all_reduce(param_sync_results):
    """Past ``CARRY_MAX_BYTES`` (8 N^2 bytes of slots) the loss is summed in a float64 all-reduce of
    its own: the same loss, a NaN still updates nothing, the masters bit for bit those of the carry."""
    for r in param_sync_results:
        assert r["carried_by_default"]            # 4 ranks: 128 bytes of slots ride along
        for record in r["steps"]:
            loss, masters_equal = record["separate"]
            assert loss == record["loss"] or (math.isnan(loss) and math.isnan(record["loss"]))
            assert masters_equal


def _executor_worker(rank, world):
    from hgraph.errors import HGraphError
    from hgraph.runtime.comm.process_groups import GroupCache
    from hgraph.runtime.data.micro_batch import MicroBatch
    from hgraph.runtime.engine.executor import Executor
    from hgraph.runtime.train.config import TrainConfig
    from hgraph.runtime.train.model_setup import build_model, make_optimizer
    groups = GroupCache(rank, world)

    def setup(**options):
        cfg = TrainConfig.from_values(model="tiny", world_size=world, strategy_schedule="4xTP1PP1", steps=1,
                                      tokens_per_iter=1, **options)
        compiled = hgraph.compile(build_model(cfg))
        opt = make_optimizer(cfg, compiled, rank, world)
        return compiled, opt

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
    mbs = [[MicroBatch.pack([d])] for d in docs[:world]]
    targets = sum(len(d) - 1 for d in docs[:world])
    out = {}

    compiled, opt = setup()
    ex = Executor(compiled, opt, rank, world, groups)
    prog = compiled.instantiate("4xTP1PP1")
    start = opt.state_dict()
    first = ex.step(prog, mbs, targets, 0, prefetch=True)
    second = ex.step(prog, mbs, targets, 1, prefetch=True)
    opt.load_state_dict(start)                          # a checkpoint load: the prefetch is stale
    again = ex.step(prog, mbs, targets, 2)              # the last step ran it too: prefetch by default
    fourth = ex.step(prog, mbs, targets, 3)
    out["flags"] = [(r.overlapped_update, r.pull_prefetched) for r in (first, second, again, fourth)]
    out["losses"] = [first.loss, second.loss, again.loss]

    def poison(optimizer, on_rank):
        """NaN in the final norm's weight of one rank's master shard: every rank's loss is NaN."""
        with torch.no_grad():
            if rank == on_rank:
                optimizer.params["norm.weight"].fill_(float("nan"))

    compiled, opt = setup()
    ex = Executor(compiled, opt, rank, world, groups, skip_nonfinite=True)
    prog = compiled.instantiate("4xTP1PP1")
    ex.step(prog, mbs, targets, 0)
    poison(opt, 1)
    bits = {n: t.view(torch.int32).clone() for n, t in opt.params.items()}
    skipped = ex.step(prog, mbs, targets, 1)
    out["skipped"] = (skipped.overlapped_update, skipped.skipped, math.isnan(skipped.loss),
                      all(torch.equal(opt.params[n].view(torch.int32), bits[n]) for n in bits))

    compiled, opt = setup()
    ex = Executor(compiled, opt, rank, world, groups)
    prog = compiled.instantiate("4xTP1PP1")
    ex.step(prog, mbs, targets, 7)
    poison(opt, 2)
    try:
        ex.step(prog, mbs, targets, 8)
        out["raised"] = None
    except HGraphError as exc:
        out["raised"] = str(exc)

    compiled, opt = setup(grad_clip=1.0)
    ex = Executor(compiled, opt, rank, world, groups)
    clipped = ex.step(compiled.instantiate("4xTP1PP1"), mbs, targets, 0)
    out["clipped_overlapped"] = clipped.overlapped_update
    return out


@pytest.fixture(scope="module")
def executor_results():
    return spawn(_executor_worker, WORLD, timeout_s=240)


def test_executor_reuses_the_prefetched_pull_until_the_masters_change(executor_results):
    for r in executor_results:
        assert r["flags"] == [(True, False), (True, True), (True, False), (True, True)]
        first, second, again = r["losses"]
        assert second < first                  # it trained
        assert again == first                  # from the loaded state, not from the stale prefetch


def test_nonfinite_loss_is_skipped_or_raises_on_every_rank(executor_results):
    for r in executor_results:
        assert r["skipped"] == (True, True, True, True)
        assert r["raised"] is not None and "step 8" in r["raised"] and "not finite" in r["raised"]


def test_global_norm_clipping_takes_the_plain_path(executor_results):
    assert not any(r["clipped_overlapped"] for r in executor_results)
