"""hgraph.compile on instances and classes, options, and the CompiledModule surface."""
import pytest
import torch

import hgraph
from hgraph import ops
from hgraph.frontends.zoo import llama
from hgraph.frontends.zoo.llama import Llama, make_config


def test_compile_instance_runs_like_the_original():
    torch.manual_seed(0)
    model = llama.build("tiny", num_layers=2)
    compiled = hgraph.compile(model)
    assert isinstance(compiled, hgraph.CompiledModule)
    ids = torch.randint(0, 512, (2, 7))
    with torch.no_grad():
        assert torch.equal(compiled(ids), model(ids))
    assert compiled.hgraph.slot_counts()["push_gradient"] == len(list(model.parameters()))


def test_decorator_on_a_class_with_and_without_options():
    @hgraph.compile
    class Plain(Llama):
        pass

    @hgraph.compile(dtype="bf16")
    class Half(Llama):
        pass

    cfg = make_config("tiny", num_layers=2)
    a, b = Plain(cfg), Half(cfg)
    assert isinstance(a, hgraph.CompiledModule) and isinstance(b, hgraph.CompiledModule)
    assert b.options.working_dtype == torch.bfloat16
    prog = b.instantiate("1xTP1PP1")
    w = prog.rank(0).graph_module.get_parameter("layers.0.self_attn.q_proj.weight")
    assert w.dtype == torch.bfloat16 and w.device.type == "meta"


def test_bad_options_and_targets_are_clear():
    model = llama.build("tiny", num_layers=2)
    with pytest.raises(hgraph.HGraphError, match="unknown hgraph.compile option"):
        hgraph.compile(model, fullgraph=True)
    with pytest.raises(hgraph.HGraphError, match="unknown dtype"):
        hgraph.compile(model, dtype="fp8")
    with pytest.raises(hgraph.HGraphError, match="nn.Module"):
        hgraph.compile(42)


def test_disabling_an_unknown_pass_is_an_error_and_a_known_one_is_skipped():
    model = llama.build("tiny", num_layers=2)
    with pytest.raises(hgraph.HGraphError, match="unknown pass"):
        hgraph.compile(model, disable_passes=["nope"])
    prog = hgraph.compile(model, disable_passes=["schedule_comm"]).instantiate("1xTP1PP2")
    pushes = [n for n in prog.rank(1).graph_module.graph.nodes if n.target is ops.push_gradient]
    assert pushes and all(n.args[3] is True for n in pushes)   # later stages stay eager without the scheduler


def test_pass_failure_names_the_pass_and_those_before():
    from hgraph.passes.pipeline import Pass, PassError, run_passes

    def ok_pass(gm, ctx):
        return gm

    def broken_pass(gm, ctx):
        raise KeyError("boom")

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(PassError, match=r"pass 2 'broken' failed \(passes run before it: ok\)"):
        run_passes(gm, None, [Pass("ok", ok_pass), Pass("broken", broken_pass)])
