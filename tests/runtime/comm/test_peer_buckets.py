"""The coalesced point-to-point buckets: sender and receiver cut the same messages, under the cap.

No processes: the buckets are a pure function of the transfers (the exchange itself runs in
``test_param_sync``, which also counts the messages).
"""
import torch

from hgraph.runtime.comm.peer_buckets import ALONE_BYTES, PeerTransfers, Rows

# (name, rows, width): transfers of rank 0 to rank 1 and to rank 2, and of rank 1 to rank 0
PARAMS = [("a", 4, 3), ("b", 10, 3), ("c", 1, 1), ("d", 2, 5), ("e", 3, 3)]


def _transfers():
    out = []
    for name, n, width in PARAMS:
        out.append((Rows(name, 0, n, (n, width)), 0, 1))
        out.append((Rows(name, 0, 1, (1, width)), 0, 2))
        out.append((Rows(name, n, n + 2, (2, width)), 1, 0))
    return out


def _mine(rank):
    return [t for t in _transfers() if rank in t[1:]]


def _messages(pt, send, peer):
    return [(b.tag, [(r.name, r.lo, r.hi) for r in b.rows]) for b in pt.buckets() if b.send == send and b.peer == peer]


def test_sender_and_receiver_cut_the_same_buckets_under_the_cap():
    cap = 64                                   # bytes: 16 fp32 elements
    r0, r1, r2 = (PeerTransfers(rank, _mine(rank), 4, cap, parity=1) for rank in range(3))
    assert _messages(r0, True, 1) == _messages(r1, False, 0)
    assert _messages(r1, True, 0) == _messages(r0, False, 1)
    assert _messages(r0, True, 2) == _messages(r2, False, 0)
    sent = _messages(r0, True, 1)
    # model order, nothing lost or repeated; 'b' (120 bytes) is over the cap and travels alone
    assert [x for _, rows in sent for x in rows] == [(n, 0, rows) for n, rows, _ in PARAMS]
    assert [rows for _, rows in sent] == [[("a", 0, 4)], [("b", 0, 10)], [("c", 0, 1), ("d", 0, 2)], [("e", 0, 3)]]
    assert [tag for tag, _ in sent] == [1, 3, 5, 7]
    for b in r0.buckets():
        assert b.numel * 4 <= cap or len(b.rows) == 1
    # round k holds bucket k of every peer and direction
    assert [[(b.peer, b.send) for b in rnd] for rnd in r0.rounds] == [
        [(1, False), (1, True), (2, True)], [(1, False), (1, True)], [(1, True)], [(1, True)]]


def test_without_a_cap_one_message_per_peer_and_direction():
    r0 = PeerTransfers(0, _mine(0), 4, None, parity=2)
    assert [(b.peer, b.send, b.tag, len(b.rows)) for b in r0.buckets()] == [(1, False, 2, 5), (1, True, 2, 5),
                                                                            (2, True, 2, 5)]
    assert [(b.peer, b.rows[i]) for b, i in r0.received["b"]] == [(1, Rows("b", 10, 12, (2, 3)))]


def test_a_large_transfer_travels_alone_and_small_ones_around_it_do_not_join_across_it():
    big = ALONE_BYTES // 4
    transfers = [(Rows("s1", 0, 4, (4,)), 0, 1), (Rows("big", 0, big, (big,)), 0, 1), (Rows("s2", 0, 4, (4,)), 0, 1)]
    sender, receiver = PeerTransfers(0, transfers, 4, None, parity=2), PeerTransfers(1, transfers, 4, None, parity=2)
    assert [([r.name for r in b.rows], b.tag, b.alone) for b in sender.buckets()] == [
        (["s1"], 2, False), (["big"], 4, True), (["s2"], 6, False)]
    assert _messages(sender, True, 1) == _messages(receiver, False, 0)


def test_a_received_buffer_is_freed_once_every_parameter_in_it_was_copied_out():
    r1 = PeerTransfers(1, _mine(1), 4, 64, parity=1)
    first = next(b for b in r1.buckets() if not b.send)          # 'c' and 'd' travel together
    assert [r.name for r in first.rows] == ["a"]
    together = next(b for b in r1.buckets() if not b.send and len(b.rows) == 2)
    for b in r1.buckets():
        b.allocate(torch.float32, torch.device("cpu"))
    r1.consumed("c")
    assert together.flat is not None
    r1.consumed("d")
    assert together.flat is None and first.flat is not None
