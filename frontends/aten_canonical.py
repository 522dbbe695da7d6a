"""Rewrites of an exported (aten-level) graph into the canonical HGraph form.

``torch.export`` gives aten ops (``aten.view.default``, ``aten.linear.default``, ...). The passes
read torch-level ops (``F.linear``, ``x.view(...)``, ``operator.getitem``, ...), so each rewrite here
turns one aten pattern into the op the fx frontend would have produced, computing the same values:

* ``translate_aten_ops``: layout / elementwise / slicing aten ops -> the torch method or function of
  the same name (``aten.slice`` -> ``x[..., a:b]``, ``aten.sym_size`` -> ``x.size(d)``); no-op nodes
  (metadata asserts, ``alias``, ``dropout`` with p = 0 or not training, full slices) disappear;
  a train-mode ``dropout`` becomes ``ops.keyed_dropout`` (strategy-invariant masks);
* ``moe_layers``: ``torch.ops.hgraph.moe_layer`` (hgraph's MoE op as it exports) -> ``moe.moe_layer``;
* ``rewrite_linears``: ``aten.linear`` -> ``F.linear``; ``addmm(b, x, w.t())`` and
  ``matmul(x, w.t()) (+ b)`` -> ``F.linear(x, w[, b])``; GPT-2's Conv1D
  ``view(x, [-1, in]) -> addmm(b, ., w) -> view(., [..., out])`` -> ``in_out_linear(x, w, b)``;
  ``aten.embedding(w, ids)`` -> ``F.embedding(ids, w)``; ``aten.layer_norm`` -> ``F.layer_norm``;
* ``rewrite_attention``: SDPA (``aten.scaled_dot_product_attention`` or a ``_scaled_dot_product_*``
  variant) -> ``F.scaled_dot_product_attention(q, k, v, is_causal=True, ...)`` (``ops.causal_attention``
  with its ``window`` for a sliding-window mask, ``hgraph.frontends.attention_form``) after checking that
  its explicit mask depends only on the inputs and is the causal mask on an example batch; key / value
  heads repeated for grouped-query attention (``repeat_kv``) are passed unrepeated with
  ``enable_gqa=True`` (the same values, and TP can split the key / value heads).

Parameters are ``get_attr`` nodes (one per use) before these rewrites run.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from hgraph import moe, ops
from hgraph.errors import TraceError
from hgraph.frontends.attention_form import NOT_CAUSAL, causal_attention_node, causal_window
from hgraph.linear_ops import in_out_linear

aten = torch.ops.aten
STACK_KEY = "nn_module_stack"
_INT_MAX = 2 ** 63 - 1

# aten op packet -> Tensor method name (same positional arguments)
_METHODS = {
    aten.view: "view", aten._unsafe_view: "view", aten.reshape: "reshape", aten.transpose: "transpose",
    aten.permute: "permute", aten.unsqueeze: "unsqueeze", aten.squeeze: "squeeze", aten.split: "split",
    aten.chunk: "chunk", aten.mean: "mean", aten.clone: "clone", aten.contiguous: "contiguous",
    aten.flatten: "flatten", aten.unflatten: "unflatten", aten.type_as: "type_as",
}
# aten op packet -> torch-level function (same positional arguments)
_FUNCTIONS = {
    aten.add: operator.add, aten.sub: operator.sub, aten.mul: operator.mul, aten.div: operator.truediv,
    aten.neg: operator.neg, aten.pow: torch.pow, aten.rsqrt: torch.rsqrt, aten.sqrt: torch.sqrt,
    aten.exp: torch.exp, aten.tanh: torch.tanh, aten.sigmoid: torch.sigmoid, aten.silu: F.silu,
    aten.gelu: F.gelu, aten.relu: F.relu, aten.cat: torch.cat, aten.cos: torch.cos, aten.sin: torch.sin,
    aten.where: torch.where, aten.abs: torch.abs,
}
_NO_OPS = (aten._assert_tensor_metadata, aten._assert_scalar, aten.sym_constrain_range_for_size)
_SDPA = {aten.scaled_dot_product_attention: None,  # returns the output itself
         aten._scaled_dot_product_flash_attention_for_cpu: 0, aten._scaled_dot_product_flash_attention: 0,
         aten._scaled_dot_product_efficient_attention: 0, aten._scaled_dot_product_cudnn_attention: 0}


def packet(node: fx.Node) -> Any:
    """The aten op packet of a call_function node (``aten.view``), else None."""
    target = node.target if node.op == "call_function" else None
    return getattr(target, "overloadpacket", None) if isinstance(target, torch._ops.OpOverload) else None


def where(node: fx.Node) -> str:
    """'in module PATH' of the innermost module a node was created in (for error messages)."""
    stack = [path for path, _ in (node.meta.get(STACK_KEY) or {}).values()]
    return f"in module '{stack[-1]}'" if stack else "at the top level"


def _replace(graph: fx.Graph, node: fx.Node, op: str, target: Any, args: tuple, kwargs: Optional[dict] = None
             ) -> fx.Node:
    with graph.inserting_before(node):
        new = graph.create_node(op, target, args, kwargs or {})
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _drop(graph: fx.Graph, node: fx.Node, value: fx.Node) -> None:
    """Remove an identity node: its users read ``value`` instead."""
    node.replace_all_uses_with(value)
    graph.erase_node(node)


# ---- layout / elementwise ops -------------------------------------------------------------------
def _slice_index(dim: int, index: Any) -> tuple:
    return (slice(None),) * dim + (index,) if dim >= 0 else (Ellipsis, index) + (slice(None),) * (-dim - 1)


def _is_full_slice(start: Any, end: Any, step: Any) -> bool:
    return start in (None, 0) and (end is None or end == _INT_MAX) and step in (None, 1)


def moe_layers(graph: fx.Graph) -> None:
    """``torch.ops.hgraph.moe_layer`` (how ``moe.moe_layer`` exports) -> the call of ``moe.moe_layer``."""
    for node in list(graph.nodes):
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) is torch.ops.hgraph.moe_layer:
            x, router, experts, top_k, normalize = node.args
            _replace(graph, node, "call_function", moe.moe_layer, (x, router, *experts),
                     {"top_k": top_k, "normalize_top_k": normalize})


def translate_aten_ops(graph: fx.Graph) -> None:
    """aten layout / elementwise / slicing ops -> torch methods and functions."""
    for node in list(graph.nodes):
        pk = packet(node)
        if pk is None:
            continue
        args, kwargs = tuple(node.args), dict(node.kwargs)
        if pk in _NO_OPS:
            if not node.users:
                graph.erase_node(node)
        elif pk in (aten.alias, aten.lift_fresh_copy):
            _drop(graph, node, args[0])
        elif pk is aten.detach:
            _replace(graph, node, "call_method", "detach", args[:1])
        elif pk is aten.dropout:        # exported in train mode: a dropout with p > 0 stays, keyed
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            if (args[2] if len(args) > 2 else kwargs.get("train", False)) and p:
                if not isinstance(p, (int, float)):
                    raise TraceError(f"dropout {where(node)} has a probability computed at run time ({p}); "
                                     "hgraph needs a constant dropout probability")
                _replace(graph, node, "call_function", ops.keyed_dropout, (args[0], float(p)))
            else:
                _drop(graph, node, args[0])
        elif pk is aten.sym_size:
            _replace(graph, node, "call_method", "size", args)
        elif pk is aten.slice:
            x, dim = args[0], args[1] if len(args) > 1 else 0
            start, end, step = (list(args[2:]) + [None, None, 1])[:3]
            if _is_full_slice(start, end, step):
                _drop(graph, node, x)
            else:
                end = None if end == _INT_MAX else end
                _replace(graph, node, "call_function", operator.getitem,
                         (x, _slice_index(dim, slice(start, end, None if step == 1 else step))))
        elif pk is aten.select:
            _replace(graph, node, "call_function", operator.getitem, (args[0], _slice_index(args[1], args[2])))
        elif pk is aten.expand:
            _replace(graph, node, "call_method", "expand", args[:2])
        elif pk is aten.to:  # the device is where the inputs are: only a dtype change is kept
            dtype = _to_dtype(node)
            if dtype is None:
                _drop(graph, node, args[0])
            else:
                _replace(graph, node, "call_method", "to", args[:1], {"dtype": dtype})
        elif pk in _METHODS and not kwargs:
            _replace(graph, node, "call_method", _METHODS[pk], args)
        elif pk in _FUNCTIONS and (not kwargs or pk is aten.gelu):
            _replace(graph, node, "call_function", _FUNCTIONS[pk], args, kwargs)


def _to_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype an ``aten.to`` overload converts to (None: a device move only)."""
    schema = node.target._schema
    bound = {a.name: v for a, v in zip(schema.arguments, node.args)} | dict(node.kwargs)
    if "other" in bound:
        raise TraceError(f"Tensor.to(other) {where(node)} is not supported by the export frontend")
    return bound.get("dtype")


