"""Plots of a training run from its ``metrics.jsonl`` (PNG and SVG), and the run's summary figures.

One JSON object per line, one line per step. Fields read (the trainer writes them; see
``hgraph.runtime.train.trainer``):

* always: ``step`` (int), ``strategy`` (text form), ``loss`` (number; null or NaN for a skipped or
  non-finite step), ``tokens`` (int), ``time_s`` (measured step time);
* when present: ``est_latency_ms`` (the planner's estimate of the step), ``pipelines`` (a list of
  ``{"scheme", "est_latency_ms", "measured_latency_ms"}``; the step estimate defaults to the slowest
  pipeline's), ``rank_busy_s`` (per rank, seconds of work in the step), ``planner_wait_s`` (time the
  trainer waited for the plan), ``switch_s`` (strategy switch time), ``cache_hit`` (bool; else the running ``cache_hits`` /
  ``cache_misses`` counters), ``build_s`` and ``built_ahead`` (a Program's build, on its first step), ``skipped``.

Figures (``write_plots``), each as ``NAME.png`` and ``NAME.svg``:

* ``strategy_latency``: the measured step latency per iteration over a colour band per strategy
  (like Fig. 12a of the Hydraulis paper), the estimate dashed when known;
* ``est_vs_measured``: estimated and measured latency per step, and one against the other with the
  +-10% band (needs estimates);
* ``rank_busy``: busy time per rank and step as a heat map, with the balance (max / mean busy time)
  per step (needs ``rank_busy_s``);
* ``loss``: the loss curve (and ``eval_loss``, the validation loss, where measured);
* ``overheads``: planner wait and switch time per step (needs either field).

A figure whose fields are missing from every line is skipped and named in the result. matplotlib
is imported only when plotting (the ``plots`` extra) and drives its Agg canvas directly, so the
process's global backend is never changed.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from hgraph.errors import HGraphError
from hgraph.runtime.data.jsonl import jsonl_values

METRICS_FILE = "metrics.jsonl"
FORMATS = ("png", "svg")
REQUIRED = {"step": int, "strategy": str, "tokens": int, "time_s": (int, float)}
PLOT_NAMES = ("strategy_latency", "est_vs_measured", "rank_busy", "loss", "overheads")


# ---- reading --------------------------------------------------------------------------------------
def metrics_path(run: Union[str, Path]) -> Path:
    """``RUN_DIR/metrics.jsonl`` for a run folder; a ``.jsonl`` file is taken as is."""
    run = Path(run)
    return run if run.suffix == ".jsonl" and not run.is_dir() else run / METRICS_FILE


def _number_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def read_metrics(path: Union[str, Path]) -> list[dict]:
    """The step records of a metrics file; HGraphError (one line, naming file and line) when the file
    is missing, empty or a line is not a step record."""
    path = Path(path)
    if not path.exists():
        raise HGraphError(f"metrics file {str(path)!r} does not exist (is this a run folder?)")
    records = []
    for where, rec in jsonl_values(path, expect="each line must be one step's JSON object"):
        if not isinstance(rec, dict):
            raise HGraphError(f"{where}: expected one JSON object per step")
        for name, kind in REQUIRED.items():
            if name not in rec:
                raise HGraphError(f"{where}: missing field {name!r} (each line needs "
                                  f"{', '.join(REQUIRED)} and loss)")
            if not isinstance(rec[name], kind) or isinstance(rec[name], bool):
                raise HGraphError(f"{where}: field {name!r} = {rec[name]!r} has the wrong type")
        if "loss" not in rec or not _number_or_none(rec["loss"]):
            raise HGraphError(f"{where}: field 'loss' must be a number or null")
        records.append(rec)
    if not records:
        raise HGraphError(f"metrics file {str(path)!r} holds no steps")
    return records


# ---- derived series -------------------------------------------------------------------------------
def estimated_ms(rec: dict) -> Optional[float]:
    """The planner's estimate of one step (ms): ``est_latency_ms`` or the slowest pipeline's."""
    if rec.get("est_latency_ms") is not None:
        return float(rec["est_latency_ms"])
    ests = [p.get("est_latency_ms") for p in rec.get("pipelines") or []]
    ests = [float(e) for e in ests if e is not None]
    return max(ests) if ests else None


def balance(rec: dict) -> Optional[float]:
    """Max over mean of the ranks' busy times in one step (1.0 = perfectly balanced)."""
    busy = rec.get("rank_busy_s")
    if not busy:
        return None
    mean = sum(busy) / len(busy)
    return max(busy) / mean if mean > 0 else None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass
