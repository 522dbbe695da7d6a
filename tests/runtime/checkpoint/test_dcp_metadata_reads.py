"""A resume reads the checkpoint's ``.metadata`` once per rank: it lists a chunk per parameter, moment
and writing rank (at G = world it grows with the world: 70B at 1,024 ranks, 319 MB), and the load
used to unpickle it four times (the shapes, the rows, then the RNG states' look-up and their read)."""
import torch.distributed.checkpoint as dcp

from hgraph.frontends.zoo import llama
from hgraph.runtime.checkpoint import shards as ckpt
from hgraph.runtime.engine.optimizer import ShardedAdam


def test_a_load_reads_the_metadata_once(tmp_path, monkeypatch):
    model = llama.build("tiny")
    opt = ShardedAdam(list(model.named_parameters()), None, 0, 1)
    ckpt.save(tmp_path, 3, opt)
    reads = []
    plain = dcp.FileSystemReader.read_metadata

    def counted(self, *args, **kwargs):
        reads.append(self.path)
        return plain(self, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", counted)
    for rank, world, group in ((0, 1, None), (1, 2, None), (3, 4, 2)):
        reads.clear()
        loaded = ckpt.load(tmp_path, rank, world, shard_group=group)
        assert len(reads) == 1, (rank, world, group, reads)
        assert loaded.step == 3 and (loaded.rng is not None) == (rank == 0)
