"""Weight files without processes: each rank's segments read by slices, and bad input in one line.

A rank reads its optimizer segment of every parameter (any shard dimension, empty segments, 0-d
parameters) from a safetensors file (``get_slice``: the whole tensor is never read), a torch
state_dict and an hgraph checkpoint saved by another number of ranks, and gets exactly the rows of
the full tensor. Bad input to ``hgraph train`` (a missing ``config.json``, a hub name, names or
shapes that do not fit, a truncated safetensors file, a checkpoint of another model) is one line on
stderr naming the file, exit code 2, found before any process starts.
"""
import pytest
import torch

pytest.importorskip("safetensors")

from safetensors.torch import save_file  # noqa: E402
from tests.runtime.weights.tiny_models import assemble_checkpoint, save_tiny_hf  # noqa: E402

from hgraph.errors import HGraphError, RunFailed  # noqa: E402
from hgraph.frontends.zoo import llama  # noqa: E402
from hgraph.runtime.checkpoint.masters import CheckpointMasters  # noqa: E402
from hgraph.runtime.engine.optimizer import ShardedAdam  # noqa: E402
from hgraph.runtime.weights.deferred_init import record_init  # noqa: E402
from hgraph.runtime.weights.file_weights import FileWeights  # noqa: E402
from hgraph.runtime.weights.safetensors_files import SafetensorsFiles  # noqa: E402
from hgraph.runtime.weights.sources import SeededInit  # noqa: E402
from hgraph.runtime.weights.state_dict_file import StateDictFile  # noqa: E402
from hgraph.runtime.train.run import prepare  # noqa: E402
from hgraph.runtime.train.run_config import config_from_options  # noqa: E402

# a shard dimension of 1 for some parameters (as row-parallel weights may have), a 0-d parameter
SHARD_DIMS = {"layers.0.self_attn.o_proj.weight": 1, "layers.1.mlp.down_proj.weight": 1}


