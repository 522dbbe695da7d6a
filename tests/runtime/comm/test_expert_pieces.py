"""A stacked expert tensor pulled and pushed by piece on one rank (``runtime/comm/rank_params.ExpertPieces``),
without processes: ``hf:qwen2_moe``'s fused ``gate_up [8, 64, 64]`` at ``1xTP2PP1EP2``, rank 3 (EP rank 1,
TP rank 1; one layer). Its pieces are views of the tensors the graph and the optimizer hold, and the pushed shards
come back stacked in expert order."""
import pytest
import torch

import hgraph
from hgraph.runtime.comm.rank_params import ExpertPieces

pytest.importorskip("transformers")

NAME = "model.layers.0.mlp.experts.gate_up_proj"


def test_a_ranks_pieces_are_views_of_its_experts_and_its_shards_stack_back():
    from hgraph.frontends.zoo import resolve_model_spec

    torch.manual_seed(0)
    compiled = hgraph.compile(resolve_model_spec("hf:qwen2_moe", {"num_hidden_layers": 1}))
    program = compiled.instantiate("1xTP2PP1EP2")
    rp = program.rank(3)
    pieces = ExpertPieces(program, rp.params)
    master = torch.arange(8 * 16 * 64, dtype=torch.float32).view(8, 16, 64)    # rows 48:64 of every expert
    masters = pieces.masters({NAME: master, "other": torch.ones(3)})
    assert [n for n in masters if n.startswith(NAME)] == [f"{NAME}[{e}]" for e in range(8)]
    assert masters[f"{NAME}[5]"].data_ptr() == master[5].data_ptr() and masters["other"].shape == (3,)
    working = torch.zeros(rp.params[NAME].shard_shape)                       # [4, 32, 64]: experts 4..7
    assert working.shape == (4, 32, 64)
    views = pieces.working({NAME: working})
    assert list(views) == [f"{NAME}[{e}]" for e in range(4, 8)]
    views[f"{NAME}[6]"].fill_(1.0)
    assert working[2].eq(1).all() and working[[0, 1, 3]].eq(0).all()
    shard = pieces.shards()[f"{NAME}[6]"]
    assert (shard.full_shape, shard.shard_dim, shard.ranges) == ((64, 64), 0, ((16, 32), (48, 64)))
    assert pieces.working({NAME: None}) == {f"{NAME}[{e}]": None for e in range(4, 8)}
    pushed = {f"{NAME}[{e}]": torch.full((16, 64), float(e)) for e in reversed(range(8))}
    stacked = pieces.stacked({**pushed, "other": torch.ones(3)})
    assert set(stacked) == {NAME, "other"}
    assert torch.equal(stacked[NAME], torch.arange(8.0).view(8, 1, 1).expand(8, 16, 64))
    # a strategy without an EP pipeline plans the tensor whole: nothing is split
    whole = ExpertPieces(compiled.instantiate("2xTP2PP1"), rp.params)
    assert whole.masters({NAME: master}) == {NAME: master}
