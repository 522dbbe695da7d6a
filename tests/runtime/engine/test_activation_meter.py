"""The activation meter's replay tracker (``engine.memory``): what a recomputed block's replay leaves
alive is its stash, except a collective's buffer objects, which a backend may hold a moment past the
wait (gloo's worker thread drops its work item after waking the waiter). What the replay keeps from a
buffer (an alias checkpoint saves, a result) is still counted."""
import torch
import torch.distributed as dist

from hgraph.runtime.engine.memory import ActivationMeter

FEATURES = (1.0, 1.0, 1.0)


def test_a_collectives_buffer_held_past_the_replay_is_not_its_stash(one_rank):
    meter, held = ActivationMeter(), []
    with meter.replay_tracker(FEATURES):
        buf = torch.ones(256) * 3                   # 1 KiB, all-reduced in place
        dist.all_reduce(buf, async_op=True).wait()
        padded = torch.zeros(2, 64) + 1             # a buffer's base: a collective takes a view of it
        dist.all_reduce(padded.unsqueeze(0), async_op=True).wait()
        held += [buf, padded]                       # the backend still holds them: not saved
        held.append(buf * 2)                        # a result the replay keeps: 1 KiB
    assert meter.observations["layer"] == [(FEATURES, 1024)]


def test_what_the_replay_keeps_of_a_buffer_is_counted(one_rank):
    meter, held = ActivationMeter(), []
    with meter.replay_tracker(FEATURES, stashed_input=100):
        buf = torch.ones(256) * 3
        dist.all_reduce(buf, async_op=True).wait()
        held.append(buf.detach())                   # what checkpoint stores of a tensor that requires grad
        held.append(torch.ones(64) * 2)             # and a tensor of its own
    assert meter.observations["layer"] == [(FEATURES, 1024 + 256 + 100)]
