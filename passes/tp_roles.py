"""Tensor-parallel roles of the linears of a traced graph (Megatron's column / row pairs), by a
forward data-flow analysis inside each block.

A linear whose input is not sharded is COLUMN and makes its output sharded; a linear whose input is
sharded is ROW and makes its output whole again. Sharded values may only flow through elementwise
ops, reshapes that keep the head count free (``-1``), slicing after such a reshape, and attention; a
sharded value reaching anything else (a reduction, a mix with a whole activation, the block's
output) makes the linears of that column/row group REPLICATED, never silently wrong. Embeddings are
VOCAB; a "post" linear producing the output logits is COLUMN; other parameter users (norm weights)
and parameters with conflicting uses are REPLICATED.

hgraph's MoE op (``moe.moe_layer``) on a whole input inside a block is EXPERTS: every expert is a
SwiGLU MLP, so its gate / up matrices split by their intermediate rows (COLUMN) and its down matrix by
the same columns (ROW), as a dense MLP's; the router stays whole (REPLICATED) and routes every token on
every TP rank alike, and the op's output is a partial sum over the TP ranks (reduced after it).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch.fx as fx

from hgraph import moe
from hgraph.linear_ops import IN_OUT_LINEARS
from hgraph.meta import OpKind, TPRole
from hgraph.passes.blocks import POST
from hgraph.passes.op_kinds import (ATTENTION_TARGETS, ELEMENTWISE, LAYOUT, RESHAPE, SLICING, op_kind, op_name,
                                    op_params, param_of)

FLAT, HEADS = "flat", "heads"  # sharded along the last dim / along a head dim after a -1 reshape
FUSED = "fused"                 # a fused projection's output cut into parts (split / chunk): a tuple
#: ``NodeMeta.tp_rewrite`` position of a node cutting a fused projection into parts (split, chunk, slice)
FUSED_PART = -1
#: ``NodeMeta.tp_rewrite`` position of a sum / mean over the whole sharded feature dim (partial sums all-reduced)
PARTIAL_SUM = -2


class _Groups:
    """Union-find over linears: a ROW joins the group of the COLUMNs feeding it."""

    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}

    def find(self, x: fx.Node) -> fx.Node:
        self.parent.setdefault(x, x)
        while self.parent[x] is not x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: fx.Node, b: fx.Node) -> None:
        self.parent[self.find(a)] = self.find(b)


def _reshape_state(node: fx.Node, state: str, local_meta: set[fx.Node]) -> tuple[Optional[str], Optional[int]]:
    """State after a view/reshape of a sharded value (None when TP would change its meaning), and the
    position in the target shape of a size that TP must rewrite for the shard (``shard_tp``).

    The sharded dim may be split with the free ``-1`` in front (heads) and constant factors behind it
    (``view(b, t, -1, head_dim)``), or kept whole as the last dim (``reshape(b, t, -1)``,
    ``view(-1, x.size(-1))``). Sizes written out are rewritten: ``view(b, t, heads, head_dim)`` with one
    constant head count in front of a head dim that is a constant or computed from a whole tensor
    (``C // n_head``) gives HEADS and a rewrite of the head count;
    ``view(b, t, hidden)`` of a HEADS value, the hidden size a constant or read from a whole tensor, gives
    FLAT and a rewrite of that width. A symbolic last dim read from a sharded tensor (``local_meta``)
    is its local width already.
    """
    shape = tuple(node.args[1:])
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if not shape:
        return None, None
    last, front = shape[-1], shape[:-1]
    if -1 not in [d for d in shape if isinstance(d, int)]:
        heads = [i for i, d in enumerate(front) if isinstance(d, int) and d != 1]
        # the last size a constant or computed from a whole tensor (nanoGPT's ``C // n_head``)
        whole_last = isinstance(last, int) or (isinstance(last, fx.Node) and last not in local_meta)
        if state == FLAT and whole_last and len(heads) == 1:
            return HEADS, heads[0]
        if state == HEADS and len(shape) == 3 and whole_last:
            return FLAT, len(shape) - 1
        if state == FLAT and isinstance(last, fx.Node) and last in local_meta and not heads:
            return state, None
        return None, None
    constant_front = any(isinstance(d, int) and d not in (-1, 1) for d in front)
    if isinstance(last, int) and last == -1:
        return (None if constant_front else FLAT), None
    if isinstance(last, fx.Node) and last in local_meta:
        return state, None  # view(-1, x.size(-1)): the sharded dim stays as it is
    return HEADS, None  # -1 in front of a constant trailing dim: the free dim holds the heads


# reductions that keep a HEADS value sharded when they reduce its last (head) dim
_LAST_DIM_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "norm", "softmax", "log_softmax", "rms_norm"}


def _reduces_last_dim(n: fx.Node) -> bool:
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    if op_name(n) == "rms_norm":
        shape = n.args[1] if len(n.args) > 1 else n.kwargs.get("normalized_shape")
        return isinstance(shape, (tuple, list)) and len(shape) == 1
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return all(isinstance(d, int) and d == -1 for d in dims)


def _partial_reduction(n: fx.Node) -> bool:
    """A sum / mean over the last dim with ``keepdim=True`` (a full-width norm's statistic): on a FLAT
    value each TP rank reduces its slice, and the all-reduced result broadcasts over the shard."""
    if op_name(n) not in ("mean", "sum") or not _reduces_last_dim(n):
        return False
    keepdim = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
    return keepdim is True and not n.kwargs.get("dtype")


def _flow(n: fx.Node, states: list[str], name: str, local_meta: set[fx.Node],
          rewrites: dict[fx.Node, int], fused_cuts: dict[fx.Node, list[tuple[int, int]]]) -> Optional[str]:
    """State of a non-linear op's output given its sharded inputs' states; None = not allowed.
    A reshape whose written-out size TP must change records its position in ``rewrites``."""
    if n.op == "call_function" and n.target in ATTENTION_TARGETS:
        return HEADS if len(states) >= 3 and set(states) == {HEADS} else None
    if len(set(states)) != 1:
        return None
    if name in RESHAPE:
        state, position = _reshape_state(n, states[0], local_meta)
        if state is not None and position is not None:
            rewrites[n] = position
        return state
    if name in ELEMENTWISE or name in LAYOUT:
        return states[0]
    if states[0] == FUSED and name == "getitem":
        return FLAT
    if states[0] == FLAT and n in fused_cuts:      # a part of a fused projection (recorded by the caller)
        return FUSED if name in ("split", "chunk") else FLAT
    if states[0] == HEADS and (name == "repeat_interleave"          # GQA: key/value heads repeated
                               or (name in _LAST_DIM_REDUCTIONS and _reduces_last_dim(n))):
        return HEADS
    if name in SLICING:  # slicing the sharded last dim itself would split it unevenly
        return HEADS if states[0] == HEADS else None
    return None


def is_metadata(n: fx.Node, meta_nodes: set[fx.Node]) -> bool:
    """A node computing shapes / dtypes / devices (or arithmetic on them), not tensor data."""
    if n.op == "call_method" and n.target in ("size", "dim", "numel"):
        return True
    if n.op == "call_function" and n.target is getattr and n.args[1] in ("shape", "dtype", "device", "ndim"):
        return True
    ins = n.all_input_nodes
    return n.op in ("call_function", "call_method") and bool(ins) and all(a in meta_nodes for a in ins)


def assign_tp_roles(gm: fx.GraphModule, block_of: dict[fx.Node, Optional[str]],
                    blocks: list[str], params: set[str],
                    reasons: Optional[dict[fx.Node, str]] = None,
                    rewrite_sources: Optional[dict[fx.Node, tuple[int, str]]] = None,
                    fused_parts: Optional[dict[fx.Node, tuple]] = None,
                    partial: Optional[dict[fx.Node, bool]] = None) -> dict[fx.Node, TPRole]:
    """TP role of every op that reads a parameter. ``reasons``, if given,
    gets for each linear replicated although it could pair up, the first node that blocked it;
    ``rewrite_sources`` for each reshape of a sharded value whose written-out size TP rewrites, the
    position of that size and the column-parallel weight whose shard decides it; ``fused_parts`` for
    each column linear whose output is cut into parts (fused q/k/v, gate/up), the parts' row ranges;
    ``partial`` the ops that read a whole parameter on TP-sharded heads (its gradient is a partial sum)."""
    fused_parts = {} if fused_parts is None else fused_parts
    partial = {} if partial is None else partial
    nodes = list(gm.graph.nodes)
    roles: dict[fx.Node, TPRole] = {}
    groups = _Groups()
    bad: dict[fx.Node, str] = {}       # linears whose group must be replicated -> why
    state: dict[fx.Node, str] = {}     # sharded activations: FLAT / HEADS
    sources: dict[fx.Node, set[fx.Node]] = {}  # column linears a sharded value comes from
    meta_nodes: set[fx.Node] = set()
    local_meta: set[fx.Node] = set()   # shapes read from sharded values (local sizes under TP)
    data: set[fx.Node] = set()         # activations whose *data* derives from parameters
    rewrites: dict[fx.Node, int] = {}  # reshapes whose written-out size TP rewrites -> its position
    fused_cuts: dict[fx.Node, list[tuple[int, int]]] = {}   # split / chunk / slice of a linear -> its parts
    partial_ops: dict[fx.Node, set] = {}   # ops reading a whole parameter on sharded heads -> their sources
    reductions: dict[fx.Node, set] = {}    # full-width sums / means of FLAT values -> their sources
    reduced: set[fx.Node] = set()          # those (all-reduced, whole) and elementwise ops of them alone
    scaled: dict[fx.Node, set] = {}        # ops multiplying a FLAT value by a full-width 1-D parameter
    block_set = set(blocks)

    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        if is_metadata(n, meta_nodes):
            meta_nodes.add(n)
            if any(a in state or a in local_meta for a in n.all_input_nodes):
                local_meta.add(n)
            continue
        if any(a in data or param_of(a, params) is not None for a in n.all_input_nodes):
            data.add(n)
        b = block_of.get(n)
        ins = [a for a in n.all_input_nodes if a in state]
        if is_moe_layer(n) and b in block_set and not ins and expert_param_roles(n, params, gm) is not None:
            roles[n] = TPRole.EXPERTS     # whole tokens in, a partial sum out: no sharded value leaves it
            parts = _fused_expert_parts(n, params, gm)
            if parts:
                fused_parts[n] = parts
            continue
        if op_kind(n) == OpKind.LINEAR and b in block_set and _linear_weight(n, params) is not None:
            groups.find(n)
            x = n.args[0]
            if x in state:
                for c in sources[x]:
                    groups.union(n, c)
                if state[x] != FLAT or len(ins) != 1:
                    _block(bad, sources[x] | {n}, f"{n.name} reads a sharded value it cannot split "
                           f"{'(a value viewed as heads)' if state[x] != FLAT else '(several sharded inputs)'}")
                roles[n] = TPRole.ROW
            else:
                roles[n] = TPRole.COLUMN
                state[n], sources[n] = FLAT, {n}
            continue
        if not ins:
            if op_name(n) in ELEMENTWISE and any(a in reduced for a in n.all_input_nodes) and \
                    not any(a in data and a not in reduced for a in n.all_input_nodes):
                reduced.add(n)          # rsqrt(variance + eps): still one number per token, whole
            continue
        src = set().union(*(sources[a] for a in ins))
        if len(ins) == 1 and state[ins[0]] == FLAT and n.args and n.args[0] is ins[0] and _partial_reduction(n) \
                and all(block_of.get(a) == b for a in ins):
            reductions[n] = src
            reduced.add(n)
            continue
        if len(ins) == 1 and n.args and n.args[0] in state and op_kind(n.args[0]) == OpKind.LINEAR:
            parts = _fused_parts(n, _out_rows(n.args[0], params, gm))
            if parts is not None:
                fused_cuts[n] = parts
                rewrites[n] = FUSED_PART
        new = _flow(n, [state[a] for a in ins], op_name(n), local_meta, rewrites, fused_cuts)
        # another tensor mixed with a sharded one has the wrong shape under TP, except a
        # position-only one broadcast over the head dim (rotary tables)
        others = [a for a in n.all_input_nodes if a not in state and a not in meta_nodes]
        if new == HEADS:
            # a 1-D parameter broadcasts over the last (head) dim, the same for every head: it stays whole,
            # and each TP rank's gradient of it covers its own heads only (summed by the push)
            vectors = [a for a in others if a.op == "get_attr" and _is_vector_param(a, params, gm)]
            others = [a for a in others if a in data or (a.op == "get_attr" and a not in vectors)]
            if vectors:
                partial_ops[n] = src
        elif new == FLAT and op_name(n) in ELEMENTWISE:
            # a norm's statistic broadcasts over the shard; a 1-D parameter of the full width (a
            # full-width norm's weight) is split like the column's output
            vectors = [a for a in others if a.op == "get_attr" and _is_vector_param(a, params, gm)
                       and _width(a, params, gm) == _flat_width(ins[0], sources, params, gm)]
            others = [a for a in others if a not in reduced and a not in vectors]
            if vectors and not others:
                scaled[n] = src
        if new is None or others or any(block_of.get(a) != b for a in ins):
            if new is None:
                why = f"{n.name} ({op_name(n)}) cannot run on a TP-sharded input"
            elif others:
                why = f"{n.name} mixes a sharded value with the whole tensor {others[0].name}"
            else:
                why = f"{n.name} uses a sharded value of another block"
            _block(bad, src, why)
            continue
        state[n], sources[n] = new, src

    # a fused projection is sharded part by part: its cuts must tile its output and be its only users
    for lin in {c.args[0] for c in fused_cuts}:
        if lin not in state:
            continue
        cuts = [u for u in lin.users if u in fused_cuts]
        parts = sorted({p for c in cuts for p in fused_cuts[c]})
        rows = _out_rows(lin, params, gm)
        tiles = all(a[1] == b[0] for a, b in zip(parts, parts[1:])) and parts and parts[0][0] == 0 \
            and parts[-1][1] == rows
        if len(cuts) != len(lin.users) or not tiles:
            _block(bad, sources[lin], f"the parts {lin.name} is cut into do not tile its output")
        else:
            fused_parts[lin] = tuple(parts)

    # a sharded value must reach a ROW before leaving its block (or the graph)
    for n in state:
        for u in n.users:
            if u.op == "output" or (u not in meta_nodes and block_of.get(u) != block_of.get(n)):
                _block(bad, sources[n], f"the sharded value {n.name} leaves its block without a row-parallel "
                                        f"linear (used by {u.name})")

    _post_and_embedding_roles(gm, nodes, block_of, params, roles)
    _replicate_bad_groups(nodes, params, roles, groups, bad, gm)
    for n, role in roles.items():
        if role == TPRole.EXPERTS:
            partial[n] = True       # the whole router's gradient: each rank's from its experts' slices
        elif is_moe_layer(n):
            fused_parts.pop(n, None)
    for n, src in partial_ops.items():
        if any(roles.get(c) == TPRole.COLUMN for c in src):
            partial[n] = True
    for n, src in scaled.items():
        if any(roles.get(c) == TPRole.COLUMN for c in src):
            roles[n] = TPRole.COLUMN          # its 1-D parameter: split like a column bias
    if rewrite_sources is not None:
        for n, src in reductions.items():
            cols = [c for c in src if roles.get(c) == TPRole.COLUMN]
            if cols:
                rewrite_sources[n] = (PARTIAL_SUM, _linear_weight(cols[0], params))
    if rewrite_sources is not None:
        for n, position in rewrites.items():
            cols = [c for c in sources.get(n, ()) if roles.get(c) == TPRole.COLUMN]
            if cols and n in state:
                rewrite_sources[n] = (position, _linear_weight(cols[0], params))
    if reasons is not None:
        by_root: dict[fx.Node, str] = {}
        for n, why in bad.items():
            by_root.setdefault(groups.find(n), why)
        for n, r in roles.items():
            if r == TPRole.REPLICATED and n in groups.parent and groups.find(n) in by_root:
                reasons[n] = by_root[groups.find(n)]
    return roles


def _out_rows(linear: fx.Node, params: set[str], gm: fx.GraphModule) -> int:
    """Output features of a linear (its weight's rows; an ``[in, out]`` weight's columns)."""
    weight = gm.get_parameter(_linear_weight(linear, params))
    return int(weight.shape[param_shard_dim(TPRole.COLUMN, "weight", linear)])


def _last_dim(dim: Any) -> bool:
    """Whether ``dim`` names the last dim of a 3-D ``[batch, tokens, features]`` activation."""
    return isinstance(dim, int) and dim in (-1, 2)


def _fused_parts(n: fx.Node, rows: int) -> Optional[list[tuple[int, int]]]:
    """The row ranges a split / chunk / last-dim slice of a linear's output takes, else None."""
    name = op_name(n)
    if name == "split":
        size = n.args[1] if len(n.args) > 1 else n.kwargs.get("split_size_or_sections", n.kwargs.get("split_size"))
        if not _last_dim(n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)):
            return None
        if isinstance(size, int) and size > 0:
            return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]
        if isinstance(size, (list, tuple)) and all(isinstance(x, int) for x in size):
            bounds = [0]
            for x in size:
                bounds.append(bounds[-1] + x)
            return list(zip(bounds, bounds[1:]))
        return None
    if name == "chunk":
        chunks = n.args[1] if len(n.args) > 1 else n.kwargs.get("chunks")
        if not isinstance(chunks, int) or not _last_dim(n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)):
            return None
        size = -(-rows // chunks)
        return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]
    if name == "getitem" and isinstance(n.args[1], tuple) and n.args[1]:
        *front, last = n.args[1]
        if not isinstance(last, slice) or last.step not in (None, 1) or len(n.args[1]) != 3:
            return None
        if not all(f == slice(None) or f is Ellipsis for f in front):
            return None
        lo, hi = last.start or 0, rows if last.stop is None else last.stop
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi <= rows):
            return None
        return [(lo, hi)]
    return None


