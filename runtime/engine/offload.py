"""Activation offload: a block's saved tensors kept in host memory from its forward to its backward,
the sibling of recomputation (``engine.recompute``) as a way of taking a layer's stash off the device.

A block chosen for offload in a micro-batch (``recompute.run_block``, when its layer is in the
micro-batch's ``MicroBatchOffload.layers``) runs under ``saved_tensors_hooks`` that copy every tensor
autograd saves into a host buffer and keep only that buffer: the device tensor is dropped with the
forward's other temporaries, so it leaves the device-side saved set (the activation meter never sees
it) and its bytes are counted on the host (``HostOffload.live_bytes``). When the block's backward
starts (the gradient of one of its outputs arrives) its tensors, and those of the offloaded block
below it, are brought back; autograd's unpack takes them.

On CUDA the host buffers are pinned; both copies run on a side stream (``non_blocking``), ordered
after the compute stream's producer by ``wait_stream``, with ``record_stream`` so the allocator does
not reuse a device block a copy still reads, and an event the compute stream waits for before it
uses a tensor brought back. On CPU the device is host memory: the copy into the host buffer is the
same (the path is one), the streams and events are absent, and bringing back is the host buffer
itself. Copies keep values and strides, so an offloaded run is bitwise the run without offload.

What stays on the device (passed to the activation meter like any saved tensor): the working
parameters and views of them (the meter's excluded storages: they live anyway), tensors smaller than
``min_bytes`` of storage (1 KiB by default: a norm's per-token statistics, scalars, whose copies
would cost more in launches than they free; a small view of a larger storage goes with its
storage), expanded tensors (a stride 0 over a longer dimension: a copy would materialise them),
tensors of other devices (the fake tensors of memory counting), and any tensor whose copy would
pass the rank's host budget.
"""
from __future__ import annotations

import math
import os
import weakref
from typing import Any, ContextManager, Optional, Union

import torch
from torch.multiprocessing.reductions import StorageWeakRef

OFFLOAD_MODES = ("off", "on", "auto")
DEFAULT_MIN_BYTES = 1024
# the host link of an A800-class node, PCIe Gen4 x16: ~25 GB/s each way (a prior; the profiler
# measures the run's own device: ``planner.cost.profiler.measure_host_link``)
DEFAULT_HOST_LINK_BYTES_PER_S = 25e9
DEFAULT_HOST_FRACTION = 0.5        # of the host's RAM, shared by the ranks on it


def rank_host_budget(given: Optional[float], gpus_per_node: int, world_size: int,
                     fraction: float = DEFAULT_HOST_FRACTION) -> float:
    """Host bytes one rank may hold offloaded: ``given`` (``--host-memory-budget``), else ``fraction``
    of the host's RAM over the ranks on it (a node's GPUs, or the whole run where it is smaller)."""
    if given is not None:
        return float(given)
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return math.inf               # a host that does not say: only the flag bounds it
    return fraction * ram / max(min(gpus_per_node, world_size), 1)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A storage as a flat byte tensor (every byte of it, whatever views were saved)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _HostCopy:
    """One offloaded storage: its host bytes and, once brought back, its device bytes."""

    __slots__ = ("host", "device", "back", "ready", "owner", "nbytes", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, owner: "HostOffload") -> None:
        self.host, self.device, self.owner = host, device, owner
        self.back: Optional[torch.Tensor] = None
        self.ready: Any = None                   # the CUDA event the copy back recorded
        self.nbytes = host.numel()
        owner._add(self.nbytes)

    def __del__(self) -> None:
        owner = getattr(self, "owner", None)
        if owner is not None:
            owner._release(self.nbytes)


class _SavedView:
    """A saved tensor of an offloaded block: where it sits in an offloaded storage."""

    __slots__ = ("copy", "offset", "size", "stride", "dtype")

    def __init__(self, copy: _HostCopy, t: torch.Tensor) -> None:
        self.copy, self.offset, self.size, self.stride, self.dtype = (
            copy, t.storage_offset(), t.size(), t.stride(), t.dtype)

    def on(self, data: torch.Tensor) -> torch.Tensor:
        """The saved tensor over the byte tensor ``data`` (the host copy, or the one brought back)."""
        storage = data.untyped_storage()
        return torch.empty(0, dtype=self.dtype, device=data.device).set_(storage, self.offset, self.size,
                                                                           self.stride)


