"""Hugging Face mixtures of experts through the export frontend: ``Qwen3MoeForCausalLM`` (fused experts,
renormalised top-k), ``Qwen2MoeForCausalLM`` (a sigmoid-gated shared expert) and ``MixtralForCausalLM``,
built tiny from a config.
Their MoE blocks export as hgraph's MoE op; the compiled model computes what HF's eager model computes, and
training equals HF's eager model trained by ``torch.optim.Adam`` (noise-aware comparison). TP coverage is
reported as for dense models: TP shards the routed experts inside (gate / up by their intermediate rows,
down by its columns, a fused gate_up part by part), attention and the shared expert; the router stays whole
(``EP<n>``: each EP rank holds its own experts' block of the fused expert tensors, TP-sharded inside, and the
report gives the share of the MoE blocks' bytes an EP rank holds, alone and with TP)."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.runtime.reference_training import assert_trained_like, reference_run, write_random_documents  # noqa: E402

import hgraph  # noqa: E402
from hgraph import moe  # noqa: E402
from hgraph.frontends.zoo import resolve_model_spec  # noqa: E402
from hgraph.runtime.data.documents import mini_batches, read_jsonl  # noqa: E402
from hgraph.tools.cli import main  # noqa: E402

SPECS = ["hf:qwen3_moe", "hf:qwen2_moe", "hf:mixtral"]


def _hf_logits(model, ids):
    return model(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_random_documents(tmp_path_factory.mktemp("hfmoe") / "docs.jsonl", [13, 5, 9, 7, 11, 3, 6, 8],
                                  seed=5, vocab=256)


def _parameter(node):
    """The parameter a node reads (through its Pull Parameter slot)."""
    while node.op != "get_attr":
        (node,) = [a for a in node.all_input_nodes if a.op != "placeholder"] or [node.all_input_nodes[0]]
    return node.target


@pytest.mark.parametrize("spec", SPECS)
def test_export_gives_the_moe_op_and_the_models_numbers_and_reports_tp_coverage(spec):
    torch.manual_seed(0)
    model = resolve_model_spec(spec)
    compiled = hgraph.compile(model)
    layers = [n for n in compiled.hgraph.gm.graph.nodes if n.target is moe.moe_layer]
    assert len(layers) == model.config.num_hidden_layers
    assert [_parameter(a) for a in layers[0].args[1:]] == ["model.layers.0.mlp.gate.weight",
                                                            "model.layers.0.mlp.experts.gate_up_proj",
                                                      "model.layers.0.mlp.experts.down_proj"]
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(11).expand(2, 11)
    torch.testing.assert_close(compiled.hgraph.gm(ids, pos), model(ids, position_ids=pos).logits,
                               rtol=1e-5, atol=1e-6)
    report = compiled.sharding_report("2xTP2PP1+1xTP2PP1EP2")
    (tp2,), (ep2,) = report.summaries, report.expert_parallel
    fraction = tp2.fraction_sharded()
    print(f"{spec}: TP2 shards {100 * fraction:.1f}% of the blocks' parameter bytes "
          f"({100 * tp2.fraction_sharded(matrices_only=True):.1f}% of their 2-D weight bytes); an EP2 rank holds "
          f"{100 * ep2.fraction_held(False):.1f}% of the MoE blocks' parameter bytes, a TP2 x EP2 rank "
          f"{100 * ep2.fraction_held():.1f}%")
    # EP's view, counted here from the parameters: an EP rank holds half of each fused expert tensor and
    # every other parameter of the MoE blocks (attention, norms, router, shared expert) whole, which TP2
    # then halves where it shards (the old layout held every expert: 100% / about 50%)
    whole = {p.name: p.nbytes for p in tp2.placements}
    fused = {n for n in whole if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(fused) == 2 * model.config.num_hidden_layers and ep2.total_bytes == sum(whole.values())
    assert ep2.ep_rank_bytes == sum(b / 2 if n in fused else b for n, b in whole.items())
    assert ep2.rank_bytes == sum((b / 2 if n in fused else b) / (2 if p.sharded else 1)
                                 for p in tp2.placements for n, b in [(p.name, p.nbytes)])
    assert ep2.fraction_held() < 0.36 and f"EP2: an EP rank holds {100 * ep2.fraction_held(False):.1f}%" in report.text()
    # the routed experts sharded inside (before: 19.8% / 33.1% / 33.0%, the experts whole); the largest
    # whole parameter left is the router, read by the MoE op on every token
    assert fraction > 0.95
    assert tp2.first_replicated().name == "model.layers.0.mlp.gate.weight"
    assert "moe_layer" in (tp2.first_replicated().reason or "")
    shards = {p.name: p.dim for p in tp2.placements if p.sharded}
    assert shards["model.layers.0.mlp.experts.gate_up_proj"] == 1
    assert shards["model.layers.0.mlp.experts.down_proj"] == 2


@pytest.mark.parametrize("spec,world,schedule", [("hf:qwen3_moe", 1, "1xTP1PP1"),
                                                 # EP2: each EP rank its own documents and its own
                                                 # experts' block of the fused expert tensors
                                                 ("hf:qwen2_moe", 2, "1xTP2PP1;2xTP1PP1;1xTP1PP1EP2")])
def test_training_equals_the_hugging_face_model(spec, world, schedule, data, tmp_path, capsys):
    final = tmp_path / "final.pt"
    steps = len(schedule.split(";"))
    rc = main(["train", "--model", spec, "--data", str(data), "--world-size", str(world), "--strategy-schedule",
               schedule, "--steps", str(steps), "--tokens-per-iter", "30", "--save-final", str(final), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sequence_parallel"] == "on" or world == 1
    torch.manual_seed(0)
    reference = reference_run(resolve_model_spec(spec), mini_batches(read_jsonl(data), 30, steps), 1e-3,
                              logits=_hf_logits)
    params = [n for n, _ in resolve_model_spec(spec).named_parameters()]
    assert_trained_like([s["loss"] for s in out["steps"]], torch.load(final), reference, names=params)