def inputs_device(graph: fx.Graph) -> None:
    """Ops created on a fixed device while exporting (``arange(..., device=cpu)``) use the device of
    ``input_ids`` instead, so the graph runs wherever its inputs are (meta, CPU, CUDA)."""
    fixed = [n for n in graph.nodes if isinstance(n.kwargs.get("device"), torch.device)]
    if not fixed:
        return
    ids = next(n for n in graph.nodes if n.op == "placeholder" and n.target == "input_ids")
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        device = graph.call_function(getattr, (ids, "device"))
    for n in fixed:
        n.update_kwarg("device", device)


# ---- linear, embedding, norms -------------------------------------------------------------------
def _param(node: Any, is_param: Callable[[str], bool]) -> Optional[fx.Node]:
    if isinstance(node, fx.Node) and node.op == "get_attr" and is_param(str(node.target)):
        return node
    return None


def _transposed_param(node: Any, is_param: Callable[[str], bool]) -> Optional[fx.Node]:
    """The get_attr of ``w`` if ``node`` is ``aten.t(w)`` / ``aten.transpose(w, 0, 1)`` / ``permute(w, [1, 0])``."""
    if not isinstance(node, fx.Node):
        return None
    pk = packet(node)
    ok = (pk is aten.t or (pk is aten.transpose and sorted(d % 2 for d in node.args[1:3]) == [0, 1])
          or (pk is aten.permute and [d % 2 for d in node.args[1]] == [1, 0]) or
          (node.op == "call_method" and node.target in ("t", "transpose", "permute")
           and (node.target == "t" or sorted(_dims(node)) == [0, 1])))
    return _param(node.args[0], is_param) if ok else None