def _width(a: fx.Node, params: set[str], gm: fx.GraphModule) -> int:
    return int(gm.get_parameter(param_of(a, params)).shape[-1])


def _flat_width(x: fx.Node, sources: dict, params: set[str], gm: fx.GraphModule) -> Optional[int]:
    """Full feature width of a FLAT value straight from one column linear (else None: unknown)."""
    cols = sources.get(x, set())
    if len(cols) != 1:
        return None
    (col,) = cols
    return _out_rows(col, params, gm)


def _is_vector_param(a: fx.Node, params: set[str], gm: fx.GraphModule) -> bool:
    name = param_of(a, params)
    return name is not None and gm.get_parameter(name).dim() == 1


def _block(bad: dict, nodes: Iterable[fx.Node], why: str) -> None:
    for x in nodes:
        bad.setdefault(x, why)


def _linear_weight(n: fx.Node, params: set[str]) -> Optional[str]:
    return param_of(n.args[1] if len(n.args) > 1 else n.kwargs.get("weight"), params)


def _post_and_embedding_roles(gm, nodes, block_of, params, roles) -> None:
    output = next(n for n in nodes if n.op == "output")
    logits = _linears_reaching(output)
    for n in nodes:
        if n in roles or not op_params(n, params):
            continue
        kind = op_kind(n)
        if kind == OpKind.EMBEDDING and _linear_weight(n, params) is not None:
            roles[n] = TPRole.VOCAB
        elif kind == OpKind.LINEAR and block_of.get(n) == POST and n in logits:
            roles[n] = TPRole.COLUMN
        else:
            roles[n] = TPRole.REPLICATED


