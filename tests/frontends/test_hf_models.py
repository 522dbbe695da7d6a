"""Hugging Face models (tiny configs, random weights) through the torch.export frontend.

For Llama, Qwen2 (tied embeddings), Mistral (a sliding window shorter than the documents), Gemma-2
(eager attention with logit softcapping, sliding and global layers, tied) and GPT-2 (Conv1D): the
HGraph equals the HF model's logits, the single-rank program computes packed documents exactly as
each document alone, and the slots / TP roles are the expected ones.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hgraph  # noqa: E402
from hgraph.frontends.zoo import resolve_model_spec  # noqa: E402
from hgraph.meta import TPRole  # noqa: E402

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2}
MODELS = {
    "llama": dict(SMALL),
    "qwen2": dict(SMALL),
    "mistral": dict(SMALL, sliding_window=4),
    "gemma2": dict(SMALL, head_dim=8, sliding_window=4),
    "gpt2": {"vocab_size": 64, "n_embd": 32, "n_head": 4},
}


def hf_logits(model, ids, pos):
    with torch.no_grad():
        return model(ids, position_ids=pos, use_cache=False).logits


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    torch.manual_seed(0)
    model = resolve_model_spec(f"hf:{request.param}", MODELS[request.param])
    return request.param, model, hgraph.compile(model)


def _load(rank_program, model):
    full = dict(model.named_parameters())
    gm = rank_program.graph_module
    for name, shard in rank_program.params.items():
        *path, leaf = name.split(".")
        mod = gm
        for p in path:
            mod = getattr(mod, p)
        setattr(mod, leaf, torch.nn.Parameter(shard.take(full[name].detach())))
    return gm


def test_export_frontend_is_chosen_and_the_hgraph_equals_the_model(pair):
    name, model, compiled = pair
    assert compiled.frontend == "export"
    for b, t in ((2, 9), (1, 5), (3, 16)):
        ids = torch.randint(0, 64, (b, t))
        pos = torch.arange(t).expand(b, t)
        with torch.no_grad():
            assert torch.equal(compiled(ids, pos), hf_logits(model, ids, pos))
            assert torch.equal(compiled(ids), hf_logits(model, ids, pos))   # default positions


def test_parameters_keep_the_model_names_and_are_shared(pair):
    name, model, compiled = pair
    canonical = {n: p for n, p in model.named_parameters()}
    assert set(compiled.hgraph.params) == set(canonical)
    for n in canonical:
        assert compiled.hgraph.gm.get_parameter(n) is canonical[n]


def test_single_rank_program_computes_each_document_alone(pair):
    name, model, compiled = pair
    gm = _load(compiled.instantiate("1xTP1PP1").rank(0), model)
    ids = torch.randint(0, 64, (2, 11))
    pos = torch.cat([torch.arange(5), torch.arange(6)]).expand(2, 11)
    with torch.no_grad():
        whole = torch.arange(11).expand(2, 11)
        torch.testing.assert_close(gm(ids, whole), hf_logits(model, ids, whole), rtol=0, atol=1e-6)
        alone = torch.cat([hf_logits(model, ids[:, :5], pos[:, :5]), hf_logits(model, ids[:, 5:], pos[:, 5:])], dim=1)
        torch.testing.assert_close(gm(ids, pos), alone, rtol=0, atol=1e-6)



def test_bf16_program_computes_what_the_model_computes_in_bf16(pair):
    # torch.export records dtypes: traced in fp32, HF's casts back to the input's dtype (RMSNorm's
    # .to(input_dtype), GPT-2's position embeddings) would run the bf16 program in fp32 and fail
    name, model, _ = pair
    gm = _load(hgraph.compile(model, dtype="bf16").instantiate("1xTP1PP1").rank(0), model)
    reference = copy.deepcopy(model)
    for p in reference.parameters():          # the parameters in bf16, as the program's working copies
        p.data = p.data.to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, 11))
    whole = torch.arange(11)[None]
    with torch.no_grad():
        got = gm(ids, whole)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, hf_logits(reference, ids, whole), rtol=0, atol=2e-2)

def test_slot_counts(pair):
    name, model, compiled = pair
    hg = compiled.hgraph
    counts = hg.slot_counts()
    n_params = len(list(model.parameters()))
    assert hg.num_layers == 2 and counts["push_gradient"] == n_params
    tied = 1 if model.config.tie_word_embeddings else 0
    assert counts["pull_parameter"] == n_params + tied       # a tied table is used by the lookup and the head
    assert counts["cp_kv"] == 2 * 2                           # key and value of each attention
    assert counts["pp_boundary"] == 3                         # pre -> 0 -> 1 -> post
    assert counts["tp_gather"] == 1                           # the lm head
    # attention (GPT-2's fused c_attn too, sharded part by part) and MLP enter; o_proj/c_proj,
    # down_proj and the embedding exit (GPT-2 also its position embedding)
    exits = 2 * 2 + (2 if name == "gpt2" else 1)
    assert counts["tp_enter"] == 2 * 2 + 1 and counts["tp_exit"] == exits


def test_tp_roles(pair):
    name, model, compiled = pair
    params = compiled.hgraph.params
    if name == "gpt2":
        roles = {"transformer.wte.weight": (TPRole.VOCAB, 0),
                 "transformer.h.0.mlp.c_fc.weight": (TPRole.COLUMN, 1),    # Conv1D [in, out]: out is dim 1
                 "transformer.h.0.mlp.c_fc.bias": (TPRole.COLUMN, 0),
                 "transformer.h.1.mlp.c_proj.weight": (TPRole.ROW, 0),     # in is dim 0
                 "transformer.h.1.mlp.c_proj.bias": (TPRole.REPLICATED, 0),
                 "transformer.h.0.attn.c_attn.weight": (TPRole.COLUMN, 1),  # fused q/k/v, part by part
                 "transformer.h.0.attn.c_proj.weight": (TPRole.ROW, 0),
                 "transformer.ln_f.weight": (TPRole.REPLICATED, 0)}
    else:
        roles = {"model.embed_tokens.weight": (TPRole.VOCAB, 0),
                 "model.layers.0.self_attn.q_proj.weight": (TPRole.COLUMN, 0),
                 "model.layers.1.self_attn.k_proj.weight": (TPRole.COLUMN, 0),
                 "model.layers.0.self_attn.o_proj.weight": (TPRole.ROW, 1),
                 "model.layers.1.mlp.up_proj.weight": (TPRole.COLUMN, 0),
                 "model.layers.1.mlp.down_proj.weight": (TPRole.ROW, 1),
                 "model.norm.weight": (TPRole.REPLICATED, 0)}
        if name == "qwen2":
            roles["model.layers.0.self_attn.q_proj.bias"] = (TPRole.COLUMN, 0)
        if not model.config.tie_word_embeddings:
            roles["lm_head.weight"] = (TPRole.COLUMN, 0)
    for n, (role, dim) in roles.items():
        assert (params[n].tp_role, params[n].shard_dim) == (role, dim), n