class RunSummary:
    """The run's figures: step count, strategies and how often, step time, balance, estimate accuracy."""

    steps: int
    strategies: dict
    distinct_strategies: int
    mean_step_s: float
    steps_per_s: float
    tokens_per_s: float
    first_loss: Optional[float]
    last_loss: Optional[float]
    mean_balance: Optional[float] = None
    est_within_10pct: Optional[float] = None
    planner_wait_s: Optional[float] = None
    switch_s: Optional[float] = None
    cache_hit_rate: Optional[float] = None
    skipped_steps: int = 0          # steps whose update was skipped for a non-finite loss
    build_s: Optional[float] = None          # the Programs' builds (``build_s`` of their first steps)
    built_ahead: Optional[int] = None        # how many of those were built ahead

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def summarize(records: Sequence[dict]) -> RunSummary:
    """Summary figures of a run (the closing figures of ``hgraph train`` and ``hgraph report``)."""
    times = [float(r["time_s"]) for r in records]
    total = sum(times)
    losses = [r["loss"] for r in records if _finite(r.get("loss"))]
    bal = [b for b in map(balance, records) if b is not None]
    pairs = [(estimated_ms(r), 1e3 * float(r["time_s"])) for r in records]
    pairs = [(e, m) for e, m in pairs if e is not None and m > 0]
    waits = [float(r["planner_wait_s"]) for r in records if _finite(r.get("planner_wait_s"))]
    switches = [float(r["switch_s"]) for r in records if _finite(r.get("switch_s"))]
    hits = [bool(r["cache_hit"]) for r in records if "cache_hit" in r]
    builds = [r for r in records if _finite(r.get("build_s"))]
    hit_rate = sum(hits) / len(hits) if hits else _cumulative_hit_rate(records)
    counts = Counter(r["strategy"] for r in records)
    return RunSummary(
        steps=len(records), strategies=dict(counts.most_common()), distinct_strategies=len(counts),
        mean_step_s=total / len(records), steps_per_s=len(records) / total if total > 0 else 0.0,
        tokens_per_s=sum(r["tokens"] for r in records) / total if total > 0 else 0.0,
        first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
        mean_balance=sum(bal) / len(bal) if bal else None,
        est_within_10pct=sum(abs(e - m) <= 0.1 * m for e, m in pairs) / len(pairs) if pairs else None,
        planner_wait_s=sum(waits) if waits else None, switch_s=sum(switches) if switches else None,
        cache_hit_rate=hit_rate,
        skipped_steps=sum(1 for r in records if r.get("skipped") or not _finite(r.get("loss"))),
        build_s=sum(float(r["build_s"]) for r in builds) if builds else None,
        built_ahead=sum(bool(r.get("built_ahead")) for r in builds) if builds else None)


def _cumulative_hit_rate(records: Sequence[dict]) -> Optional[float]:
    """Hit rate from the running ``cache_hits`` / ``cache_misses`` counters (the last line's)."""
    last = records[-1]
    if not (_finite(last.get("cache_hits")) and _finite(last.get("cache_misses"))):
        return None
    total = last["cache_hits"] + last["cache_misses"]
    return last["cache_hits"] / total if total > 0 else None


# ---- plotting -------------------------------------------------------------------------------------
def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise HGraphError("plots need matplotlib, which is not installed: pip install -e '.[plots]' in the "
                          "hgraph checkout (or pip install matplotlib)") from None
    return Figure


@dataclass
class PlotResult:
    """What ``write_plots`` wrote (paths) and which figures it skipped, with the reason."""

    files: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)


def _strategy_colours(records: Sequence[dict]) -> dict[str, Any]:
    from matplotlib import colormaps
    order = list(dict.fromkeys(r["strategy"] for r in records))
    cmap = colormaps["tab10" if len(order) <= 10 else "tab20"]
    return {s: cmap(i % cmap.N) for i, s in enumerate(order)}


