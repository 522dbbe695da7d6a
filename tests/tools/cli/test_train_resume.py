"""hgraph train with checkpoints, end to end on CPU: resume equality, a killed rank, a corrupt
checkpoint, another world size on resume, export, and the config file's bad input.

Process launches are the cost here (seconds each), so the module shares them: one uninterrupted
reference run (2 ranks, 6 steps, a checkpoint every 2) serves every comparison; the other runs are
a run whose rank 1 dies in step 3, its resume, and one resume from a corrupt checkpoint onto 3 ranks.
A resharded resume is compared with the noise-aware comparison of ``tests/runtime/reference_training.py``;
a same-world-size resume is compared bitwise.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from tests.runtime.fault_injection import dying_worker, sigterm_worker
from tests.runtime.reference_training import assert_losses_like, assert_params_like

from hgraph.runtime.data.builtin import synthetic_documents, write_jsonl
from hgraph.runtime.train.config import TrainConfig
from hgraph.runtime.train.launch import SpawnError, spawn
from hgraph.runtime.train.rank_run import train_worker
from hgraph.tools.cli import main

STEPS, EVERY, TOKENS = 6, 2, 512
CANDIDATES = "2xTP1PP1;1xTP2PP1"


def _argv(data, ck, run, *extra, world=2):
    # the analytic cost model: a measured one differs from run to run, so the uninterrupted reference
    # and the interrupted run could choose other strategies (a resumed run keeps its run's model)
    return ["train", "--model", "llama:tiny", "--data", str(data), "--world-size", str(world),
            "--steps", str(STEPS), "--tokens-per-iter", str(TOKENS), "--checkpoint-dir", str(ck),
            "--checkpoint-every", str(EVERY), "--run-dir", str(run), "--no-plots", "--json",
            "--profile", "analytic", *extra]


def _json_out(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The uninterrupted run: its folder, data, per-step metrics and final parameters."""
    base = tmp_path_factory.mktemp("resume")
    data = base / "docs.jsonl"
    write_jsonl(data, synthetic_documents(200, 256, 128, seed=0))
    ck, run = base / "ref-ck", base / "ref-run"
    argv = _argv(data, ck, run, "--strategies", CANDIDATES, "--save-final", str(base / "ref-final.pt"))
    assert main(argv) == 0
    return {"base": base, "data": data, "ck": ck, "metrics": _metrics(run / "metrics.jsonl"),
            "final": torch.load(base / "ref-final.pt", weights_only=True)}


def test_reference_run_saves_every_k_steps_and_at_the_end(ref):
    from hgraph.runtime.checkpoint import manifest as ckpt_manifest
    assert ckpt_manifest.complete_steps(ref["ck"]) == [2, 4, 6]
    manifest = ckpt_manifest.read_manifest(ref["ck"] / "step-00000004")
    pos = manifest["data_position"]
    # the data position is the document after the last one trained in step 3
    assert pos["next_step"] == 4 and pos["next_document"] == ref["metrics"][3]["next_document"]
    assert pos["next_document"] == ref["metrics"][3]["documents"][-1] + 1
    assert manifest["delay_queues"]["outlier_delay"] is False and manifest["delay_queues"]["queues"] == []
    assert manifest["planner_state"]["candidates"] and manifest["planner_state"]["world_size"] == 2
    assert manifest["run"]["model"] == "llama:tiny"
    trained = [i for r in ref["metrics"] for i in r["documents"]]
    assert trained == list(range(len(trained)))          # file order, each once


def _spawned_config(ref, ck, run):
    """The reference run's settings, launched by ``spawn`` (the CLI's analytic profile, no device limit)."""
    return TrainConfig.from_values(model="llama:tiny", world_size=2, strategies=CANDIDATES, profile="analytic",
                                   device_memory=None, steps=STEPS, tokens_per_iter=TOKENS, data=str(ref["data"]),
                                   checkpoint_dir=str(ck), checkpoint_every=EVERY, metrics=str(run / "metrics.jsonl"))


