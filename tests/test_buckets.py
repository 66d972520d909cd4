"""Buckets: a large psum as several custom calls (jbps/ops/buckets.py), the
same sums as one call, and gradients that travel while the backward pass
still runs, read from the engine's trace."""

import numpy as np
import pytest

from conftest import check_results, last_json, run_job, worker_script
from jbps.config import Config
from jbps.ops import buckets
from jbps.partition import defaults


def test_buckets_follow_the_backward_order_and_their_size():
    rng = np.random.default_rng(3)
    nbytes = [int(b) for b in rng.integers(1, 5000, size=40)]
    prios = [int(p) for p in rng.permutation(40)]
    groups = buckets.split(nbytes, prios, 8000)
    assert sorted(i for g in groups for i in g) == list(range(40))
    # Lowest priority first: every leaf of a bucket comes before every leaf of the next.
    for a, b in zip(groups, groups[1:]):
        assert max(prios[i] for i in a) < min(prios[i] for i in b)
    # Every bucket but the last holds at least bucket_bytes, and would hold less
    # without its last leaf (in the backward order).
    for g in groups[:-1]:
        last = max(g, key=lambda i: (prios[i], -i))
        assert sum(nbytes[i] for i in g) >= 8000 > sum(nbytes[i] for i in g) - nbytes[last]


def test_one_call_when_the_tree_fits_or_buckets_are_off():
    assert buckets.split([100, 200], [0, -1], 300) == [[0, 1]]
    assert buckets.split([100, 200], [0, -1], 0) == [[0, 1]]
    # Default priorities (-index): the last leaf first, as backprop produces it.
    assert buckets.split([100, 200, 300], [0, -1, -2], 250) == [[2], [0, 1]]
    assert buckets.split([100, 200, 300], [0, -1, -2], 350) == [[1, 2], [0]]


@pytest.mark.parametrize("raw,expected", [("0", 0), ("1M", 1 << 20), ("65536", 65536)])
def test_bucket_bytes_is_an_option(raw, expected):
    assert Config.resolve({}, {}).bucket_bytes is None  # sized per psum (defaults.bucket_bytes)
    assert Config.resolve({}, {"JBPS_BUCKET_BYTES": raw}).bucket_bytes == expected
    assert Config.resolve({"bucket_bytes": raw}, {}).bucket_bytes == expected


def test_default_buckets_follow_the_tree_and_the_link():
    mib = 1 << 20
    # One host: 4 MiB whatever the tree.
    assert defaults.bucket_bytes(6 * mib, False) == defaults.bucket_bytes(100 * mib, False) == 4 * mib
    # Across hosts, no rate known: an eighth of the tree, between 256 KiB and 4 MiB.
    assert defaults.bucket_bytes(16 * mib, True) == 2 * mib
    assert defaults.bucket_bytes(100 * mib, True) == 4 * mib
    assert defaults.bucket_bytes(1 * mib, True) == 256 << 10
    # At most BUCKET_LINK_S of the busiest link: 200 Mbit/s (25 MB/s) carrying
    # 1.5 bytes per byte of psum holds 166,666 bytes in 10 ms, under the floor.
    assert defaults.bucket_bytes(32 * mib, True, 25e6, 1.5) == 256 << 10
    ten_ms_at_2g5 = int(312.5e6 * defaults.BUCKET_LINK_S)
    assert defaults.bucket_bytes(100 * mib, True, 312.5e6, 1.0) == ten_ms_at_2g5
    # The size only grows with the tree and the rate.
    sizes = [defaults.bucket_bytes(t * mib, True, r, 1.0) for t in (1, 8, 64) for r in (25e6, 125e6, 1.25e9)]
    assert sizes == sorted(sizes[:3]) + sorted(sizes[3:6]) + sorted(sizes[6:])
    assert all(defaults.MIN_BUCKET_BYTES <= s <= defaults.MAX_BUCKET_BYTES for s in sizes)


@pytest.mark.parametrize("mode,devices", [("pmap", 2), ("jit", 1)])
def test_random_trees_in_small_buckets_match_numpy(mode, devices):
    rounds = 3
    results = run_job(
        [worker_script("random_trees.py"), "--rounds", str(rounds), "--mode", mode, "--seed", "21"],
        workers=2,
        servers=2,
        devices=devices,
        env={"JBPS_BUCKET_BYTES": "4096", "JBPS_PARTITION_BYTES": "65536", "JBPS_TIMEOUT_S": "60"},
    )
    check_results(results, rounds)


def test_a_training_step_pushes_its_first_bucket_before_the_last_is_entered(tmp_path):
    def run(bucket_bytes, trace_dir):
        results = run_job(
            # A backward pass of ~0.2 s (4096 rows): a server's first acknowledgement must fit
            # in it even when the machine is busy with other work (CI builds beside the tests).
            [worker_script("overlap_step.py"), "--bucket-bytes", str(bucket_bytes), "--batch", "4096"],
            workers=2,
            servers=2,
            env={"JBPS_TRACE_DIR": str(trace_dir), "JBPS_TIMEOUT_S": "60"},
            timeout_s=300,
        )
        for r in results:
            assert r.returncode == 0, r.stderr[-3000:]
        return [last_json(r.stdout) for r in results]

    bucketed = run(1 << 20, tmp_path / "buckets")
    whole = run(0, tmp_path / "one")
    # The same sums, so the same parameters, on every worker either way.
    assert len({r["checksum"] for r in bucketed + whole}) == 1, (bucketed, whole)
    assert all(len(r["calls"]) == 1 for r in whole)
    for r in bucketed:
        # (entered, first pushed, first acknowledged), in the order the calls were entered
        calls = sorted(r["calls"].values())
        assert len(calls) >= 6, r["calls"]
        first_pushed, first_acked, last_entered = calls[0][1], calls[0][2], calls[-1][0]
        # The last layers' gradients were on the wire, and a server had
        # acknowledged some, before the backward pass had produced the first
        # layer's (whose call is entered last). Without overlap XLA would enter
        # the calls one after the other once the backward pass is done, and no
        # push could make the round trip to a server in between. (The first
        # bucket's sum itself may come back last: later buckets rank higher.)
        assert first_pushed < first_acked < last_entered, r["calls"]
