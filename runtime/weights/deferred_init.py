"""Build a model without allocating it and materialise its initial values one tensor at a time.

``record_init(factory, seed)`` builds the model under torch's ``FakeTensorMode`` (tensors with
shapes, dtypes and devices but no data) while a dispatch mode records every aten op the constructor
runs (parameter creation, ``nn.init`` calls, a Hugging Face ``post_init``, buffers such as rotary
tables, tensors made from Python data, which are kept as constants). Nothing is allocated: a 70B
model records in seconds. Fake tensors, not ``torch.device("meta")``: initialisers that see a meta
tensor skip their work on purpose (Hugging Face's ``init_weights``, ``nn.init.trunc_normal_``), which
would silently change the initial values. The returned model's parameters and buffers are on the
meta device.

``InitRecord.replay()`` re-runs the recorded ops on CPU, in their recorded order, from
``torch.manual_seed(seed)``, and yields every parameter and buffer (``name, tensor``) as soon as
its value is final; the caller keeps what it needs (a rank: its optimizer shard) and drops the rest.
Two rules keep the result bitwise equal to the model built eagerly after ``torch.manual_seed(seed)``
while memory holds about one parameter at a time:

* an op runs only if a final value depends on it (a backward liveness pass over storages); an op
  that wholly overwrites a storage without reading it (``normal_``, ``uniform_``, ``fill_``,
  ``zero_``, ``copy_``) ends the liveness of what was there before, so ``nn.Linear``'s
  ``kaiming_uniform_`` that a Hugging Face ``_init_weights`` overwrites later is not kept alive;
* an op that draws random numbers always runs, in order, so the generator advances exactly as in
  the eager build; when its result is dead it runs on a scratch tensor of the same shape and strides.

Storages are allocated when first written by a live op and freed after their last live use; view
ops cost nothing (a recorded view is the storage, an offset, sizes and strides).

An initialiser whose work depends on values (``trunc_normal_``'s rejection sampling: a loop until no
sample falls outside the bounds) cannot be recorded without data: ``record_init`` raises
``NotRecordable`` saying which op needed a value, and the caller builds the model eagerly instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from hgraph.errors import HGraphError

_META = torch.device("meta")


class NotRecordable(HGraphError):
    """The model's construction needs tensor values."""

# ops that draw from the generator: always replayed, in their recorded order
_RANDOM = {"normal", "normal_", "uniform_", "bernoulli", "bernoulli_", "random_", "exponential_",
           "geometric_", "cauchy_", "log_normal_", "randn", "rand", "randint", "randperm", "rand_like",
           "randn_like", "randint_like", "multinomial", "native_dropout", "poisson"}
# in-place ops that overwrite every element of ``self`` without reading it (only when ``self`` spans
# its whole storage does this end the liveness of the storage's previous contents)
_OVERWRITE = {"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "exponential_", "geometric_",
              "cauchy_", "log_normal_", "bernoulli_"}


@dataclass(frozen=True)
class TensorRef:
    """A recorded tensor: which storage, where in it, and how it is laid out."""

    storage: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _Op:
    func: Any
    args: Any                 # args and kwargs with tensors replaced by TensorRefs
    kwargs: Any
    outputs: list             # TensorRefs of the tensors it returns
    reads: set = field(default_factory=set)     # storages whose contents it reads
    writes: set = field(default_factory=set)    # storages it writes (new outputs or mutated inputs)
    kills: set = field(default_factory=set)     # storages it overwrites whole without reading
    random: bool = False
    view_only: bool = False   # returns views of its inputs and writes nothing: nothing to run


@dataclass
class _Storage:
    numel: int
    dtype: torch.dtype
    constant: Optional[torch.Tensor] = None    # a real (non-meta) tensor seen during recording