def _dims(node: fx.Node) -> list[int]:
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = rest[0]
    return [d % 2 for d in rest if isinstance(d, int)]


def _erase_if_unused(graph: fx.Graph, *nodes: Any) -> None:
    for n in nodes:
        if isinstance(n, fx.Node) and not n.users:
            graph.erase_node(n)


def rewrite_linears(graph: fx.Graph, is_param: Callable[[str], bool], param_shape: Callable[[str], torch.Size]
                    ) -> None:
    """linear / addmm / matmul(+add) / Conv1D / embedding / layer_norm -> canonical ops."""
    for node in list(graph.nodes):
        pk = packet(node)
        if pk is aten.linear:
            _replace(graph, node, "call_function", F.linear, tuple(node.args))
        elif pk is aten.embedding:
            w, ids = node.args[0], node.args[1]
            padding = node.args[2] if len(node.args) > 2 else -1
            kw = {"padding_idx": padding} if padding not in (-1, None) else {}
            _replace(graph, node, "call_function", F.embedding, (ids, w), kw)
        elif pk is aten.layer_norm:
            _replace(graph, node, "call_function", F.layer_norm, tuple(node.args[:5]))
        elif pk is aten.addmm and not node.kwargs:
            bias, x, w = node.args
            wt = _transposed_param(w, is_param)
            if wt is not None:
                _replace(graph, node, "call_function", F.linear, (x, wt, bias))
                _erase_if_unused(graph, w)
            elif _param(w, is_param) is not None:
                _rewrite_conv1d(graph, node, param_shape)
        elif pk in (aten.matmul, aten.mm) and not node.kwargs:
            x, w = node.args
            wt = _transposed_param(w, is_param)
            if wt is None:
                continue
            new = _replace(graph, node, "call_function", F.linear, (x, wt))
            _erase_if_unused(graph, w)
            _fuse_bias(graph, new, is_param, param_shape)