class _WithScalar(torch.nn.Module):
    """The zoo Llama plus a 0-d parameter (a shape-[1] optimizer segment)."""

    def __init__(self):
        super().__init__()
        self.llama = llama.build("tiny", num_layers=2)
        self.scale = torch.nn.Parameter(torch.tensor(0.5).add(torch.zeros(())))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same values as a safetensors file, a state_dict and a checkpoint of 3 ranks."""
    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(1)
    model = _WithScalar()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    save_file(values, str(root / "w.safetensors"))
    torch.save(model.state_dict(), root / "w.pt")
    folder = root / "ckpt" / "step-00000002"
    from hgraph.runtime.checkpoint import manifest as ckpt_manifest
    from hgraph.runtime.checkpoint import rng_state
    from hgraph.runtime.checkpoint import shards as ckpt
    opts = [ShardedAdam(model.named_parameters(), {f"llama.{k}": d for k, d in SHARD_DIMS.items()}, r, 3)
            for r in range(3)]
    entries = [ckpt.write_shard(folder, r, 3, 2, o, rng_state.capture_rng()) for r, o in enumerate(opts)]
    ckpt_manifest.write_manifest(folder, 2, 3, entries)
    return root, values


def _no_whole_reads(table):
    """Make reading a whole (non-0-d) tensor from a safetensors table fail: only slices are allowed."""
    real = table._handle

    class Handle:
        def __init__(self, h):
            self.h = h

        def get_slice(self, name):
            return self.h.get_slice(name)

        def get_tensor(self, name):
            assert table.entries[name].shape == (), f"{name} was read whole"
            return self.h.get_tensor(name)

    table._handle = lambda file: Handle(real(file))
    return table


@pytest.mark.parametrize("kind", ["safetensors", "state_dict", "checkpoint"])
@pytest.mark.parametrize("world", [4, 7])
def test_every_rank_gets_exactly_its_rows(files, kind, world):
    root, values = files
    record = record_init(_WithScalar, 0)
    dims = {f"llama.{k}": d for k, d in SHARD_DIMS.items()}
    for rank in range(world):
        table = {"safetensors": lambda: _no_whole_reads(SafetensorsFiles.open(root / "w.safetensors")),
                 "state_dict": lambda: StateDictFile(root / "w.pt"),
                 "checkpoint": lambda: CheckpointMasters(root / "ckpt")}[kind]()
        layouts = ShardedAdam(record.model.named_parameters(), dims, rank, world).layouts
        got = dict(FileWeights(table, record.model, SeededInit(record)).shards(layouts))
        assert set(got) == set(values)
        for name, layout in layouts.items():
            assert torch.equal(got[name], layout.slice_of(values[name])), (kind, rank, name)


def _refused(tmp_path, *must_contain, **options):
    """A run of ``options`` refused as bad input (the command's exit 2) in one line naming ``must_contain``,
    before any rank starts."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3, 4, 5]}\n')
    with pytest.raises(HGraphError) as refused:
        config, _ = config_from_options({"data": str(data), "world_size": 2, "strategy_schedule": "2xTP1PP1",
                                         "steps": 1, **options})
        with prepare(config) as run:
            run.execute()
    line = str(refused.value)
    assert not isinstance(refused.value, RunFailed) and "\n" not in line, line
    for text in must_contain:
        assert text in line, line


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return save_tiny_hf(tmp_path_factory.mktemp("hf") / "llama", "llama")


def test_a_folder_without_config_json_and_a_hub_name_are_one_line(tmp_path):
    (tmp_path / "m").mkdir()
    save_file({"x": torch.zeros(2)}, str(tmp_path / "m" / "model.safetensors"))
    _refused(tmp_path, str(tmp_path / "m" / "config.json"), "does not exist", model=f"hf:{tmp_path / 'm'}")
    _refused(tmp_path, "'meta-llama/Llama-2-7b-hf' is not a local directory", "never downloads",
             model="hf:meta-llama/Llama-2-7b-hf")


def test_names_and_shapes_that_do_not_fit_are_listed_in_one_line(tmp_path):
    values = {n: p.detach() for n, p in llama.build("tiny").named_parameters()}
    values["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)          # mis-shaped
    del values["norm.weight"]                                           # missing
    values["layers.9.extra"] = torch.zeros(1)                           # unexpected
    save_file(values, str(tmp_path / "bad.safetensors"))
    _refused(tmp_path, str(tmp_path / "bad.safetensors"), "1 missing (norm.weight)",
             "1 unexpected (layers.9.extra", "1 mis-shaped (layers.0.mlp.up_proj.weight [3, 3]",
             "the model's [176, 64]", "nothing was loaded", model="llama:tiny",
             init_from=str(tmp_path / "bad.safetensors"))


def test_a_truncated_shard_of_an_hf_folder_is_named(hf_dir, tmp_path):
    import shutil
    folder = shutil.copytree(hf_dir, tmp_path / "cut")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    _refused(tmp_path, str(shard), "is truncated", model=f"hf:{folder}")
    loose = tmp_path / "cut.safetensors"               # --init-from a single truncated file too
    loose.write_bytes(b"\x10\x00")
    _refused(tmp_path, str(loose), "is truncated", init_from=str(loose))


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    assemble_checkpoint(tmp_path / "other" / "step-00000001", "llama:tiny-tied", 2)
    _refused(tmp_path, str(tmp_path / "other" / "step-00000001"), "of model llama:tiny-tied",
             "does not fit Llama", "10 missing (layers.3.",
             "6 mis-shaped (layers.0.self_attn.k_proj.weight [16, 64] in rank-00000-of-00002.pt",
             model="llama:tiny", init_from=str(tmp_path / "other"))


def test_other_unreadable_init_sources_are_one_line(hf_dir, tmp_path):
    _refused(tmp_path, "does not exist", init_from=str(tmp_path / "nothing-here"))
    (tmp_path / "junk.pt").write_bytes(b"PK\x03\x04 not a zip")
    _refused(tmp_path, str(tmp_path / "junk.pt"), "torch.load(weights_only=True, mmap=True)",
             init_from=str(tmp_path / "junk.pt"))
    (tmp_path / "bins").mkdir()
    (tmp_path / "bins" / "config.json").write_text((hf_dir / "config.json").read_text())
    (tmp_path / "bins" / "pytorch_model.bin").write_bytes(b"")
    _refused(tmp_path, "pytorch_model", "no safetensors", model=f"hf:{tmp_path / 'bins'}")


def test_an_hf_folder_without_weight_files_trains_from_the_seeded_init(hf_dir, tmp_path):
    """Only ``config.json``: the architecture, initialised from the seed (nothing to read)."""
    from hgraph.runtime.train.config import TrainConfig
    from hgraph.runtime.train.model_setup import check_weights
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "config.json").write_text((hf_dir / "config.json").read_text())
    assert "seeded initialisation" in check_weights(TrainConfig.from_values(model=f"hf:{tmp_path / 'arch'}"))
    assert "safetensors index" in check_weights(TrainConfig.from_values(model=f"hf:{hf_dir}"))


def test_a_model_without_a_hugging_face_form_is_refused():
    from hgraph.runtime.weights.hf_form import hf_form
    with pytest.raises(HGraphError, match="no Hugging Face form.*--format torch"):
        hf_form(torch.nn.Linear(2, 2))
