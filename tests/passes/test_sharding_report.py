"""The sharding report: what TP shards, and for each parameter left whole, the node that blocked it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hgraph
from hgraph.frontends.zoo import resolve_model_spec
from hgraph.tools.cli import main


def _compiled(spec, args=None):
    with torch.device("meta"):
        model = resolve_model_spec(spec, args or {})
    return hgraph.compile(model)


def test_the_zoo_llama_shards_every_block_matrix_and_says_why_norms_are_whole():
    report = _compiled("llama:tiny").sharding_report("1xTP2PP1+1xTP4PP1")
    assert [s.tp for s in report.summaries] == [2, 4]
    for s in report.summaries:
        assert s.fraction_sharded(matrices_only=True) == 1.0
        whole = [p for p in s.placements if not p.sharded]
        assert whole and all(p.name.endswith("layernorm.weight") and "whole hidden state" in p.reason for p in whole)
    assert report.warnings() == []
    assert "4 blocks alike" in report.text()


class HeadsByCount(nn.Module):
    """Attention with a norm over the full width of the queries (a QK-norm TP cannot split yet)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.ModuleDict({k: nn.Linear(32, 32, bias=False) for k in "qkv"})
        self.q_norm = nn.LayerNorm(32)
        self.o = nn.Linear(32, 32, bias=False)
        self.up, self.down = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = ((self.q_norm(self.qkv[n](h)) if n == "q" else self.qkv[n](h)).view(b, t, 4, 8).transpose(1, 2)
                   for n in "qkv")
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32)
        h = h + self.o(a)
        return h + self.down(F.gelu(self.up(h)))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(HeadsByCount() for _ in range(2))
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, input_ids, position_ids=None):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_a_replicated_projection_names_the_node_that_blocked_it():
    report = hgraph.compile(TinyLM()).sharding_report("2xTP2PP1")
    (s,) = report.summaries
    q = next(p for p in s.placements if p.name == "layers.0.qkv.q.weight")
    assert not q.sharded and "layer_norm" in q.reason and "cannot run on a TP-sharded input" in q.reason
    up = next(p for p in s.placements if p.name == "layers.0.up.weight")
    assert up.sharded and up.dim == 0
    assert 0.1 < 1 - s.fraction_sharded() < 0.9
    (warning,) = report.warnings()
    assert warning.startswith("TP2 leaves") and "layers.0.qkv" in warning


def test_hf_gpt2_fused_projection_is_sharded_part_by_part():
    """GPT-2's c_attn output is split into q, k, v: each TP rank holds its slice of each part."""
    pytest.importorskip("transformers")
    compiled = _compiled("hf:gpt2")
    report = compiled.sharding_report("2xTP2PP1")
    c_attn = next(p for p in report.summaries[0].placements if p.name.endswith("h.0.attn.c_attn.weight"))
    assert c_attn.sharded and c_attn.dim == 1 and report.warnings() == []
    shard = compiled.instantiate("2xTP2PP1").rank(1).params["transformer.h.0.attn.c_attn.weight"]
    assert shard.ranges == ((32, 64), (96, 128), (160, 192))       # second half of each 64-wide part


def test_dump_format_report(capsys):
    assert main(["dump", "llama:tiny", "--strategy", "2xTP2PP1", "--format", "report"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sharding report of Llama for 2xTP2PP1") and "split on dim 0" in out
    assert main(["dump", "llama:tiny", "--strategy", "4xTP1PP1", "--format", "report"]) == 0
    assert "no scheme with TP > 1" in capsys.readouterr().out


def test_the_report_gives_what_an_ep_rank_holds_of_the_moe_blocks(capsys):
    """``llama-moe:tiny`` (MoE layers 1 and 2, 8 experts as a list of matrices): an EP rank holds its experts
    (1/EP of them) and the rest of the MoE blocks whole, TP sharding what it shards (the router stays
    whole); the CLI prints it under ``--format report``; a block without an MoE op is not counted."""
    compiled = _compiled("llama-moe:tiny")
    report = compiled.sharding_report("1xTP2PP1EP2+1xTP1PP1EP4")
    (tp2,) = report.summaries
    ep4, ep2 = sorted(report.expert_parallel, key=lambda e: e.tp)
    assert (ep4.tp, ep4.ep, ep2.tp, ep2.ep) == (1, 4, 2, 2)
    moe = [p for p in tp2.placements if p.block in ("layers.1", "layers.2")]
    assert ep2.total_bytes == sum(p.nbytes for p in moe) and ep4.total_bytes == ep2.total_bytes
    for e, n in ((ep2, 2), (ep4, 4)):
        assert e.ep_rank_bytes == sum(p.nbytes / n if ".experts." in p.name else p.nbytes for p in moe)
    assert ep2.rank_bytes == sum((p.nbytes / 2 if ".experts." in p.name else p.nbytes) / (2 if p.sharded else 1)
                                 for p in moe)
    assert ep4.rank_bytes == ep4.ep_rank_bytes
    assert main(["dump", "llama-moe:tiny", "--strategy", "1xTP2PP1EP2", "--format", "report"]) == 0
    out = capsys.readouterr().out
    assert (f"EP2: an EP rank holds {100 * ep2.fraction_held(False):.1f}% of the MoE blocks' parameter bytes, "
            f"a TP2 x EP2 rank {100 * ep2.fraction_held():.1f}%\n") in out
    assert "EP" not in compiled.sharding_report("2xTP2PP1").text()
