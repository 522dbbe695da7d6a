"""The chunks a checkpoint's entries are cut into (``coalesce``), without processes: they tile the rows
along rank boundaries, hold the minimum bytes or more (an entry smaller than that is one chunk) and
less than twice that (or one rank's rows), within the rows of a rank or two (blocks are whole ranks);
their number does not depend on the number of ranks once the ranks' rows are smaller than a chunk,
each block's writer is one of its ranks, and ``sources`` counts the ranks whose rows it gathers."""
import random

from hgraph.runtime.checkpoint import coalesce
from hgraph.shard_rule import shard_bounds


def _cases():
    rng = random.Random(7)
    for _ in range(300):
        shape = tuple(rng.choice([1, 3, 8, 64, 100, 513, 4096]) for _ in range(rng.randint(0, 2)))
        dim = rng.randrange(len(shape)) if shape else 0
        yield coalesce.Entry(rng.randrange(2000), shape, dim), rng.choice([1, 2, 3, 8, 64, 1000, 12288]), \
            rng.choice([1, 256, 4096, 1 << 16])


def test_chunks_tile_the_rows_in_blocks_of_ranks():
    for entry, group, min_bytes in _cases():
        _check(entry, group, min_bytes)


def _rows(entry, rank, group):
    lo, hi = shard_bounds(entry.rows, rank, group)
    return hi - lo


def _check(entry, group, min_bytes):
    chunks = coalesce.chunks(entry, group, min_bytes)
    assert chunks and chunks[0].lo == 0 and chunks[-1].hi == entry.rows
    assert all(a.hi == b.lo for a, b in zip(chunks, chunks[1:]))
    total = entry.rows * entry.row_bytes
    widest_rank = -(-entry.rows // group)                  # the most rows one rank owns
    for c in chunks:
        assert (c.lo, c.hi) == (shard_bounds(entry.rows, c.first, group)[0], shard_bounds(entry.rows, c.stop - 1, group)[1])
        assert c.first <= c.writer < c.stop
        assert coalesce.own_block(entry, c.writer, group, min_bytes) == c
        if c.stop - c.first <= 64:           # the ranks holding rows, counted one by one
            assert c.sources == sum(1 for r in range(c.first, c.stop) if _rows(entry, r, group) > 0)
        size = (c.hi - c.lo) * entry.row_bytes
        slack = 2 * widest_rank * entry.row_bytes              # blocks are whole ranks
        assert size >= min(min_bytes, total) - slack or c.stop - c.first == 1
        assert size < 2 * min_bytes + slack or c.stop - c.first == 1
    assert len(chunks) <= max(1, total // min_bytes)


def test_the_number_of_chunks_stops_growing_with_the_ranks():
    embedding = coalesce.Entry(0, (128256, 8192), 0)          # the 70B's: 4.2 GB of fp32
    counts = {g: len(coalesce.chunks(embedding, g)) for g in (8, 64, 1024, 12288, 100_000)}
    assert counts[8] == 8                                     # no finer than a rank's rows
    assert counts[1024] == counts[12288] == counts[100_000] == 62
    norm = coalesce.Entry(1, (8192,), 0)
    assert {len(coalesce.chunks(norm, g)) for g in (8, 1024, 12288)} == {1}


def test_a_gather_tree_takes_log_fan_in_rounds():
    assert [coalesce.gather_rounds(n, 8) for n in (1, 2, 8, 9, 64, 65, 8192)] == [0, 1, 1, 2, 2, 3, 5]
    assert [coalesce.gather_rounds(n, 2) for n in (1, 2, 3, 4, 5)] == [0, 1, 2, 2, 3]
