"""Soak: many rounds of mixed trees, 2 workers x 2 devices, 2 servers, every
result checked against numpy, and no memory growth in workers or servers.
The default suite runs 300 rounds; `pytest --soak` (or JBPS_SOAK=1) runs
2,000 and prints the figures."""

import sys

from conftest import last_json, soaking, worker_script
from benchmarks.local_cluster import LocalCluster


def test_soak_rounds_match_numpy_and_memory_stays_flat(request):
    long = soaking(request.config)
    rounds, measure_at = (2000, 200) if long else (300, 100)
    with LocalCluster(
        2,
        2,
        local_devices=2,
        python=sys.executable,
        timeout_s=1200,
        env={"JBPS_PARTITION_BYTES": "32768", "JBPS_TIMEOUT_S": "60"},
    ) as cluster:
        pids = ",".join(str(p.pid) for p in cluster.servers)
        results = cluster.run_workers(
            [worker_script("soak.py"), "--rounds", str(rounds), "--measure-at", str(measure_at)],
            env_per_rank={0: {"SOAK_SERVER_PIDS": pids}},
        )
    for r in results:
        assert r.returncode == 0, f"worker {r.rank}:\n{r.stderr[-3000:]}"
    memory = {}
    for r in results:
        rep = last_json(r.stdout)
        assert rep["rounds"] == rounds
        memory.update(
            {f"{name} (rank {r.rank})" if name == "worker" else name: kib for name, kib in rep["rss_kib"].items()}
        )
    assert len(memory) == 4, memory  # 2 workers, 2 servers
    for name, (at, end) in memory.items():
        growth = (end - at) / at
        print(
            f"{name}: RSS {at / 1024:.1f} MiB after round {measure_at}, {end / 1024:.1f} MiB after round "
            f"{rounds} ({growth:+.2%})"
        )
        assert abs(growth) < 0.05, (name, at, end)
