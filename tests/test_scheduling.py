"""Scheduling with real processes: routing by the optimal split, server
threads balanced by bytes, priority order proven from the trace, and
deterministic rank-order sums."""

import sys

import jax
import numpy as np
import pytest

from conftest import WORKERS, check_results, last_json, run_job, worker_script
from jbps import _core
from benchmarks.local_cluster import LocalCluster
from jbps.partition import make_plan, server_fractions
from jbps.trace import read_trace, trace_path

sys.path.insert(0, WORKERS)
import random_trees  # noqa: E402  (the worker's own tree, to plan it here)


def random_tree_leaves(big_elems):
    tree = random_trees.make_tree(0, 0, 0, 0, 1, big_elems)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return (
        [jax.tree_util.keystr(p) for p, _ in flat],
        [np.shape(x) for _, x in flat],
        [np.asarray(x).dtype for _, x in flat],
    )


def test_servers_receive_the_planned_bytes(tmp_path):
    # 2 workers, two colocated servers and one dedicated: the split gives each
    # colocated server y = 1/4 and the dedicated one x = 1/2 of the bytes.
    roles = ["colocated", "colocated", "dedicated"]
    servers = [_core.Server("127.0.0.1:0", 2, sum_threads=3, role=r, keep_alive=True) for r in roles]
    try:
        rounds, partition = 3, 16384
        with LocalCluster(2, 0, timeout_s=180, env={"JBPS_PARTITION_BYTES": str(partition)}) as cluster:
            cluster.addresses = [f"127.0.0.1:{s.port}" for s in servers]
            results = cluster.run_workers(
                [worker_script("random_trees.py"), "--rounds", str(rounds), "--mode", "jit", "--big-elems", "200000"]
            )
        check_results(results, rounds)
        paths, shapes, dtypes = random_tree_leaves(200000)
        fractions = server_fractions(roles, 2)
        assert fractions == pytest.approx([0.25, 0.25, 0.5])
        plan = make_plan("psum.0", paths, shapes, dtypes, 1, partition_bytes=partition, server_fractions=fractions)
        planned = [2 * rounds * b for b in plan.server_bytes(len(servers))]
        stats = [s.stats() for s in servers]
        assert [st["bytes_received"] for st in stats] == planned
        total = sum(planned)
        for got, f in zip(planned, fractions):  # each call within one partition of its share
            assert abs(got - f * total) <= partition * 2 * rounds
        # Each server's threads took keys by bytes: no thread more than one key's bytes ahead.
        largest_key = max(min(partition, leaf.shard_bytes) for leaf in plan.leaves)
        for st in stats:
            assert max(st["thread_bytes"]) - min(st["thread_bytes"]) <= largest_key, st
        assert total > 0
    finally:
        for s in servers:
            s.stop()


def pull_order(trace_dir, rank):
    chunks = read_trace(trace_path(str(trace_dir), rank))
    by_leaf = {}
    for ch in chunks:
        by_leaf.setdefault(ch.tensor, []).append(ch)
    return by_leaf


@pytest.mark.parametrize("reverse", [False, True])
def test_trace_shows_priority_order(tmp_path, reverse):
    # Leaf [0] is 2 chunks, leaf [2] 32 chunks; a window of 2 chunks makes
    # the dispatch order visible in when each chunk is sent.
    results = run_job(
        [worker_script("priority_tree.py")] + (["--reverse"] if reverse else []),
        workers=2,
        servers=2,
        env={"JBPS_TRACE_DIR": str(tmp_path), "JBPS_PARTITION_BYTES": "16384", "JBPS_SCHEDULING_CREDIT": "2"},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert last_json(r.stdout)["leaves"] == 3
    for rank in (0, 1):
        by_leaf = pull_order(tmp_path, rank)
        first, last = by_leaf["grads[0]"], by_leaf["grads[2]"]
        assert len(first) == 2 and len(last) == 32 and len(by_leaf["grads[1]"]) == 4
        for ch in first + last:
            assert ch.queued <= ch.sent_start <= ch.acked <= ch.sum_arrived <= ch.pulled
            assert ch.nbytes == 16384
        # When the engine's sender took each chunk: its choice by priority, with the 2 chunks'
        # window gating it. When the sums came back depends on the servers' threads too, which
        # a loaded machine deschedules (a CI run saw half the last leaf's sums back first).
        first_sent = max(ch.sent_start for ch in first)
        later = sum(ch.sent_start > first_sent for ch in last) / len(last)
        if reverse:
            assert later < 0.5, f"reversed priority: {later:.0%} of the last leaf was sent after the first"
            assert {ch.priority for ch in first} == {0} and {ch.priority for ch in last} == {2}
        else:
            assert later > 0.5, f"default priority: only {later:.0%} of the last leaf was sent after the first"
            assert {ch.priority for ch in first} == {0} and {ch.priority for ch in last} == {-2}


def test_byteps_trace_variables(tmp_path):
    results = run_job(
        [worker_script("priority_tree.py")],
        workers=1,
        servers=1,
        env={"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_DIR": str(tmp_path)},
    )
    assert results[0].returncode == 0, results[0].stderr[-3000:]
    chunks = read_trace(trace_path(str(tmp_path), 0))
    assert {ch.tensor for ch in chunks} == {"grads[0]", "grads[1]", "grads[2]"}


def run_digests(deterministic):
    env = {"JBPS_PARTITION_BYTES": "65536"}
    if deterministic:
        env["JBPS_DETERMINISTIC"] = "1"
    results = run_job(
        [worker_script("random_trees.py"), "--rounds", "6", "--mode", "jit", "--jitter-ms", "40", "--seed", "3"],
        workers=3,
        servers=2,
        env=env,
    )
    check_results(results, 6)
    return last_json(results[0].stdout)["digest"]


def test_deterministic_sums_are_bitwise_stable():
    # Workers sleep randomly before each round, so pushes reach the servers
    # in varying order; with JBPS_DETERMINISTIC the sums are the same bits.
    digests = {run_digests(True) for _ in range(3)}
    assert len(digests) == 1


def test_high_priority_call_overtakes_queued_chunks(tmp_path):
    # A 256-chunk low-priority call on one device; once it is pushing, a
    # 1-chunk high-priority call on another device. Of the big call's chunks
    # still queued when the small one arrived, at most the credit window may
    # leave before it, plus one: a big chunk dispatched in the same step as
    # the small one, to the other server, may reach its socket first.
    credit = 2
    results = run_job(
        [worker_script("overtake.py")],
        workers=2,
        servers=2,
        devices=2,
        env={"JBPS_TRACE_DIR": str(tmp_path), "JBPS_PARTITION_BYTES": "65536", "JBPS_SCHEDULING_CREDIT": str(credit)},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        chunks = read_trace(trace_path(str(tmp_path), rank))
        big = [c for c in chunks if c.tensor == "big" and c.round == 1]
        (small,) = [c for c in chunks if c.tensor == "small" and c.round == 1]
        assert len(big) == 256
        waiting = [c for c in big if c.queued < small.queued < c.sent_start]
        assert len(waiting) >= 64, f"the small call came too late to test overtaking ({len(waiting)} chunks waiting)"
        went_first = [c for c in waiting if c.sent_start < small.sent_start]
        assert len(went_first) <= credit + 1, f"{len(went_first)} queued low-priority chunks went before the small call"
