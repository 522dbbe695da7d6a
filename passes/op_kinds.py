"""What a node of a traced graph computes, as the annotation passes read it: its op name and kind
(linear, embedding, attention), the parameters it reads and in which argument role, and the classes
of ops a tensor-parallel sharded activation may flow through unchanged.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.fx as fx
import torch.nn.functional as F

from hgraph import ops
from hgraph.linear_ops import IN_OUT_LINEARS
from hgraph.meta import OpKind

LINEAR_TARGETS = (F.linear,) + IN_OUT_LINEARS
EMBEDDING_TARGETS = (F.embedding,)
ATTENTION_TARGETS = (F.scaled_dot_product_attention, ops.causal_attention)

# Ops a sharded activation may flow through unchanged (elementwise, dtype, layout).
ELEMENTWISE = {
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "exp", "sigmoid", "silu", "gelu", "relu", "tanh",
    "softplus", "mish", "leaky_relu", "elu", "square", "sqrt", "rsqrt", "abs", "clamp",
    "to", "float", "half", "bfloat16", "type", "type_as", "contiguous", "clone", "detach",
    "iadd", "imul", "isub", "add_", "mul_", "floordiv", "where",
}
LAYOUT = {"transpose", "permute", "unsqueeze", "squeeze", "expand", "expand_as", "swapaxes", "movedim"}
RESHAPE = {"view", "reshape"}
SLICING = {"chunk", "split", "getitem", "cat", "narrow", "unbind", "stack", "flip", "roll"}


def op_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return str(t)
    if t is getattr:
        return "getattr"
    return getattr(t, "__name__", str(t)).lstrip("_")


def op_kind(node: fx.Node) -> OpKind:
    if node.op != "call_function":
        return OpKind.OTHER
    if node.target in LINEAR_TARGETS:
        return OpKind.LINEAR
    if node.target in EMBEDDING_TARGETS:
        return OpKind.EMBEDDING
    if node.target in ATTENTION_TARGETS:
        return OpKind.ATTENTION
    return OpKind.OTHER


def parameter_names(gm: fx.GraphModule) -> set[str]:
    return {name for name, _ in gm.named_parameters(remove_duplicate=False)}


def param_of(node: Any, params: set[str]) -> Optional[str]:
    """The parameter FQN a get_attr node reads, else None."""
    if isinstance(node, fx.Node) and node.op == "get_attr" and node.target in params:
        return str(node.target)
    return None


def op_params(node: fx.Node, params: set[str]) -> list[tuple[str, str, fx.Node]]:
    """(argument role, parameter FQN, get_attr node) for each parameter an op reads directly.

    The role is "weight" / "bias" for linear, embedding and layer_norm style ops, else "arg".
    """
    out = []
    kind = op_kind(node)
    for i, a in enumerate(node.args):
        name = param_of(a, params)
        if name is not None:
            role = "arg"
            if kind in (OpKind.LINEAR, OpKind.EMBEDDING):
                role = {1: "weight", 2: "bias"}.get(i, "arg")
            out.append((role, name, a))
    for k, a in node.kwargs.items():
        name = param_of(a, params)
        if name is not None:
            out.append((k if k in ("weight", "bias") else "arg", name, a))
    return out
