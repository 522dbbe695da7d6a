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


def test_each_micro_batch_counts_through_its_own_view():
    """A micro-batch's view carries its features and what its blocks stashed in its forward; a block
    of an earlier micro-batch (a recomputed one's replay in backward) still observes its own, however
    many forwards began since; the counting is the rank's meter's."""
    meter = ActivationMeter()
    first, second = meter.for_microbatch((1.0, 1.0, 1.0)), meter.for_microbatch((2.0, 2.0, 2.0))
    kept = torch.ones(64)                                   # 256 bytes
    token = first.hold([kept])                              # a recomputed block's checkpoint
    second.observe("layer", 20, in_forward=True)
    first.observe("layer", 10, in_forward=True)
    first.observe("other", 5, in_forward=False)
    assert meter.live_bytes == first.live_bytes == second.live_bytes == 256
    assert (first.forward_block_bytes, second.forward_block_bytes) == (256 + 10, 20)
    with first.replay_tracker():                            # the replay, after the second forward began
        kept_in_replay = torch.ones(16)                     # noqa: F841 (alive at the end: its stash)
    assert meter.observations["checkpoint"] == [((1.0, 1.0, 1.0), 256)]
    assert meter.observations["layer"] == [((2.0, 2.0, 2.0), 20), ((1.0, 1.0, 1.0), 10), ((1.0, 1.0, 1.0), 64)]
    assert meter.observations["other"] == [((1.0, 1.0, 1.0), 5)]
    del token
    assert meter.live_bytes == 0