def _linears_reaching(output: fx.Node) -> set[fx.Node]:
    """Linears whose value reaches the output through non-linear ops only."""
    found, seen, work = set(), set(), list(output.all_input_nodes)
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        if op_kind(n) == OpKind.LINEAR:
            found.add(n)
            continue
        if n.op in ("call_function", "call_method"):
            work.extend(n.all_input_nodes)
    return found


def param_shard_dim(role: TPRole, arg_role: str, op: Optional[fx.Node] = None) -> int:
    """Dimension TP (and the optimizer layout) splits a parameter of ``op`` with ``role``; a weight
    stored [in, out] (``IN_OUT_LINEARS``) splits on the other dim."""
    in_out = op is not None and op.op == "call_function" and op.target in IN_OUT_LINEARS and arg_role == "weight"
    if role == TPRole.ROW and arg_role == "weight":
        return 0 if in_out else 1
    return 1 if in_out and role == TPRole.COLUMN else 0


def param_role(role: TPRole, arg_role: str) -> TPRole:
    """Role of the parameter itself: a ROW bias is added after the all-reduce, whole."""
    if role == TPRole.ROW and arg_role != "weight":
        return TPRole.REPLICATED
    if role in (TPRole.COLUMN, TPRole.ROW) and arg_role not in ("weight", "bias"):
        return TPRole.REPLICATED
    return role


