"""The GPU checks of one session in one go: ``python -m hgraph.tools.bench.gpu_checks [--out DIR]``.

On a machine with one CUDA GPU (checks 1-3 under 10 minutes on an H100 or H200, check 4 at most 4
more) it runs, each as its own process with a time limit, its output kept under ``--out``:

1. ``bench``: ``python -m hgraph.tools.bench.gpu --profile`` (1.1B Llama, bf16, 16K packed tokens,
   compiled): hgraph's step against plain PyTorch + ``torch.compile``, MFU, the top kernels, where
   the GPU waits for the host between kernels;
2. ``train_1gpu``: ``hgraph train`` on the GPU alone (bf16, 16K tokens a step, the same model, on
   documents of the bench's length distribution, written to ``documents.jsonl``), its measured
   allocator peak per step beside ``memory``: ``hgraph memory`` of the same run (``--compile on``),
   the planner's estimates against the measured step times, and its warm step against the bench's;
3. ``shared_gpu``: 4 ranks sharing the GPU over gloo (``--backend gloo``), fp32, compiled, a
   heterogeneous schedule with TP, PP, SP and CP, beside ``cpu_reference``: the same run as 4 CPU
   processes (eager); the losses must agree within the equivalence tolerance;
4. ``moe``: ``python -m hgraph.tools.bench.gpu_moe --profile`` (``llama-moe`` of 0.96B parameters, 64
   experts top-6, bf16, 16K packed tokens, compiled): hgraph's step against plain PyTorch + ``torch.compile``
   with the experts in grouped GEMMs, MFU by activated FLOPs, both sides' top kernels (goal: ratio <= 1.05).
   It runs last, under its own time limit, so it never takes time from the checks before it.

It prints one summary (``--json``: one JSON object) and writes ``summary.json``; ``--only`` runs some
of the checks (a session may split them over several device calls). ``--smoke`` runs the same
commands at tiny size on CPU (no GPU needed; the runs eager, the peaks then RSS, not comparable with
``hgraph memory``); ``--dry-run`` prints the commands only. A check past its time limit is stopped
with every process it started.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from hgraph.frontends.zoo import llama
from hgraph.runtime.data.builtin import write_jsonl
from hgraph.tools.bench.gpu import DEFAULT_MODEL_ARGS, bench_documents
from hgraph.tools.bench.gpu_moe import GOAL_RATIO as MOE_GOAL_RATIO, MOE_MODEL_ARGS
from hgraph.tools.bench.gpu_idle import idle_lines

TOKENS = 16384
SMOKE_TOKENS = 512
SHARED_SCHEDULE = "1xTP2PP2;1xTP1PP1CP2+1xTP2PP1"     # TP + SP and PP; CP beside TP
LOSS_RTOL = 1e-5           # fp32 on the GPU against the CPU: other kernels, other summation orders
SMOKE_MODEL_ARGS = {"num_layers": 2}
MOE_SMOKE_MODEL_ARGS = {"num_layers": 2}     # llama-moe:tiny's dense layer and one MoE layer
#: the summary's figures of the two benches (the rest of their JSON stays in their stdout files)
BENCH_KEYS = ("device", "hgraph_ms", "plain_ms", "ratio", "hgraph_mfu", "plain_mfu", "region_compiles")
MOE_KEYS = BENCH_KEYS + ("plain_experts", "loss_rel_diff", "losses_agree")
TABLES = ("profile", "plain_profile", "sync_sites", "gpu_idle")     # shown apart from the one-line figures
DOCUMENTS = "documents.jsonl"


@dataclass
class Check:
    """One command of the session and what came of it."""

    name: str
    argv: list[str]
    timeout_s: float
    rc: Optional[int] = None
    wall_s: float = 0.0
    stdout: str = ""
    figures: dict = field(default_factory=dict)


def _hgraph(*args: str) -> list[str]:
    return [sys.executable, "-m", "hgraph.tools.cli", *args]


def plan_checks(out: Path, smoke: bool) -> list[Check]:
    """The session's commands (``smoke``: tiny, on CPU)."""
    model_args = json.dumps(SMOKE_MODEL_ARGS if smoke else DEFAULT_MODEL_ARGS)
    tokens = SMOKE_TOKENS if smoke else TOKENS
    device = ["--device", "cpu"] if smoke else []
    bench = [sys.executable, "-m", "hgraph.tools.bench.gpu", "--model-args", model_args, "--tokens", str(tokens),
             "--json", *(["--device", "cpu", "--steps", "2"] if smoke else ["--profile"])]
    train = _hgraph("train", "--model", "llama:tiny", "--model-args", model_args, "--world-size", "1",
                    "--data", str(out / DOCUMENTS),
                    *device, "--dtype", "fp32" if smoke else "bf16", "--tokens-per-iter", str(tokens),
                    "--steps", "3" if smoke else "8", "--compile", "on", "--run-dir", str(out / "train_1gpu"),
                    "--progress", "off", "--json", "--no-plots")
    memory = _hgraph("memory", "--model", "llama:tiny", "--model-args", model_args, "--strategy", "1xTP1PP1",
                     "--dtype", "fp32" if smoke else "bf16", "--tokens", str(tokens), "--compile", "on", "--json")
    shared = ["--model", "llama:tiny", "--world-size", "4", "--dtype", "fp32", "--strategy-schedule",
              SHARED_SCHEDULE, "--steps", "2", "--tokens-per-iter", "1024", "--progress", "off", "--json",
              "--no-plots"]
    on_gpu = ["--compile", "off"] + device if smoke else ["--compile", "on", "--backend", "gloo"]
    moe = [sys.executable, "-m", "hgraph.tools.bench.gpu_moe", "--tokens", str(tokens), "--json",
           *(["--model-args", json.dumps(MOE_SMOKE_MODEL_ARGS), "--device", "cpu", "--steps", "1"] if smoke
             else ["--model-args", json.dumps(MOE_MODEL_ARGS), "--profile"])]
    return [Check("bench", bench, 240),
            Check("train_1gpu", train, 240),
            Check("memory", memory, 90),
            Check("shared_gpu", _hgraph("train", *shared, *on_gpu, "--run-dir", str(out / "shared_gpu")), 180),
            Check("cpu_reference", _hgraph("train", *shared, "--compile", "off", "--device", "cpu",
                                           "--run-dir", str(out / "cpu_reference")), 150),
            Check("moe", moe, 240)]


