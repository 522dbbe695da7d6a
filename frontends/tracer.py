"""The torch.fx tracer of the fx frontend, and turning trace failures into one-line TraceErrors.

Leaf policy: the tracer goes THROUGH every module, including ``nn.Linear``, ``nn.Embedding`` and
the norms, so that each parameter access becomes a ``get_attr`` node feeding a functional op
(``F.linear``, ``F.embedding``, ...) that the passes can see, shard and put slots around. Only
modules the user declares as leaves (by class, or by qualified name such as ``"layers.0.mlp"``)
become ``call_module`` nodes; canonicalisation later turns leaf Linear / Embedding / LayerNorm back
into functional ops and rejects other leaves that hold parameters.

fx records ``node.meta["nn_module_stack"]`` (module path -> (qualified name, type)) for every node
created inside a submodule; the annotate pass reads the repeated blocks from it.
"""
from __future__ import annotations

import inspect
import os
import traceback
from typing import Any, Iterable, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn

from hgraph.errors import TraceError

LeafSpec = Union[type, str]

_TORCH_DIR = os.path.dirname(torch.__file__)


class HGraphTracer(fx.Tracer):
    """fx tracer that traces through all modules except user-declared leaves.

    It remembers the innermost module that was being traced when tracing failed, so the error can
    name it.
    """

    def __init__(self, leaf_modules: Iterable[LeafSpec] = ()):
        super().__init__()
        leaves = tuple(leaf_modules)
        bad = [x for x in leaves if not (isinstance(x, str) or (isinstance(x, type) and issubclass(x, nn.Module)))]
        if bad:
            raise TraceError(f"leaf_modules must be nn.Module subclasses or qualified module names, got {bad!r}")
        self.leaf_types = tuple(x for x in leaves if isinstance(x, type))
        self.leaf_names = frozenset(x for x in leaves if isinstance(x, str))
        self.failed_module: Optional[tuple[str, str]] = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.leaf_types) or module_qualified_name in self.leaf_names

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:  # the innermost module sees the exception first
                try:
                    path = self.path_of_module(m)
                except NameError:
                    path = "?"
                self.failed_module = (path, type(m).__name__)
            raise


def forward_signature(model: nn.Module) -> inspect.Signature:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"cannot read the signature of {type(model).__name__}.forward: {exc}") from None


def concrete_args_for(model: nn.Module) -> tuple[list[str], dict[str, Any]]:
    """Names of the traced inputs (token ids, then ``position_ids`` if forward takes it) and the
    values of the other forward arguments, which are fixed to their defaults while tracing.

    A forward with other required arguments cannot be traced into the canonical form.
    """
    params = list(forward_signature(model).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise TraceError(f"{type(model).__name__}.forward takes no positional input; hgraph needs "
                         "forward(input_ids, position_ids=None) -> logits")
    traced = [positional[0].name]
    if any(p.name == "position_ids" for p in params):
        traced.append("position_ids")
    concrete: dict[str, Any] = {}
    for p in params:
        if p.name in traced or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            raise TraceError(f"{type(model).__name__}.forward requires argument {p.name!r}; hgraph calls "
                             "forward(input_ids, position_ids=None), so other arguments need defaults")
        concrete[p.name] = p.default
    return traced, concrete


def trace_graph(model: nn.Module, leaf_modules: Iterable[LeafSpec] = ()) -> tuple[fx.Graph, HGraphTracer]:
    """Trace ``model.forward`` into an fx Graph whose root is ``model``; failures -> one-line TraceError."""
    tracer = HGraphTracer(leaf_modules)
    _, concrete = concrete_args_for(model)
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(describe_trace_failure(model, tracer, exc)) from exc
    return graph, tracer


def describe_trace_failure(model: nn.Module, tracer: HGraphTracer, exc: BaseException) -> str:
    """One line: where tracing failed (module, file:line and code) and what to do instead."""
    where = []
    if tracer.failed_module is not None:
        path, kind = tracer.failed_module
        where.append(f"in module '{path}' ({kind})" if path else f"in the top-level {kind}")
    frame = _user_frame(exc)
    if frame is not None:
        code = (frame.line or "").strip()
        where.append(f"at {os.path.basename(frame.filename)}:{frame.lineno}" + (f" `{code}`" if code else ""))
    reason = (str(exc).strip().splitlines() or [""])[0]
    subject = " ".join([f"torch.fx cannot trace {type(model).__name__}"] + where)
    return (f"{subject}: {type(exc).__name__}: {reason}; make that code traceable (a torch.fx.wrap'ped "
            "helper, a leaf module) or use the torch.export frontend (frontend=\"export\")")


def _user_frame(exc: BaseException) -> Optional[traceback.FrameSummary]:
    """The innermost traceback frame outside torch (the user's code that failed to trace)."""
    frames = traceback.extract_tb(exc.__traceback__)
    here = os.path.abspath(__file__)
    user = [f for f in frames if not os.path.abspath(f.filename).startswith(_TORCH_DIR)
            and os.path.abspath(f.filename) != here]
    return user[-1] if user else None
