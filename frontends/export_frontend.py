"""The torch.export frontend: models torch.fx cannot trace (Hugging Face transformers) -> canonical form.

``export_trace(model)``:

1. Hugging Face models get ``attn_implementation="sdpa"`` where they have it (one op instead of the
   eager path's softmax written out, which ``hgraph.frontends.eager_attention`` recognises, as it
   does in models without SDPA such as Gemma-2); a sliding window is read from the evaluated mask
   (``hgraph.frontends.attention_form``).
2. A thin wrapper calls ``model(input_ids, position_ids=position_ids, use_cache=False)`` and returns
   the logits tensor; it is exported with ``torch.export.export(..., strict=False)``, batch and
   sequence length dynamic, in train mode (what training runs; dropout becomes ``ops.keyed_dropout``)
   and with the parameters in the working precision (``dtype``): code that casts back to an input's
   dtype (Hugging Face RMSNorm's ``.to(input_dtype)``) records the dtype the run computes in, not fp32.
3. The exported graph is rebuilt with the original model's names: each parameter use becomes its own
   ``get_attr`` of the parameter's canonical FQN (a tied head reads ``embed_tokens.weight``), buffers
   and constants are ``get_attr`` too, ``nn_module_stack`` paths lose the wrapper's prefix, and
   higher-order ops around no-grad / autocast regions (the rotary tables) are inlined.
4. ``hgraph.frontends.aten_canonical`` turns the aten ops into the canonical ops (linear, Conv1D,
   embedding, layer norm, causal SDPA, torch-level layout ops); attention written by hand becomes
   causal SDPA (``hgraph.frontends.eager_attention``).
5. A deep model is exported with two layers and the second layer's graph replicated (checked to be
   a copy of the first; ``hgraph.frontends.layer_replication``), which makes export time nearly
   independent of depth.

The GraphModule shares the model's parameters and buffers (references, not copies). Export failures
raise a one-line ``TraceError`` naming the exception and the model code where export stopped.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import traceback
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from hgraph.errors import TraceError
from hgraph.frontends import aten_canonical
from hgraph.frontends.canonicalize import _check_attention, canonical_param_names
from hgraph.frontends.attention_form import mask_example_length
from hgraph.frontends.eager_attention import depends_on, mask_evaluator, rewrite_eager_attention
from hgraph.frontends.moe_blocks import swapped_moe_blocks
from hgraph.frontends.layer_replication import (NotReplicable, layer_container, replicate_layers as replicate,
                                                truncated_layers)

__all__ = ["LogitsOf", "export_trace", "logits_of"]

WRAPPER = "model"            # the wrapped model's attribute name: stripped from FQNs and module paths
EXAMPLE_LEN = 8              # example sequence length (any length > 1 exports the same dynamic graph)
_HOP_INPUTS = {"wrap_with_set_grad_enabled": 2, "wrap_with_autocast": 5}   # index of the first real input
_TORCH_DIR = os.path.dirname(torch.__file__)


def logits_of(output: Any) -> torch.Tensor:
    """The logits tensor of a model's output: the tensor itself, ``.logits``, a one-element tuple or a
    dict holding ``logits``."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        return output.logits
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TraceError(f"the model returns {type(output).__name__}; hgraph needs the logits (a tensor, "
                     "an output with .logits, or a tuple whose first element is the logits)")


class LogitsOf(nn.Module):
    """``forward(input_ids, position_ids) -> logits`` of ``model`` (the module that is exported)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        params = _forward_parameters(model)
        self.takes_positions = "position_ids" in params
        # no KV cache: HF models take use_cache as a named argument or through **kwargs
        takes_cache = "use_cache" in params or (_accepts_var_kwargs(model) and
                                                hasattr(getattr(model, "config", None), "use_cache"))
        self.extra = {"use_cache": False} if takes_cache else {}

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.takes_positions:
            return logits_of(self.model(input_ids, position_ids=position_ids, **self.extra))
        return logits_of(self.model(input_ids, **self.extra))


def _forward_parameters(model: nn.Module) -> dict:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def _accepts_var_kwargs(model: nn.Module) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in _forward_parameters(model).values())


def prepare_hf_attention(model: nn.Module) -> None:
    """Hugging Face models: SDPA attention (set on the model) where the model has it, else its eager
    attention (``eager_attention`` rewrites it); sliding windows are read from the masks."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return
    if config._attn_implementation != "sdpa":
        if not getattr(model, "_supports_sdpa", True):
            return      # eager attention (e.g. Gemma-2's softcapped logits): rewritten by eager_attention
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("sdpa")
        else:
            config._attn_implementation = "sdpa"