def is_moe_layer(n: fx.Node) -> bool:
    """A call of hgraph's MoE op (``moe.moe_layer``)."""
    return n.op == "call_function" and n.target is moe.moe_layer


def expert_param_roles(n: fx.Node, params: set[str], gm: fx.GraphModule) -> Optional[list[tuple[str, TPRole, int]]]:
    """(parameter, role, shard dim) of each parameter an MoE op reads when it shards its experts: the
    router whole; per expert gate / up COLUMN on their intermediate rows, down ROW on its intermediate
    columns, in any of ``moe_layer``'s layouts (3 x E matrices ``[I, H]`` / ``[H, I]``; stacked
    ``[E, I, H]`` / ``[E, H, I]``; fused ``gate_up [E, 2I, H]``). None when the router or an expert
    weight is not a parameter read directly (a computed weight cannot be split)."""
    names = [param_of(a, params) for a in n.args[1:]]
    if not names or any(name is None for name in names):
        return None
    router, *experts = names
    ranks = [gm.get_parameter(name).dim() for name in experts]
    if len(experts) in (2, 3) and ranks == [3] * len(experts):
        *columns, down = experts
        return [(router, TPRole.REPLICATED, 0)] + [(c, TPRole.COLUMN, 1) for c in columns] + \
            [(down, TPRole.ROW, 2)]
    if experts and len(experts) % 3 == 0 and ranks == [2] * len(experts):
        e = len(experts) // 3
        return [(router, TPRole.REPLICATED, 0)] + [(c, TPRole.COLUMN, 0) for c in experts[:2 * e]] + \
            [(d, TPRole.ROW, 1) for d in experts[2 * e:]]
    return None


