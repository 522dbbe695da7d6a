"""An unwritable run or checkpoint folder is one line and exit code 2 at the start of ``hgraph train``,
before any rank starts (``runtime/process/writable.py``), not an ``OSError`` at the first save; under a
launcher each node's local rank 0 probes the folders its node writes."""
import os
from types import SimpleNamespace

import pytest

from hgraph.errors import HGraphError
from hgraph.runtime.process.writable import probe_writable
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.run import prepare, probe_folders
from hgraph.runtime.train.run_config import config_from_options


def test_a_writable_folder_is_created_and_left_clean(tmp_path):
    probe_writable([("--run-dir", tmp_path / "a" / "b"), ("--checkpoint-dir", None)])
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []


def test_a_folder_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(HGraphError, match=r"^--checkpoint-dir '.*file/ck' cannot be written \(Not a directory"):
        probe_writable([("--checkpoint-dir", tmp_path / "file" / "ck")])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(HGraphError, match=r"--checkpoint-dir '.*ro' cannot be written \(Permission denied"):
            probe_writable([("--checkpoint-dir", ro)])
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--run-dir", "--save-final", "--metrics"])
def test_train_refuses_an_unwritable_folder_before_any_rank(tmp_path, capsys, flag):
    (tmp_path / "file").write_text("x")
    data = tmp_path / "docs.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    target = str(tmp_path / "file" / ("out.pt" if flag in ("--save-final", "--metrics") else "dir"))
    config, _ = config_from_options({"model": "tiny", "data": str(data), "world_size": 1, "steps": 1,
                                     "strategy_schedule": "1xTP1PP1", "tokens_per_iter": 30,
                                     flag.removeprefix("--").replace("-", "_"): target})
    with pytest.raises(HGraphError) as refused:       # bad input: the command prints it, exit 2
        prepare(config)
    line = str(refused.value)
    # the run's lock (runtime/process/run_lock) is the first to write into the checkpoint and run folders
    named = {"--checkpoint-dir": "checkpoint folder", "--run-dir": "run folder"}.get(flag, flag)
    assert "\n" not in line and not capsys.readouterr().err
    assert line.startswith(f"{named} ") and "cannot be written" in line


def test_under_a_launcher_each_node_s_local_rank_0_probes_what_its_node_writes(tmp_path):
    (tmp_path / "file").write_text("x")
    bad = str(tmp_path / "file" / "x")
    config = TrainConfig.from_values(checkpoint_dir=bad, save_final=bad + "/f.pt")
    probe_folders(config, None, SimpleNamespace(rank=5, local_rank=1))          # not this rank's job
    with pytest.raises(HGraphError, match="--checkpoint-dir"):                    # every node writes shards
        probe_folders(config, None, SimpleNamespace(rank=4, local_rank=0))
    only_rank0 = TrainConfig.from_values(save_final=bad + "/f.pt")
    probe_folders(only_rank0, tmp_path / "run", SimpleNamespace(rank=4, local_rank=0))
    with pytest.raises(HGraphError, match="--save-final"):
        probe_folders(only_rank0, tmp_path / "run", SimpleNamespace(rank=0, local_rank=0))