@contextlib.contextmanager
def _train_mode(model: nn.Module) -> Iterator[None]:
    """Export what training runs: train-mode branches, dropout (kept as strategy-invariant dropout)."""
    modes = {m: m.training for m in model.modules()}
    model.train()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


def _vocab_size(model: nn.Module) -> int:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size:
        return int(size)
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else 2


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs warnings and prints the partial graph to stderr when it fails; the error we
    raise says what matters in one line, so both are held back while exporting."""
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def _traced_tensors(model: nn.Module, dtype: Optional[torch.dtype]) -> Iterator[None]:
    """While exporting: the floating parameters replaced by uninitialised ones in ``dtype`` (the same
    object for tied ones; export reads shapes and dtypes only, untouched pages cost no memory), and for
    a model whose parameters are on the meta device, its buffers too (export wants one device; the
    buffers' values are read later, from the model, to check attention masks)."""
    meta = any(p.device.type == "meta" for p in model.parameters())
    swapped: dict[int, torch.Tensor] = {}
    originals: list[tuple[dict, str, torch.Tensor]] = []

    def swap(table: dict, name: str, new: Callable[[torch.Tensor], torch.Tensor]) -> None:
        t = table[name]
        if id(t) not in swapped:
            swapped[id(t)] = new(t)
        originals.append((table, name, t))
        table[name] = swapped[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and dtype is not None and p.is_floating_point() and p.dtype != dtype:
                swap(module._parameters, name,
                     lambda t: nn.Parameter(torch.empty_like(t, dtype=dtype), requires_grad=t.requires_grad))
        for name, b in list(module._buffers.items()):
            if meta and b is not None and b.device.type != "meta":
                swap(module._buffers, name, lambda t: torch.empty_like(t, device="meta"))
    try:
        yield
    finally:
        for table, name, t in reversed(originals):
            table[name] = t


def export_program(model: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.export.ExportedProgram:
    """``torch.export`` of ``LogitsOf(model)`` with dynamic batch and sequence length, in train mode,
    the parameters in ``dtype`` (the working precision; None: as they are)."""
    wrapper = LogitsOf(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = torch.randint(0, _vocab_size(model), (2, EXAMPLE_LEN)).to(device)
    pos = torch.arange(EXAMPLE_LEN, device=device).expand(2, EXAMPLE_LEN)
    dyn = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}
    try:
        with _train_mode(model), _traced_tensors(model, dtype), _quiet_torch_logs():
            return torch.export.export(wrapper, (ids, pos), dynamic_shapes=(dyn, dyn), strict=False)
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(describe_export_failure(model, exc)) from exc


def describe_export_failure(model: nn.Module, exc: BaseException) -> str:
    """One line: what stopped torch.export (exception and first message line) and where in the model."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(_TORCH_DIR)
              and os.path.abspath(f.filename) != os.path.abspath(__file__)]
    where = ""
    if frames:
        f = frames[-1]
        where = f" at {os.path.basename(f.filename)}:{f.lineno}" + (f" `{f.line.strip()}`" if f.line else "")
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    reason = lines[0] if lines else ""
    return f"torch.export cannot export {type(model).__name__}{where}: {type(exc).__name__}: {reason}"


# ---- rebuilding the exported graph with the model's names ---------------------------------------
def _strip(path: str) -> Optional[str]:
    return path[len(WRAPPER) + 1:] if path.startswith(WRAPPER + ".") else None


def _stack(meta: dict) -> dict:
    """nn_module_stack without the wrapper and the export hooks' placeholder entries."""
    out = {}
    for key, (path, kind) in (meta.get(aten_canonical.STACK_KEY) or {}).items():
        inner = _strip(path) if isinstance(path, str) else None
        if inner:
            out[key] = (inner, kind)
    return out


class _GraphBuilder:
    """Copies an exported graph into a new fx Graph whose get_attr targets are the model's FQNs."""

    def __init__(self, ep: torch.export.ExportedProgram, model: nn.Module):
        self.ep, self.model = ep, model
        self.graph = fx.Graph()
        self.root: dict[str, Any] = {}
        self.env: dict[fx.Node, Any] = {}
        self.params: dict[fx.Node, str] = {}          # exported placeholder -> canonical FQN
        self.new_attrs: list[fx.Node] = []

    def build(self) -> tuple[fx.Graph, dict[str, Any]]:
        sig = self.ep.graph_signature
        canonical = canonical_param_names(self.model)
        placeholders = [n for n in self.ep.graph_module.graph.nodes if n.op == "placeholder"]
        users = [n for n in placeholders if n.name in sig.user_inputs]
        for node, name in zip(users, ("input_ids", "position_ids")):
            self.env[node] = self.graph.placeholder(name)
        for node in placeholders:
            if node.name in sig.inputs_to_parameters:
                fqn = _strip(sig.inputs_to_parameters[node.name])
                param = self.model.get_parameter(fqn)
                self.params[node] = canonical[id(param)]
                self.root[canonical[id(param)]] = param
            elif node.name in sig.inputs_to_buffers:
                fqn = _strip(sig.inputs_to_buffers[node.name])
                self.root[fqn] = self.model.get_buffer(fqn)
                self.env[node] = self.graph.get_attr(fqn)
            elif node.name in sig.inputs_to_lifted_tensor_constants:
                name = f"_export_constant_{len(self.root)}"
                self.root[name] = self.ep.constants[sig.inputs_to_lifted_tensor_constants[node.name]]
                self.env[node] = self.graph.get_attr(name)
            elif node not in self.env:
                raise TraceError(f"the exported graph has an input {node.name!r} hgraph does not know "
                                 "(neither input_ids, position_ids, a parameter, a buffer nor a constant)")
        for node in self.ep.graph_module.graph.nodes:
            if node.op in ("call_function", "call_method"):
                self._copy(node, self.ep.graph_module)
            elif node.op == "output":
                value = node.args[0]
                self.graph.output(self.env[value[0] if isinstance(value, (tuple, list)) else value])
        return self.graph, self.root

    def _arg(self, n: fx.Node, stack: dict) -> Any:
        if n in self.params:  # one get_attr per parameter use, right before the use
            attr = self.graph.get_attr(self.params[n])
            attr.meta[aten_canonical.STACK_KEY] = stack
            return attr
        return self.env[n]

    def _copy(self, node: fx.Node, owner: fx.GraphModule) -> None:
        stack = _stack(node.meta)
        name = getattr(node.target, "__name__", "")
        if name in _HOP_INPUTS:
            self._inline(node, owner, stack)
            return
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            raise TraceError(f"the exported graph uses the higher-order op {name} {aten_canonical.where(node)}; "
                             "the export frontend inlines only no-grad and autocast regions")
        src = node.args[0] if node.args else None
        if node.target.__name__ == "getitem" and isinstance(self.env.get(src), tuple):
            self.env[node] = self.env[src][node.args[1]]   # an output of an inlined region
            return
        new = self.graph.node_copy(node, lambda n: self._arg(n, stack))
        new.meta = {k: v for k, v in node.meta.items() if k != aten_canonical.STACK_KEY}
        new.meta[aten_canonical.STACK_KEY] = stack
        self.env[node] = new

    def _inline(self, hop: fx.Node, owner: fx.GraphModule, stack: dict) -> None:
        """Copy a no-grad / autocast region's subgraph inline; a no-grad region's outputs are detached."""
        first = _HOP_INPUTS[hop.target.__name__]
        sub = getattr(owner, hop.args[first - 1].target)
        inputs = [self._arg(a, stack) if isinstance(a, fx.Node) else a for a in hop.args[first:]]
        sub_env: dict[fx.Node, Any] = {}
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        sub_env.update(zip(placeholders, inputs))
        no_grad = hop.target.__name__ == "wrap_with_set_grad_enabled" and hop.args[0] is False
        outputs: tuple = ()
        for n in sub.graph.nodes:
            if n.op in ("call_function", "call_method"):
                if getattr(n.target, "__name__", "") in _HOP_INPUTS:
                    raise TraceError(f"nested no-grad / autocast regions {aten_canonical.where(hop)} are not "
                                     "supported by the export frontend")
                new = self.graph.node_copy(n, lambda a: sub_env[a])
                new.meta = {k: v for k, v in n.meta.items() if k != aten_canonical.STACK_KEY}
                new.meta[aten_canonical.STACK_KEY] = stack
                sub_env[n] = new
            elif n.op == "output":
                values = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
                outputs = tuple(sub_env[v] for v in values)
        if no_grad:
            detached = []
            for v in outputs:
                d = self.graph.call_method("detach", (v,))
                d.meta[aten_canonical.STACK_KEY] = stack
                detached.append(d)
            outputs = tuple(detached)
        self.env[hop] = outputs


def export_trace(model: nn.Module, *, replicate_layers: bool = True,
                 dtype: Optional[torch.dtype] = None) -> fx.GraphModule:
    """The canonical GraphModule of ``model`` through torch.export (placeholders ``input_ids``,
    ``position_ids``; the model's parameter FQNs), traced with its
    parameters in ``dtype``, the working precision the graph will run in (None: as they are).

    ``replicate_layers``: a model with more than two layers in a config-sized ModuleList is exported
    with two and the second layer's graph is replicated (``hgraph.frontends.layer_replication``);
    when the layers turn out not to be copies of each other the whole model is exported.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"hgraph exports nn.Module instances, got {type(model).__name__}")
    prepare_hf_attention(model)
    with swapped_moe_blocks(model):      # MoE blocks export as hgraph's MoE op (``hgraph.frontends.moe_blocks``)
        gm = _export_canonical(model, replicate_layers, dtype)
    return gm


def _export_canonical(model: nn.Module, replicate_layers: bool, dtype: Optional[torch.dtype]) -> fx.GraphModule:
    layers = layer_container(model) if replicate_layers else None
    if layers is not None and len(layers[1]) > 2:
        path, modules = layers
        try:
            with truncated_layers(model, path, keep=2):
                graph, root = _canonical_graph(model, dtype)
            replicate(graph, root, model, path, len(modules), canonical_param_names(model))
        except NotReplicable:
            graph, root = _canonical_graph(model, dtype)
    else:
        graph, root = _canonical_graph(model, dtype)
    graph.eliminate_dead_code()
    graph.lint()
    gm = fx.GraphModule(root, graph, class_name=f"{type(model).__name__}HGraph")
    if hasattr(model, "config"):
        gm.config = model.config
    return gm


def _canonical_graph(model: nn.Module, dtype: Optional[torch.dtype]) -> tuple[fx.Graph, dict[str, Any]]:
    """Export ``model`` and rewrite the graph into the canonical form: (graph, get_attr root)."""
    ep = export_program(model, dtype)
    graph, root = _GraphBuilder(ep, model).build()
    params = {name for name, obj in root.items() if isinstance(obj, nn.Parameter)}
    aten_canonical.translate_aten_ops(graph)
    aten_canonical.moe_layers(graph)
    aten_canonical.rewrite_linears(graph, params.__contains__, lambda name: root[name].shape)
    aten_canonical.inputs_device(graph)
    memo: dict = {}

    def free(n: fx.Node) -> bool:        # depends only on the inputs, buffers and constants
        return not depends_on(n, lambda a: a.op == "get_attr" and a.target in params, memo)

    evaluate = mask_evaluator(graph, root.__getitem__, _vocab_size(model), mask_example_length(model, EXAMPLE_LEN))
    rewrite_eager_attention(graph, evaluate, free)
    aten_canonical.rewrite_attention(graph, evaluate, free)
    graph.eliminate_dead_code()
    _check_attention(graph)
    return graph, root