def _runs(records: Sequence[dict]) -> list[tuple[str, int, int]]:
    """Consecutive records with one strategy: (strategy, first index, last index)."""
    out: list[tuple[str, int, int]] = []
    for i, r in enumerate(records):
        if out and out[-1][0] == r["strategy"]:
            out[-1] = (out[-1][0], out[-1][1], i)
        else:
            out.append((r["strategy"], i, i))
    return out


def _plot_strategy_latency(fig: Any, records: Sequence[dict]) -> None:
    from matplotlib.patches import Patch
    ax = fig.add_subplot(1, 1, 1)
    steps = [r["step"] for r in records]
    colours = _strategy_colours(records)
    for strategy, i, j in _runs(records):
        ax.axvspan(steps[i] - 0.5, steps[j] + 0.5, color=colours[strategy], alpha=0.35, lw=0)
    ax.plot(steps, [1e3 * r["time_s"] for r in records], "o-", color="black", ms=3, lw=1.2,
            label="measured")
    est = [estimated_ms(r) for r in records]
    if any(e is not None for e in est):
        ax.plot(steps, [e if e is not None else math.nan for e in est], "--", color="0.35", lw=1,
                label="estimated")
    handles = [Patch(color=c, alpha=0.6, label=s) for s, c in colours.items()]
    handles += ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="strategy")
    ax.set_xlabel("iteration")
    ax.set_ylabel("step latency (ms)")
    ax.set_title("Strategy chosen per iteration and its latency")
    ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    ax.set_ylim(bottom=0)


def _plot_est_vs_measured(fig: Any, records: Sequence[dict]) -> None:
    steps = [r["step"] for r in records]
    est = [estimated_ms(r) for r in records]
    meas = [1e3 * r["time_s"] for r in records]
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax1.plot(steps, meas, "o-", ms=3, lw=1, label="measured")
    ax1.plot(steps, [e if e is not None else math.nan for e in est], "s--", ms=3, lw=1, label="estimated")
    ax1.set_xlabel("iteration")
    ax1.set_ylabel("latency (ms)")
    ax1.legend(fontsize=8)
    ax1.set_title("Per step")
    xs = [(e, m) for e, m in zip(est, meas) if e is not None]
    ax2.scatter([e for e, _ in xs], [m for _, m in xs], s=12)
    # zoom on the data: the band around the diagonal is what matters
    lo = min(min(e for e, _ in xs), min(m for _, m in xs)) * 0.9
    hi = max(max(e for e, _ in xs), max(m for _, m in xs)) * 1.05
    ax2.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="measured = estimated")
    ax2.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="tab:green", alpha=0.15,
                     label="within 10%")
    ax2.set_xlim(lo, hi)
    ax2.set_ylim(lo, hi)
    ax2.set_xlabel("estimated (ms)")
    ax2.set_ylabel("measured (ms)")
    ax2.legend(fontsize=8)
    ax2.set_title("Measured against estimated")
    pipe = [p for r in records for p in r.get("pipelines") or []
            if p.get("est_latency_ms") is not None and p.get("measured_latency_ms") is not None]
    if pipe:
        ax2.scatter([p["est_latency_ms"] for p in pipe], [p["measured_latency_ms"] for p in pipe], s=8,
                    marker="x", color="tab:orange", label="per pipeline")
        ax2.legend(fontsize=8)
    fig.suptitle("Estimated vs measured latency")


def _plot_rank_busy(fig: Any, records: Sequence[dict]) -> None:
    rows = [r for r in records if r.get("rank_busy_s")]
    width = max(len(r["rank_busy_s"]) for r in rows)
    grid = np.full((width, len(rows)), np.nan)
    for j, r in enumerate(rows):
        grid[: len(r["rank_busy_s"]), j] = r["rank_busy_s"]
    steps = [r["step"] for r in rows]
    ax1 = fig.add_subplot(2, 1, 1)
    im = ax1.imshow(1e3 * grid, aspect="auto", interpolation="nearest", cmap="viridis",
                    extent=(steps[0] - 0.5, steps[-1] + 0.5, width - 0.5, -0.5))
    fig.colorbar(im, ax=ax1, label="busy (ms)")
    from matplotlib.ticker import MaxNLocator
    ax1.yaxis.set_major_locator(MaxNLocator(nbins=min(width, 16), integer=True))
    ax1.set_ylabel("rank")
    ax1.set_title("Busy time per rank and step")
    ax2 = fig.add_subplot(2, 1, 2, sharex=ax1)
    ax2.plot(steps, [balance(r) for r in rows], "o-", ms=3, lw=1)
    ax2.axhline(1.0, color="black", lw=0.8)
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("max / mean busy")
    ax2.set_title("Balance (1.0 = every rank equally busy)")


