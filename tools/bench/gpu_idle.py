"""Where a profiled GPU waits for the host: the gaps between the kernels of a ``torch.profiler`` trace
(Chrome trace JSON, recorded ``with_stack``) and, per gap, the code the host thread was in when it
launched the kernel that ended the gap: the innermost frame of hgraph's code and the innermost frame of
any code (a ``torch/_dynamo`` guard, a synchronising copy, ...). ``tools.bench.gpu --profile`` prints
it: when the GPU's own time per step is the plain model's whole step, the gaps are what is left of the
difference. The profiler's Python tracing slows the host, so gaps are larger than in an unprofiled step.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>.+)$")


@dataclass
class IdleReport:
    """Idle time of the device within the profiled window (first kernel start to last kernel end)."""

    window_us: float = 0.0
    busy_us: float = 0.0
    gaps: int = 0
    # (innermost hgraph frame, innermost frame, idle us, gaps), most idle first
    sites: list[tuple[str, str, float, int]] = field(default_factory=list)

    @property
    def idle_us(self) -> float:
        return self.window_us - self.busy_us

    def per_step(self, steps: int, rows: int = 12) -> dict:
        """The figures (ms, gaps) per step of a trace of ``steps`` steps, the ``rows`` most idle sites."""
        ms = 1e3 * steps
        return {"window_ms": self.window_us / ms, "busy_ms": self.busy_us / ms, "idle_ms": self.idle_us / ms,
                "gaps": self.gaps / steps,
                "sites": [[ours, inner, us / ms, n / steps] for ours, inner, us, n in self.sites[:rows]]}


def _frame_site(name: str, roots: Sequence[str]) -> str:
    """``file:line function`` of a python_function event's name, the file relative to its root."""
    m = _FRAME.match(name)
    if not m:
        return name
    path = m.group("file")
    for root in roots:
        if path.startswith(root):
            path = os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))
            break
    return f"{path}:{m.group('line')} {m.group('func')}"


def _innermost(frames: list[tuple[float, float, str]], times: list[tuple[float, int]]) -> dict[int, str]:
    """For each (time, key) the name of the innermost frame open at that time: ``frames`` (start, end,
    name) of one thread nest as a call tree; one sweep over both in time order."""
    frames = sorted(frames, key=lambda f: (f[0], -f[1]))
    out: dict[int, str] = {}
    stack: list[tuple[float, float, str]] = []
    i = 0
    for t, key in sorted(times):
        while i < len(frames) and frames[i][0] <= t:
            while stack and stack[-1][1] < frames[i][0]:
                stack.pop()
            stack.append(frames[i])
            i += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        if stack:
            out[key] = stack[-1][2]
    return out


def gpu_idle(events: Iterable[dict[str, Any]], roots: Sequence[str], min_gap_us: float = 10.0) -> IdleReport:
    """The device's idle gaps of at least ``min_gap_us`` in a trace's ``events`` (``traceEvents``), each
    charged to the frames open on the host thread where the kernel ending it was launched; ``roots``: the
    folders of the code called ours (hgraph's)."""
    events = list(events)
    kernels = sorted((e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"),
                     key=lambda e: float(e["ts"]))
    if not kernels:
        return IdleReport()
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in (e.get("args") or {})}
    gaps: list[tuple[float, Optional[dict]]] = []
    start = float(kernels[0]["ts"])
    end = start + float(kernels[0].get("dur", 0.0))
    busy = 0.0
    run_start = start
    for k in kernels[1:]:
        ts = float(k["ts"])
        if ts > end:
            busy += end - run_start
            if ts - end >= min_gap_us:
                gaps.append((ts - end, launches.get((k.get("args") or {}).get("correlation"))))
            run_start = ts
        end = max(end, ts + float(k.get("dur", 0.0)))
    busy += end - run_start
    report = IdleReport(window_us=end - start, busy_us=busy, gaps=len(gaps))

    # the frames of each host thread, all and ours, and the launch times to look up in them
    frames: dict[Any, list] = defaultdict(list)
    ours: dict[Any, list] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and e.get("ph") == "X":
            f = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"])
            frames[e.get("tid")].append(f)
            path = _FRAME.match(e["name"])
            if path and path.group("file").startswith(tuple(roots)):
                ours[e.get("tid")].append(f)
    times: dict[Any, list] = defaultdict(list)
    for i, (_, launch) in enumerate(gaps):
        if launch is not None:
            times[launch.get("tid")].append((float(launch["ts"]), i))
    inner: dict[int, str] = {}
    mine: dict[int, str] = {}
    for tid, ts in times.items():
        inner.update(_innermost(frames[tid], ts))
        mine.update(_innermost(ours[tid], ts))
    by_site: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])
    for i, (us, launch) in enumerate(gaps):
        key = ("no launch in the trace", "") if launch is None else (
            _frame_site(mine[i], roots) if i in mine else "outside hgraph's code",
            _frame_site(inner[i], roots) if i in inner else launch.get("name", "?"))
        by_site[key][0] += us
        by_site[key][1] += 1
    report.sites = sorted(((a, b, us, n) for (a, b), (us, n) in by_site.items()), key=lambda s: -s[2])
    return report


def idle_lines(per_step: Optional[dict]) -> list[str]:
    """The printed form of ``IdleReport.per_step`` (none for a trace without kernels)."""
    if not per_step or not per_step.get("window_ms"):
        return []
    lines = [f"GPU idle between kernels (profiled, per step): {per_step['idle_ms']:.1f} of "
             f"{per_step['window_ms']:.1f} ms in {per_step['gaps']:.0f} gaps; by the code launching the "
             "kernel after a gap (hgraph's | innermost):"]
    lines += [f"  {ms:7.2f} ms {n:6.1f}  {ours} | {inner}" for ours, inner, ms, n in per_step["sites"]]
    return lines
