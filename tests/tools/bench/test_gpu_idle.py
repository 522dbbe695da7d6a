"""Where a profiled GPU waits for the host (``tools/bench/gpu_idle``), read from a Chrome trace as
``torch.profiler`` writes it: the gaps between kernels, each charged to the host frames open where the
kernel after it was launched (its thread's frames: backward launches from the autograd thread)."""
import json

import torch
from torch.profiler import ProfilerActivity, profile

from hgraph.tools.bench.gpu_idle import gpu_idle, idle_lines

ROOT = "/src/runtime/"


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _trace():
    return [
        # host, thread 1: the step; the loss's chunk loop; torch code inside it
        _x("python_function", ROOT + "engine/executor.py(400): step", 0, 1000),
        _x("python_function", ROOT + "engine/loss.py(20): chunk", 250, 50),
        _x("python_function", "torch/_tensor.py(7): item", 280, 12),
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 90, 2, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 291, 2, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 296, 2, correlation=4),
        # host, thread 2 (autograd): a backward kernel launched outside hgraph's code
        _x("python_function", "torch/autograd/function.py(3): apply", 600, 100, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 650, 2, tid=2, correlation=5),
        # device: busy 10-100, 100-200 (overlapping 150-180), idle 200-300, busy 300-320, 330-340, idle to 700
        _x("kernel", "gemm", 10, 90, tid=7, correlation=1),
        _x("kernel", "gemm", 100, 100, tid=7, correlation=2),
        _x("kernel", "copy", 150, 30, tid=8),
        _x("kernel", "softmax", 300, 20, tid=7, correlation=3),
        _x("kernel", "add", 325, 15, tid=7, correlation=4),       # a 5 us gap: under the threshold
        _x("kernel", "gemm_bwd", 700, 100, tid=7, correlation=5),
    ]


def test_gaps_are_charged_to_the_frames_that_launched_the_next_kernel():
    r = gpu_idle(_trace(), [ROOT])
    assert (r.window_us, r.busy_us, r.idle_us, r.gaps) == (790, 90 + 100 + 20 + 15 + 100, 465, 2)
    assert r.sites == [("outside hgraph's code", "torch/autograd/function.py:3 apply", 360.0, 1),
                       ("runtime/engine/loss.py:20 chunk", "torch/_tensor.py:7 item", 100.0, 1)]
    per = r.per_step(2)
    assert per["idle_ms"] == 0.2325 and per["gaps"] == 1 and per["sites"][1][2:] == [0.05, 0.5]
    lines = idle_lines(per)
    assert lines[0].startswith("GPU idle between kernels (profiled, per step): 0.2 of 0.4 ms in 1 gaps")
    assert lines[2] == "     0.05 ms    0.5  runtime/engine/loss.py:20 chunk | torch/_tensor.py:7 item"


def test_a_cpu_trace_has_no_kernels_and_reports_nothing(tmp_path):
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        torch.ones(8).sum()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "python_function" for e in events)
    r = gpu_idle(events, [ROOT])
    assert (r.window_us, r.idle_us, r.gaps, r.sites) == (0.0, 0.0, 0, []) and idle_lines(r.per_step(2)) == []
