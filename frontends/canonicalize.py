"""Canonicalisation of a traced graph into the form the hgraph passes rely on.

The canonical form (the contract of ``hgraph.frontends.fx_frontend.trace``):

* exactly two placeholders, ``input_ids`` and ``position_ids`` (both required; a model whose forward
  takes no ``position_ids`` gets an unused one);
* every parameter *use* is its own ``get_attr`` node whose target is the parameter's canonical FQN
  (the first name ``named_parameters()`` gives it, so a tied head uses ``embed_tokens.weight``),
  feeding a functional op; leaf ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm`` calls become
  ``F.linear`` / ``F.embedding`` / ``F.layer_norm``; ``x @ w.t()`` and ``addmm(b, x, w.t())`` with a
  2-D parameter ``w`` become ``F.linear(x, w[, b])``;
* attention stays a ``call_function`` to ``F.scaled_dot_product_attention``, which must be causal
  with no mask (packing makes it block-diagonal per document; any other attention is rejected);
  attention written by hand (softmax of ``q @ k^T`` with a causal mask) becomes that call
  (``hgraph.frontends.eager_attention``), or is refused when it cannot be packed;
* a dropout that trains (``F.dropout`` / ``nn.Dropout`` with ``training`` true and ``p > 0``) is
  ``ops.keyed_dropout(x, p)``, whose masks do not depend on the strategy; one that does not train is
  gone; other dropout kinds that train are refused;
* the output is a single tensor (a one-element tuple, or a dict / tuple holding ``logits``, is
  unwrapped).

All rewrites work on the fx Graph whose root is the user's model, before the GraphModule is built,
so the GraphModule references (does not copy) the model's parameters.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from hgraph import ops
from hgraph.errors import TraceError
from hgraph.frontends.attention_form import mask_example_length
from hgraph.frontends.eager_attention import depends_on, mask_evaluator, rewrite_eager_attention

STACK_KEY = "nn_module_stack"

_TRANSPOSE_METHODS = {"t", "transpose", "permute"}
# what fx emits to check that a concrete argument keeps its traced value
_GUARD_TARGETS = (operator.eq, torch._assert, getattr(fx._symbolic_trace, "_assert_is_none", None))


def canonical_param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its canonical FQN (the first name under which named_parameters() lists it)."""
    return {id(p): name for name, p in model.named_parameters()}


def resolve_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def canonicalize_graph(graph: fx.Graph, model: nn.Module, traced_inputs: list[str]) -> None:
    """Rewrite ``graph`` (traced from ``model``) into the canonical form, in place."""
    _canonical_placeholders(graph, traced_inputs)
    _functionalize_leaves(graph, model)
    _keyed_dropouts(graph)
    _rewrite_matmuls(graph, model)
    _eager_attention(graph, model)
    _split_parameter_uses(graph, model)
    _single_output(graph, model)
    _check_attention(graph)
    graph.lint()


def _canonical_placeholders(graph: fx.Graph, traced_inputs: list[str]) -> None:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    by_name = {n.target: n for n in placeholders}
    ids = by_name[traced_inputs[0]]
    if ids.target != "input_ids":
        if "input_ids" in by_name:
            raise TraceError("forward's first argument must be the token ids; it is "
                             f"{ids.target!r} while another argument is called 'input_ids'")
        ids.target = "input_ids"
        ids.name = "input_ids"
    ids.args = ()
    pos = by_name.get("position_ids")
    if pos is None:
        with graph.inserting_after(ids):
            pos = graph.placeholder("position_ids")
    pos.args = ()  # required: HGraph.run fills in the default positions
    extra = [n for n in placeholders if n is not ids and n is not pos]
    for n in extra:  # concrete (defaulted) arguments: fx keeps a placeholder and a value guard
        guards = _descendants(n)
        if not all(g.op == "call_function" and g.target in _GUARD_TARGETS for g in guards):
            raise TraceError(f"forward argument {n.target!r} is used by the traced graph; hgraph calls "
                             "forward(input_ids, position_ids) only")
        for g in reversed([x for x in graph.nodes if x in guards]):
            graph.erase_node(g)
        graph.erase_node(n)


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen, work = set(), list(node.users)
    while work:
        n = work.pop()
        if n not in seen:
            seen.add(n)
            work.extend(n.users)
    return seen