def write_documents(out: Path, smoke: bool, steps: int = 10) -> Path:
    """The 1-GPU run's data: ``steps`` batches drawn as the bench draws its one (the same model's
    vocabulary and context), so the run's warm step compares with the bench's."""
    args = SMOKE_MODEL_ARGS if smoke else DEFAULT_MODEL_ARGS
    config = llama.make_config("tiny", **args)
    tokens = SMOKE_TOKENS if smoke else TOKENS
    docs = [d for seed in range(steps)
            for d in bench_documents(tokens, config.vocab_size, min(config.max_seq_len, tokens), seed=seed)]
    return write_jsonl(out / DOCUMENTS, docs)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}


def figures(check: Check, out: Path) -> dict:
    """What a finished check's output says (the summary's figures)."""
    if check.name in ("bench", "moe"):
        got = _last_json(check.stdout)
        return {k: got.get(k) for k in (BENCH_KEYS if check.name == "bench" else MOE_KEYS) + TABLES}
    if check.name == "memory":
        rank = (_last_json(check.stdout).get("ranks") or [{}])[0]
        return {"activations": rank.get("activations"), "peak": rank.get("peak")}
    records = _metrics(out / check.name)
    if check.name == "train_1gpu":
        return {"step_ms": [round(1e3 * r["time_s"], 1) for r in records],
                "est_ms": [r.get("est_model_ms") for r in records],
                "rank_peak_bytes": [max(r.get("rank_peak_bytes") or [0]) for r in records]}
    return {"loss": [r["loss"] for r in records]}


