"""The memory model of *this* runtime under a per-rank device memory limit (``--device-memory``), and
the check that every document fits some scheme.

Why not the analytic prior's: it describes a GPU with bf16 working weights, flash attention and
sequence parallelism (``A = 34``) and 80 GiB, so on CPU MaxLen never binds and every scheme holds
every document. Here (App. B.1's form, ``cost_model.MemoryModel``):

* activations: bytes autograd saves for backward, counted by the runtime's own accounting
  (``engine.memory.ActivationMeter``: saved-tensor hooks, each storage once, parameters excluded) on one
  TP rank's shard of the model (``tp_shard_config``) with 1 and 2 layers, built and run on fake tensors
  (nothing allocated, any model size), on a micro-batch packed
  from several documents through the runtime's varlen attention (measured against the executor's
  own ``peak_mem_bytes`` on one rank: within 0.1%; a single-document micro-batch keeps ~4% less, so
  the model is an upper bound for it): the difference is one layer (``A = bytes_per_token * TP / hidden``), the rest is the embedding, head and loss
  (``other_coeff``). Counts are bytes, not times: the same on every run and every machine load.
  The loss is counted as the runtime makes it (``kernels.head_cross_entropy``: chunk by chunk from the
  output head's input, which it keeps with the targets; the whole ``[tokens, vocab]`` logits are never
  saved; one chunk's transient logits, at most a few times ``CHUNK_BYTES``, are not per token and not
  counted). Under sequence parallelism (the default with TP > 1) what the norms save and their outputs,
  the values between TP regions, hold 1/TP of the tokens (the column-parallel linears keep only the
  rank's slice of their all-gathered input, ``ops.sp_linear``): those bytes, counted apart, are divided
  by TP. A compiled step (``--compile``) keeps what AOTAutograd's partitioner saves, not what eager
  autograd saves (it recomputes cheap pointwise ops in backward instead of saving their inputs;
  measured on llama:tiny: 23% fewer bytes): with ``compiled_step`` the accounting pass runs the model
  behind ``torch.compile`` with that partitioner and no code generation (``PARTITIONER_BACKEND``,
  on fake tensors too; inductor's code generation saves the same tensors, measured to the byte).
  Under 1F1B the first stage holds PP
  micro-batches of ``layers / PP`` layers, i.e. the whole model's layers for one micro-batch (B.1): PP
  alone does not lengthen MaxLen
  by much, TP does.
* model states: what the runtime's ranks hold, counted from its layouts (``counted_states``,
  ``engine.model_states``): fp32 masters and Adam's two moments (12 bytes a parameter) of the rank's
  optimizer segments (1/N of every parameter), and one working layout's parameters and gradients
  (2 x 4 bytes in fp32, 2 x 2 in bf16) on the scheme's fullest rank: its stage's layers and the
  embedding or head that stage holds, ``1 / TP`` of what TP splits, norms whole, padded vocabulary
  rows included. The optimizer step's transient (gradient segments, Adam's denominator, 8 bytes a
  parameter / N) must fit beside them, while the activations are freed. The App. B.1 constants
  (``state_coeff``, ``alpha``: 12 bytes / N and the working bytes of ``layers / PP`` layers of
  ``1 / TP``) remain for a world size not counted.
* no framework gap or safety margin: the limit given is what activations and states may use.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

import hgraph
from hgraph.errors import HGraphError
from hgraph.frontends.zoo import llama
from hgraph.frontends.zoo.llama import tp_shard_config
from hgraph.runtime.engine.memory import ActivationMeter, _storage
from hgraph.runtime.engine.model_states import scheme_states
from hgraph.runtime.kernels.head_cross_entropy import chunk_tokens, head_cross_entropy_sum
from hgraph.runtime.planner.cost.cost_model import CostModel, MemoryModel
from hgraph.strategy import Scheme
from hgraph.torch_compat import limit_recompiles
from hgraph.varlen_attention import varlen_attention

MEASURE_LENGTH = 128          # tokens of the accounting pass (bytes are linear in it without l^2 terms)
PACKED_DOC_LEN = 32          # documents of the accounting pass (a packed micro-batch; any size >1 doc counts alike)
MASTER_AND_ADAM_BYTES = 12    # fp32 master + Adam m + v per parameter, sharded over all ranks
# inductor's forward / backward partition (min-cut rematerialisation) without its code generation
PARTITIONER_BACKEND = "aot_eager_decomp_partition"
ACCOUNTING_RECOMPILES = 64    # the accounting passes compile the same layer code for every model shape


class PackedAttention(TorchFunctionMode):
    """A context in which ``F.scaled_dot_product_attention`` runs as the runtime's per-document
    ``varlen_attention`` over ``cu_seqlens``: a packed micro-batch's attention keeps per-document
    slices of Q, K, V (measured: +4% bytes per token for llama:tiny), which one SDPA call does not."""

    def __init__(self, cu_seqlens: Sequence[int]) -> None:
        super().__init__()
        self.cu_seqlens = cu_seqlens

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:     # the mode is off inside its own handler
            return varlen_attention(*args[:3], self.cu_seqlens, enable_gqa=kwargs.get("enable_gqa", False))
        return func(*args, **kwargs)


class _RegionMeter(ActivationMeter):
    """The runtime's accounting, also telling apart the bytes of what is first saved while a module of
    ``region`` (a type) runs, or is such a module's output: the norms, whose values lie between TP
    regions (their outputs are what the column-parallel linears keep of their all-gathered input)."""

    def __init__(self, excluded: Any, region: type) -> None:
        super().__init__(excluded)
        self.region, self.depth, self.region_bytes = region, 0, 0
        self.outputs: set[int] = set()

    def _add(self, t: torch.Tensor) -> Optional[int]:
        before = self.live_bytes
        key = super()._add(t)
        if self.depth or key in self.outputs:
            self.region_bytes += self.live_bytes - before
        return key

    def watch(self, model: torch.nn.Module) -> list:
        def enter(*_: Any) -> None:
            self.depth += 1

        def leave(_m: Any, _args: Any, out: Any) -> None:
            self.depth -= 1
            if isinstance(out, torch.Tensor):
                self.outputs.add(_storage(out)[0])
        return [h for m in model.modules() if isinstance(m, self.region)
                for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]


def saved_activation_bytes(model: Any, length: int, doc_len: Optional[int] = None,
                           sequence_parallel_tp: int = 1, compiled_step: bool = False) -> int:
    """Bytes autograd keeps for backward in one forward of ``model`` on ``length`` random tokens
    (the runtime's ``ActivationMeter``; parameters excluded), packed as documents of ``doc_len``
    tokens through the runtime's varlen attention (None: one document, plain SDPA), the loss made as
    the runtime makes it, from the output head's input. ``sequence_parallel_tp``:
    what the norms save counts 1/TP (a TP rank's token slice under sequence parallelism);
    ``compiled_step``: what a ``--compile`` step keeps (the model behind ``torch.compile``)."""
    meter = _RegionMeter(list(model.parameters()), llama.RMSNorm)
    handles = meter.watch(model)
    head_input: list = []

    def capture(_m: Any, args: Any) -> None:
        head_input.append(args[0])
        meter.outputs.discard(_storage(args[0])[0])    # the chunked loss keeps the head's input whole
    handles.append(model.lm_head.register_forward_pre_hook(capture))
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    packed = PackedAttention(list(range(0, length, doc_len)) + [length]) if doc_len else contextlib.nullcontext()
    run = torch.compile(model, backend=PARTITIONER_BACKEND, dynamic=False) if compiled_step else model
    try:
        with meter.hooks(), packed, limit_recompiles(ACCOUNTING_RECOMPILES):
            run(ids)               # the logits themselves are not kept: the loss below does not use them
            (h,) = head_input
            loss = head_cross_entropy_sum(h[0, :-1], model.lm_head.weight, model.lm_head.bias, ids[0, 1:])
    finally:
        for handle in handles:
            handle.remove()
    peak = meter.peak_bytes - meter.region_bytes * (1 - 1 / sequence_parallel_tp)
    del loss, head_input
    return int(round(peak))


def measured_activation_coeffs(cfg: Any, tps: Iterable[int], length: int = MEASURE_LENGTH, dtype: Any = None,
                               sequence_parallel: bool = True,
                               compiled_step: bool = False) -> tuple[tuple[tuple[int, float], ...],
                                                                        tuple[tuple[int, float], ...]]:
    """``(activation_coeff, other_coeff)`` of ``MemoryModel`` for a zoo Llama config.

    The 1- and 2-layer models run on fake tensors (``FakeTensorMode`` on the CPU device: the same
    kernels are chosen, so the same tensors are saved, with the same shapes and dtypes as a real run,
    measured equal to the byte): nothing is allocated, so a 70B-shaped layer costs what a tiny one does
    (a real 168M-shaped pass took 23 s and its weights; the fake one 0.6 s). ``sequence_parallel``: the
    TP > 1 schemes run it (what the norms save is a TP rank's token slice); ``compiled_step``: count
    what a ``--compile`` step keeps."""
    A, other = [], []
    with torch.random.fork_rng(devices=[]), FakeTensorMode():
        torch.manual_seed(0)
        for tp in sorted(set(tps)):
            counts = []
            for n in (1, 2):
                m = llama.build(tp_shard_config(cfg, n, tp))
                if dtype is not None:
                    _cast_parameters(m, dtype)
                # packed (the common micro-batch, and the larger count): the model is an upper bound
                counts.append(saved_activation_bytes(m, length, PACKED_DOC_LEN,
                                                     tp if sequence_parallel else 1, compiled_step))
            layer = max(counts[1] - counts[0], 1) / length
            A.append((tp, layer * tp / cfg.hidden_size))
            other.append((tp, max(counts[0] / length - layer, 0.0)))
    return tuple(A), tuple(other)


def loss_transient_bytes(vocab: int, tokens: int, tp: int = 1, dtype: Any = None) -> int:
    """Bytes the chunked loss allocates for one chunk on top of what is saved (``head_cross_entropy``): the
    fp32 logits of ``min(tokens, chunk)`` tokens and their log-softmax; under TP with the gathered loss
    (the default in fp32) this rank's piece, the gathered pieces and their concatenation; with the
    vocabulary-parallel loss (the default below fp32) a few pieces of this rank's rows. At most a few
    times ``CHUNK_BYTES``, whatever the micro-batch's length."""
    rows = -(-vocab // tp)
    chunk = min(tokens, chunk_tokens(rows))
    if tp == 1:
        return 2 * chunk * vocab * 4
    if dtype is not None and dtype != torch.float32:        # vocabulary-parallel: logits, exp, log-probs
        return 3 * chunk * rows * 4
    return chunk * rows * 4 + 3 * chunk * vocab * 4          # piece, gathered, concatenated, log-softmax


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for fake parameters (``Module.to`` swaps tensors, which fake ones refuse);
    a tied parameter stays one."""
    cast: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in cast:
                    cast[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = cast[id(p)]


def runtime_memory_model(cfg: Any, device_memory: float, tps: Iterable[int], *, working_bytes: int = 4,
                         dtype: Any = None, states: Optional[Mapping] = None,
                         sequence_parallel: bool = True, compiled_step: bool = False) -> MemoryModel:
    """This runtime's memory model of a zoo Llama ``cfg`` on devices of ``device_memory`` bytes;
    ``states``: the model states this runtime's ranks hold (``counted_states``), which replace the
    formula for the schemes they list. Activations are counted in the working dtype (``dtype``;
    default: that of ``working_bytes``), with or without ``sequence_parallel`` under TP > 1, as an
    eager or a compiled (``compiled_step``) step keeps them."""
    if dtype is None:
        dtype = torch.bfloat16 if working_bytes == 2 else None
    A, other = measured_activation_coeffs(cfg, tps, dtype=dtype, sequence_parallel=sequence_parallel,
                                          compiled_step=compiled_step)
    h, f = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_kv_heads * cfg.head_dim
    layer_params = h * cfg.num_heads * cfg.head_dim * 2 + 2 * h * kv + 3 * h * f + 2 * h
    per_param = MASTER_AND_ADAM_BYTES + 2 * working_bytes
    embedding_mats = 1 if getattr(cfg, "tie_embeddings", False) else 2   # embedding + head
    return MemoryModel(activation_coeff=A, state_coeff=layer_params / h ** 2 * per_param,
                       alpha=MASTER_AND_ADAM_BYTES / per_param, framework_gap_bytes=0, safety_margin_bytes=0,
                       gpu_memory_bytes=int(device_memory), other_coeff=other,
                       embedding_bytes_per_param=embedding_mats * per_param,
                       scheme_states=tuple(sorted(dict(states or {}).items())),
                       loss_transient=loss_transient_terms(cfg.vocab_size, [tp for tp, _ in A], dtype))


def loss_transient_terms(vocab: int, tps: Iterable[int], dtype: Any = None) -> tuple[tuple[int, float, int], ...]:
    """``MemoryModel.loss_transient`` of ``loss_transient_bytes``: per TP degree, the bytes per loss
    token (it is linear up to one chunk) and the chunk's tokens."""
    out = []
    for tp in sorted(set(tps)):
        chunk = chunk_tokens(-(-vocab // tp))
        out.append((tp, loss_transient_bytes(vocab, chunk, tp, dtype) / chunk, chunk))
    return tuple(out)


def least_state_bytes(parameters: int, world_size: int, working_bytes: int = 4) -> float:
    """A lower bound of the model states on the fullest rank of any strategy of ``world_size`` ranks:
    its ``1/N`` of the fp32 masters and Adam moments, and at least ``1/N`` of the working weights and
    gradients (a pipeline's ranks hold every parameter between them, and the fullest at least their
    mean). A device smaller than this holds no scheme at all, whatever the profile says."""
    return parameters * (MASTER_AND_ADAM_BYTES + 2 * working_bytes) / world_size


def is_runtime_model(cost: CostModel, model: Any) -> bool:
    """Whether ``model`` is a zoo Llama of ``cost``'s shape: this runtime's memory model applies."""
    cfg = getattr(model, "config", None)
    return isinstance(cfg, llama.LlamaConfig) and (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == \
        (cost.model.hidden, cost.model.layers, cost.model.vocab)


def counted_states(cost: CostModel, model: Any, *, working_bytes: int = 4,
                   compiled: Any = None, group_size: Optional[int] = None) -> dict[tuple[int, int, int], tuple[int, int]]:
    """``MemoryModel.scheme_states`` of every <TP, PP> of ``cost`` on its world size: the bytes the
    fullest rank of such a pipeline holds in this runtime (``engine.model_states.scheme_states``:
    optimizer segments, one working layout and its gradients; the step's transient). Counted from
    the layouts of ``compiled`` (default: ``model`` traced here), nothing allocated; a <TP, PP> the
    model refuses is left to the formula. ``group_size``: the run shards its optimizer states over groups
    of that many ranks (``--shard-group``; None: the world)."""
    compiled = compiled if compiled is not None else hgraph.compile(model)
    n = cost.world_size
    schemes = [Scheme(tp, pp) for tp, pp in sorted({(tp, pp) for tp, pp, _ in cost.profiled}) if tp * pp <= n]
    dtype = torch.bfloat16 if working_bytes == 2 else torch.float32
    states = scheme_states(compiled, schemes, n, dtype, skip_refused=True, group_size=group_size)
    return {(tp, pp, n): v for (tp, pp), v in states.items()}


def with_device_memory(cost: CostModel, model: Any, device_memory: Optional[float], *,
                       working_bytes: int = 4, states: Optional[Mapping] = None,
                       sequence_parallel: bool = True, compiled_step: bool = False) -> CostModel:
    """``cost`` with MaxLen bounded by ``device_memory`` bytes per rank (None: ``cost`` unchanged).

    For a zoo Llama whose shape is the cost model's, the memory model becomes this runtime's
    (``runtime_memory_model``, with the model states its ranks hold: ``states``, counted here when
    not given); otherwise (a profile of another model, a non-zoo model) the profile's own App. B.1
    constants are kept with the limit as the device memory and no margins.
    """
    if device_memory is None:
        return cost
    cfg = getattr(model, "config", None)
    tps = sorted({tp for tp, _, _ in cost.profiled})
    if is_runtime_model(cost, model):
        if states is None:
            states = counted_states(cost, model, working_bytes=working_bytes)
        memory = runtime_memory_model(cfg, device_memory, tps, working_bytes=working_bytes, states=states,
                                      sequence_parallel=sequence_parallel, compiled_step=compiled_step)
    else:
        memory = dataclasses.replace(cost.memory, gpu_memory_bytes=int(device_memory), framework_gap_bytes=0,
                                     safety_margin_bytes=0)
    return dataclasses.replace(cost, memory=memory)


def default_device_memory(cost: CostModel, model_shape: Any, world_size: int, context: int) -> int:
    """The built-in run's limit: the smallest device on which the widest TP scheme (``TPmax PP1``)
    still holds a micro-batch of the model's whole ``context``. A TP1PP1 rank then holds about half of
    it (llama:tiny: 46%, TP2 running sequence parallelism; two thirds without), so the longest
    documents need TP >= 2 while most fit TP1PP1."""
    mem = cost.memory
    widest = Scheme(max(s.tp for s in cost.schemes if s.pp == 1 and s.seq == 1), 1, 1)
    return int(mem.state_bytes(model_shape, widest, world_size)
               + mem.activation_bytes_per_token(model_shape, widest) * context
               + mem.transient_bytes(widest, context)) + 1


def check_documents_fit(lengths: Sequence[int], cost: CostModel, device_memory: Optional[float],
                        schemes: Optional[Sequence[Any]] = None, offset: int = 0) -> None:
    """One-line error naming the first document longer than every scheme's MaxLen (of ``schemes``,
    default every scheme of ``cost``); ``offset``: index of ``lengths[0]`` in the data."""
    pool = list(dict.fromkeys(schemes if schemes is not None else cost.schemes))
    for s in pool:
        cost.max_len(s)      # a given scheme the profile lacks (or that does not fit) is that error
    largest = max((cost.max_len(s) for s in pool), default=0)
    over = np.flatnonzero(np.asarray(lengths, dtype=np.int64) > largest)     # one pass, not a Python loop
    if over.size:
        i = int(over[0])
        best = max(pool, key=cost.max_len, default=None)
        limit = f"--device-memory {bytes_text(device_memory)}" if device_memory is not None else \
            f"profile {cost.name!r}"
        raise HGraphError(
            f"document {offset + i} has {int(lengths[i])} tokens, more than any scheme holds under {limit} "
            f"(largest MaxLen {largest} tokens" + (f", {best}" if best is not None else "")
            + "); give more device memory or truncate the data")


def max_len_table(cost: CostModel) -> str:
    """``TP1PP1<=512, TP2PP1<=1100`` for the PP1 schemes (a log line)."""
    return ", ".join(f"{s}<={cost.max_len(s)}" for s in cost.schemes if s.pp == 1 and s.seq == 1)


def bytes_text(nbytes: Optional[float]) -> str:
    """A byte size as ``--device-memory`` takes it, in the largest unit that leaves a number of at
    least 1 (``1K``, ``512M``, ``1.5G``, ``12.86M``; 4 significant digits): a size given as ``1K`` is
    printed ``1K``, not ``0.0M``."""
    if nbytes is None:
        return "none"
    for unit, scale in (("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g}{unit}"
    return f"{nbytes:.4g}"
