"""The runtime's accounting of activation memory and, under a budget, the per-micro-batch choice of
the blocks to recompute or offload.

``ActivationMeter`` is the CPU measurement of activation memory: saved-tensor hooks count the bytes
of every tensor autograd saves for backward (each storage once; the working parameters excluded)
and release them when autograd drops them, so ``live_bytes`` follows the activations held between
forward and backward and ``peak_bytes`` is their maximum. A recomputed block (``recompute.run_block``)
adds its checkpointed inputs while it waits for backward, and, during its replay, the tensors the
replay saves (tracked by a dispatch mode inside the recompute context): that transient is the
block's stash. An offloaded block (``engine.offload``) passes the meter only what it keeps on the
device. Per block the meter records what one layer stashed (``observations``) for the memory model
(``hgraph.runtime.engine.activation_model``).

``StageMemory`` is one rank's use of it in the executor: per micro-batch it opens the meter's view
of it (``MicroBatchMeter``: its features and what its blocks stash) and, with a budget, picks the
stage's blocks that recompute and those that offload (the model's choice,
``activation_model.choose_layer_roles`` under an ``OffloadPolicy``, agreed over the stage's TP x CP
group; the executor hands them and the view to the micro-batch's communication context); per step
it refits the model to what was measured. ``stage_memory`` makes a rank's ``StageMemory`` for a
Program and, with a budget or an offload, outlines the graph's blocks (``recompute.outline_blocks``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hgraph.program import GroupRound, Program, RankProgram
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.runtime.comm.process_groups import GroupCache
from hgraph.runtime.data.micro_batch import MicroBatch
from hgraph.runtime.engine.activation_model import (FORWARD_FRACTION, LayerRoles, choose_layer_roles,
                                                    choose_recompute_layers, fit_activation_model,
                                                    offload_exposed_ms)
from hgraph.runtime.engine.offload import DEFAULT_HOST_LINK_BYTES_PER_S, HostOffload, MicroBatchOffload
from hgraph.runtime.engine.recompute import block_ranges, outline_blocks
from hgraph.runtime.kernels.cp_attention import CPLayout
from hgraph.runtime.kernels.ulysses_layout import UlyssesLayout

SequenceLayout = Union[CPLayout, UlyssesLayout]     # a sequence rank's tokens: CP alone, or UL inside CP

Features = tuple[float, float, float]   # a micro-batch's (tokens, entries, keys) on this rank (``microbatch_features``)


class _Saved:
    """A tensor saved for backward, counted until autograd drops it."""

    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "ActivationMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        # dynamo, tracing the pack hook under torch.compile, makes instances it never initialises
        meter = getattr(self, "meter", None)
        if meter is not None:
            meter._release(self.key)


class _Held:
    """Checkpointed inputs of a recomputed block, counted while its checkpoint frame lives."""

    def __init__(self, keys: list[int], meter: "ActivationMeter") -> None:
        self.keys, self.meter = keys, meter

    def __del__(self) -> None:
        for key in self.keys:
            self.meter._release(key)


class _ReplayTracker(TorchDispatchMode):
    """Inside a block's replay: remembers (weakly) every tensor an op produced, and which tensor
    objects a collective (a ``c10d`` op) took as its buffers (or as the base of a buffer it viewed)."""

    def __init__(self, meter: "ActivationMeter", features: Optional[Features], stashed_input: int = 0) -> None:
        super().__init__()
        self.meter, self.features, self.refs = meter, features, []
        self.stashed_input = stashed_input     # the block's input bytes a forward stash counts
        self.comm_buffers: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # most ops return one tensor (torch's tree_flatten makes a reference cycle per call)
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        if func.namespace == "c10d":        # a collective: its buffers, and the tensors they view
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    for b in (t, t._base):
                        if b is not None:
                            self.comm_buffers[id(b)] = weakref.ref(b)
        return out

    def _comm_buffer(self, t: torch.Tensor) -> bool:
        ref = self.comm_buffers.get(id(t))
        return ref is not None and ref() is t

    def __exit__(self, *exc: object) -> Optional[bool]:
        result = super().__exit__(*exc)
        # What is still alive once the replay's outputs were dropped is what the replay saved, except
        # a collective's buffer objects: the backend may release them a moment after the wait (gloo's
        # worker thread drops its work item after waking the waiter), so whether they are alive here
        # is a race. What the replay saves from a buffer is another tensor object (checkpoint saves a
        # detached alias of what requires grad; an op's result is its own), still counted through its
        # storage. A buffer that a Function saved as itself would be missed: none of hgraph's does.
        seen: dict[int, int] = {}
        for ref in self.refs:
            t = ref()
            if t is not None and not self._comm_buffer(t):
                key, nbytes = _storage(t)
                if key and not self.meter.is_live(key) and key not in self.meter.excluded:
                    seen[key] = nbytes
        transient = sum(seen.values())
        self.meter.peak_bytes = max(self.meter.peak_bytes, self.meter.live_bytes + transient)
        self.meter.observe("layer", self.features, transient + self.stashed_input)
        self.refs, self.comm_buffers = [], {}
        return result


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of ``t``'s storage. The key is the storage itself (its StorageImpl), not its data
    pointer: the same on every device, for fake tensors too (the memory model counts a model's
    activations under ``FakeTensorMode``, with nothing allocated), and unchanged when a working
    parameter's storage is freed and re-allocated across a strategy switch."""
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