def compare(checks: dict[str, Check]) -> dict:
    """The session's verdicts: the bench ratio, the memory model against the measured peak, the
    shared-GPU run against the CPU run, the MoE bench's ratio against its goal and whether its two
    sides' losses agree (fp32 only; those whose checks ran)."""
    out: dict = {}
    figures_of = {name: c.figures for name, c in checks.items()}
    empty: dict = {}
    bench = figures_of.get("bench", empty)
    if bench.get("ratio") is not None:
        out["bench_ratio"] = bench["ratio"]
    warm = figures_of.get("train_1gpu", empty).get("step_ms", [])[2:]     # past compiles and warm-up
    if warm and bench.get("hgraph_ms"):
        out["train_over_bench"] = statistics.median(warm) / bench["hgraph_ms"]
    peaks = [p for p in figures_of.get("train_1gpu", empty).get("rank_peak_bytes", []) if p]
    predicted = figures_of.get("memory", empty).get("peak")
    if peaks and predicted:
        out["memory_model_over_measured"] = predicted / max(peaks)
    a, b = figures_of.get("shared_gpu", empty).get("loss"), figures_of.get("cpu_reference", empty).get("loss")
    if a and b and len(a) == len(b):
        worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        out["shared_gpu_loss_rel_diff"] = worst
        out["shared_gpu_equals_cpu"] = worst <= LOSS_RTOL and all(math.isfinite(x) for x in a)
    moe = figures_of.get("moe", empty)
    if moe.get("ratio") is not None:
        out["moe_ratio"] = moe["ratio"]
        out["moe_within_goal"] = moe["ratio"] <= MOE_GOAL_RATIO
    if moe.get("losses_agree") is not None:
        out["moe_losses_agree"] = moe["losses_agree"]
    return out


def run_check(check: Check, out: Path) -> None:
    """Run ``check`` in a process group of its own: past its time limit the whole group is stopped
    (a run's ranks included), and its rc is 124."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(check.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        check.stdout, stderr = proc.communicate(timeout=check.timeout_s)
        check.rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        check.stdout, stderr = proc.communicate()
        check.rc = 124
    (out / f"{check.name}.stderr.txt").write_text(stderr, encoding="utf-8")
    check.wall_s = time.perf_counter() - t0
    (out / f"{check.name}.stdout.txt").write_text(check.stdout, encoding="utf-8")
    check.figures = figures(check, out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hgraph.tools.bench.gpu_checks",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-checks", help="folder of the outputs (default: ./gpu-checks)")
    ap.add_argument("--smoke", action="store_true", help="the same commands at tiny size on CPU")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help="comma-separated checks to run (bench, train_1gpu, memory, shared_gpu, cpu_reference, moe)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    checks = plan_checks(out, args.smoke)
    if args.only is not None:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - {c.name for c in checks})
        if unknown:
            print(f"bench gpu_checks: error: --only: unknown check(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        checks = [c for c in checks if c.name in names]
    if args.dry_run:
        for c in checks:
            print(f"{c.name}: {subprocess.list2cmdline(c.argv)}")
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("bench gpu_checks: error: needs a CUDA GPU (--smoke runs the commands at tiny size on CPU)",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if any(c.name == "train_1gpu" for c in checks):
        write_documents(out, args.smoke)
    for c in checks:
        run_check(c, out)
    by_name = {c.name: c for c in checks}
    summary = {"checks": {c.name: {"rc": c.rc, "wall_s": round(c.wall_s, 1), **c.figures} for c in checks},
               "verdicts": compare(by_name)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(summary))
    else:
        for c in checks:
            shown = {k: v for k, v in c.figures.items() if k not in TABLES}
            print(f"{c.name}: rc {c.rc}, {c.wall_s:.0f} s, {shown}")
        for name in ("bench", "moe"):
            got = by_name[name].figures if name in by_name else {}
            if got.get("profile"):
                print(f"{name}: hgraph's top kernels\n{got['profile']}")
            if got.get("plain_profile"):
                print(f"{name}: plain PyTorch's top kernels\n{got['plain_profile']}")
            for site, n in got.get("sync_sites") or []:
                print(f"{name}: sync {n:4d}  {site}")
            for line in idle_lines(got.get("gpu_idle")):
                print(f"{name}: {line}")
        print(f"verdicts: {summary['verdicts']}")
    return 0 if all(c.rc == 0 for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