def test_killed_rank_is_named_and_resume_loses_nothing_and_matches_bitwise(ref, capsys):
    base = ref["base"]
    ck, run = base / "kill-ck", base / "kill-run"
    run.mkdir()
    config = _spawned_config(ref, ck, run)
    with pytest.raises(SpawnError, match="rank 1") as info:    # not spawn's timeout, which names no rank
        spawn(dying_worker, 2, args=(config, 1, 3), timeout_s=60)
    assert info.value.rank == 1
    from hgraph.runtime.checkpoint import manifest as ckpt_manifest
    assert ckpt_manifest.complete_steps(ck) == [2]
    # step 2 was trained (and logged) after the checkpoint, then lost: the resume trains it again
    assert [r["step"] for r in _metrics(run / "metrics.jsonl")] == [0, 1, 2]

    _resume_matches_the_reference_bitwise(ref, ck, run, "kill", 2, capsys)


def _resume_matches_the_reference_bitwise(ref, ck, run, name, from_step, capsys):
    """``--resume`` from the checkpoint of ``from_step`` in ``ck`` runs to the end; the whole run then
    equals the uninterrupted reference: documents per step, losses and final parameters, bitwise."""
    from hgraph.runtime.checkpoint import manifest as ckpt_manifest
    final_path = ref["base"] / f"{name}-final.pt"
    argv = _argv(ref["data"], ck, run, "--resume", "--strategies", CANDIDATES, "--save-final", str(final_path))
    assert main(argv) == 0
    out = _json_out(capsys)
    assert out["resumed_from"]["step"] == from_step and out["resumed_from"]["resharded"] is False
    assert [s["step"] for s in out["steps"]] == list(range(from_step, STEPS))
    got = _metrics(run / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(STEPS))
    # nothing skipped or trained twice: the same documents per step as the uninterrupted run
    assert [r["documents"] for r in got] == [r["documents"] for r in ref["metrics"]]
    manifest = ckpt_manifest.read_manifest(ck / f"step-{from_step:08d}")
    assert got[from_step]["documents"][0] == manifest["data_position"]["next_document"]
    # bitwise: losses and final parameters
    assert [r["loss"] for r in got] == [r["loss"] for r in ref["metrics"]]
    final = torch.load(final_path, weights_only=True)
    assert final.keys() == ref["final"].keys()
    for k, v in ref["final"].items():
        assert torch.equal(final[k], v), k


def test_sigterm_to_one_rank_stops_every_rank_after_the_step_with_a_checkpoint_and_resume_matches(ref, capsys):
    """SLURM-style preemption reaching rank 1 alone, in step 2: both ranks agree to stop after step 2,
    save the checkpoint of 3 steps (not a multiple of --checkpoint-every) and return; the resume
    continues as if nothing happened."""
    from hgraph.runtime.checkpoint import manifest as ckpt_manifest
    base = ref["base"]
    ck, run = base / "term-ck", base / "term-run"
    run.mkdir()
    config = _spawned_config(ref, ck, run)
    out = spawn(sigterm_worker, 2, args=(config, 1, 2), timeout_s=60)
    stopped = {"signal": "SIGTERM", "step": 3, "checkpoint": str(ck / "step-00000003")}
    assert [o["stopped"] for o in out] == [stopped, stopped]
    assert [[s["step"] for s in o["steps"]] for o in out] == [[0, 1, 2]] * 2
    assert ckpt_manifest.complete_steps(ck) == [2, 3]
    _resume_matches_the_reference_bitwise(ref, ck, run, "term", 3, capsys)


def _dying_in_save_worker(rank, world, config, victim, save_step):
    """The trainer, with rank ``victim`` dying as it starts writing its part of checkpoint ``save_step``
    (the others are inside DCP's collective save: a save that does not finish)."""
    from hgraph.runtime.checkpoint import dcp_format
    if rank == victim:
        original = dcp_format.save

        def save(folder, *args, **kwargs):
            if folder.name == f"step-{save_step:08d}":
                os._exit(17)
            return original(folder, *args, **kwargs)
        dcp_format.save = save
    return train_worker(rank, world, config)


