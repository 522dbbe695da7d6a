"""Pretrained weights in, trained weights out, on 4 gloo ranks under strategies that switch every step.

Round trip: a tiny Hugging Face Llama and a tiny Qwen2 (tied embeddings), built with ``from_config``
after ``manual_seed`` and saved with ``save_pretrained`` in shards with an index, are trained as
``hf:DIR`` under a fixed heterogeneous schedule; each step's loss (the first too, which only the
pretrained weights give) and the final parameters equal single-device ``torch.optim.Adam`` started
from ``from_pretrained(DIR)``. The run's checkpoint then goes through ``hgraph export --format hf``
and ``from_pretrained`` loads it with nothing missing, bitwise the trained parameters, and the logits
of the reference architecture holding them. The comparison with the reference is the noise-aware one of
``tests/runtime/reference_training.py``.

``--init-from`` on the zoo Llama, once per kind of source: a safetensors file (of the tied model, with
only the alias ``lm_head.weight``, as a file of a tied model may hold it), a torch state_dict, an
hgraph checkpoint saved by 3 ranks (resharded to 4), and a DCP checkpoint of a plain model written by
``dcp.save``: the fp32 masters equal the file's values bitwise.

One spawn of 4 processes runs every case (one process group).
"""
import copy
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import save_file  # noqa: E402
from tests.runtime.reference_training import assert_trained_like, reference_run  # noqa: E402
from tests.runtime.weights.tiny_models import MAX_SHARD_SIZE, assemble_checkpoint, save_tiny_hf  # noqa: E402

from hgraph.runtime.comm.process_groups import GroupCache  # noqa: E402
from hgraph.runtime.data.documents import Document, mini_batches  # noqa: E402
from hgraph.runtime.train.config import TrainConfig  # noqa: E402
from hgraph.runtime.train.launch import spawn  # noqa: E402
from hgraph.runtime.train.trainer import Trainer  # noqa: E402
from hgraph.runtime.train.model_setup import build_model  # noqa: E402
from hgraph.tools.cli import main  # noqa: E402

LENGTHS = [13, 5, 9, 7, 11, 3, 6, 8, 10, 4, 12, 2]
SCHEDULE = "1xTP2PP1+2xTP1PP1;1xTP1PP2+1xTP2PP1;1xTP2PP2"
STEPS, TOKENS_PER_ITER, LR = 3, 30, 1e-3
FAMILIES = ["llama", "qwen2"]
INIT_KINDS = ["safetensors", "state_dict", "checkpoint", "dcp"]


def _docs():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in LENGTHS]


def _train_config(family, root):
    return TrainConfig.from_values(model=f"hf:{root / family}", world_size=4, strategy_schedule=SCHEDULE, steps=STEPS,
                                   tokens_per_iter=TOKENS_PER_ITER, docs=_docs(), lr=LR,
                                   checkpoint_dir=str(root / f"ckpt-{family}"))


def _init_sources(root):
    """Per kind: (zoo model, path, the values the masters must get)."""
    tied = build_model(TrainConfig.from_values(model="llama:tiny-tied", seed=5))
    tied_values = {n: p.detach().clone() for n, p in tied.named_parameters()}
    save_file({"lm_head.weight" if n == "embed_tokens.weight" else n: t for n, t in tied_values.items()},
              str(root / "tied.safetensors"))
    plain = build_model(TrainConfig.from_values(model="llama:tiny", seed=6))
    torch.save(plain.state_dict(), root / "plain.pt")
    plain_values = {n: p.detach().clone() for n, p in plain.named_parameters()}
    ckpt_values = assemble_checkpoint(root / "ckpt3" / "step-00000001", "llama:tiny", 3)
    # a DCP checkpoint of a plain model, as another PyTorch program writes it (torchtitan's "model." keys)
    other = build_model(TrainConfig.from_values(model="llama:tiny", seed=8))
    dcp.save({"model": other.state_dict()}, checkpoint_id=str(root / "plain-dcp"), no_dist=True)
    return {"safetensors": ("llama:tiny-tied", root / "tied.safetensors", tied_values),
            "state_dict": ("llama:tiny", root / "plain.pt", plain_values),
            "checkpoint": ("llama:tiny", root / "ckpt3", ckpt_values),
            "dcp": ("llama:tiny", root / "plain-dcp", {n: p.detach().clone() for n, p in other.named_parameters()})}