def _fused_expert_parts(n: fx.Node, params: set[str], gm: fx.GraphModule) -> tuple:
    """The row ranges of a fused ``gate_up [E, 2I, H]`` (gate rows, then up rows): each split by TP."""
    weights = [param_of(a, params) for a in n.args[2:]]
    if len(weights) != 2:
        return ()
    rows = int(gm.get_parameter(weights[0]).shape[1])
    return ((0, rows // 2), (rows // 2, rows))


def _param_layouts(n: fx.Node, role: TPRole, params: set[str], gm: Optional[fx.GraphModule]) -> list[tuple]:
    """(parameter, what its use by ``n`` under ``role`` needs: whole or split on a dim) of each parameter."""
    if role == TPRole.EXPERTS and gm is not None:
        return [(name, _layout(r, dim)) for name, r, dim in expert_param_roles(n, params, gm)]
    return [(name, _layout(param_role(role, arg_role), param_shard_dim(role, arg_role, n)))
            for arg_role, name, _ in op_params(n, params)]


def _replicate_bad_groups(nodes, params, roles, groups: _Groups, bad: dict,
                          gm: Optional[fx.GraphModule] = None) -> None:
    """Replicate every group with a bad member; then every group touching a parameter whose uses
    disagree on the split (until nothing changes)."""
    while True:
        bad_roots = {groups.find(x) for x in bad}
        for n, r in list(roles.items()):
            if r in (TPRole.COLUMN, TPRole.ROW) and n in groups.parent and groups.find(n) in bad_roots:
                roles[n] = TPRole.REPLICATED
        layouts: dict[str, set[tuple[TPRole, int]]] = {}
        users: dict[str, list[fx.Node]] = {}
        for n in nodes:
            if n not in roles:
                continue
            for name, layout in _param_layouts(n, roles[n], params, gm):
                layouts.setdefault(name, set()).add(layout)
                users.setdefault(name, []).append(n)
        conflicted = [name for name, ls in layouts.items() if len(ls) > 1]
        newly = {n for name in conflicted for n in users[name] if roles[n] != TPRole.REPLICATED}
        if not newly:
            return
        for n in newly:
            if n in groups.parent:
                name = next(name for _, name, _ in op_params(n, params) if name in conflicted)
                bad.setdefault(n, f"parameter {name} is used by ops that need different splits")
            else:
                roles[n] = TPRole.REPLICATED


def _layout(role: TPRole, dim: int) -> tuple[Any, int]:
    """What a parameter's use needs: whole, or split on ``dim`` (VOCAB and COLUMN on 0 agree)."""
    return ("whole", 0) if role == TPRole.REPLICATED else ("split", dim)