def test_rank_lost_mid_save_is_named_and_leaves_the_previous_checkpoint(ref, tmp_path):
    """The others fail in the save's collective, outside a training step: the error still names the
    lost rank, and the unfinished checkpoint is skipped (with a note) in favour of the previous one."""
    from hgraph.runtime.checkpoint import manifest as ckpt_manifest
    from hgraph.runtime.checkpoint.run import find_resume_point
    ck = tmp_path / "ck"
    config = TrainConfig.from_values(model="llama:tiny", world_size=2, strategy_schedule="2xTP1PP1", steps=STEPS,
                                     tokens_per_iter=TOKENS, data=str(ref["data"]), checkpoint_dir=str(ck),
                                     checkpoint_every=EVERY)
    with pytest.raises(SpawnError, match="rank 1 was lost") as info:
        spawn(_dying_in_save_worker, 2, args=(config, 1, 4), timeout_s=60)
    assert info.value.rank == 1
    assert ckpt_manifest.complete_steps(ck) == [2]
    assert (ck / "step-00000004").is_dir() and not (ck / "step-00000004" / "manifest.json").exists()
    point = find_resume_point(ck)
    assert point.step == 2 and "step-00000004" in point.warnings[0]


def _copy_without(src, dst, *steps):
    shutil.copytree(src, dst)
    for s in steps:
        shutil.rmtree(dst / f"step-{s:08d}")


def test_corrupt_newest_checkpoint_is_named_and_fallback_resumes_on_another_world_size(ref, capsys):
    base = ref["base"]
    ck, run = base / "corrupt-ck", base / "corrupt-run"
    _copy_without(ref["ck"], ck, 6)
    shard = ck / "step-00000004" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])                # truncated
    argv = _argv(ref["data"], ck, run, "--resume", world=3)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(shard) in err[0] and "truncated" in err[0]
    assert "--resume-fallback" in err[0] and "step-00000002" in err[0]

    assert main(argv + ["--resume-fallback", "--save-final", str(base / "corrupt-final.pt")]) == 0
    captured = capsys.readouterr()
    assert "falling back to step-00000002" in captured.err
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["resumed_from"]["step"] == 2 and out["resumed_from"]["saved_world_size"] == 2
    assert out["resumed_from"]["resharded"] is True
    got = {r["step"]: r for r in _metrics(run / "metrics.jsonl")}
    assert sorted(got) == [2, 3, 4, 5]
    for r in ref["metrics"][2:]:
        assert got[r["step"]]["documents"] == r["documents"]
    assert_losses_like([got[r["step"]]["loss"] for r in ref["metrics"][2:]], [r["loss"] for r in ref["metrics"][2:]])
    final = torch.load(base / "corrupt-final.pt", weights_only=True)
    assert_params_like(final, ref["final"], lr=TrainConfig().optimizer.lr)
    # the newest complete checkpoint is now the resumed run's own, written by 3 ranks
    from hgraph.runtime.checkpoint import manifest as ckpt_manifest
    assert ckpt_manifest.read_manifest(ck / "step-00000006")["world_size"] == 3


