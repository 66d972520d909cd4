"""Multi-process correctness: real server and worker processes on loopback."""

import pytest

from conftest import check_results, run_job, worker_script

# The full cross product of 1-3 workers x 1/2/4 local devices x 1-3 servers,
# cycling through the transforms (plain jit only where there is one device).
MATRIX = [
    (w, d, s, ("jit", "pmap", "shard_map")[(w + s) % 3] if d == 1 else ("pmap", "shard_map")[(w + s) % 2])
    for w in (1, 2, 3)
    for d in (1, 2, 4)
    for s in (1, 2, 3)
]


@pytest.mark.parametrize("workers,devices,servers,mode", MATRIX)
def test_random_trees_match_numpy(workers, devices, servers, mode):
    # A small partition size makes the big leaf span several chunks and servers.
    rounds = 4
    results = run_job(
        [
            worker_script("random_trees.py"),
            "--rounds",
            str(rounds),
            "--mode",
            mode,
            "--seed",
            str(workers * 100 + devices * 10 + servers),
        ],
        workers=workers,
        servers=servers,
        devices=devices,
        env={"JBPS_PARTITION_BYTES": "65536", "JBPS_TIMEOUT_S": "60"},
    )
    check_results(results, rounds)


def test_fifty_rounds_with_a_slow_worker():
    # Rank 1 sleeps before every other round: the others push round r+1 while
    # it is still on round r, and rounds must not mix.
    rounds = 50
    results = run_job(
        [worker_script("random_trees.py"), "--rounds", str(rounds), "--sleep-rank", "1", "--big-elems", "20000"],
        workers=3,
        servers=2,
        devices=2,
        env={"JBPS_PARTITION_BYTES": "16384", "JBPS_SCHEDULING_CREDIT": "2"},
        timeout_s=300,
    )
    check_results(results, rounds)
