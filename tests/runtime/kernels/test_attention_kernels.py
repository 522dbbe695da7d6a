"""The runtime's attention kernels with logit softcapping and a sliding window: a CP rank's queries
against the gathered keys, and attention with keyed dropout (at p = 0, where it must be plain
attention), equal the packed attention of the whole row (``hgraph.varlen_attention``)."""
import pytest
import torch

from hgraph.runtime.kernels.cp_attention import CPLayout, cp_attention
from hgraph.runtime.kernels.dropout import TokenKeys, attention_with_dropout, cp_groups, packed_groups
from hgraph.varlen_attention import cu_seqlens_for, varlen_attention

LENGTHS = [7, 3, 9]
TOL = dict(atol=1e-6, rtol=1e-5)


def _qkv(seed=0, hq=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    return [torch.randn(1, h, t, d, generator=g) for h in (hq, hkv, hkv)]


def _layout(cp_rank):
    doc_of = [d for d, n in enumerate(LENGTHS) for _ in range(n)]
    pos_of = [p for n in LENGTHS for p in range(n)]
    tokens = list(range(sum(LENGTHS)))
    ranks = (tuple(tokens[0::2]), tuple(tokens[1::2]))      # every other token: documents on both ranks
    return CPLayout(cp_rank, ranks, tuple(doc_of), tuple(pos_of))


@pytest.mark.parametrize("softcap, window", [(None, None), (3.0, None), (None, 3), (3.0, 2)])
def test_cp_ranks_and_dropout_at_zero_equal_the_packed_attention(softcap, window):
    q, k, v = _qkv()
    whole = varlen_attention(q, k, v, cu_seqlens_for(LENGTHS), scale=0.4, enable_gqa=True, softcap=softcap,
                             window=window)
    keys = TokenKeys(0, 0, torch.tensor([d for d, n in enumerate(LENGTHS) for _ in range(n)]),
                     torch.tensor([p for n in LENGTHS for p in range(n)]), doc_ids=tuple(range(len(LENGTHS))))
    dropped = attention_with_dropout(q, k, v, packed_groups(keys, q.device, window), 0.0, 1, keys, 0.4, True, 0,
                                     softcap)
    torch.testing.assert_close(dropped, whole, **TOL)
    for cp_rank in (0, 1):
        layout = _layout(cp_rank)
        gathered = [i for t in layout.rank_tokens for i in t]
        local = list(layout.local_tokens)
        got = cp_attention(q[:, :, local], k[:, :, gathered], v[:, :, gathered], layout, 0.4, True, softcap, window)
        torch.testing.assert_close(got, whole[:, :, local], **TOL)
        local_keys = TokenKeys(0, 0, keys.documents[local], keys.positions[local], keys.doc_ids)
        got = attention_with_dropout(q[:, :, local], k[:, :, gathered], v[:, :, gathered],
                                     cp_groups(layout, local_keys, q.device, window), 0.0, 1, local_keys, 0.4, True,
                                     0, softcap)
        torch.testing.assert_close(got, whole[:, :, local], **TOL)
