"""The engine's scheduling policy and chunk fusion, driven through the
extension piece by piece (the end-to-end jobs in test_scheduling.py check
the same from a trace): the credit queue against a reference model written
here with heapq, fusion against the rules it must keep."""

import heapq
import random

import pytest

from benchmarks.cxx_hooks import hooks


class ReferenceQueue:
    """What the engine's queue must do: highest priority first, first pushed
    first among equals, at most `credit` sent and not yet acknowledged."""

    def __init__(self, credit):
        self.credit, self.heap, self.seq, self.out = credit, [], 0, 0

    def push(self, id, priority):
        heapq.heappush(self.heap, (-priority, self.seq, id))
        self.seq += 1

    def send(self):
        if not self.heap or self.out >= self.credit:
            return -1
        self.out += 1
        return heapq.heappop(self.heap)[2]

    def ack(self):
        self.out -= 1


@pytest.mark.parametrize("seed", range(10))
def test_credit_queue_matches_the_reference(seed):
    rng = random.Random(seed)
    credit = rng.randint(1, 6)
    engine, reference = hooks().ChunkQueue(credit), ReferenceQueue(credit)
    next_id = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.45:
            priority = rng.choice([-100, -1, 0, 0, 5, 100, rng.randint(-1000, 1000)])
            engine.push(next_id, priority)
            reference.push(next_id, priority)
            next_id += 1
        elif op < 0.8:
            assert engine.send() == reference.send()
        elif reference.out > 0:
            engine.ack()
            reference.ack()
        assert (engine.out, engine.waiting) == (reference.out, len(reference.heap))


def test_a_high_priority_chunk_waits_behind_the_window_only():
    credit = 3
    q = hooks().ChunkQueue(credit)
    for i in range(100):
        q.push(i, -100)
    sent = [q.send() for _ in range(credit)]
    assert sent == [0, 1, 2] and q.send() == -1  # the window is full
    q.push(1000, 100)
    q.ack()
    assert q.send() == 1000  # the first credit back goes to it, ahead of 97 queued chunks
    q.ack()
    assert q.send() == 3


def fuse(chunks, partition):
    nbytes, dtypes, servers, priorities = (list(x) for x in zip(*chunks))
    return hooks().fuse_small_chunks(nbytes, dtypes, servers, priorities, partition)


def test_fusion_groups_small_chunks_per_server_and_dtype():
    partition = 64
    chunks = [
        (10, "float32", 0, 0),
        (10, "float32", 0, 0),
        (100, "float32", 0, 0),  # a big one stays alone
        (10, "float32", 1, 0),  # another server
        (10, "float16", 0, 0),  # another dtype: server 0's open group is now this one's
        (16, "float32", 0, 0),
        (16, "float32", 0, 0),
        (16, "float32", 0, 0),  # a new group: 48 bytes
        (16, "float32", 0, 0),  # 64 would be a whole partition, not over it: joins
        (1, "float32", 0, 0),
    ]  # 65 would be over: a new group
    assert fuse(chunks, partition) == [[0, 1], [2], [3], [4], [5, 6, 7, 8], [9]]


@pytest.mark.parametrize("seed", range(10))
def test_fusion_keeps_its_rules(seed):
    rng = random.Random(seed)
    partition = rng.choice([4096, 65536, 1 << 20])
    small = partition // 4
    chunks = [
        (
            rng.choice([rng.randint(1, small), rng.randint(1, partition)]),
            rng.choice(["float32", "float16"]),
            rng.randint(0, 3),
            rng.choice([0, -1, -2, 7]),
        )
        for _ in range(rng.randint(1, 2000))
    ]
    groups = fuse(chunks, partition)
    assert sorted(i for g in groups for i in g) == list(range(len(chunks)))  # every chunk, once
    send_order = sorted(range(len(chunks)), key=lambda i: -chunks[i][3])  # stable: by priority, then position
    rank = {i: r for r, i in enumerate(send_order)}
    for g in groups:
        if len(g) == 1:
            continue
        assert len({chunks[i][2] for i in g}) == 1 and len({chunks[i][1] for i in g}) == 1  # one server, one dtype
        assert all(chunks[i][0] <= small for i in g)  # only small chunks fuse
        assert sum(chunks[i][0] for i in g) <= partition and len(g) <= 256
        assert [rank[i] for i in g] == sorted(rank[i] for i in g)  # parts in send order