def _worker(rank, world, cases):
    groups = GroupCache(rank, world)
    out = []
    for kind, config in cases:
        trainer = Trainer(config, rank, world, groups)
        if kind == "train":
            summary = trainer.run()
            final = trainer.final_state_dict()
            out.append({"losses": [s.loss for s in summary.steps], "strategies": [s.strategy for s in summary.steps],
                        "final": final if rank == 0 else None})
        else:
            masters = trainer.optimizer.full_state_dict()
            out.append({"masters": masters if rank == 0 else None, "source": trainer.weights_from})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    for family in FAMILIES:
        save_tiny_hf(root / family, family)
    sources = _init_sources(root)
    cases = [("train", _train_config(f, root)) for f in FAMILIES]
    cases += [("load", TrainConfig.from_values(model=sources[k][0], init_from=str(sources[k][1]), world_size=4,
                                               strategy_schedule="4xTP1PP1", steps=1, tokens_per_iter=TOKENS_PER_ITER,
                                               docs=_docs())) for k in INIT_KINDS]
    results = spawn(_worker, 4, args=(cases,), timeout_s=300)[0]
    return {"root": root, "sources": sources, "train": dict(zip(FAMILIES, results[:2])),
            "load": dict(zip(INIT_KINDS, results[2:]))}


def _hf_logits(model, ids):
    return model(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits


@pytest.fixture(scope="module")
def references(runs):
    """Per family: single-device Adam from from_pretrained(DIR): losses and the trained model."""
    from transformers import AutoModelForCausalLM
    out = {}
    docs = [Document(i, tuple(d)) for i, d in enumerate(_docs())]
    for family in FAMILIES:
        model = AutoModelForCausalLM.from_pretrained(runs["root"] / family)
        out[family] = (reference_run(model, mini_batches(docs, TOKENS_PER_ITER, STEPS), LR, logits=_hf_logits),
                       model)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_dir_trains_like_pytorch_from_pretrained(runs, references, family):
    run, (reference, ref_model) = runs["train"][family], references[family]
    assert run["strategies"] == SCHEDULE.split(";")
    assert_trained_like(run["losses"], run["final"], reference, names=[n for n, _ in ref_model.named_parameters()])


@pytest.mark.parametrize("family", FAMILIES)
def test_export_hf_loads_with_from_pretrained_as_the_trained_model(runs, references, family, tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "exported"
    assert main(["export", str(runs["root"] / f"ckpt-{family}"), "--format", "hf", "-o", str(out),
                 "--max-shard-size", MAX_SHARD_SIZE, "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert "model.safetensors.index.json" in written["files"]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    final = runs["train"][family]["final"]
    for name, p in model.state_dict().items():
        assert torch.equal(p, final[name]), name              # tied lm_head included
    # the exported config computes what the reference architecture computes with the trained weights
    ids = torch.tensor([_docs()[0]])
    trained = copy.deepcopy(references[family][1])
    trained.load_state_dict(final, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(model, ids), _hf_logits(trained, ids), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", INIT_KINDS)
def test_init_from_fills_the_masters_with_the_files_values(runs, kind):
    _, path, values = runs["sources"][kind]
    loaded = runs["load"][kind]
    assert str(path) in loaded["source"]
    assert set(loaded["masters"]) == set(values)
    for name, want in values.items():
        assert torch.equal(loaded["masters"][name], want), name