class _Recorder(TorchDispatchMode):
    """Records every aten op with its storages."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.storages: dict[int, _Storage] = {}
        self._keep: list[torch.Tensor] = []     # keeps recorded storages alive: their ids stay unique

    def ref(self, t: torch.Tensor) -> TensorRef:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.storages:
            # a tensor no recorded op produced: a real one (``torch.tensor(data)``) is a constant
            numel = storage.nbytes() // t.element_size() if t.element_size() else 0
            constant = None
            if not isinstance(t, FakeTensor) and t.device.type != "meta":
                with _disable_current_modes():      # a real copy, not a fake one
                    constant = t.detach().cpu().clone()
                numel = constant.numel()
            self.storages[key] = _Storage(numel, t.dtype, constant)
            self._keep.append(t)
        return TensorRef(key, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        before = {t.untyped_storage()._cdata for t in inputs}
        in_refs = {id(t): self.ref(t) for t in inputs}
        out = func(*args, **kwargs)       # on fake tensors: shapes only
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        new = []
        for t in outs:
            key = t.untyped_storage()._cdata
            if key not in before and key not in self.storages:
                element = t.element_size()
                self.storages[key] = _Storage(t.untyped_storage().nbytes() // element if element else 0, t.dtype)
                self._keep.append(t)
                new.append(key)
        op = _Op(func, *tree_map(lambda a: in_refs[id(a)] if isinstance(a, torch.Tensor) else a, (args, kwargs)),
                 outputs=[self.ref(t) for t in outs])
        name = func._schema.name.split("::")[-1]
        op.random = name in _RANDOM
        mutated = set()
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in tree_flatten(value)[0]:
                    if isinstance(t, torch.Tensor):
                        mutated.add(t.untyped_storage()._cdata)
        op.writes = set(new) | mutated
        op.reads = set(before)
        if name in _OVERWRITE and args and isinstance(args[0], torch.Tensor) and _spans_storage(args[0]):
            target = args[0].untyped_storage()._cdata
            op.kills = {target}
            # copy_ reads its source, the others read nothing of ``self``
            op.reads = {t.untyped_storage()._cdata for t in inputs[1:]} - {target} if name == "copy_" else set()
        op.view_only = not op.writes and not op.random
        self.ops.append(op)
        return out


def _spans_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()


class InitRecord:
    """A model's recorded construction; ``model`` is the meta-device module."""

    def __init__(self, model: nn.Module, recorder: _Recorder, seed: int) -> None:
        self.model, self.seed = model, seed
        self._ops, self._storages = recorder.ops, recorder.storages
        # final values wanted: every parameter (tied ones once) and buffer, by storage
        self.peak_bytes = 0     # the most bytes the last replay held at once (its own tensors)
        self.targets: dict[str, TensorRef] = {}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            self.targets[name] = recorder.ref(t)

    def replay(self, wanted: Optional[set[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every parameter and buffer (or those in ``wanted``), CPU, each when final.

        The tensor is valid until the next item is asked for (its storage may be freed or reused).
        """
        names = [n for n in self.targets if wanted is None or n in wanted]
        live_ops, last_use = self._liveness({self.targets[n].storage for n in names})
        by_storage: dict[int, list[str]] = {}
        for n in names:
            by_storage.setdefault(self.targets[n].storage, []).append(n)
        done_at: dict[int, list[int]] = {}     # op index -> storages whose value is final after it
        for key in by_storage:
            done_at.setdefault(last_use.get(key, -1), []).append(key)
        real: dict[int, torch.Tensor] = {}
        self.peak_bytes = 0
        gen_state = torch.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            yield from self._emit(done_at.get(-1, []), by_storage, real)
            for i, op in enumerate(self._ops):
                if i in live_ops:
                    self._run(op, real)
                    self.peak_bytes = max(self.peak_bytes, sum(t.untyped_storage().nbytes() for t in real.values()))
                elif op.random:
                    self._run_on_scratch(op)
                yield from self._emit(done_at.get(i, []), by_storage, real)
                for key in live_ops.get(i, ()):    # storages this op used for the last time
                    real.pop(key, None)
        finally:
            torch.set_rng_state(gen_state)

    def _liveness(self, wanted: set[int]) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Which ops must run (index -> storages last used there) and each storage's last live use."""
        live = set(wanted)
        needed: dict[int, list[int]] = {}
        last_use: dict[int, int] = {}
        for i in range(len(self._ops) - 1, -1, -1):
            op = self._ops[i]
            if op.view_only or not (op.writes & live):
                continue
            touched = op.reads | op.writes
            needed[i] = [k for k in touched if k not in last_use and k not in wanted]
            for k in touched:
                last_use.setdefault(k, i)
            live -= op.kills | (op.writes - op.reads)
            live |= op.reads
        unknown = {k for k in live if self._storages[k].constant is None}
        if unknown:
            names = [n for n, ref in self.targets.items() if ref.storage in unknown] or ["a parameter or buffer"]
            raise NotRecordable(f"{', '.join(names[:3])} of {type(self.model).__name__} depends on a tensor whose "
                                "making the recording did not see (created outside the model's construction?)")
        return needed, last_use

    def _tensor(self, ref: TensorRef, real: dict[int, torch.Tensor]) -> torch.Tensor:
        base = real.get(ref.storage)
        if base is None:
            store = self._storages[ref.storage]
            base = store.constant.clone() if store.constant is not None else torch.empty(store.numel, dtype=store.dtype)
            real[ref.storage] = base
        if base.dtype != ref.dtype:
            raise NotRecordable(f"a tensor of the model's construction reinterprets a {base.dtype} storage as "
                                f"{ref.dtype}, which the replay does not do")
        return base.as_strided(ref.size, ref.stride, ref.offset)

    def _run(self, op: _Op, real: dict[int, torch.Tensor]) -> None:
        args, kwargs = tree_map(lambda a: _on_cpu(a, real, self), (op.args, op.kwargs))
        out = op.func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for ref, t in zip(op.outputs, outs):
            if ref.storage not in real:
                # a new storage: keep the whole of it, viewed flat, under the recorded id
                numel = t.untyped_storage().nbytes() // t.element_size()
                real[ref.storage] = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (numel,), (1,))

    def _run_on_scratch(self, op: _Op) -> None:
        """A random op whose result is dead: run it where it writes nothing kept (the generator advances)."""
        scratch: dict[int, torch.Tensor] = {}
        args, kwargs = tree_map(lambda a: _on_cpu(a, scratch, self), (op.args, op.kwargs))
        op.func(*args, **kwargs)

    def _emit(self, keys: list[int], by_storage: dict[int, list[str]],
              real: dict[int, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for key in keys:
            for name in by_storage[key]:
                yield name, self._tensor(self.targets[name], real)
            real.pop(key, None)


def _on_cpu(value: Any, real: dict[int, torch.Tensor], record: InitRecord) -> Any:
    """An op argument for the replay: recorded tensors realised, devices (meta) replaced by the CPU."""
    if isinstance(value, TensorRef):
        return record._tensor(value, real)
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def record_init(factory: Callable[[], nn.Module], seed: int) -> InitRecord:
    """Build ``factory()`` without allocating it, recording its construction.
    The global generator is left as found (the recording seeds it with ``seed`` as the eager build does)."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    recorder = _Recorder()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), recorder:
            model = factory()
    except DataDependentOutputException as exc:
        raise NotRecordable(f"the construction of the model reads tensor values ({exc.func}, e.g. "
                            "nn.init.trunc_normal_'s rejection sampling), which cannot be recorded without "
                            "allocating them") from None
    finally:
        torch.set_rng_state(state)
    record = InitRecord(model, recorder, seed)
    to_meta(model)
    return record


def to_meta(model: nn.Module, buffers: bool = True) -> None:
    """Swap the parameters (and buffers) for meta tensors, freeing them (tied parameters stay one object)."""
    swapped: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers) if buffers else (module._parameters,):
            for key, t in table.items():
                if t is None:
                    continue
                new = swapped.get(id(t))
                if new is None:
                    data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
                    new = nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
                    swapped[id(t)] = new
                table[key] = new
