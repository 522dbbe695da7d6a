"""A cost model of *this* machine, measured by the ranks of a run at its start (``--profile measure``),
and the online correction of its estimates from the steps measured so far.

``calibrate_cost_model`` runs on every rank at once, so the timings include the contention of the
training itself (on a CPU machine, N rank processes share the cores exactly as they will in training):

* compute: dual-layer timing (a 1- and a 2-layer copy of the model, forward + backward on one
  sequence, ``interleaved_layer_timings``) at a few lengths, for every TP degree on one TP rank's
  shard of the model (heads, MLP width and vocabulary divided by TP); each rank measures, the median
  over ranks is fitted to ``layer_TP(l)`` and ``rest_TP(l)`` (embedding, head, loss) as
  ``a l^2 + b l + c``;
* tensor parallelism: all-reduce of ``l x hidden`` activations inside every TP group of each TP degree
  (all groups at once, each after an MLP shard's matmuls), fitted to ``alpha + beta l``; a TP stage
  pays it once per TP slot of its layers (the model's ``tp_enter`` + ``tp_exit`` slots: all-reduce in
  backward or forward);
* pipeline parallelism: send/recv of ``l x hidden`` between neighbour ranks, fitted the same way; a
  stage pays one forward and one backward transfer per micro-batch;
* Push Gradient: the reduction of fp32 gradients over all ranks as the runtime runs it (gloo: an
  all-to-all, ``runtime/comm/grad_buckets``; else a reduce-scatter) at two sizes, fitted to a
  latency and a bandwidth: the model's ``push`` (``cost.push``: only its part the last backward does
  not hide is priced);
* Ulysses, when asked (``ul_degrees``): all-to-all of ``l x hidden`` inside every group of ``UL``
  consecutive ranks (``measure_ul_comm``), fitted the same way and read as the latency and bytes per
  second of ``ulysses.AllToAll`` (the slowest degree's: a conservative figure for all); the model's
  Ulysses schemes are derived from the measured ``<TP, PP>`` with it (``cost.ulysses``), up to the
  largest degree measured. ``measured_cost_model`` asks for it on a GPU only: ranks that share CPU
  cores do not run ``1/UL`` of the work each ``UL`` times faster, as CP showed below;
* expert parallelism, for a MoE model (``ep_degrees``): the dispatch all-to-all of the token rows,
  ``k`` copies of ``l x hidden``, inside every group of ``EP`` consecutive ranks (``measure_ep_comm``,
  on any device: it times an exchange, not a split of compute), read the same way as the model's
  ``ep_all_to_all`` (``cost.moe_cost``: the EP schemes' all-to-all terms).

Context parallelism is not timed, and the GPU rule that derives CP schemes from ``<TP, PP>`` (compute
divided by CP) is far off on CPU (measured: 1xTP1PP1CP4 2.5x slower than 4xTP1PP1 where it predicted
4x faster), so the measured model has no CP schemes. A scheme ``<TP, PP>`` then gets
``T(l) = ceil(layers/PP) * (layer_TP(l) + tp_comm(l)) + rest_TP(l) + pp_comm(l)`` (the slowest stage
holds the rest). Memory and MaxLen come from the analytic prior.

What the model leaves out on purpose: the pull / optimizer phases of a step and the per-document
cost of varlen attention; ``StepCorrection`` scales every estimate by the median ratio measured/estimate
of the last steps (the same factor for every strategy, so it never changes the planner's choice).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.torch_compat import reduce_scatter_single
from hgraph.runtime.comm import p2p
from hgraph.runtime.planner.cost.cost_model import CostModel
from hgraph.runtime.planner.cost.fit import fit_coefficients
from hgraph.runtime.planner.cost.profiler import fwd_bwd_ms
from hgraph.runtime.planner.cost.push import PushModel
from hgraph.runtime.planner.cost.ulysses import AllToAll

DEFAULT_LENGTHS = (64, 256, 512, 1024)
COMM_LENGTHS = (64, 1024)
PUSH_BYTES = (256 * 1024, 2 * 1024 * 1024)     # a rank's reduction input, timed (fp32)
GPU_LONGEST = 16384          # the longest sequence timed on a GPU (the model's context if shorter)


def calibration_lengths(device: Any, max_seq_len: int) -> tuple[int, ...]:
    """The sequence lengths the compute is timed at on ``device``. A CPU is compute-bound from a few
    tokens on (``DEFAULT_LENGTHS``); a GPU is not below thousands: a layer took 1.6-2.1 ms at every
    length from 64 to 1024 on an H200 (1.1B, bf16), so a line through those points put a 16K-token
    step at 47 ms where it took 290. There the lengths are an eighth, a quarter, a half and all of
    the model's context (at most ``GPU_LONGEST``), where the planner's micro-batches are."""
    if torch.device(device or "cpu").type != "cuda":
        return DEFAULT_LENGTHS
    longest = min(int(max_seq_len), GPU_LONGEST)
    return tuple(sorted({max(longest // d, 3) for d in (8, 4, 2, 1)}))


def _median_rows(rows: Sequence[Sequence[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*rows)]


def _fit_line(lengths: Sequence[int], ms: Sequence[float]) -> tuple[float, float]:
    """``alpha + beta l`` through two or more points (least squares, both kept >= 0)."""
    (l0, t0), (l1, t1) = (lengths[0], ms[0]), (lengths[-1], ms[-1])
    beta = max((t1 - t0) / (l1 - l0), 0.0) if l1 != l0 else 0.0
    alpha = max(statistics.mean(t - beta * l for l, t in zip(lengths, ms)), 0.0)
    return alpha, beta


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_comm(fn: Callable[[], None], repeats: int, work: Optional[Callable[[], Any]] = None,
               device: torch.device = torch.device("cpu")) -> float:
    """Median ms of ``fn()``; ``work()`` (untimed) runs before each call, so the time includes the
    wait for peers that were descheduled or slower in their own work, as between a layer's ops."""
    fn()                                                # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        if work is not None:
            work()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _consecutive_group(size: int, rank: int, world_size: int, groups: Any) -> Any:
    """This rank's group of ``size`` consecutive ranks (all such groups are created, collectively), or
    None for a rank outside every group (it waits at the barrier the others reach when done)."""
    members = [list(range(g, g + size)) for g in range(0, world_size - size + 1, size)]
    groups.ensure(members)
    mine = next((m for m in members if rank in m), None)
    if mine is None:
        dist.barrier()
        return None
    return groups.get(mine)