def _fuse_bias(graph: fx.Graph, linear: fx.Node, is_param, param_shape) -> None:
    """linear(x, w) + b with a 1-D parameter b of the output size -> linear(x, w, b)."""
    users = list(linear.users)
    if len(users) != 1:
        return
    add = users[0]
    if add.target is not operator.add and packet(add) is not aten.add or add.kwargs or len(add.args) != 2:
        return
    bias = add.args[1] if add.args[0] is linear else add.args[0]
    b = _param(bias, is_param)
    w_shape = param_shape(str(linear.args[1].target))
    if b is None or tuple(param_shape(str(b.target))) != (w_shape[0],):
        return
    linear.args = (linear.args[0], linear.args[1], b)
    add.replace_all_uses_with(linear)
    graph.erase_node(add)


def _rewrite_conv1d(graph: fx.Graph, addmm: fx.Node, param_shape) -> None:
    """view(x, [-1, in]) -> addmm(b, ., w[in, out]) -> view(., [..., out])  ==>  in_out_linear(x, w, b)."""
    bias, flat, w = addmm.args
    shape = param_shape(str(w.target))
    users = list(addmm.users)
    flat_shape = flat.args[1] if flat.op == "call_method" and flat.target in ("view", "reshape") else None
    if (flat_shape is None or len(flat_shape) != 2 or flat_shape[0] != -1 or flat_shape[1] != shape[0]
            or len(users) != 1 or users[0].op != "call_method" or users[0].target not in ("view", "reshape")):
        # a plain x2d @ w + b with x already 2-D is still a linear with an [in, out] weight
        _replace(graph, addmm, "call_function", in_out_linear, (flat, w, bias))
        return
    unflat = users[0]
    x = flat.args[0]
    out_shape = unflat.args[1]
    if not isinstance(out_shape, (list, tuple)) or out_shape[-1] != shape[1]:
        _replace(graph, addmm, "call_function", in_out_linear, (flat, w, bias))
        return
    with graph.inserting_before(addmm):
        new = graph.call_function(in_out_linear, (x, w, bias))
    new.meta.update(addmm.meta)
    unflat.replace_all_uses_with(new)
    graph.erase_node(unflat)
    graph.erase_node(addmm)
    _erase_if_unused(graph, flat)