def _new_get_attr(graph: fx.Graph, target: str, meta_from: fx.Node) -> fx.Node:
    node = graph.get_attr(target)
    if STACK_KEY in meta_from.meta:
        node.meta[STACK_KEY] = meta_from.meta[STACK_KEY]
    return node


def _functionalize_leaves(graph: fx.Graph, model: nn.Module) -> None:
    """Leaf Linear / Embedding / LayerNorm -> functional ops; other leaves may not hold parameters."""
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        mod = resolve_attr(model, node.target)
        if node.kwargs or len(node.args) != 1:
            call = None
        elif isinstance(mod, nn.Linear):
            call = (F.linear, ("weight", "bias"), {})
        elif isinstance(mod, nn.Embedding):
            call = (F.embedding, ("weight",), {"padding_idx": mod.padding_idx, "max_norm": mod.max_norm,
                                               "norm_type": mod.norm_type,
                                               "scale_grad_by_freq": mod.scale_grad_by_freq,
                                               "sparse": mod.sparse})
        elif isinstance(mod, nn.Dropout):
            call = (F.dropout, (), {"p": mod.p, "training": mod.training})
        elif isinstance(mod, nn.LayerNorm):
            call = (F.layer_norm, (), {"normalized_shape": tuple(mod.normalized_shape),
                                       "weight": "weight", "bias": "bias", "eps": mod.eps})
        else:
            call = None
        if call is None:
            if any(True for _ in mod.parameters()):
                raise TraceError(f"leaf module '{node.target}' ({type(mod).__name__}) holds parameters that "
                                 "hgraph must see; trace through it (only Linear, Embedding and LayerNorm "
                                 "leaves are turned into functional ops)")
            continue
        fn, positional, kwargs = call
        with graph.inserting_before(node):
            def param(attr: str) -> Optional[fx.Node]:
                if getattr(mod, attr, None) is None:
                    return None
                return _new_get_attr(graph, f"{node.target}.{attr}", node)
            args = (node.args[0],) + tuple(param(a) for a in positional)
            kw = {k: (param(v) if k in ("weight", "bias") else v) for k, v in kwargs.items()}
            new = graph.call_function(fn, args, kw)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


_DROPOUTS = {F.dropout: ("input", "p", "training", "inplace"), torch.dropout: ("input", "p", "train")}
_OTHER_DROPOUTS = (F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)


