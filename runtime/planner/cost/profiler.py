"""Measuring a cost profile on this machine by dual-layer profiling (DCP).

For each sequence length ``l`` the model is built with 1 and with 2 decoder layers and one
forward + backward on ``[1, l]`` tokens is timed (fastest of ``repeats`` interleaved runs after a
warm-up); the
difference is the cost of one decoder layer, the 1-layer time minus that is the rest (embedding,
final norm, head, loss). A stage of ``<TP1, PP>`` holds ``ceil(layers / PP)`` layers plus the rest
(the first or last stage, the slowest), so ``T(l) = ceil(layers/PP) * layer(l) + rest(l)`` and
``a, b, c`` are fitted by least squares.

Memory: ``A`` (activation bytes per token per layer, per hidden/TP) is *measured* by counting the
bytes of the tensors autograd saves for backward (``saved_tensors_hooks``, distinct storages) with 1
and 2 layers; the model-state constant ``B`` and ``alpha`` are *derived* from the parameter count
(16 bytes per parameter under mixed-precision Adam, 12 of them sharded), as in the analytic prior.
Only TP=1 schemes can be measured in one process; TP/CP > 1 needs the multi-process runtime.

A check closes the measurement: the whole model (all its layers) is timed at the longest length with
the same threads and set beside what the profile predicts for it (``whole_model_check``). On a CPU
shared with other processes, intra-op threads wait for each other at every op (a thread that is
descheduled holds the others): ``llama:tiny``'s layers timed 40-430 ms each with 2 threads on a loaded
2-core machine, against ~2-8 ms with 1, so ``hgraph profile`` times with the threads one rank of a
local run has, and the check says when the figures still disagree.

The host link (what activation offload copies over, ``schedule.offload``) is measured on the
profiled device: device to pinned host memory and back on CUDA, a memcpy on CPU
(``measure_host_link``); the analytic prior assumes an A800 node's PCIe Gen4 (~25 GB/s).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from hgraph.errors import HGraphError
from hgraph.runtime.planner.cost.cost_model import CostModel, MemoryModel, ModelShape
from hgraph.runtime.planner.cost.fit import fit_coefficients
from hgraph.runtime.planner.schedule.offload import HOST_LINK_KEY
from hgraph.strategy import Scheme

UTIL_EFFICIENCY = 0.85  # App. C threshold: UtilLen is where the constant overhead is 15% of the time


@dataclass
class LayerTimings:
    """Per length: milliseconds of one decoder layer and of the rest of the model (fwd + bwd)."""

    lengths: list[int]
    layer_ms: list[float]
    rest_ms: list[float]


def fwd_bwd_ms(model, ids) -> float:
    """ms of one forward + backward of ``model`` on ``ids`` (next-token loss); on CUDA from the
    device's idle to the end of its work, not just the launches."""
    model.zero_grad(set_to_none=True)
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    t0 = time.perf_counter()
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    return (time.perf_counter() - t0) * 1e3


def _time_pair(one, two, length: int, vocab: int, repeats: int, warmup: int) -> tuple[float, float]:
    """Fastest of ``repeats`` runs of each model, the two interleaved so that a busy machine
    slows both alike; the minimum is the run least disturbed by other processes."""
    ids = torch.randint(0, vocab, (1, length))
    for _ in range(warmup):
        fwd_bwd_ms(one, ids)
        fwd_bwd_ms(two, ids)
    t1, t2 = [], []
    for _ in range(repeats):
        t1.append(fwd_bwd_ms(one, ids))
        t2.append(fwd_bwd_ms(two, ids))
    return min(t1), min(t2)


