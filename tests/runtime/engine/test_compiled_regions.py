"""``torch.compile`` of rank graphs (``engine.compiled_regions``): where the graph is cut, and a compiled
run equals single-device PyTorch while each region compiles once for any packed length.

The multi-rank case (heterogeneous strategies with TP2 and PP2, switching, under compile) is a case of
``test_executor_equivalence``; this module runs one process: inductor's CPU code generation.
"""
import types

import pytest
import torch

import hgraph
from hgraph import ops
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import llama
from hgraph.meta import SlotKind, get_meta
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.documents import Document, mini_batches
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.compiled_regions import (REGION_PREFIX, CompiledRegion, check_backend,
                                                    compile_regions, compile_wanted)
from hgraph.runtime.engine.executor import Executor, StepResult, shard_dims_of
from hgraph.runtime.engine.optimizer import ShardedAdam
from hgraph.runtime.train.metrics import metrics_line
from hgraph.strategy import Cluster, Strategy
from tests.runtime.reference_training import assert_trained_like, reference_run

LR = 1e-3
STEPS = 20
COMPARED = 4


def _talks_to_runtime(n):
    return any(a.op == "placeholder" and a.name == "comm" for a in n.all_input_nodes) or \
        n.target is ops.packed_attention


def test_regions_hold_compute_only_and_the_runtime_ops_keep_their_order():
    model = llama.build("tiny", num_layers=2)
    program = hgraph.compile(model).build_program(Strategy.parse("1xTP2PP2"), Cluster(4))
    for r in range(4):
        gm = program.rank(r).graph_module
        before = [n.name for n in gm.graph.nodes if _talks_to_runtime(n) and
                  get_meta(n).slot not in (SlotKind.PULL_PARAMETER, SlotKind.PUSH_GRADIENT)]
        out, compiles = compile_regions(gm, backend="eager")
        regions = {name: m for name, m in out.named_children() if name.startswith(REGION_PREFIX)}
        assert regions and all(isinstance(m, CompiledRegion) for m in regions.values())
        for m in regions.values():
            assert not any(_talks_to_runtime(n) for n in m.body.graph.nodes), r
        # the collectives, attention and sends in the graph's order (the schedule); the pull chains
        # move to the front of the run they feed and do not cut it: one region per gap at most
        after = [n.name for n in out.graph.nodes if n.name in set(before)]
        assert after == before, r
        assert len(regions) <= len(before) + 1, (r, len(regions), len(before))
        assert compiles.total == 0       # nothing compiles before it runs
        # the parameters are the rank graph's own objects (the executor installs and frees them)
        assert {id(p) for p in out.parameters()} == {id(p) for p in gm.parameters()}


def test_alike_runs_of_the_layers_share_one_compiled_region():
    """Parameters are the regions' inputs, so the runs between two attentions, the same in every layer,
    are one compiled function (traced and compiled once, not once per layer)."""
    layers = 4
    gm = hgraph.compile(llama.build("tiny", num_layers=layers)).build_program(
        Strategy.parse("1xTP1PP1"), Cluster(1)).rank(0).graph_module
    out, compiles = compile_regions(gm, backend="eager")
    calls = [n for n in out.graph.nodes if n.op == "call_module" and n.target.startswith(REGION_PREFIX)]
    # before the first attention, between two attentions (layers - 1 times), after the last one
    assert len(calls) == layers + 1 and len(compiles.counts) == 3


def _docs():
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(2, 40, (60,), generator=g).tolist()
    return [Document(i, tuple(torch.randint(0, 512, (n,), generator=g).tolist()))
            for i, n in enumerate(lengths)]


def _one_rank(compile_mode, backend, **kw):
    """A seeded 2-layer tiny Llama, its sharded Adam and an executor of ``1xTP1PP1`` on one rank."""
    torch.manual_seed(0)
    model = llama.build("tiny", num_layers=2)
    compiled = hgraph.compile(model)
    params = dict(model.named_parameters())
    opt = ShardedAdam([(n, params[n].detach().clone()) for n in compiled.hgraph.params],
                      shard_dims_of(compiled), 0, 1, lr=LR)
    ex = Executor(compiled, opt, 0, 1, GroupCache(0, 1), compile_mode=compile_mode, compile_backend=backend,
                  **kw)
    return model, opt, ex, ex.program(Strategy.parse("1xTP1PP1"))


def test_inductor_run_equals_pytorch_and_compiles_each_region_once_for_every_packed_length():
    """Twenty steps of different packed lengths compile each region once; the first four equal
    ``torch.optim.Adam`` on the model under the noise-aware comparison of the equivalence tests
    (inductor's CPU kernels sum in another order than ATen's, by the machine's SIMD width)."""
    batches = list(mini_batches(_docs(), 64, STEPS))
    assert len({sum(len(d.input_ids) for d in b.docs) for b in batches}) > 10     # packed lengths vary
    model, opt, ex, program = _one_rank("on", "inductor")      # three regions: around the two attentions
    losses = []
    for k, b in enumerate(batches):
        mb = MicroBatch.pack([d.input_ids for d in b.docs], [d.index for d in b.docs])
        losses.append(ex.step(program, [[mb]], b.num_targets, k).loss)
        if k == 0:
            after_first = dict(ex.region_compiles.counts)
        if k == COMPARED - 1:
            trained = {n: p.detach().clone() for n, p in opt.params.items()}
    counts = ex.region_compiles.counts
    assert len(counts) == 3 and not ex.region_compiles.eager
    assert counts == after_first and set(counts.values()) == {1}, counts
    reference = reference_run(model, batches[:COMPARED], LR)
    assert_trained_like(losses[:COMPARED], trained, reference, names=[n for n, _ in model.named_parameters()])


