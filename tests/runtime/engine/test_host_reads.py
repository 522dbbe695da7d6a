"""A training step reads no device values per layer or per loss chunk.

On a GPU every read of a device value on the host (``nonzero``, ``.item()``, ``.tolist()``) waits for
the queue to drain, and the GPU idles while Python catches up. Packed attention takes the
micro-batch's documents from the host (``DocumentBounds`` on its communication context) and the
chunked head loss's backward scatters its target gradients, and the micro-batches' losses are added
on the device, so the reads of a step stay a fixed few (the loss sum before the last backward, the
global loss at the end), whatever the depth, the micro-batches and the number of chunks.
On CPU the same ops run, so counting them under a ``TorchDispatchMode`` shows it.
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hgraph
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.builtin import synthetic_documents
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.executor import Executor
from hgraph.runtime.kernels.head_cross_entropy import head_cross_entropy_sum
from hgraph.runtime.train.model_setup import build_model, make_optimizer
from hgraph.runtime.train.config import TrainConfig

aten = torch.ops.aten
HOST_READS = {aten.nonzero.default, aten._local_scalar_dense.default, aten.masked_select.default,
              aten.is_nonzero.default}


class HostReads(TorchDispatchMode):
    """Counts the ops whose result the host must wait for on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _reads_of_a_step(layers: int, microbatches: int) -> collections.Counter:
    cfg = TrainConfig.from_values(model="tiny", model_args={"num_layers": layers}, world_size=1,
                                  strategy_schedule="1xTP1PP1", steps=1, tokens_per_iter=512, lr=1e-4)
    compiled = hgraph.compile(build_model(cfg))
    ex = Executor(compiled, make_optimizer(cfg, compiled, 0, 1), 0, 1, GroupCache(0, 1))
    docs = [list(d) for d in synthetic_documents(12, 256, 128, seed=0)]
    per = len(docs) // microbatches
    mbs = [[MicroBatch.pack(docs[k * per:(k + 1) * per]) for k in range(microbatches)]]
    targets = sum(len(d) - 1 for d in docs)
    ex.step("1xTP1PP1", mbs, targets)                  # builds the program
    with HostReads() as watch:
        ex.step("1xTP1PP1", mbs, targets, step=1)
    return watch.reads


def test_a_step_reads_the_device_a_fixed_number_of_times_whatever_its_depth_and_micro_batches(one_rank):
    shallow, deep = _reads_of_a_step(1, 1), _reads_of_a_step(3, 4)
    assert deep == shallow, (f"host reads grow with the layers or micro-batches: 1 layer and micro-batch "
                             f"{dict(shallow)}, 3 layers and 4 micro-batches {dict(deep)}")
    assert "nonzero" not in deep, f"a step still finds something with nonzero: {dict(deep)}"


def test_the_chunked_head_loss_backward_reads_nothing_back():
    torch.manual_seed(0)
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (40,))
    targets[::7] = -100
    loss = head_cross_entropy_sum(hidden, weight, None, targets, chunk=8)      # five chunks
    with HostReads() as watch:
        loss.backward()
    assert not watch.reads, f"the head loss's backward reads the device: {dict(watch.reads)}"
    # and it is still the gradient of the plain loss
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(h2 @ w2.t(), targets, ignore_index=-100, reduction="sum").backward()
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)
