"""A launcher's restarted attempt resumes by itself from the newest complete checkpoint (decision
only; the torchrun test kills a rank and checks the whole run)."""
import json
from types import SimpleNamespace

from hgraph.runtime.checkpoint.manifest import FORMAT_VERSION, MANIFEST, step_dir
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.launcher_env import read_launcher_env
from hgraph.runtime.train.restart import finished_before_restart, restart_config, restart_run_dir

ENV = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}


def _env(restarts):
    return read_launcher_env({**ENV, "TORCHELASTIC_RESTART_COUNT": str(restarts)})


def _checkpoint(root, step, complete=True):
    folder = step_dir(root, step)
    folder.mkdir(parents=True)
    if complete:
        (folder / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "world_size": 2,
                                                   "shards": []}))


def test_the_first_attempt_and_a_local_run_start_as_configured(tmp_path):
    _checkpoint(tmp_path, 2)
    config = TrainConfig.from_values(checkpoint_dir=str(tmp_path))
    assert restart_config(config, None) == (config, None)
    assert restart_config(config, _env(0)) == (config, None)


def test_a_restart_resumes_from_a_complete_checkpoint_by_itself(tmp_path):
    config = TrainConfig.from_values(checkpoint_dir=str(tmp_path))
    same, note = restart_config(config, _env(1))
    assert same == config and "no complete checkpoint" in note and "starts again from step 0" in note
    _checkpoint(tmp_path, 4, complete=False)            # a save cut by the failure
    assert restart_config(config, _env(1))[0] == config
    _checkpoint(tmp_path, 2)
    resumed, note = restart_config(config, _env(2))
    assert resumed.checkpointing.resume and resumed.checkpointing.resume_fallback
    assert note == "restart 2 (TORCHELASTIC_RESTART_COUNT=2): resuming by itself"
    # no checkpoint folder: the same run again from the start
    assert "no --checkpoint-dir" in restart_config(TrainConfig(), _env(1))[1]
    # --resume given: resumes as asked on every attempt
    asked = config.with_values(resume=True)
    assert restart_config(asked, _env(1)) == (asked, None)


def test_a_requeued_slurm_job_under_torchrun_resumes_too(tmp_path):
    _checkpoint(tmp_path, 2)
    env = read_launcher_env({**ENV, "TORCHELASTIC_RESTART_COUNT": "0", "SLURM_RESTART_COUNT": "1"})
    assert env.is_restart and env.restart_count == 0            # the store's attempt is torchrun's
    resumed, note = restart_config(TrainConfig.from_values(checkpoint_dir=str(tmp_path)), env)
    assert resumed.checkpointing.resume and note == "requeue 1 (SLURM_RESTART_COUNT=1): resuming by itself"


def test_a_restart_continues_in_its_checkpoints_run_folder(tmp_path):
    point = SimpleNamespace(run={"run_dir": str(tmp_path / "runs" / "x")})
    assert restart_run_dir(point, _env(1)) == tmp_path / "runs" / "x"
    assert restart_run_dir(point, _env(0)) is None and restart_run_dir(point, None) is None
    assert restart_run_dir(None, _env(1)) is None
    assert restart_run_dir(SimpleNamespace(run={}), _env(1)) is None       # a checkpoint from before


def test_a_restart_after_the_last_checkpoint_of_the_run_has_nothing_to_train(tmp_path):
    config = TrainConfig.from_values(checkpoint_dir=str(tmp_path), steps=4)
    _checkpoint(tmp_path, 2)
    assert finished_before_restart(config, _env(1)) is None
    _checkpoint(tmp_path, 4)
    assert finished_before_restart(config, _env(0)) is None          # a new run overwrites, as before
    assert "already holds all 4 steps; nothing left to train" in finished_before_restart(config, _env(1))
    assert finished_before_restart(config.with_values(steps=6), _env(1)) is None