class _Kept:
    """A saved tensor of an offloaded block that stays on the device (as the meter packed it)."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


class HostOffload:
    """One rank's offload: the rule of what leaves the device, the side stream of the copies and
    the count of host bytes held (``live_bytes``, ``peak_bytes``), never more than ``budget``: a
    tensor that would pass it stays on the device (whatever the memory model predicted)."""

    def __init__(self, device: torch.device, meter: Any = None, budget: float = math.inf,
                 min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.device = torch.device(device)
        self.meter = meter                       # an engine.memory.ActivationMeter, or None
        self.budget = budget
        self.min_bytes = min_bytes
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _add(self, n: int) -> None:
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, n: int) -> None:
        self.live_bytes -= n

    def for_microbatch(self, layers: frozenset) -> "MicroBatchOffload":
        return MicroBatchOffload(self, layers)

    # ---- the copies ------------------------------------------------------------------------------
    def offloads(self, t: torch.Tensor) -> bool:
        """Whether ``t`` leaves the device (the rule of the module's docstring)."""
        nbytes = t.untyped_storage().nbytes()
        if t.device.type not in ("cpu", "cuda") or nbytes < self.min_bytes:
            return False
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            return False
        if self.live_bytes + nbytes > self.budget:
            return False
        excluded = self.meter.excluded if self.meter is not None else ()
        return t.untyped_storage()._cdata not in excluded and not isinstance(t, torch.nn.Parameter)

    def to_host(self, t: torch.Tensor) -> _HostCopy:
        """A host copy of ``t``'s whole storage (as the meter counts it: each storage once)."""
        src = _bytes_of(t.untyped_storage(), t.device)
        cuda = t.device.type == "cuda"
        host = torch.empty(src.numel(), dtype=torch.uint8, device="cpu", pin_memory=cuda)
        if cuda:
            stream = self.stream
            stream.wait_stream(torch.cuda.current_stream(t.device))     # after the op that made t
            with torch.cuda.stream(stream):
                host.copy_(src, non_blocking=True)
            src.record_stream(stream)            # its block is not reused before the copy read it
        else:
            host.copy_(src)
        return _HostCopy(host, t.device, self)

    def bring_back(self, rec: _HostCopy) -> None:
        """Start the copy of ``rec`` back to its device (nothing to copy on CPU)."""
        if rec.back is not None or rec.device.type != "cuda":
            return
        with torch.cuda.stream(self.stream):
            back = torch.empty(rec.host.numel(), dtype=torch.uint8, device=rec.device)
            back.copy_(rec.host, non_blocking=True)
            rec.ready = torch.cuda.Event()
            rec.ready.record(self.stream)
        rec.back = back

    def device_tensor(self, view: _SavedView) -> torch.Tensor:
        """A saved tensor on its device, for autograd's unpack (waiting for the copy back on CUDA)."""
        rec = view.copy
        if rec.device.type != "cuda":
            return view.on(rec.host)
        self.bring_back(rec)
        current = torch.cuda.current_stream(rec.device)
        current.wait_event(rec.ready)
        rec.back.record_stream(current)
        return view.on(rec.back)


class MicroBatchOffload:
    """The offload of one micro-batch: its offloaded layers and, per layer, the host copies its block
    made (weakly: autograd owns them through the saved views), brought back when that block's
    backward starts."""

    def __init__(self, owner: HostOffload, layers: frozenset) -> None:
        self.owner, self.layers = owner, frozenset(layers)
        self._copies: dict[int, dict] = {}
        self._fetched: set[int] = set()
        self._seen: dict[int, tuple] = {}      # storage key -> (its weak reference, the copy, version)

    def hooks(self, layer: int) -> ContextManager[None]:
        """The context one offloaded block's forward runs in."""
        owner, meter, seen = self.owner, self.owner.meter, self._seen
        copies = self._copies.setdefault(layer, {})     # id -> weak reference, in the order made

        def pack(t: torch.Tensor) -> Union[_SavedView, _Kept]:
            storage = t.untyped_storage()
            entry = seen.get(storage._cdata)
            # a storage saved again (another op, another view, another block: the rotary tables) is
            # copied once, unless it was freed since (its address reused) or written in place
            rec = entry[1]() if entry is not None and not entry[0].expired() and entry[2] == t._version else None
            if rec is None:
                if not owner.offloads(t):
                    return _Kept(meter.pack(t) if meter is not None else t)
                rec = owner.to_host(t)
                seen[storage._cdata] = (StorageWeakRef(storage), weakref.ref(rec), t._version)
            copies.setdefault(id(rec), weakref.ref(rec))
            return _SavedView(rec, t)

        def unpack(p: Union[_SavedView, _Kept]) -> torch.Tensor:
            if isinstance(p, _Kept):
                return meter.unpack(p.packed) if meter is not None else p.packed
            return owner.device_tensor(p)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def watch(self, layer: int, outputs: Any) -> None:
        """Bring ``layer``'s tensors (and the next offloaded layer's below it) back when the gradient
        of one of the block's ``outputs`` arrives: its backward is about to start."""
        below = max((k for k in self.layers if k < layer), default=None)

        def on_grad(_grad: torch.Tensor) -> None:
            self.prefetch(layer)
            if below is not None:
                self.prefetch(below)

        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_grad)

    def prefetch(self, layer: int) -> None:
        if layer in self._fetched:
            return
        self._fetched.add(layer)
        for ref in self._copies.get(layer, {}).values():
            rec = ref()
            if rec is not None:
                self.owner.bring_back(rec)