def _run(compile_mode, batches, **kw):
    _, _, ex, program = _one_rank(compile_mode, "aot_eager", **kw)
    results = [ex.step(program, [[MicroBatch.pack([d.input_ids for d in b.docs])]], b.num_targets, k)
               for k, b in enumerate(batches)]
    return results, ex


def test_blocks_recomputed_under_a_memory_budget_run_eagerly_and_the_rest_compiled():
    """Recomputation (DCP-intra) runs a block under ``torch.utils.checkpoint``, where dynamo does not
    trace: such a block's regions run eagerly, in its forward and its replay; AOTAutograd without code
    generation gives the eager run's losses to the bit."""
    batches = list(mini_batches(_docs(), 64, 2))
    eager, _ = _run("off", batches, memory_budget=1.0)
    compiled, ex = _run("on", batches, memory_budget=1.0)
    assert all(r.recompute_layers for r in compiled)
    assert [r.loss for r in compiled] == [r.loss for r in eager]
    assert ex.region_compiles.total > 0 and not ex.region_compiles.eager
    assert compiled[-1].compiles == ex.region_compiles.total


def test_offloaded_blocks_stay_compiled_and_train_like_pytorch():
    """Offload (``engine.offload``) keeps a block compiled: its regions' saved tensors go through the
    offload's hooks to host memory (AOTAutograd's partition saves less than eager autograd: it
    recomputes cheap pointwise ops), and the run equals ``torch.optim.Adam`` on the model under the
    noise-aware comparison (offload itself changes no bit: ``test_offload``)."""
    batches = list(mini_batches(_docs(), 64, 2))
    eager, _ = _run("off", batches[:1], offload="on")
    model, opt, ex, program = _one_rank("on", "aot_eager", offload="on")
    steps = [ex.step(program, [[MicroBatch.pack([d.input_ids for d in b.docs])]], b.num_targets, k)
             for k, b in enumerate(batches)]
    assert all(r.offload_layers == [2] for r in eager + steps)
    assert 0 < steps[0].host_peak_bytes < eager[0].host_peak_bytes
    assert ex.region_compiles.total > 0 and not ex.region_compiles.eager
    reference = reference_run(model, batches, LR)
    assert_trained_like([r.loss for r in steps], {n: p.detach().clone() for n, p in opt.params.items()},
                        reference, names=[n for n, _ in model.named_parameters()])


def test_a_compile_mode_or_backend_torch_does_not_know_is_one_line():
    with pytest.raises(HGraphError, match="--compile 'yes': expected one of auto, on, off"):
        compile_wanted("yes", torch.device("cpu"))
    assert not compile_wanted("auto", torch.device("cpu")) and compile_wanted("on", torch.device("cpu"))
    with pytest.raises(HGraphError, match="--compile-backend 'fast': not a torch.compile backend"):
        check_backend("fast")


class _Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, 3))

    def forward(self, x):
        return torch.relu(x @ self.w) * 2


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend compiles nothing")


def test_a_region_that_does_not_compile_runs_eagerly_or_is_one_line_and_an_op_error_stays_the_op_s():
    torch._dynamo.register_backend(_failing_backend, name="hgraph_test_failing")
    gm = torch.fx.symbolic_trace(_Affine())
    x = torch.randn(2, 3)
    lenient, compiles = compile_regions(gm, backend="hgraph_test_failing")
    with pytest.warns(UserWarning, match="runs eagerly: it did not compile"):
        assert torch.equal(lenient(x), gm(x))
    assert len(compiles.eager) == 1
    assert torch.equal(lenient(x), gm(x))          # eager from then on, without trying again
    strict, _ = compile_regions(gm, backend="hgraph_test_failing", strict=True)
    one_line = r"--compile on: region hgraph_region_\d+ \(.*\) does not compile: "
    with pytest.raises(HGraphError, match=one_line):
        strict(x)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):     # the op's own error, not compile's
        strict(torch.randn(2, 4))


def test_the_metrics_line_carries_the_compilations_only_with_compile():
    cache = types.SimpleNamespace(hits=1, misses=1)
    compiled = StepResult(3, "1xTP1PP1", 1.0, 10, 0.1, compiles=7)
    assert metrics_line(compiled, cache)["region_compiles"] == 7
    assert "region_compiles" not in metrics_line(StepResult(3, "1xTP1PP1", 1.0, 10, 0.1), cache)