def test_export_is_a_plain_state_dict_of_the_module(ref, tmp_path, capsys):
    from hgraph.frontends.zoo import resolve_model_spec
    out = tmp_path / "model.pt"
    assert main(["export", str(ref["ck"]), "-o", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"].endswith("step-00000006")
    state = torch.load(out, weights_only=True)
    model = resolve_model_spec("llama:tiny", {})
    model.load_state_dict(state, strict=True)
    for k, v in ref["final"].items():
        assert torch.equal(state[k], v), k


def test_resume_bad_input_is_one_line_and_exit_code_2(ref, tmp_path, capsys):
    data = ref["data"]
    cases = [
        (_argv(data, tmp_path / "empty", tmp_path / "r", "--resume"), "does not exist"),
        (_argv(data, ref["ck"], tmp_path / "r", "--resume"), "is at step 6 and --steps is 6: nothing left"),
        (["train", "--resume-fallback"], "--resume-fallback needs resume"),
    ]
    for argv, match in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0], err


@pytest.mark.parametrize("text, match", [
    ("[checkpointing]\ncheckpoint_every = 0\n", r"run.toml: [checkpointing] checkpoint-every = 0: must be >= 1"),
    ("[checkpointing]\nevery = 2\n", "run.toml: unknown key [checkpointing] every; allowed in [checkpointing]: "
                                     "checkpoint-dir, checkpoint-every"),
    ("[optimizer]\noptimizer = \"sgd\"\n", 'run.toml: [optimizer] optimizer = "sgd": allowed are adam, adamw'),
    ("[planner]\nmax-candidates = 0\n", "run.toml: [planner] max-candidates = 0: must be >= 1"),
    ("[planner]\nmax-candidates = 3\nstrategies = \"4xTP1PP1\"\n", "run.toml: [planner] max-candidates = 3: "
                                                                 "applies to the proposed candidates of --strategies auto only"),
    ("[planner]\noutlier-queues = -1\n", "run.toml: [planner] outlier-queues = -1: must be >= 0"),
    ("[cluster]\nworld_size = \"four\"\n", 'run.toml: [cluster] world-size = "four": expected an integer'),
])
def test_bad_config_key_or_value_is_one_line_and_exit_code_2(tmp_path, capsys, text, match):
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hgraph train: error: ") and match in err[0], err


def test_config_file_drives_a_run_and_flags_override_it(ref, tmp_path, capsys):
    """The file's keys reach the trainer (a fresh run of 1 step), a flag wins over the file."""
    path = tmp_path / "run.toml"
    path.write_text(f"""
[model]
model = "llama:tiny"
[data]
data = "{ref['data']}"
steps = 5
tokens_per_iter = {TOKENS}
[cluster]
world-size = 1
[planner]
strategy-schedule = "1xTP1PP1"
[checkpointing]
checkpoint-dir = "{tmp_path / 'ck'}"
[logging]
json = true
plots = false
""")
    assert main(["train", "--config", str(path), "--steps", "1"]) == 0
    out = _json_out(capsys)
    assert [s["step"] for s in out["steps"]] == [0] and [c["step"] for c in out["checkpoints"]] == [1]
    first = ref["metrics"][0]                  # the same first mini-batch, on 1 rank instead of 2
    assert out["steps"][0]["tokens"] == first["tokens"]
    assert abs(out["steps"][0]["loss"] - first["loss"]) <= 1e-6 * first["loss"]


def _rank_processes(parent_pid):
    """The spawned rank processes of ``parent_pid`` (Linux /proc), oldest first (rank order): its
    children, or under the forkserver start method the server's children; not the resource tracker."""
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
        except OSError:
            continue
        procs[int(d)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd)
    children = [pid for pid, (ppid, cmd) in procs.items() if ppid == parent_pid and b"resource_tracker" not in cmd]
    servers = [pid for pid in children if b"forkserver" in procs[pid][1]]
    ranks = [pid for pid in children if pid not in servers]
    ranks += [pid for pid, (ppid, _) in procs.items() if ppid in servers]
    return sorted(ranks)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank processes through /proc")
def test_sigkilled_rank_stops_the_cli_run_and_resume_trains_each_document_once(ref, capsys):
    """A real ``hgraph train`` process tree: rank 1 is SIGKILLed at a point the test does not choose
    (right after the first checkpoint, possibly mid-save); the run exits naming it within the
    timeout, and the resume trains exactly the mini-batches of an uninterrupted run."""
    import signal
    import subprocess
    import sys

    from hgraph.runtime.data.documents import mini_batches, read_jsonl
    base, steps = ref["base"], 24
    ck, run = base / "sigkill-ck", base / "sigkill-run"
    # --plan-ahead 0: the ranks are the run's only children (no planner process to tell apart)
    argv = _argv(ref["data"], ck, run, "--strategies", CANDIDATES, "--timeout", "20", "--plan-ahead", "0")
    argv[argv.index("--steps") + 1] = str(steps)
    proc = subprocess.Popen([sys.executable, "-m", "hgraph.tools.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ck / "step-00000002" / "manifest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        ranks = _rank_processes(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)        # rank 0 gives up after --timeout 20, not at this bound
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    err_lines = err.strip().splitlines()
    assert any(line.startswith("hgraph train: error: ") and "rank 1" in line and "--resume continues from" in line
               for line in err_lines), err

    assert main(_argv(ref["data"], ck, run, "--strategies", CANDIDATES, "--resume", "--steps", str(steps))) == 0
    out = _json_out(capsys)
    start = out["resumed_from"]["step"]
    assert start >= 2 and start % EVERY == 0
    expected = list(mini_batches(read_jsonl(ref["data"]), TOKENS, steps))
    got = _metrics(run / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(steps))
    assert [r["documents"] for r in got] == [[d.index for d in b.docs] for b in expected]
    assert out["resumed_from"]["next_document"] == expected[start - 1].next_position
    assert [r["loss"] for r in got[:6]] == [r["loss"] for r in ref["metrics"]]
