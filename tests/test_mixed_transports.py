"""Pushes over TCP in one-host jobs: beside workers on shared memory (a large TCP read
that ends in a small remainder once waited for a wake-up threshold it could never
reach), and many fused pushes gathered into one write (within the kernel's iovec limit)."""

from conftest import last_json, run_job, worker_script


def test_workers_on_tcp_and_on_shared_memory_sum_together():
    results = run_job(
        [worker_script("mixed_transports.py")],
        workers=2,
        servers=2,
        env={"JBPS_TIMEOUT_S": "20", "JBPS_PARTITION_BYTES": str(4 << 20)},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert last_json(r.stdout)["calls"] == 30


def test_many_fused_pushes_in_one_write_over_tcp():
    results = run_job(
        [worker_script("fused_over_tcp.py")], workers=2, servers=2, env={"JBPS_TIMEOUT_S": "20", "JBPS_SHM": "0"}
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert last_json(r.stdout)["calls"] == 3