# ---- attention ----------------------------------------------------------------------------------
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def rewrite_attention(graph: fx.Graph, mask_values: Callable[[list[fx.Node]], dict[fx.Node, torch.Tensor]],
                      free: Callable[[fx.Node], bool]) -> None:
    """SDPA variants -> causal ``F.scaled_dot_product_attention``.

    ``mask_values(nodes)`` evaluates mask nodes on an example batch with positions 0..T-1;
    ``free(node)``: whether a node depends only on the graph inputs, buffers and constants.
    """
    sdpas = [n for n in graph.nodes if packet(n) in _SDPA]
    masks = {}
    for n in sdpas:
        bound = _bind_sdpa(n)
        mask = bound.get("attn_mask")
        if not isinstance(bound.get("dropout_p") or 0.0, (int, float)):
            raise TraceError(f"attention {where(n)} has a dropout probability computed at run time; hgraph "
                             "needs a constant dropout_p")
        if mask is not None:
            if not free(mask):
                raise TraceError(f"attention {where(n)} uses a mask computed from activations or parameters; "
                                 "hgraph needs causal attention whose mask depends only on the positions")
            masks[n] = mask
        elif not bound.get("is_causal"):
            raise TraceError(f"attention {where(n)} is not causal (no mask, is_causal=False); hgraph trains "
                             "causal language models")
    values = mask_values(sorted(set(masks.values()), key=lambda m: m.name)) if masks else {}
    windows: dict[fx.Node, Optional[int]] = {}
    for n, mask in masks.items():
        m = values[mask]
        if m.dtype == torch.bool:
            allowed = m
        else:          # additive: 0 seen, -inf (or the dtype's minimum) hidden
            allowed = m == 0
            if m.is_floating_point() and not (bool((m[~allowed] == float("-inf")).all())
                                              or bool((m[~allowed] < -1e30).all())):
                allowed = torch.zeros_like(allowed)
        windows[n] = causal_window(allowed)
        if windows[n] == NOT_CAUSAL:
            raise TraceError(f"attention {where(n)} uses a mask that is neither causal nor a causal sliding window "
                             "for positions 0..T-1 (bidirectional or padding mask?); hgraph supports causal "
                             "attention only (packed documents become block-diagonal causal)")
    for n in sdpas:
        _to_causal_sdpa(graph, n, windows.get(n))
    graph.eliminate_dead_code()


def _bind_sdpa(n: fx.Node) -> dict:
    bound = dict(zip(_SDPA_NAMES, n.args)) | dict(n.kwargs)
    if packet(n) is not aten.scaled_dot_product_attention:   # (q, k, v, dropout_p, is_causal, ...)
        bound = dict(zip(("query", "key", "value", "dropout_p", "is_causal"), n.args)) | dict(n.kwargs)
    return bound


def _to_causal_sdpa(graph: fx.Graph, n: fx.Node, window: Optional[int]) -> None:
    bound = _bind_sdpa(n)
    q, k, v = bound["query"], bound["key"], bound["value"]
    gqa = bool(bound.get("enable_gqa", False))
    k0, v0 = _unrepeated_kv(k), _unrepeated_kv(v)
    if k0 is not None and v0 is not None:
        k, v, gqa = k0, v0, True
    kwargs: dict = {}
    if bound.get("scale") is not None:
        kwargs["scale"] = bound["scale"]
    if bound.get("dropout_p"):        # a train-mode model: the packed-attention pass keys its masks
        kwargs["dropout_p"] = float(bound["dropout_p"])
    if gqa:
        kwargs["enable_gqa"] = True
    index = _SDPA[packet(n)]
    with graph.inserting_before(n):
        new = causal_attention_node(graph, q, k, v, kwargs, None, window)
    new.meta.update(n.meta)
    if index is None:
        n.replace_all_uses_with(new)
    else:  # the variants return (output, logsumexp, ...): only the output may be used
        for u in list(n.users):
            if u.target is not operator.getitem or u.args[1] != index:
                raise TraceError(f"attention {where(n)}: the graph uses more than the attention output")
            u.replace_all_uses_with(new)
            graph.erase_node(u)
    graph.erase_node(n)


def _unrepeated_kv(node: Any) -> Optional[fx.Node]:
    """``x`` if ``node`` is repeat_kv(x): reshape(expand(x[:, :, None], [b, kv, rep, t, d]), [b, kv*rep, t, d])."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "reshape"):
        return None
    exp = node.args[0]
    if not (isinstance(exp, fx.Node) and exp.op == "call_method" and exp.target == "expand"):
        return None
    unsq = exp.args[0]
    if not (isinstance(unsq, fx.Node) and unsq.op == "call_method" and unsq.target == "unsqueeze"
            and unsq.args[1] == 2):
        return None
    size = exp.args[1]
    if len(size) != 5 or len(node.args[1]) != 4:
        return None
    return unsq.args[0]