def measure_tp_comm(tp: int, rank: int, world_size: int, hidden: int, groups: Any, dtype: Any,
                    repeats: int, device: torch.device = torch.device("cpu")) -> Optional[list[float]]:
    """ms of one all-reduce of ``l x hidden`` per ``COMM_LENGTHS`` inside this rank's TP group of
    ``tp`` consecutive ranks (every group at once; collective: call on every rank)."""
    group = _consecutive_group(tp, rank, world_size, groups)
    if group is None:
        return None
    out = []
    for l in COMM_LENGTHS:
        x = torch.ones(l, hidden, dtype=dtype, device=device)
        # an MLP shard's matmuls between the all-reduces, as in a TP layer: on shared cores the
        # all-reduce mostly waits for the peer (measured alone it was ~0.5 ms, and TP2 estimated
        # 2-5x too fast)
        w = torch.randn(hidden, max(4 * hidden // tp, 1), dtype=dtype, device=device)
        out.append(_time_comm(lambda: dist.all_reduce(x, group=group), repeats,
                              work=lambda: torch.tanh(x @ w) @ w.T, device=device))
    dist.barrier()
    return out


def measure_pp_comm(rank: int, world_size: int, hidden: int, dtype: Any, repeats: int,
                    device: torch.device = torch.device("cpu")) -> Optional[list[float]]:
    """ms of one send/recv of ``l x hidden`` between ranks 2i and 2i+1 (all pairs at once); the
    receiver's time (which includes the transfer) is returned on the odd rank."""
    pairs = world_size // 2 * 2
    if rank >= pairs:
        dist.barrier()
        return None
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    out = []
    for l in COMM_LENGTHS:
        x = torch.ones(l, hidden, dtype=dtype, device=device)
        stage = p2p.host_staged(device)          # ranks sharing a GPU over gloo
        op = ((lambda: p2p.isend(x, peer, stage=stage).wait()) if rank % 2 == 0
              else (lambda: p2p.irecv(x, peer, stage=stage).wait()))
        out.append(_time_comm(op, repeats, device=device))
    dist.barrier()
    return out if rank % 2 == 1 else None


def measure_ul_comm(ul: int, rank: int, world_size: int, hidden: int, groups: Any, dtype: Any, repeats: int,
                    device: torch.device = torch.device("cpu"), rows_per_token: int = 1) -> Optional[list[float]]:
    """ms of one all-to-all of ``rows x hidden`` per ``COMM_LENGTHS`` (``rows``: ``rows_per_token`` rows
    a token, rounded up to a multiple of ``ul``) inside this rank's group of ``ul`` consecutive ranks
    (every group at once; collective: call on every rank). Ranks outside every group return None."""
    group = _consecutive_group(ul, rank, world_size, groups)
    if group is None:
        return None
    out = []
    for l in COMM_LENGTHS:
        x = torch.ones(ep_rows(l, rows_per_token, ul), hidden, dtype=dtype, device=device)
        y = torch.empty_like(x)
        out.append(_time_comm(lambda: dist.all_to_all_single(y, x, group=group), repeats, device=device))
    dist.barrier()
    return out


def measure_ep_comm(ep: int, top_k: int, rank: int, world_size: int, hidden: int, groups: Any, dtype: Any,
                    repeats: int, device: torch.device = torch.device("cpu")) -> Optional[list[float]]:
    """ms of one dispatch all-to-all of the ``top_k`` copies of ``l`` token rows per ``COMM_LENGTHS``
    (``ep_rows``) inside this rank's group of ``ep`` consecutive ranks (every group at once;
    collective: call on every rank). Ranks outside every group return None."""
    return measure_ul_comm(ep, rank, world_size, hidden, groups, dtype, repeats, device, rows_per_token=top_k)


def ep_rows(length: int, top_k: int, ep: int) -> int:
    """The rows an EP all-to-all of ``length`` tokens exchanges: ``top_k`` copies, rounded up to ``ep``."""
    return -(-length * top_k // ep) * ep


def measure_expert_all_to_all(degrees: Sequence[int], top_k: int, rank: int, world_size: int, hidden: int,
                              groups: Any, dtype: Any, repeats: int, device: torch.device,
                              say: Callable[[str], None]) -> tuple[dict[int, list[float]], Optional[AllToAll]]:
    """The EP all-to-all timed for each degree in ``degrees`` (2..world size) and read as an ``AllToAll``
    (``all_to_all_model``; None when no degree is timed); collective: call on every rank."""
    raw: dict[int, list[float]] = {}
    lines: dict[int, tuple[float, float]] = {}
    for ep in sorted({n for n in degrees if 1 < n <= world_size}):
        say(f"all-to-all EP{ep}")
        ms = [r for r in _all_gather(measure_ep_comm(ep, top_k, rank, world_size, hidden, groups, dtype, repeats,
                                                     device)) if r is not None]
        raw[ep] = _median_rows(ms)
        lines[ep] = _fit_line([ep_rows(l, top_k, ep) for l in COMM_LENGTHS], raw[ep])
    if not lines:
        return raw, None
    comm = all_to_all_model(lines, hidden, torch.empty((), dtype=dtype).element_size())
    return raw, dataclasses.replace(comm, source=comm.source.replace("UL", "EP"))


def measure_push_comm(rank: int, world_size: int, repeats: int,
                      device: torch.device = torch.device("cpu")) -> list[float]:
    """ms of one reduction over all ranks of ``PUSH_BYTES`` of fp32 gradients per rank, as Push Gradient
    runs it (gloo: all-to-all then a local sum; else reduce-scatter; collective: call on every rank)."""
    out = []
    for size in PUSH_BYTES:
        n = max(size // 4 // world_size, 1)
        x = torch.ones(world_size, n, dtype=torch.float32, device=device)
        gloo = dist.get_backend() == "gloo"
        y = torch.empty_like(x) if gloo else torch.empty(n, dtype=torch.float32, device=device)

        def reduce() -> None:
            if gloo:
                dist.all_to_all_single(y, x)
                y.sum(0)
            else:
                reduce_scatter_single(y, x.view(-1))
        out.append(_time_comm(reduce, repeats, device=device))
    dist.barrier()
    return out


def push_model(line: tuple[float, float]) -> PushModel:
    """``PushModel`` from the fitted ``(alpha ms, beta ms per byte)`` of ``measure_push_comm``."""
    alpha, beta = line
    return PushModel(bandwidth=1e3 / beta if beta > 0 else 1e15, latency_ms=alpha)


def all_to_all_model(lines: dict[int, tuple[float, float]], hidden: int, bytes_per_element: int) -> AllToAll:
    """``AllToAll`` from ``{ul: (alpha ms, beta ms per row of hidden values)}``: per degree a row sends
    ``(ul - 1) / ul`` of its bytes; the slowest bandwidth and the largest latency of the degrees."""
    rates = [hidden * bytes_per_element * (ul - 1) / ul / (beta / 1e3) if beta > 0 else math.inf
             for ul, (_, beta) in lines.items()]
    rate = min(rates)
    rate = rate if math.isfinite(rate) else 1e15       # too fast to see at these sizes: latency only
    latency = max(alpha for alpha, _ in lines.values())
    return AllToAll(latency, rate, rate, bytes_per_element, "measured at the start of the run (all-to-all of "
                    f"UL{', UL'.join(map(str, sorted(lines)))})")


def interleaved_layer_timings(build: Callable[[int, int], Any], tps: Sequence[int], lengths: Sequence[int],
                              vocab: int, repeats: int, *, warmup: int = 1, device: Any = "cpu",
                              dtype: Any = torch.float32) -> dict[int, tuple[list[float], list[float]]]:
    """Per TP degree, ms of one decoder layer and of the rest at each length, forward + backward on one
    rank's shard (``build(n, tp)``: ``n`` layers), on ``device`` in ``dtype`` (what the run trains on).

    Every model runs ``warmup`` untimed rounds at each length before any timed one: a first call
    (a kernel's first launch, the allocator's growth, cuBLAS's choice for a new shape, a compile) is
    never timed.

    Why not ``profiler.dual_layer_timings`` per degree: on a loaded machine the load changes between
    two phases, and a layer's time is a difference of two timings. Here every repeat runs the 1- and
    the 2-layer model of every degree back to back (round robin), the layer is the median of the
    paired differences and the rest the median 1-layer time minus it; medians, not minima, because
    ranks that share cores are slowed for the whole step (measured: the minimum was ~2.5x too low).
    """
    torch.manual_seed(0)
    models = {tp: (build(1, tp).to(device=device, dtype=dtype), build(2, tp).to(device=device, dtype=dtype))
              for tp in tps}
    out: dict[int, tuple[list[float], list[float]]] = {tp: ([], []) for tp in tps}
    for length in lengths:
        diffs: dict[int, list[float]] = {tp: [] for tp in tps}
        ones: dict[int, list[float]] = {tp: [] for tp in tps}
        ids = {tp: torch.randint(0, -(-vocab // tp), (1, length)).to(device) for tp in tps}
        for _ in range(warmup):
            for tp in tps:
                for m in models[tp]:
                    fwd_bwd_ms(m, ids[tp])
        for _ in range(repeats):
            for tp in tps:
                one, two = models[tp]
                t1, t2 = fwd_bwd_ms(one, ids[tp]), fwd_bwd_ms(two, ids[tp])
                diffs[tp].append(t2 - t1)
                ones[tp].append(t1)
        for tp in tps:
            lay = max(statistics.median(diffs[tp]), 0.0)
            out[tp][0].append(lay)
            out[tp][1].append(max(statistics.median(ones[tp]) - lay, 0.0))
    return out


def calibration_phases(prior: CostModel, world_size: int, ul_degrees: Sequence[int] = (),
                       ep_degrees: Sequence[int] = ()) -> int:
    """How many ``progress`` calls ``calibrate_cost_model`` makes (for a progress bar's total)."""
    tps = {tp for tp, _, _ in prior.profiled}
    pps = {pp for _, pp, _ in prior.profiled}
    multi = world_size > 1
    return 1 + (len(tps - {1}) if multi else 0) + (1 if multi and max(pps) > 1 else 0) + (1 if multi else 0) \
        + (len([u for u in set(ul_degrees) if 1 < u <= world_size]) if multi else 0) \
        + (len([n for n in set(ep_degrees) if 1 < n <= world_size]) if multi else 0)


def calibrate_cost_model(prior: CostModel, model_config: Any, build: Callable[[int], Any], rank: int,
                         world_size: int, groups: Any = None, *, tp_slots: int = 0, dtype: Any = None,
                         lengths: Optional[Sequence[int]] = None, repeats: int = 5,
                         progress: Optional[Callable[[str], None]] = None,
                         device: Any = None, ul_degrees: Sequence[int] = (),
                         ep_degrees: Sequence[int] = ()) -> tuple[CostModel, dict]:
    """The cost model of this machine for the schemes of ``prior`` (collective: call on every rank;
    every rank returns the same model). ``build(n, tp)``: a model with ``n`` layers of one TP rank's
    shard (``tp`` 1: the model's own layers);
    ``tp_slots``: the model's TP communication points (one all-reduce each per step and token pass);
    ``device``, ``dtype``: where and in what the run trains (CPU, fp32 by default), which is what is timed.
    ``lengths``: the sequence lengths timed (default: ``calibration_lengths`` of the device).
    ``ul_degrees``: the Ulysses degrees whose all-to-all is timed (none: the model has no UL scheme);
    ``ep_degrees``: the EP degrees whose dispatch all-to-all is timed (a MoE prior's, ``moe_cost``).
    Returns the model and the raw measurements."""
    dtype = dtype or torch.float32
    device = torch.device(device or "cpu")
    hidden, layers, vocab = prior.model.hidden, prior.model.layers, prior.model.vocab
    if lengths is None:
        lengths = calibration_lengths(device, getattr(model_config, "max_seq_len", max(DEFAULT_LENGTHS)))
    lengths = [int(l) for l in lengths if l <= max(getattr(model_config, "max_seq_len", max(lengths)), 3)]
    if len(set(lengths)) < 3:
        raise HGraphError(f"calibration needs 3 distinct lengths up to the model's context, got {lengths}")
    say = progress or (lambda _text: None)
    tps = sorted({tp for tp, _, _ in prior.profiled})
    pps = sorted({pp for _, pp, _ in prior.profiled})
    raw: dict[str, Any] = {"lengths": lengths, "layer_ms": {}, "rest_ms": {}, "tp_comm_ms": {},
                           "pp_comm_ms": None, "repeats": repeats, "ranks": world_size,
                           "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    layer: dict[int, tuple[float, float, float]] = {}
    rest: dict[int, tuple[float, float, float]] = {}
    say("compute " + ", ".join(f"TP{tp}" for tp in tps))
    timed = interleaved_layer_timings(build, tps, lengths, vocab, repeats, device=device, dtype=dtype)
    rows = _all_gather(timed)
    for tp in tps:
        raw["layer_ms"][tp] = _median_rows([r[tp][0] for r in rows])
        raw["rest_ms"][tp] = _median_rows([r[tp][1] for r in rows])
        layer[tp] = fit_coefficients(list(zip(lengths, raw["layer_ms"][tp])))
        rest[tp] = fit_coefficients(list(zip(lengths, raw["rest_ms"][tp])))
    tp_line: dict[int, tuple[float, float]] = {1: (0.0, 0.0)}
    multi = dist.is_initialized() and world_size > 1
    for tp in tps:
        if tp == 1 or not multi:
            continue
        say(f"all-reduce TP{tp}")
        timed_tp = measure_tp_comm(tp, rank, world_size, hidden, groups, dtype, repeats, device)
        ms = [r for r in _all_gather(timed_tp) if r is not None]
        med = _median_rows(ms)
        raw["tp_comm_ms"][tp] = med
        tp_line[tp] = _fit_line(COMM_LENGTHS, med)
    pp_line = (0.0, 0.0)
    if multi and max(pps) > 1:
        say("send/recv PP")
        ms = [r for r in _all_gather(measure_pp_comm(rank, world_size, hidden, dtype, repeats, device))
              if r is not None]
        med = _median_rows(ms)
        raw["pp_comm_ms"] = med
        pp_line = _fit_line(COMM_LENGTHS, med)
    push = None
    if multi:
        say("push (all ranks)")
        raw["push_comm_ms"] = _median_rows(_all_gather(measure_push_comm(rank, world_size, repeats, device)))
        push = push_model(_fit_line(PUSH_BYTES, raw["push_comm_ms"]))
    ul_lines: dict[int, tuple[float, float]] = {}
    for ul in sorted({u for u in ul_degrees if 1 < u <= world_size}) if multi else ():
        say(f"all-to-all UL{ul}")
        ms = [r for r in _all_gather(measure_ul_comm(ul, rank, world_size, hidden, groups, dtype, repeats, device))
              if r is not None]
        med = _median_rows(ms)
        raw.setdefault("ul_comm_ms", {})[ul] = med
        ul_lines[ul] = _fit_line([-(-l // ul) * ul for l in COMM_LENGTHS], med)
    all_to_all = all_to_all_model(ul_lines, hidden, torch.empty((), dtype=dtype).element_size()) if ul_lines else None
    experts = prior.model.experts
    ep_all_to_all = None
    if multi and experts is not None and ep_degrees:
        raw["ep_comm_ms"], ep_all_to_all = measure_expert_all_to_all(ep_degrees, experts.top_k, rank, world_size,
                                                                     hidden, groups, dtype, repeats, device, say)
    profiled: dict[tuple[int, int, int], tuple[float, float, float]] = {}
    per_layer_slots = tp_slots / layers if layers else 0.0
    for (tp, pp, cp) in prior.profiled:
        if cp != 1 or tp not in tp_line or tp not in layer:
            continue
        stage = math.ceil(layers / pp)
        ta, tb = tp_line[tp]
        pa, pb = pp_line if pp > 1 else (0.0, 0.0)
        (la, lb, lc), (ra, rb, rc) = layer[tp], rest[tp]
        a = stage * la + ra
        b = stage * lb + rb + stage * per_layer_slots * tb + 2 * pb
        c = stage * lc + rc + stage * per_layer_slots * ta + 2 * pa
        profiled[(tp, pp, 1)] = (a, b, c)
    util = {}
    for tp in tps:
        a, b, c = profiled.get((tp, 1, 1)) or next(v for k, v in profiled.items() if k[0] == tp)
        util[tp] = max(int(math.ceil(c * 0.85 / (0.15 * b))) if b > 0 else max(lengths), 1)
    cost = CostModel(name="measured", model=prior.model, profiled=profiled, util_len_tokens=util,
                     memory=prior.memory, world_size=prior.world_size, gpus_per_node=prior.gpus_per_node,
                     max_cp=1, all_to_all=all_to_all, max_ul=max(ul_lines, default=1), push=push,
                     ep_all_to_all=ep_all_to_all, max_ep=max(raw.get("ep_comm_ms", {}), default=1),
                     extra={"source": "measured at the start of the run (hgraph.runtime.planner.cost.calibration)",
                            "calibration": raw})
    return cost, raw


class StepCorrection:
    """Scales the cost model's estimate by the median of measured/estimated over the last ``window``
    steps (1 before any step). Steps that compiled a program (cache miss) are not counted."""

    def __init__(self, window: int = 8) -> None:
        self.ratios: deque[float] = deque(maxlen=window)

    @property
    def factor(self) -> float:
        return statistics.median(self.ratios) if self.ratios else 1.0

    def observe(self, est_ms: float, measured_ms: float) -> None:
        if est_ms > 0 and measured_ms > 0 and math.isfinite(measured_ms):
            self.ratios.append(measured_ms / est_ms)


def scaled_plan(plan: Any, factor: float) -> Any:
    """A copy of ``plan`` with every estimate multiplied by ``factor``."""
    if factor == 1.0:
        return plan
    pipes = [dataclasses.replace(p, est_latency_ms=p.est_latency_ms * factor) for p in plan.pipelines]
    return dataclasses.replace(plan, pipelines=pipes, est_latency_ms=plan.est_latency_ms * factor)