def _keyed_dropouts(graph: fx.Graph) -> None:
    """Training dropout -> ``ops.keyed_dropout``; a dropout that does not train disappears."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _OTHER_DROPOUTS:
            if node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True):
                raise TraceError(f"{node.target.__name__} {_where(node)} trains; hgraph applies plain "
                                 "elementwise dropout only (F.dropout / nn.Dropout)")
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        names = _DROPOUTS.get(node.target)
        if names is None:
            continue
        bound = {"p": 0.5, "training": True, "train": True} | dict(zip(names, node.args)) | dict(node.kwargs)
        p, training = bound["p"], bound["training"] and bound["train"]
        if isinstance(p, fx.Node) or isinstance(training, fx.Node):
            raise TraceError(f"dropout {_where(node)} has a probability or training flag computed at run time; "
                             "hgraph needs constants")
        if training and p:
            with graph.inserting_before(node):
                new = graph.call_function(ops.keyed_dropout, (bound["input"], float(p)))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
        else:
            node.replace_all_uses_with(bound["input"])
        graph.erase_node(node)


def _eager_attention(graph: fx.Graph, model: nn.Module) -> None:
    """Hand-written softmax attention -> causal SDPA (``hgraph.frontends.eager_attention``)."""
    memo: dict = {}

    def is_param(n: fx.Node) -> bool:
        return n.op == "get_attr" and isinstance(resolve_attr(model, n.target), nn.Parameter)

    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    evaluate = mask_evaluator(graph, lambda target: resolve_attr(model, target),
                              emb.num_embeddings if emb is not None else 2, mask_example_length(model, 8))
    rewrite_eager_attention(graph, evaluate, lambda n: not depends_on(n, is_param, memo))


def _where(n: fx.Node) -> str:
    stack = [path for path, _ in (n.meta.get(STACK_KEY) or {}).values()]
    return f"in module '{stack[-1]}'" if stack else "at the top level"


def _param_node(node: Any, model: nn.Module) -> Optional[fx.Node]:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = resolve_attr(model, node.target)
        if isinstance(value, nn.Parameter):
            return node
    return None


def _transposed_matrix_param(node: Any, model: nn.Module) -> Optional[fx.Node]:
    """If ``node`` is the transpose of a 2-D parameter ``w`` (w.t(), w.T, w.transpose(0, 1),
    w.permute(1, 0), torch.t(w), ...), the get_attr node of ``w``."""
    if not isinstance(node, fx.Node) or node.kwargs or not node.args:
        return None
    if node.op == "call_method" and node.target in _TRANSPOSE_METHODS:
        kind = node.target
    elif node.op == "call_function" and node.target in (torch.t, torch.transpose, torch.permute):
        kind = node.target.__name__
    elif node.op == "call_function" and node.target is getattr and tuple(node.args[1:]) in (("T",), ("mT",)):
        kind = "t"
    else:
        return None
    p = _param_node(node.args[0], model)
    if p is None or resolve_attr(model, p.target).dim() != 2:
        return None
    rest = tuple(node.args[1:]) if kind != "t" else ()
    if kind == "permute" and len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = tuple(rest[0])
    if not all(isinstance(d, int) for d in rest):
        return None
    dims = tuple(d % 2 for d in rest)
    swaps = {"t": dims == (), "transpose": sorted(dims) == [0, 1], "permute": dims == (1, 0)}
    return p if swaps[kind] else None


def _rewrite_matmuls(graph: fx.Graph, model: nn.Module) -> None:
    """x @ w.t() -> F.linear(x, w); addmm(b, x, w.t()) -> F.linear(x, w, b) (exactly equal)."""
    for node in list(graph.nodes):
        new_args = None
        if node.op == "call_function" and node.target in (operator.matmul, torch.matmul) and not node.kwargs:
            w = _transposed_matrix_param(node.args[1], model)
            if w is not None:
                new_args = (node.args[0], w)
        elif node.op == "call_method" and node.target == "matmul" and not node.kwargs:
            w = _transposed_matrix_param(node.args[1], model)
            if w is not None:
                new_args = (node.args[0], w)
        elif node.op == "call_function" and node.target is torch.addmm and not node.kwargs and len(node.args) == 3:
            w = _transposed_matrix_param(node.args[2], model)
            if w is not None:
                new_args = (node.args[1], w, node.args[0])
        if new_args is None:
            continue
        transpose = node.args[1] if len(new_args) == 2 else node.args[2]
        with graph.inserting_before(node):
            new = graph.call_function(F.linear, new_args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if not transpose.users:
            graph.erase_node(transpose)


def _split_parameter_uses(graph: fx.Graph, model: nn.Module) -> None:
    """One get_attr per parameter use, targeting the canonical FQN, placed right before its user."""
    canonical = canonical_param_names(model)
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = resolve_attr(model, node.target)
        if not isinstance(value, nn.Parameter):
            continue
        name = canonical[id(value)]
        for user in list(node.users):
            with graph.inserting_before(user):
                use = _new_get_attr(graph, name, user)
            user.replace_input_with(node, use)
        graph.erase_node(node)


def _single_output(graph: fx.Graph, model: nn.Module) -> None:
    out = next(n for n in graph.nodes if n.op == "output")
    value = out.args[0]
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    elif isinstance(value, dict) and "logits" in value:
        value = value["logits"]
    if not isinstance(value, fx.Node):
        raise TraceError(f"{type(model).__name__}.forward returns {type(value).__name__}; hgraph needs a "
                         "single logits tensor (or a one-element tuple / a dict with 'logits')")
    out.args = (value,)


def _check_attention(graph: fx.Graph) -> None:
    """Every SDPA call must be causal without an explicit mask (the packing contract)."""
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not F.scaled_dot_product_attention:
            continue
        mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
        causal = n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)
        if mask is not None or causal is not True:
            stack = [path for path, _ in (n.meta.get(STACK_KEY) or {}).values()]
            where = f"in module '{stack[-1]}'" if stack else "at the top level"
            raise TraceError(f"attention {where} is scaled_dot_product_attention with "
                             f"{'an attn_mask' if mask is not None else 'is_causal=False'}; hgraph trains "
                             "causal language models: call it with is_causal=True and no mask")