class ActivationMeter:
    """Counts the bytes autograd holds for backward on this rank."""

    def __init__(self, excluded: Iterable[torch.Tensor] = ()) -> None:
        self.excluded: set[int] = set()
        self._excluded_tensors = list(excluded)
        self.exclude(self._excluded_tensors)
        self._live: dict[int, list[int]] = {}       # storage ptr -> [bytes, references]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.observations: dict[str, list] = {"layer": [], "checkpoint": [], "other": [], "kept": []}

    def for_microbatch(self, features: Features) -> "MicroBatchMeter":
        """One micro-batch's view: its features and what its blocks stash, counted into this meter."""
        return MicroBatchMeter(self, features)

    def is_live(self, key: int) -> bool:
        """Whether the storage ``key`` is counted now."""
        return key in self._live

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages never counted (the working parameters: they live anyway)."""
        for t in tensors:
            key, _ = _storage(t)
            self.excluded.add(key)

    def refresh_excluded(self) -> None:
        """Exclude the working parameters where they are now (a strategy switch re-allocates them)."""
        self.excluded = set()
        self.exclude(self._excluded_tensors)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _add(self, t: torch.Tensor) -> Optional[int]:
        key, nbytes = _storage(t)
        if not nbytes or key in self.excluded:
            return None
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [nbytes, 1]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[1] += 1
        return key

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.live_bytes -= entry[0]

    def pack(self, t: torch.Tensor) -> Union[torch.Tensor, _Saved]:
        """Autograd's saved-tensor pack hook: ``t`` counted while what it returns lives (offload's hooks
        count what they keep on the device through it)."""
        key = self._add(t)
        return t if key is None else _Saved(t, key, self)

    @staticmethod
    def unpack(p: Union[torch.Tensor, _Saved]) -> torch.Tensor:
        """The unpack hook of what ``pack`` returned."""
        return p.tensor if isinstance(p, _Saved) else p

    def hooks(self) -> ContextManager[None]:
        """The context that counts what autograd saves (wrap a micro-batch's forward in it)."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def hold(self, inputs: Iterable[Any]) -> tuple[_Held, int]:
        """Count a recomputed block's checkpointed ``inputs`` while what it returns lives; and their
        bytes newly counted."""
        before = self.live_bytes
        keys = [k for t in tree_flatten(list(inputs))[0] if isinstance(t, torch.Tensor)
                for k in [self._add(t)] if k is not None]
        return _Held(keys, self), self.live_bytes - before

    def activation_input_bytes(self, inputs: Iterable[Any]) -> int:
        """Bytes of the differentiable activations among ``inputs`` (each storage once; the working
        parameters excluded)."""
        seen: dict[int, int] = {}
        for t in tree_flatten(list(inputs))[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                key, nbytes = _storage(t)
                if key not in self.excluded:
                    seen[key] = nbytes
        return sum(seen.values())

    def replay_tracker(self, features: Optional[Features], stashed_input: int = 0) -> _ReplayTracker:
        """Tracks a block's replay; its stash is observed with ``stashed_input`` bytes added (the
        checkpointed input a forward block's stash holds)."""
        return _ReplayTracker(self, features, stashed_input)

    def observe(self, kind: str, features: Optional[Features], nbytes: int) -> None:
        """Record what one layer stashed (``layer``), kept as checkpoint (``checkpoint``), still saved
        on the device when offloaded (``kept``) or what the rest of the stage saved (``other``) for a
        micro-batch of ``features`` (None: not recorded)."""
        if features is not None:
            self.observations[kind].append((features, int(nbytes)))


class MicroBatchMeter:
    """One micro-batch's view of its rank's ``ActivationMeter`` (``ActivationMeter.for_microbatch``):
    its features and the bytes its blocks stashed in its forward, with the counting shared. The
    micro-batch's ``CommContext`` view carries it (``comm.activation_meter``), so a recomputed block's
    replay in backward observes its own micro-batch, as the context's views do for their values."""

    def __init__(self, meter: ActivationMeter, features: Features) -> None:
        self.meter, self.features = meter, features
        self.start_live = meter.live_bytes    # what was saved before this micro-batch's forward
        self.forward_block_bytes = 0          # what its blocks stashed in its forward

    @property
    def live_bytes(self) -> int:
        return self.meter.live_bytes

    def hooks(self) -> ContextManager[None]:
        return self.meter.hooks()

    def pack(self, t: torch.Tensor) -> Union[torch.Tensor, _Saved]:
        return self.meter.pack(t)

    def unpack(self, p: Union[torch.Tensor, _Saved]) -> torch.Tensor:
        return self.meter.unpack(p)

    def observe(self, kind: str, nbytes: int, in_forward: bool) -> None:
        """What one of this micro-batch's blocks saved (``ActivationMeter.observe``); ``in_forward``:
        in its forward, so not counted again in the rest of the stage (``StageMemory.after_forward``)."""
        if in_forward:
            self.forward_block_bytes += int(nbytes)
        self.meter.observe(kind, self.features, nbytes)

    def hold(self, inputs: Iterable[Any]) -> _Held:
        """A recomputed block's checkpointed inputs, counted while the returned token lives."""
        held, nbytes = self.meter.hold(inputs)
        self.observe("checkpoint", nbytes, in_forward=True)
        return held

    def activation_input_bytes(self, inputs: Iterable[Any]) -> int:
        return self.meter.activation_input_bytes(inputs)

    def replay_tracker(self, stashed_input: int = 0) -> _ReplayTracker:
        """Tracks the replay of one of this micro-batch's blocks (``ActivationMeter.replay_tracker``)."""
        return self.meter.replay_tracker(self.features, stashed_input)


# ---- per-stage policy used by the executor --------------------------------------------------------
def microbatch_features(mb: MicroBatch, layout: Optional[SequenceLayout] = None) -> Features:
    """(tokens, attention entries, key/value rows) of a micro-batch on this rank (the activation
    model's features). Without a layout: ``sum l_d``, ``sum l_d^2`` and ``sum l_d``. A CP rank's
    attention takes its local queries of each document against all of that document's gathered keys:
    ``sum_d q_d * l_d`` entries and ``sum_d l_d`` key/value rows over the documents it has queries of
    (held per micro-batch whatever the rank's share of the tokens: CP3's shard is a third of the
    tokens, its keys are not). A Ulysses rank holds its ``tokens`` outside attention, but its attention
    runs on every token of its CP shard for ``1 / UL`` of the heads: the shard's entries and keys
    counted at that head share (``/ UL``); the key/value heads repeated where they are fewer than UL
    are a fixed factor of a program's keys, which the fitted per-key coefficient carries."""
    if layout is None:
        tokens = int(sum(mb.doc_lengths))
        return tokens, int(sum(l * l for l in mb.doc_lengths)), tokens
    ul = layout.ul if isinstance(layout, UlyssesLayout) else 1
    queries = layout.shard_tokens if isinstance(layout, UlyssesLayout) else layout.local_tokens
    per_doc_q: dict[int, int] = {}
    for i in queries:
        d = layout.doc_of[i]
        per_doc_q[d] = per_doc_q.get(d, 0) + 1
    entries = sum(q * mb.doc_lengths[d] for d, q in per_doc_q.items())
    keys = sum(mb.doc_lengths[d] for d in per_doc_q)
    return len(layout.local_tokens), entries / ul if ul > 1 else entries, keys / ul if ul > 1 else keys


@dataclass(frozen=True)
class OffloadPolicy:
    """How a rank offloads: ``mode`` ``on`` (a layer leaves the device by offload before any is
    recomputed; without a memory budget every block offloads) or ``auto`` (per micro-batch the
    cheapest per layer, priced by ``layer_ms``: a micro-batch's features -> one layer's
    forward+backward ms, None where unpriced: then as ``on``, and ``host_link_bytes_per_s``);
    ``host``: the rank's ``HostOffload``,
    whose budget no choice passes."""

    mode: str
    host: HostOffload
    layer_ms: Optional[Callable[[Features], Optional[float]]] = None
    host_link_bytes_per_s: float = DEFAULT_HOST_LINK_BYTES_PER_S


class LayerChoice(NamedTuple):
    """The layers of a micro-batch whose blocks recompute, and the offload of those that offload
    (None: not that way); ``meter``: the micro-batch's view of the activation meter (None: untracked)."""

    recompute: Optional[frozenset]
    offload: Optional[MicroBatchOffload]
    meter: Optional[MicroBatchMeter] = None


class StageMemory:
    """Activation accounting and (with a budget) the per-micro-batch recomputation and offload of one
    rank.

    ``budget``: bytes of activations this rank may hold; None measures only (and, with an ``on``
    offload, offloads every block). ``layers``: the layer indices of the stage's blocks (in order).
    ``group``: the process group of the stage's TP x CP ranks as a 1-tuple (its process group, None
    for the default group) or None alone; the recomputed and moved layer counts are agreed over it
    (max). ``offload``: the rank's ``OffloadPolicy`` (None: recomputation only); ``issuer``: the rank's
    ``CollectiveIssuer``, which the agreement goes through.
    """

    def __init__(self, meter: ActivationMeter, layers: Sequence[int], budget: Optional[float],
                 group: Optional[tuple[Optional[dist.ProcessGroup]]] = None,
                 device: Optional[torch.device] = None, offload: Optional[OffloadPolicy] = None,
                 issuer: Optional[CollectiveIssuer] = None) -> None:
        self.meter, self.layers, self.budget = meter, list(layers), budget
        self.group, self.device, self.offload = group, device, offload
        self.issuer = issuer or CollectiveIssuer()      # the rank's choke point for the agreement
        self.model = None
        self._held: dict[int, float] = {}
        self._host_held: dict[int, float] = {}
        self._current: Optional[MicroBatchMeter] = None     # the micro-batch whose forward runs
        self.step_predicted: list[float] = []
        self.step_recompute: list[int] = []
        self.step_offload: list[int] = []
        self._unknown = False

    def begin_step(self) -> None:
        self.meter.refresh_excluded()
        self.meter.reset_peak()
        if self.offload is not None:
            self.offload.host.reset_peak()
        self._held.clear()
        self._host_held.clear()
        self.step_predicted, self.step_recompute, self.step_offload, self._unknown = [], [], [], False

    def before_forward(self, index: int, mb: MicroBatch, layout: Optional[SequenceLayout]) -> LayerChoice:
        """Start micro-batch ``index`` (``layout``: its CP or Ulysses layout, or None); returns the layers whose
        blocks recompute in it (None without a budget) and its offload (None without one)."""
        f = microbatch_features(mb, layout)
        self._current = self.meter.for_microbatch(f)
        n = len(self.layers)
        r, o, predicted = 0, 0, None
        if self.budget is not None:
            held = sum(self._held.values())
            if self.model is None:
                r = n                 # nothing measured yet: recompute all (the least memory)
            else:
                roles = self._roles(f, held)
                r, o, predicted = roles.recompute, roles.offload, roles.predicted_peak
            r, o = self._agree(r, o)
            if self.model is not None:
                predicted = self.model.peak(f, n, r, held, o)
                self._held[index] = self.model.held(f, n, r, o)
                self._host_held[index] = self.model.host(f, o)
        elif self.offload is not None and self.offload.mode == "on":
            o = n                     # no budget: every block offloads (within the host budget)
        self.step_recompute.append(r)
        self.step_offload.append(o)
        if predicted is None:
            self._unknown = True
        else:
            self.step_predicted.append(predicted)
        recompute = frozenset(self.layers[:r]) if self.budget is not None else None   # the first: freed last
        offload = (self.offload.host.for_microbatch(frozenset(self.layers[r:r + o]))
                   if self.offload is not None and o > 0 else None)
        return LayerChoice(recompute, offload, self._current)

    def _roles(self, f: Features, held: float) -> LayerRoles:
        """The model's choice of recomputed and offloaded layers for a micro-batch of ``f``."""
        policy, n = self.offload, len(self.layers)
        if policy is None:
            c = choose_recompute_layers(self.model, f, n, self.budget, held)
            return LayerRoles(c.layers, 0, c.predicted_peak, 0.0, 0.0, c.fits)
        layer_ms = policy.layer_ms(f) if policy.mode == "auto" and policy.layer_ms is not None else None
        if layer_ms is not None:
            recompute_ms = FORWARD_FRACTION * layer_ms
            offload_ms = offload_exposed_ms(self.model.host(f, 1), policy.host_link_bytes_per_s, layer_ms)
        else:                         # on (or auto without prices): offload before recomputing
            recompute_ms, offload_ms = 1.0, 0.0
        return choose_layer_roles(self.model, f, n, self.budget, held, recompute_ms=recompute_ms,
                                  offload_ms=offload_ms, host_budget=policy.host.budget,
                                  host_held=sum(self._host_held.values()))

    def after_forward(self) -> None:
        view, self._current = self._current, None
        other = view.live_bytes - view.start_live - view.forward_block_bytes
        view.observe("other", other, in_forward=False)

    def after_backward(self, index: int) -> None:
        self._held.pop(index, None)
        self._host_held.pop(index, None)

    def end_step(self) -> tuple[int, Optional[float], list[int]]:
        """(measured peak bytes, predicted peak bytes or None, recomputed layers per micro-batch);
        refits the model to everything measured so far (offloaded layers per micro-batch:
        ``step_offload``)."""
        obs = self.meter.observations
        for kind in obs:
            obs[kind] = obs[kind][-256:]           # recent micro-batches are enough for the fit
        self.model = fit_activation_model(obs["layer"], obs["checkpoint"], obs["other"], obs["kept"])
        predicted = None if self._unknown or not self.step_predicted else max(self.step_predicted)
        return self.meter.peak_bytes, predicted, list(self.step_recompute)

    def _agree(self, r: int, o: int) -> tuple[int, int]:
        """The recomputed and offloaded counts of the stage's group: the most recomputed, and the
        most layers off the device (so no rank keeps more than it chose)."""
        if self.group is None:
            return r, o
        t = torch.tensor([r, r + o], dtype=torch.int64, device=self.device)
        group = self.group[0]            # None: the default group
        self.issuer.run("all_reduce", group, t,
                        lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True),
                        "memory agreement")
        return int(t[0]), int(t[1]) - int(t[0])


def stage_memory(graph: fx.GraphModule, working: Mapping[str, torch.Tensor], program: Program,
                 rank_program: RankProgram, budget: Optional[float], device: Optional[torch.device],
                 offload: Optional[Callable[[ActivationMeter], OffloadPolicy]] = None,
                 issuer: Optional[CollectiveIssuer] = None) -> tuple[fx.GraphModule, StageMemory]:
    """A rank's ``StageMemory`` for ``program`` over its ``working`` tensors, and the graph to run:
    with a budget or an offload, ``graph`` with its blocks outlined for recomputation and offload
    (the same computation; the original graph is kept for a budget-less executor sharing the
    program). ``offload``: makes the rank's ``OffloadPolicy`` over its meter (None: no offload).
    Host work only: the stage's group, over which its ranks agree, is bound by ``bind_stage_group``
    (collective) before the first step."""
    meter = ActivationMeter(working.values())
    policy = offload(meter) if offload is not None else None
    layers: list[int] = []
    if budget is not None or policy is not None:
        outlined = outline_blocks(graph)
        if outlined is not graph:
            layers = [layer for layer, _ in block_ranges(graph.graph)]
            graph = outlined
    return graph, StageMemory(meter, layers, budget, None, device, policy, issuer)


def bind_stage_group(memory: StageMemory, program: Program, rank_program: RankProgram, groups: GroupCache) -> None:
    """Create the group of this rank's stage (its TP x CP ... ranks) as one round of every rank (its part
    computed from its own coordinates, whether or not ``memory`` needs it, so the rounds stay the same
    on every rank) and give it to ``memory`` when it agrees over it (with a budget or an offload).
    Collective: every rank calls it for the same Program."""
    strategy = program.strategy
    stage_ranks = tuple(strategy.stage_ranks(rank_program.pipeline, rank_program.stage))
    if any(p.num_ranks > p.pp for _, p in strategy.groups()):       # a stage of more than one rank
        groups.create([GroupRound(("stage", str(strategy)), stage_ranks)])
    if (memory.budget is not None or memory.offload is not None) and len(stage_ranks) > 1:
        memory.group = (groups.get(stage_ranks),)
