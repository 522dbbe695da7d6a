"""The HGraph: a model's strategy-agnostic fx graph with empty slots, and what is known about it.

``hgraph.compiled.build_hgraph(model)`` traces the model into the canonical form (the frontends),
annotates blocks / op kinds / TP roles (``annotate_pass``) and inserts the empty slots
(``insert_slots_pass``). The resulting graph computes exactly what the model computes.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from hgraph.meta import CommPoint, OpKind, SlotKind, TPRole, get_meta

PRE, POST = "pre", "post"


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the HGraph.

    shard_dim / tp_role: how TP (and the optimizer layout) splits it; a parameter used by several
    ops (a tied embedding / head) has the role of its first use, and ``use_roles`` lists every use's.
    block / layer: of its first use; ``use_blocks``: the blocks of all its uses, in graph order.
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    shard_dim: Optional[int]
    tp_role: Optional[TPRole]
    block: Optional[str]
    layer: Optional[int]
    use_blocks: tuple[Optional[str], ...] = ()
    use_roles: tuple[Optional[TPRole], ...] = ()
    tp_partial: bool = False       # whole on every TP rank, but each rank's gradient is a partial sum

    @property
    def numel(self) -> int:
        return int(self.shape.numel())


@dataclass(frozen=True)
class ModelConfig:
    """The model dimensions the planner and the TP checks need."""

    vocab_size: Optional[int]
    hidden_size: Optional[int]
    intermediate_size: Optional[int]
    num_layers: int
    num_heads: Optional[int]
    num_kv_heads: Optional[int]
    head_dim: Optional[int]


class HGraph:
    """A slotted, annotated GraphModule plus its parameter table and block structure.

    ``gm``: the GraphModule (placeholders ``input_ids``, ``position_ids``; shares the model's
    parameters). ``params``: name -> ParamInfo in graph order. ``blocks``: ``"pre"``, the repeated
    blocks in order, ``"post"`` (pre / post only when the graph has nodes there).
    """

    def __init__(self, gm: fx.GraphModule, model: Optional[nn.Module] = None):
        self.gm = gm
        self.model = model
        self.blocks: list[str] = _blocks_in_order(gm)
        self.num_layers = sum(1 for b in self.blocks if b not in (PRE, POST))
        self.params: dict[str, ParamInfo] = _param_table(gm)
        self.uses_position_ids = any(n.users for n in gm.graph.nodes
                                     if n.op == "placeholder" and n.target == "position_ids")
        self._model_config: Optional[ModelConfig] = None

    @property
    def model_config(self) -> ModelConfig:
        if self._model_config is None:
            config = getattr(self.model, "config", None)
            self._model_config = (config_from_module(config, self.num_layers) if config is not None
                                  else infer_model_config(self))
        return self._model_config

    def slots(self, kind: Union[SlotKind, CommPoint, str, None] = None) -> list[fx.Node]:
        """Slot nodes in graph order, all or of one SlotKind or CommPoint (or their string value)."""
        out = []
        for n in self.gm.graph.nodes:
            m = get_meta(n)
            if m.slot is None:
                continue
            if kind is None or m.slot == kind or (m.comm_point is not None and m.comm_point == kind):
                out.append(n)
        return out

    def slot_counts(self) -> dict[str, int]:
        """Number of slots per SlotKind and, for comm_activation slots, per CommPoint as well."""
        counts: Counter = Counter()
        for n in self.slots():
            m = get_meta(n)
            counts[m.slot.value] += 1
            if m.comm_point is not None:
                counts[m.comm_point.value] += 1
        return dict(counts)

    def run(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits of the slotted graph; ``position_ids`` default to 0..T-1 in every row."""
        if position_ids is None:
            b, t = input_ids.shape
            position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
        return self.gm(input_ids, position_ids)

    __call__ = run

    def __repr__(self) -> str:
        return (f"HGraph({len(self.gm.graph.nodes)} nodes, {self.num_layers} layers, {len(self.params)} params, "
                f"slots {self.slot_counts()})")


def _blocks_in_order(gm: fx.GraphModule) -> list[str]:
    layers: dict[str, int] = {}
    seen = set()
    for n in gm.graph.nodes:
        m = get_meta(n)
        if m.block is None:
            continue
        seen.add(m.block)
        if m.layer is not None:
            layers[m.block] = m.layer
    ordered = sorted(layers, key=layers.__getitem__)
    return ([PRE] if PRE in seen else []) + ordered + ([POST] if POST in seen else [])


