"""Attention written by hand (matmul, scale, mask, softmax, matmul) -> causal SDPA.

Packing puts several documents in one row; only an attention op the passes know is made
block-diagonal per document (``hgraph.passes.packed_attention``). A model that computes
``softmax(q @ k^T * scale + causal mask) @ v`` itself (nanoGPT-style blocks, Hugging Face "eager"
attention) would otherwise let every document attend to the ones packed before it, silently.

``rewrite_eager_attention(graph, evaluate_masks, free)`` finds, for every softmax over the last
dimension, the chain back to ``matmul(q, k.transpose(-2, -1))`` through dtype casts, scalar scales
(``* s``, ``/ s``) and one causal mask (``masked_fill(mask, -inf)`` or ``+ additive_mask``), and the
chain forward through casts and an optional dropout of the probabilities to ``matmul(probs, v)``,
and replaces the whole by ``F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s
[, dropout_p=p])`` (with ``enable_gqa`` when k and v are repeated per query group, as
``repeat_kv`` does). The mask must depend only on the positions (``free``) and equal, on an example
(``evaluate_masks``), the causal mask or a causal sliding window. Logit softcapping
(``tanh(s / c) * c`` of the scaled scores, Gemma-2) or a window makes it ``ops.causal_attention``
with ``softcap`` / ``window`` instead, which SDPA cannot express. What cannot be packed is refused in
one line naming the module: a softmax over ``q @ k^T`` that is not this pattern (no mask, another
mask, a bias on the scores, a scale after the softcap).

Both frontends call it on their canonical graphs (torch-level ops; aten ops the export frontend
leaves, such as ``aten.softmax`` and ``aten.matmul``, are matched by name too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from hgraph import ops
from hgraph.errors import TraceError
from hgraph.frontends.aten_canonical import STACK_KEY
from hgraph.frontends.attention_form import NOT_CAUSAL, causal_attention_node, causal_window

_CASTS = {"to", "float", "half", "bfloat16", "type_as", "_to_copy", "contiguous", "clone"}
_ALIASES = {"truediv": "div", "_softmax": "softmax", "bmm": "matmul", "__matmul__": "matmul",
            "masked_fill_": "masked_fill", "mul_": "mul", "div_": "div", "add_": "add"}
_VERY_NEGATIVE = -1e4      # a fill value that zeroes a probability in any dtype's softmax


def op_name(n: Any) -> str:
    """What ``n`` computes, the same for a torch function, a method and an aten overload."""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        return ""
    t = n.target
    if n.op == "call_method":
        name = t
    elif isinstance(t, torch._ops.OpOverload):
        name = t.overloadpacket.__name__
    else:
        name = getattr(t, "__name__", "")
    return _ALIASES.get(name, name)


def where(n: fx.Node) -> str:
    stack = [path for path, _ in (n.meta.get(STACK_KEY) or {}).values()]
    return f"in module '{stack[-1]}'" if stack else "at the top level"


@dataclass
class _Scores:
    """What lies between ``q @ k^T`` and the softmax."""

    q: fx.Node
    k: fx.Node
    scale: float = 1.0
    softcap: Optional[float] = None
    fill_mask: Optional[fx.Node] = None        # masked_fill(scores, mask, -inf): mask True = hidden
    add_mask: Optional[fx.Node] = None         # scores + mask: 0 = seen, very negative = hidden
    other: Optional[str] = None                # why this is not a causal attention pattern


def _number(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _skip_casts(n: Any) -> Any:
    while op_name(n) in _CASTS:
        n = n.args[0]
    return n


def _k_of_transpose(n: Any) -> Optional[fx.Node]:
    """``k`` when ``n`` is ``k`` with its last two dimensions swapped."""
    name = op_name(n)
    if name == "transpose" and len(n.args) == 3 and {n.args[1], n.args[2]} in ({-2, -1}, {2, 3}):
        return n.args[0]
    if name == "permute":
        dims = list(n.args[1]) if isinstance(n.args[1], (list, tuple)) else list(n.args[1:])
        if dims in ([0, 1, 3, 2],):
            return n.args[0]
    if name == "mT" or (n is not None and getattr(n, "op", None) == "call_function" and n.target is getattr
                        and n.args[1] == "mT"):
        return n.args[0]
    return None


def _scores(x: Any, free: Callable[[fx.Node], bool]) -> Optional[_Scores]:
    """Walk back from the softmax input to ``q @ k^T``; None: no such matmul."""
    scale, softcap, fill, add, other = 1.0, None, None, None, None
    for _ in range(16):
        x = _skip_casts(x)
        name = op_name(x)
        if name == "matmul":
            q, kt = x.args[0], x.args[1]
            k = _k_of_transpose(kt)
            if k is None or free(q) or free(kt):
                return None
            return _Scores(q, k, scale, softcap, fill, add, other)
        if name == "masked_fill":
            value = _number(x.args[2])
            if fill is not None or add is not None or value is None or value > _VERY_NEGATIVE or not free(x.args[1]):
                other = other or "a mask computed from activations, or more than one mask"
            fill = x.args[1]
            x = x.args[0]
        elif name in ("add", "sub") and len(x.args) == 2:
            a, b = x.args
            if isinstance(b, fx.Node) and free(b) and name == "add" and fill is None and add is None:
                add, x = b, a
            elif isinstance(a, fx.Node) and free(a) and name == "add" and fill is None and add is None:
                add, x = a, b
            else:
                other = other or "a bias added to the attention scores"
                x = a if isinstance(a, fx.Node) and not free(a) else b
        elif name in ("mul", "div") and len(x.args) == 2:
            a, b = x.args
            c = _number(b) if name == "div" else (_number(b) if _number(b) is not None else _number(a))
            t = a if name == "div" or _number(b) is not None else b
            if c is None:
                return None
            inner = _skip_casts(t)
            if name == "mul" and op_name(inner) == "tanh":       # softcap: tanh(s / c) * c
                arg = inner.args[0]
                n2 = op_name(arg)
                cap = _number(arg.args[1]) if n2 in ("div", "mul") and len(arg.args) == 2 else None
                if cap is not None and n2 == "mul":
                    cap = 1.0 / cap if cap else None
                if cap is None or not math.isclose(cap, c, rel_tol=1e-6):
                    return None
                if scale != 1.0 or softcap is not None:
                    other = other or "a scale applied to the scores after the logit softcapping"
                softcap, x = c, arg.args[0]
                continue
            scale = scale * c if name == "mul" else scale / c
            x = t
        else:
            return None
    return None


def _probabilities_users(softmax: fx.Node) -> Optional[tuple[float, fx.Node]]:
    """(dropout p, ``matmul(probs, v)``) after the softmax through casts and one dropout; None otherwise."""
    p, n = 0.0, softmax
    while True:
        users = list(n.users)
        if len(users) != 1:
            return None
        u = users[0]
        name = op_name(u)
        if name in _CASTS and u.args[0] is n:
            n = u
        elif u.op == "call_function" and u.target is ops.keyed_dropout and p == 0.0:
            p, n = float(u.args[1]), u
        elif name == "matmul" and u.args[0] is n:
            return p, u
        else:
            return None


def _unrepeated(node: Any) -> Optional[fx.Node]:
    """``x`` if ``node`` is repeat_kv(x) (``x[:, :, None].expand(b, kv, rep, t, d).reshape(b, kv*rep, t, d)``)
    or ``x.repeat_interleave(rep, dim=1)``."""
    name = op_name(node)
    if name == "repeat_interleave" and (node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None) == 1):
        return node.args[0]
    if name not in ("reshape", "view"):
        return None
    exp = node.args[0]
    if op_name(exp) != "expand":
        return None
    unsq = exp.args[0]
    if op_name(unsq) == "unsqueeze" and unsq.args[1] == 2:
        return unsq.args[0]
    if op_name(unsq) == "getitem" and isinstance(unsq.args[1], tuple) and len(unsq.args[1]) >= 3 \
            and unsq.args[1][2] is None:
        return unsq.args[0]
    return None


def rewrite_eager_attention(graph: fx.Graph, evaluate_masks: Callable[[list[fx.Node]], dict[fx.Node, torch.Tensor]],
                            free: Callable[[fx.Node], bool]) -> None:
    """Hand-written causal attention -> causal SDPA; unpackable attention refused."""
    found = []
    for sm in [n for n in graph.nodes if op_name(n) == "softmax"]:
        dim = sm.kwargs.get("dim", sm.args[1] if len(sm.args) > 1 else None)
        scores = _scores(sm.args[0], free)
        if scores is None:
            continue                    # a softmax of something else (a router, a loss): not attention
        what = f"attention {where(sm)} (softmax of q @ k^T)"
        if dim not in (-1, 3):
            raise TraceError(f"{what} normalises over dimension {dim}; hgraph packs attention whose softmax "
                             "runs over the keys (the last dimension)")
        if scores.other:
            raise TraceError(f"{what} uses {scores.other}; hgraph packs causal attention whose mask depends "
                             "only on the positions")
        if scores.fill_mask is None and scores.add_mask is None:
            raise TraceError(f"{what} has no mask (bidirectional); hgraph trains causal language models")
        after = _probabilities_users(sm)
        if after is None:
            raise TraceError(f"{what}: the probabilities are used for more than one dropout and the product "
                             "with the values; hgraph cannot pack that")
        found.append((sm, scores, after))
    if not found:
        return
    masks = [s.fill_mask if s.fill_mask is not None else s.add_mask for _, s, _ in found]
    values = evaluate_masks(sorted(set(masks), key=lambda m: m.name))
    for (sm, scores, (p, out)), mask in zip(found, masks):
        m = values[mask]
        if scores.fill_mask is not None:
            allowed = ~m.bool()
        else:
            allowed = m == 0
            if not bool((m[~allowed] <= _VERY_NEGATIVE).all()):
                allowed = torch.zeros_like(allowed)      # some hidden score is not hidden: never causal
        window = causal_window(allowed)
        if window == NOT_CAUSAL:
            raise TraceError(f"attention {where(sm)} uses a mask that is neither causal nor a causal sliding "
                             "window for positions 0..T-1 (bidirectional or padding mask?); hgraph packs causal "
                             "attention only")
        q, k, v = scores.q, scores.k, out.args[1]
        kwargs: dict = {"scale": scores.scale}
        k0, v0 = _unrepeated(k), _unrepeated(v)
        if k0 is not None and v0 is not None:
            k, v, kwargs["enable_gqa"] = k0, v0, True
        if p:
            kwargs["dropout_p"] = p
        with graph.inserting_before(out):
            new = causal_attention_node(graph, q, k, v, kwargs, scores.softcap, window)
        new.meta.update(out.meta)
        out.replace_all_uses_with(new)
    graph.eliminate_dead_code()


def depends_on(node: fx.Node, is_source: Callable[[fx.Node], bool], memo: dict) -> bool:
    """Whether ``node`` is computed from a node for which ``is_source`` holds (``memo`` shared across calls)."""
    work, order = [node], []
    while work:
        n = work.pop()
        if n in memo:
            continue
        memo[n] = None
        order.append(n)
        work.extend(n.all_input_nodes)
    for n in reversed(order):
        if memo[n] is None:
            memo[n] = is_source(n) or any(memo[a] for a in n.all_input_nodes if memo[a] is not None)
    return bool(memo[node])


def mask_evaluator(graph: fx.Graph, attr: Callable[[str], Any], vocab: int, example_len: int = 8):
    """Evaluates mask nodes on a CPU example (one row, positions 0..T-1) by running only the nodes
    they depend on (``attr(target)``: a get_attr's value), so it works for a model on the meta device."""
    def evaluate(masks: list[fx.Node]) -> dict[fx.Node, torch.Tensor]:
        needed, work = set(), list(masks)
        while work:
            n = work.pop()
            if n not in needed:
                needed.add(n)
                work.extend(n.all_input_nodes)
        sub, env = fx.Graph(), {}
        placeholders = []
        for n in graph.nodes:
            if n in needed or n.op == "placeholder":
                env[n] = sub.node_copy(n, env.__getitem__)
                if n.op == "placeholder":
                    placeholders.append(n.target)
        sub.output(tuple(env[m] for m in masks))
        root = {str(n.target): attr(str(n.target)) for n in sub.nodes if n.op == "get_attr"}
        if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in root.values()):
            raise TraceError("the attention mask depends on buffers of a model on the meta device; "
                             "build the model on a real device to check its mask")
        inputs = {"input_ids": torch.randint(0, vocab, (1, example_len)),
                  "position_ids": torch.arange(example_len)[None]}
        with torch.no_grad():
            values = fx.GraphModule(root, sub)(*[inputs.get(name) for name in placeholders])
        return dict(zip(masks, values))
    return evaluate

