"""Every argument of every op survives the instantiation passes, or is changed by a rule that says so.

For models of every frontend path (the zoo Llama with a padding row, a user module traced by fx with
LayerNorm biases and eps, Hugging Face models exported by torch.export), each computational node of
the HGraph is found by name in every rank graph of strategies with TP, PP and CP, and its constant
arguments (eps, padding_idx, normalized_shape, dims, scale, bias=None ...) are compared. The only
differences allowed are the documented rewrites: sizes TP scales (``NodeMeta.tp_rewrite``), fused
projection cuts, attention turned into packed / CP attention (q, k, v, scale, GQA, softcap and
window kept), a
vocabulary-parallel embedding (``padding_idx`` kept), a row-parallel bias moved after the all-reduce,
and the dropout pass's ``comm`` and ``site`` (and ``tokens`` on a sequence-parallel token slice); under
sequence parallelism a linear of an all-gathered input becomes ``sp_linear`` (the same linear).
"""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import hgraph
from hgraph import ops
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.meta import get_meta

STRATEGIES = ["1xTP2PP2", "1xTP1PP1CP2+1xTP2PP1"]
MODELS = [("llama:tiny", {"pad_token_id": 0}), ("hf:gpt2", {"resid_pdrop": 0.1, "attn_pdrop": 0.1}),
          ("hf:phi3", {}), ("hf:qwen3", {}), ("hf:gemma2", {"sliding_window": 4, "attention_dropout": 0.1})]


def _constants(value):
    """The non-node leaves of an argument structure (nodes become a marker: wiring may change)."""
    if isinstance(value, fx.Node):
        return "<node>"
    if isinstance(value, (list, tuple)):
        return type(value)(_constants(v) for v in value)
    if isinstance(value, dict):
        return {k: _constants(v) for k, v in value.items()}
    return value


def _allowed(before: fx.Node, after: fx.Node) -> bool:
    m = get_meta(before)
    if m.tp_rewrite is not None:                       # TP-scaled sizes and fused-projection cuts
        return True
    if before.target in (F.scaled_dot_product_attention, ops.causal_attention):
        keep = {k: before.kwargs[k] for k in ("scale", "enable_gqa") if k in before.kwargs}
        variant = (before.kwargs.get("softcap"), before.kwargs.get("window"))   # hgraph's causal attention
        if after.target is ops.packed_attention:
            return (after.args[4] == keep.get("scale") and after.args[5] == keep.get("enable_gqa", False)
                    and tuple(after.args[6:8]) == variant)
        if after.target is ops.packed_attention_dropout:
            return (after.args[4] == before.kwargs["dropout_p"] and after.args[6] == keep.get("scale")
                    and after.args[7] == keep.get("enable_gqa", False) and tuple(after.args[9:11]) == variant)
        if after.target is ops.cp_attention:
            return (after.args[4] == keep.get("scale") and after.args[5] == keep.get("enable_gqa", False)
                    and after.args[6] == before.kwargs.get("dropout_p", 0.0) and tuple(after.args[9:11]) == variant)
    if before.target is F.linear and after.target is ops.sp_linear:     # sequence parallelism: the same
        return after.args[5:] == ("tp", after.args[6]) and isinstance(after.args[6], int)   # linear, w, b
    if before.target is F.embedding and after.target is ops.vocab_parallel_embedding:
        return after.args[4] == before.kwargs.get("padding_idx")
    if after.target is ops.keyed_dropout:              # the dropout pass adds comm and site (and under
        return after.args[1] == before.args[1] and set(after.kwargs) - {"tokens"} == {"comm", "site"}   # SP: tokens
    if get_meta(before).tp_role is not None and len(before.args) > 2 and after.args[2:] == (None,):
        return True                                    # a row-parallel bias, added after the all-reduce
    return False


@pytest.mark.parametrize("spec,args", MODELS, ids=[m[0] for m in MODELS])
def test_arguments_survive_every_pass(spec, args):
    if spec.startswith("hf:"):
        pytest.importorskip("transformers")
    with torch.device("meta"):
        model = resolve_model_spec(spec, args)
    compiled = hgraph.compile(model)
    before = {n.name: n for n in compiled.hgraph.gm.graph.nodes if n.op in ("call_function", "call_method")
              and get_meta(n).slot is None and n.target is not operator.getitem or (
                  n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], tuple))}
    checked = 0
    for strategy in STRATEGIES:
        program = compiled.instantiate(strategy)
        for rank in range(program.cluster.world_size):
            for after in program.rank(rank).graph_module.graph.nodes:
                node = before.get(after.name)
                if node is None:
                    continue
                same = (_constants(node.args), _constants(node.kwargs)) == (_constants(after.args),
                                                                           _constants(after.kwargs))
                assert same or _allowed(node, after), (
                    f"{spec} {strategy} rank {rank}: {after.name} {node.target}{_constants(node.args)}"
                    f"{_constants(node.kwargs)} became {after.target}{_constants(after.args)}{_constants(after.kwargs)}")
                checked += 1
    assert checked > 100
