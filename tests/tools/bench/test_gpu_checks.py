"""The prepared GPU session (``tools/bench/gpu_checks``): its commands are valid on a one-GPU machine
(CUDA faked; nothing runs), and its verdicts follow from the figures."""
from __future__ import annotations

import argparse
import types

import torch

from hgraph.tools.bench import gpu_checks, gpu_moe
from hgraph.tools.cli import memory as cmd_memory, train as cmd_train


def _one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(total_memory=80 * 2 ** 30))


def _parse(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    cmd_train.add_parser(sub)
    cmd_memory.add_parser(sub)
    return parser.parse_args(argv)


def test_the_commands_are_valid_on_one_gpu(monkeypatch, tmp_path):
    _one_gpu(monkeypatch)
    docs = gpu_checks.write_documents(tmp_path, smoke=False)    # the 1-GPU run's data: the bench's lengths
    lengths = [len(line.split(",")) for line in docs.read_text().splitlines()]
    assert sum(lengths) > 8 * gpu_checks.TOKENS * 0.9 and max(lengths) > 4096
    checks = {c.name: c for c in gpu_checks.plan_checks(tmp_path, smoke=False)}
    assert list(checks) == ["bench", "train_1gpu", "memory", "shared_gpu", "cpu_reference", "moe"]
    cluster = {}
    for name in ("train_1gpu", "shared_gpu", "cpu_reference"):
        argv = checks[name].argv[checks[name].argv.index("train"):]
        config, _ = cmd_train.config_from_args(_parse(argv))       # the schedule is checked on 4 ranks
        cluster[name] = (config.cluster.device, config.cluster.world_size, config.cluster.backend)
    assert cluster == {"train_1gpu": ("cuda", 1, "auto"), "shared_gpu": ("cuda", 4, "gloo"),
                       "cpu_reference": ("cpu", 4, "auto")}
    memory = _parse(checks["memory"].argv[checks["memory"].argv.index("memory"):])
    assert (memory.compile, memory.dtype, memory.tokens) == ("on", "bf16", gpu_checks.TOKENS)
    moe = gpu_moe.parser().parse_args(checks["moe"].argv[checks["moe"].argv.index("hgraph.tools.bench.gpu_moe") + 1:])
    assert (moe.device, moe.dtype, moe.compile, moe.tokens, moe.profile) == ("cuda", "bf16", "on", gpu_checks.TOKENS, True)
    config = gpu_moe.model_config(moe.model_args)      # the bench's ~1B model, fine-grained experts
    assert 0.9e9 < config.num_parameters() < 1.1e9 and (config.num_experts, config.top_k) == (64, 6)
    assert checks["moe"].timeout_s <= 240      # last, under its own limit: checks 1-3 keep theirs


def test_the_verdicts_follow_from_the_figures(tmp_path):
    checks = {c.name: c for c in gpu_checks.plan_checks(tmp_path, smoke=True)}
    checks["bench"].figures = {"ratio": 1.1, "hgraph_ms": 100.0}
    checks["train_1gpu"].figures = {"rank_peak_bytes": [90, 100], "step_ms": [900.0, 300.0, 110.0, 100.0, 105.0]}
    checks["memory"].figures = {"peak": 110}
    checks["shared_gpu"].figures = {"loss": [2.0, 1.5]}
    checks["cpu_reference"].figures = {"loss": [2.0, 1.5 * (1 + 2e-6)]}
    checks["moe"].figures = {"ratio": 1.04, "losses_agree": None}           # bf16: the losses reported only
    verdicts = gpu_checks.compare(checks)
    assert verdicts["bench_ratio"] == 1.1 and verdicts["memory_model_over_measured"] == 1.1
    assert verdicts["train_over_bench"] == 1.05          # the warm steps' median against the bench's step
    assert verdicts["shared_gpu_equals_cpu"] and verdicts["shared_gpu_loss_rel_diff"] < 2e-6
    assert verdicts["moe_ratio"] == 1.04 and verdicts["moe_within_goal"] and "moe_losses_agree" not in verdicts
    checks["moe"].figures = {"ratio": 1.06, "losses_agree": False}
    verdicts = gpu_checks.compare(checks)
    assert not verdicts["moe_within_goal"] and verdicts["moe_losses_agree"] is False
    checks["cpu_reference"].figures = {"loss": [2.0, 1.6]}
    assert not gpu_checks.compare(checks)["shared_gpu_equals_cpu"]


def test_the_moe_check_alone_dry_run_and_smoke(tmp_path, capsys, one_thread):
    """``--only moe`` plans the MoE bench alone; its smoke command (run here in this process: the same
    argv, without a process's start) trains both sides of llama-moe:tiny on CPU to the same losses."""
    assert gpu_checks.main(["--only", "moe", "--dry-run", "--smoke", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe: ") and "hgraph.tools.bench.gpu_moe" in lines[0]
    check = next(c for c in gpu_checks.plan_checks(tmp_path, smoke=True) if c.name == "moe")
    assert gpu_moe.main(check.argv[check.argv.index("hgraph.tools.bench.gpu_moe") + 1:]) == 0
    check.stdout = capsys.readouterr().out
    got = check.figures = gpu_checks.figures(check, tmp_path)
    assert got["device"] == "cpu" and got["plain_experts"] == "loop" and got["hgraph_ms"] > 0
    assert got["losses_agree"] and got["loss_rel_diff"] <= gpu_moe.LOSS_RTOL
    assert gpu_checks.compare({"moe": check})["moe_losses_agree"]