def _saved_bytes(model, length: int, vocab: int) -> int:
    """Bytes of the distinct tensors autograd saves for backward in one forward pass."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t):
        try:
            key = (t.untyped_storage().data_ptr(), t.device.index or 0)
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, vocab, (1, length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    del loss
    return sum(n for (ptr, _), n in seen.items() if ptr not in params)


def dual_layer_timings(build: Callable[[int], Any], lengths: Sequence[int], vocab: int, *, repeats: int = 10,
                       warmup: int = 2, threads: int | None = None) -> LayerTimings:
    """Time a 1-layer and a 2-layer model (``build(num_layers)``) on every length.

    ``threads`` sets torch's intra-op threads while timing (restored afterwards).
    """
    torch.manual_seed(0)
    one, two = build(1), build(2)
    layer, rest = [], []
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for l in lengths:
            t1, t2 = _time_pair(one, two, l, vocab, repeats, warmup)
            per_layer = max(t2 - t1, 0.0)  # noise can make a tiny layer look free; never negative
            layer.append(per_layer)
            rest.append(max(t1 - per_layer, 0.0))
    finally:
        torch.set_num_threads(before)
    return LayerTimings(list(lengths), layer, rest)


def whole_model_check(build: Callable[[int], Any], layers: int, timings: LayerTimings, vocab: int, *,
                      repeats: int = 10, warmup: int = 2, threads: int | None = None) -> dict[str, Any]:
    """The ``layers``-layer model timed (fastest of ``repeats``) at the longest profiled length, beside
    the profile's prediction ``layers * layer(l) + rest(l)``: ``{"length", "layers", "measured_ms",
    "predicted_ms", "ratio"}`` (predicted / measured)."""
    i = max(range(len(timings.lengths)), key=timings.lengths.__getitem__)
    length = timings.lengths[i]
    torch.manual_seed(0)
    model = build(layers)
    ids = torch.randint(0, vocab, (1, length))
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for _ in range(warmup):
            fwd_bwd_ms(model, ids)
        measured = min(fwd_bwd_ms(model, ids) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    predicted = layers * timings.layer_ms[i] + timings.rest_ms[i]
    return {"length": length, "layers": layers, "measured_ms": measured, "predicted_ms": predicted,
            "ratio": predicted / measured if measured > 0 else float("inf")}


def measure_host_link(device: Any = "cpu", nbytes: int = 64 * 2 ** 20, repeats: int = 5) -> dict[str, Any]:
    """The host link's bandwidth on ``device`` (bytes/s), as activation offload uses it: on CUDA a
    device tensor copied to pinned host memory and back (fastest of ``repeats`` each way; the slower
    direction is the figure); on CPU the device is host memory, so a memcpy between two buffers."""
    device = torch.device(device)
    if nbytes < 1 or repeats < 1:
        raise HGraphError(f"measure_host_link: nbytes and repeats must be positive, got {nbytes}, {repeats}")
    cuda = device.type == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)

    def fastest(dst: torch.Tensor, source: torch.Tensor) -> float:
        dst.copy_(source, non_blocking=cuda)          # warm-up (first touch of the pages)
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(source, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return nbytes / max(min(times), 1e-9)

    to_host = fastest(host, src)
    to_device = fastest(src, host)
    what = (f"measured on {device} (pinned host memory, {nbytes} bytes, fastest of {repeats} each way)"
            if cuda else f"measured on the CPU: a memcpy of {nbytes} bytes (the device is host memory)")
    return {"bytes_per_s": min(to_host, to_device), "to_host_bytes_per_s": to_host,
            "to_device_bytes_per_s": to_device, "source": what}


def measure_activation_coeff(build: Callable[[int], Any], hidden: int, vocab: int, length: int = 256) -> float:
    """``A``: activation bytes saved per token per layer, divided by the hidden size (TP = 1)."""
    one, two = build(1), build(2)
    per_layer = _saved_bytes(two, length, vocab) - _saved_bytes(one, length, vocab)
    if per_layer <= 0:
        raise HGraphError("could not measure activation memory: the 2-layer model saved no more than the 1-layer one")
    return per_layer / length / hidden


def profile_cost_model(name: str, build: Callable[[int], Any], *, hidden: int, layers: int, vocab: int,
                       params_per_layer: int, schemes: Sequence[Scheme], lengths: Sequence[int],
                       repeats: int = 10, warmup: int = 2, threads: int | None = None, gpu_memory_bytes: int = 80 * 2 ** 30,
                       framework_gap_bytes: int = 5 * 2 ** 30, safety_margin_bytes: int = 6 * 2 ** 30,
                       device: str = "cpu") -> tuple[CostModel, dict[str, Any]]:
    """Measure ``a, b, c`` per scheme and the memory constants; return the model and the raw data."""
    for s in schemes:
        if s.tp != 1 or s.seq != 1:
            raise HGraphError(
                f"cannot profile {s} in one process: TP, CP or UL > 1 needs multi-process profiling through the "
                "runtime, which is not built yet; profile TP1 schemes (TP1PP<n>)")
    if len(set(lengths)) < 3:
        raise HGraphError(f"profiling needs at least 3 distinct lengths to fit a*l^2 + b*l + c, got {list(lengths)}")
    timings = dual_layer_timings(build, lengths, vocab, repeats=repeats, warmup=warmup, threads=threads)
    profiled: dict[tuple[int, int, int], tuple[float, float, float]] = {}
    points: dict[str, list[list[float]]] = {}
    for s in schemes:
        stage_layers = math.ceil(layers / s.pp)
        pts = [(l, stage_layers * lay + rest) for l, lay, rest in zip(timings.lengths, timings.layer_ms, timings.rest_ms)]
        points[str(s)] = [[float(l), float(t)] for l, t in pts]
        profiled[(s.tp, s.pp, s.cp)] = fit_coefficients(pts)
    A = measure_activation_coeff(build, hidden, vocab)
    check = whole_model_check(build, layers, timings, vocab, repeats=repeats, warmup=warmup, threads=threads)
    base = profiled.get((1, 1, 1)) or next(iter(profiled.values()))
    a, b, c = base
    util = int(math.ceil(c * UTIL_EFFICIENCY / ((1 - UTIL_EFFICIENCY) * b))) if b > 0 else max(lengths)
    memory = MemoryModel(
        activation_coeff=((1, A),),
        state_coeff=params_per_layer / hidden ** 2 * 16,
        alpha=12 / 16,
        framework_gap_bytes=framework_gap_bytes,
        safety_margin_bytes=safety_margin_bytes,
        gpu_memory_bytes=gpu_memory_bytes,
    )
    raw = {"method": "dual-layer (Data-Centric Parallel paper): 1- and 2-layer models, forward+backward, fastest of interleaved repeats",
           "device": device, "lengths": list(map(int, lengths)), "repeats": repeats, "threads": threads,
           "layer_ms": timings.layer_ms, "rest_ms": timings.rest_ms, "points": points, "check": check,
           "memory_source": "A measured by counting saved tensors (1 vs 2 layers); B and alpha derived from the "
                            "parameter count (16 bytes/parameter, 12 sharded)"}
    cost = CostModel(name=name, model=ModelShape(hidden, layers, vocab), profiled=profiled,
                     util_len_tokens={1: max(util, 1)}, memory=memory, world_size=max(s.num_ranks for s in schemes),
                     gpus_per_node=1, extra={"cluster": {"gpu": device, "gpus_per_node": 1}, "profiling": raw,
                                             HOST_LINK_KEY: measure_host_link(device.split()[0])})
    return cost, raw