def _param_table(gm: fx.GraphModule) -> dict[str, ParamInfo]:
    out: dict[str, ParamInfo] = {}
    for n in gm.graph.nodes:
        m = get_meta(n)
        if m.slot != SlotKind.PUSH_GRADIENT or m.param is None:
            continue
        value = gm.get_parameter(m.param)
        uses = [u for pull in n.users if get_meta(pull).slot == SlotKind.PULL_PARAMETER for u in pull.users]
        use_blocks = tuple(get_meta(u).block for u in uses)
        use_roles = tuple(get_meta(u).tp_role for u in uses)
        first = get_meta(uses[0]) if uses else m
        out[m.param] = ParamInfo(m.param, value.shape, value.dtype, m.shard_dim, _param_role(m.tp_role, use_roles),
                                 first.block, first.layer, use_blocks, use_roles,
                                 any(get_meta(u).tp_partial for u in uses))
    return out


def _param_role(slot_role: Optional[TPRole], use_roles: tuple) -> Optional[TPRole]:
    """A tied embedding / head (VOCAB and COLUMN uses, both on dim 0) is VOCAB: its lookup needs the
    vocabulary-range rewrite; otherwise the role recorded on the parameter."""
    if TPRole.VOCAB in use_roles:
        return TPRole.VOCAB
    return slot_role


def config_from_module(config: Any, num_layers: int) -> ModelConfig:
    """ModelConfig from a model's ``.config`` (hgraph zoo names or Hugging Face names)."""
    def pick(*names: str) -> Any:
        for name in names:
            value = getattr(config, name, None) if not isinstance(config, Mapping) else config.get(name)
            if value is not None:
                return value
        return None

    heads = pick("num_heads", "num_attention_heads", "n_head")
    hidden = pick("hidden_size", "n_embd", "d_model")
    head_dim = pick("head_dim") or (hidden // heads if hidden and heads else None)
    return ModelConfig(
        vocab_size=pick("vocab_size"),
        hidden_size=hidden,
        intermediate_size=pick("intermediate_size", "n_inner", "ffn_dim"),
        num_layers=pick("num_layers", "num_hidden_layers", "n_layer") or num_layers,
        num_heads=heads,
        num_kv_heads=pick("num_kv_heads", "num_key_value_heads") or heads,
        head_dim=head_dim,
    )


def infer_model_config(hg: HGraph) -> ModelConfig:
    """ModelConfig read from the graph: parameter shapes of the first block and the shapes of the
    first attention's inputs (by propagating a small fake batch)."""
    gm = hg.gm
    vocab = hidden = intermediate = None
    for info in hg.params.values():
        if TPRole.VOCAB in info.use_roles and len(info.shape) == 2:
            vocab, hidden = int(info.shape[0]), int(info.shape[1])
            break
    first = next((b for b in hg.blocks if b not in (PRE, POST)), None)
    attention = next((n for n in gm.graph.nodes if get_meta(n).op == OpKind.ATTENTION and get_meta(n).block == first),
                     None)
    heads = kv = head_dim = None
    if attention is not None:
        shapes = _fake_shapes(gm, [attention.args[0], attention.args[1]])
        q, k = shapes
        if q is not None and len(q) == 4:
            heads, head_dim = int(q[1]), int(q[3])
        if k is not None and len(k) == 4:
            kv = int(k[1])
    for n in gm.graph.nodes:
        m = get_meta(n)
        if m.block != first or m.op != OpKind.LINEAR or m.param is None:
            continue
        w = gm.get_parameter(m.param)
        if hidden is None and m.tp_role == TPRole.COLUMN:
            hidden = int(w.shape[1])
        if m.tp_role == TPRole.ROW and not _fed_by(n.args[0], attention):
            intermediate = int(w.shape[1])  # the MLP's down projection
    return ModelConfig(vocab, hidden, intermediate, hg.num_layers, heads, kv, head_dim)


def _fed_by(node: Any, source: Optional[fx.Node]) -> bool:
    """Whether ``node`` is computed from ``source`` without passing through a linear op."""
    seen, work = set(), [node]
    while work:
        n = work.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n is source:
            return True
        if get_meta(n).op != OpKind.LINEAR:
            work.extend(n.all_input_nodes)
    return False


def _fake_shapes(gm: fx.GraphModule, nodes: list[Any]) -> list[Optional[tuple[int, ...]]]:
    """Shapes of ``nodes`` for a fake batch of 2 x 8 tokens (no real compute)."""

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        ids = torch.zeros(2, 8, dtype=torch.long)
        pos = torch.arange(8).expand(2, 8)
    ShapeProp(gm, fake_mode=mode).propagate(ids, pos)
    out = []
    for n in nodes:
        tm = n.meta.get("tensor_meta") if isinstance(n, fx.Node) else None
        out.append(tuple(tm.shape) if tm is not None and hasattr(tm, "shape") else None)
    return out