def _plot_loss(fig: Any, records: Sequence[dict]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    pts = [(r["step"], r["loss"]) for r in records if _finite(r.get("loss")) and not r.get("skipped")]
    ax.plot([s for s, _ in pts], [v for _, v in pts], "-", lw=1.2, marker="o" if len(pts) <= 60 else None,
            ms=3, label="training loss")
    evals = [(r["step"], r["eval_loss"]) for r in records if _finite(r.get("eval_loss"))]
    if evals:        # --eval-every: the validation loss on the same axis
        ax.plot([s for s, _ in evals], [v for _, v in evals], "s-", lw=1.2, ms=4, color="tab:green",
                label="validation loss (eval_loss)")
        ax.legend(loc="upper right")
    bad = [r["step"] for r in records if not _finite(r.get("loss")) or r.get("skipped")]
    for s in bad:
        ax.axvline(s, color="tab:red", lw=0.8, alpha=0.6)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title("Training loss" + (f" ({len(bad)} skipped steps in red)" if bad else ""))


def _plot_overheads(fig: Any, records: Sequence[dict]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    steps = [r["step"] for r in records]
    for key, label in (("planner_wait_s", "planner wait"), ("switch_s", "strategy switch")):
        if any(_finite(r.get(key)) for r in records):
            ax.plot(steps, [1e3 * r[key] if _finite(r.get(key)) else math.nan for r in records], "o-",
                    ms=3, lw=1, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title("Time the trainer waited for the planner, and strategy switches")


def _needs(records: Sequence[dict]) -> dict[str, Optional[str]]:
    """Per figure: None when it can be drawn, else why not."""
    has_est = any(estimated_ms(r) is not None for r in records)
    has_busy = any(r.get("rank_busy_s") for r in records)
    has_loss = any(_finite(r.get("loss")) for r in records)
    has_over = any(_finite(r.get("planner_wait_s")) or _finite(r.get("switch_s")) for r in records)
    return {"strategy_latency": None,
            "est_vs_measured": None if has_est else "no step has an estimated latency",
            "rank_busy": None if has_busy else "no step has rank_busy_s",
            "loss": None if has_loss else "no step has a finite loss",
            "overheads": None if has_over else "no step has planner_wait_s or switch_s"}


_DRAW = {"strategy_latency": (_plot_strategy_latency, (9, 4.2)),
         "est_vs_measured": (_plot_est_vs_measured, (10, 4.2)),
         "rank_busy": (_plot_rank_busy, (9, 6)),
         "loss": (_plot_loss, (7, 4)),
         "overheads": (_plot_overheads, (8, 3.6))}


def write_plots(records: Sequence[dict], out_dir: Union[str, Path],
                formats: Sequence[str] = FORMATS) -> PlotResult:
    """Draw every figure the records allow into ``out_dir`` as ``NAME.FORMAT``; returns what was
    written and what was skipped (with the reason)."""
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise HGraphError(f"plot formats {list(formats)}: allowed are {', '.join(FORMATS)}")
    if not records:
        raise HGraphError("no steps to plot")
    figure = _figure_class()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = sorted(records, key=lambda r: r["step"])
    result = PlotResult()
    for name, reason in _needs(records).items():
        if reason is not None:
            result.skipped[name] = reason
            continue
        draw, size = _DRAW[name]
        fig = figure(figsize=size, dpi=110, layout="constrained")
        draw(fig, records)
        for fmt in formats:
            path = out_dir / f"{name}.{fmt}"
            fig.savefig(path, format=fmt)
            result.files.append(path)
    return result
