"""``hgraph export --format hf`` of the zoo Llama: a ``LlamaForCausalLM`` folder with the same logits.

Checkpoints are assembled without processes (as 2 and 3 ranks save them). ``from_pretrained`` loads
the export with nothing missing or unexpected, and gives the zoo model's logits (the zoo model is
written to match Hugging Face's Llama; measured bitwise equal on CPU, checked here to 1e-6), tied
and untied, with a non-default rope theta and RMSNorm eps. Each output shard stays within
``--max-shard-size`` (a tensor larger than that alone in its shard); a second export into the same
folder as one file removes the first one's shards and index. An ``hf:`` model is rebuilt from the
config its run recorded (here ``hf:gpt2``; ``hf:DIR`` in the round trip test,
``tests/runtime/weights/test_pretrained_round_trip.py``).
"""
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.runtime.weights.tiny_models import assemble_checkpoint  # noqa: E402

from hgraph.frontends.zoo import llama  # noqa: E402
from hgraph.tools.cli import main  # noqa: E402

CASES = [("llama:tiny", {"rope_theta": 5e5, "rms_norm_eps": 1e-6, "pad_token_id": 0}, 3),
         ("llama:tiny-tied", {}, 2)]


def _export(ckpt, out, capsys, *extra):
    assert main(["export", str(ckpt), "--format", "hf", "-o", str(out), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("spec,args,world", CASES, ids=[c[0] for c in CASES])
def test_the_zoo_llama_exports_as_llama_for_causal_lm_with_its_logits(tmp_path, capsys, spec, args, world):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    values = assemble_checkpoint(tmp_path / "ck" / "step-00000001", spec, world, args)
    out = tmp_path / "hf"
    written = _export(tmp_path / "ck", out, capsys, "--max-shard-size", "100KB")
    assert written["architecture"] == "LlamaForCausalLM" and "model.safetensors.index.json" in written["files"]
    for f in out.glob("model-*.safetensors"):
        with safe_open(str(f), "pt") as h:
            sizes = [h.get_slice(k).get_shape() for k in h.keys()]
        nbytes = [4 * torch.Size(s).numel() for s in sizes]
        assert len(nbytes) == 1 or sum(nbytes) <= 100_000, (f.name, nbytes)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    zoo = llama.build(spec.split(":")[1], **args)
    zoo.load_state_dict(values, strict=False)           # every parameter (the tied alias too)
    assert all(torch.equal(p, values[n]) for n, p in zoo.named_parameters())
    ids = torch.randint(0, zoo.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, zoo(ids), atol=1e-6, rtol=1e-6)
    if zoo.config.tie_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]

    again = _export(tmp_path / "ck", out, capsys)       # default 5GB: one file, the shards go
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"], again
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(p, q) for p, q in zip(reloaded.parameters(), model.parameters()))


def test_an_hf_model_exports_from_the_config_its_run_recorded(tmp_path, capsys):
    """``hf:gpt2`` (tied ``transformer.wte`` / ``lm_head``): rebuilt from the checkpoint's recorded
    config, written under its own names, the tied weight once."""
    from transformers import AutoModelForCausalLM
    values = assemble_checkpoint(tmp_path / "ck" / "step-00000001", "hf:gpt2", 2)
    written = _export(tmp_path / "ck", tmp_path / "hf", capsys)
    assert written["architecture"] == "GPT2LMHeadModel" and written["tensors"] == len(values)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert all(torch.equal(model.get_parameter(n), v) for n, v in values.items())


def test_bf16_export_rounds_the_masters_and_loads_as_bf16(tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    values = assemble_checkpoint(tmp_path / "ck" / "step-00000001", "llama:tiny-tied", 2)
    written = _export(tmp_path / "ck", tmp_path / "hf", capsys, "--dtype", "bf16")
    assert written["dtype"] == "bf16"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.dtype == torch.bfloat16 and written["bytes"] < 2 * sum(v.numel() for v in values.values()) + 4096
    assert torch.equal(model.model.embed_tokens.weight, values["embed_tokens.weight"].to(torch.bfloat16))
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight,
                       values["layers.1.mlp.down_proj.weight"].to(torch.bfloat16))
    assert main(["export", str(tmp_path / "ck"), "-o", str(tmp_path / "m.pt"), "--dtype", "bf16"]) == 2
    assert "applies to --format hf" in capsys.readouterr().err


def test_bad_export_input_is_one_line(tmp_path, capsys):
    assemble_checkpoint(tmp_path / "ck" / "step-00000001", "llama:tiny", 1)
    assert main(["export", str(tmp_path / "ck"), "--format", "hf", "-o", str(tmp_path / "o"),
                 "--max-shard-size", "5XB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-shard-size '5XB'" in err, err
    assert main(["export", str(tmp_path / "none"), "--format", "hf", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no complete checkpoint" in err, err
    (tmp_path / "a-file").write_text("")
    assert main(["export", str(tmp_path / "ck"), "--format", "hf", "-o", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot make the output folder" in err, err
