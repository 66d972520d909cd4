"""A lost peer fails every pending and later psum, naming the peer, well
within JBPS_TIMEOUT_S: a worker or a server SIGKILLed mid-run, with real
processes on loopback; a fault that fails one local device's part of a psum
fails every device's part; and every connection carries the liveness bound
that catches a host that vanishes without closing its connections."""

import os
import signal
import socket
import sys
import time

import numpy as np
import pytest

import jbps
from conftest import last_json, worker_script
from jbps import _core
from benchmarks.local_cluster import LocalCluster
from leftovers import tcp_sockets

TIMEOUT_S = 5  # JBPS_TIMEOUT_S of these jobs: a detection by timeout would take this long
WORKERS = 3
LATE = WORKERS - 1


def run_with_fault(kill, tmp_path):
    """Starts 3 workers and 2 servers; once every worker but the last has a
    psum pending, kill(cluster, workers) kills something. Returns
    (reports of the surviving workers, kill time, cluster exit codes)."""
    go = tmp_path / "go"
    # 64-byte chunks: the pending psum (64 float32) has chunks on both servers, so it waits on
    # whichever server is killed (a psum waits only on the servers its chunks go to).
    with LocalCluster(
        WORKERS,
        2,
        timeout_s=90,
        python=sys.executable,
        env={"JBPS_TIMEOUT_S": str(TIMEOUT_S), "JBPS_PARTITION_BYTES": "64"},
    ) as cluster:
        procs = cluster.start_workers([worker_script("lost_peer.py"), "--late-rank", str(LATE), "--go-file", str(go)])
        deadline = time.monotonic() + 60
        while not all("pending" in (cluster.dir / f"worker{r}.out").read_text() for r in range(LATE)):
            assert time.monotonic() < deadline, "workers never got their psum pending"
            for rank, p in enumerate(procs):
                assert p.poll() is None, (cluster.dir / f"worker{rank}.err").read_text()[-3000:]
            time.sleep(0.02)
        time.sleep(0.5)  # their pushes are on the servers now
        killed_at = time.time()
        kill(cluster, procs)
        go.touch()
        results = cluster.wait_workers(procs, timeout_s=60)
        servers = []
        for proc, name in zip(cluster.servers, ("server0", "server1")):
            try:
                code = proc.wait(timeout=10)
            except Exception:
                code = None
            servers.append((code, (cluster.dir / f"{name}.err").read_text()))
        return results, killed_at, servers


def check_reports(results, ranks, needle, killed_at):
    for r in results:
        if r.rank not in ranks:
            continue
        assert r.returncode == 0, f"worker {r.rank}:\n{r.stderr[-3000:]}"
        rep = last_json(r.stdout)
        errors = [rep["next_error"], rep["check_error"], rep["converted"]]
        if r.rank != LATE:
            errors.append(rep["pending_error"])
            latency = rep["pending_at"] - killed_at
            print(f"worker {r.rank}: pending psum failed {latency:.3f} s after the kill")
            # Noticed from the connection, not by waiting for the psum timeout.
            assert latency < TIMEOUT_S / 2, f"worker {r.rank} took {latency:.2f} s"
        for e in errors:
            assert e is not None and needle in e and "jbps:" in e, (r.rank, e)
            assert "timed out" not in e, e
        assert rep["check_error"].startswith("JbpsError"), rep["check_error"]
        assert rep["converted"].startswith("JbpsError"), rep["converted"]


def test_a_killed_worker_fails_every_other_workers_psums_naming_it(tmp_path):
    def kill_late_worker(cluster, procs):
        os.kill(procs[LATE].pid, signal.SIGKILL)

    results, killed_at, servers = run_with_fault(kill_late_worker, tmp_path)
    assert results[LATE].returncode == -signal.SIGKILL
    check_reports(results, range(LATE), f"worker {LATE} ", killed_at)
    assert "was lost" in last_json(results[0].stdout)["pending_error"]
    # Both servers noticed, said so, and ended the job by themselves.
    for code, err in servers:
        assert code == 0, err
        assert f"worker {LATE} " in err and "was lost" in err, err


def test_a_killed_server_fails_every_workers_psums_naming_it(tmp_path):
    victim = {}

    def kill_server(cluster, procs):
        victim["address"] = cluster.addresses[0]
        os.kill(cluster.servers[0].pid, signal.SIGKILL)

    results, killed_at, servers = run_with_fault(kill_server, tmp_path)
    check_reports(results, range(WORKERS), f"lost summation server {victim['address']}", killed_at)
    assert servers[0][0] == -signal.SIGKILL
    assert servers[1][0] == 0, servers[1][1]  # the other server ends when every worker said goodbye


def test_connections_carry_the_stated_liveness_bound():
    # JBPS_TIMEOUT_S=16: keepalive probes every 16/8 = 2 s, 3 of them, and
    # unacknowledged data gives up after as long (8 s): a vanished host is
    # noticed within 8 s, half the psum timeout.
    srv = _core.Server("127.0.0.1:0", 1, timeout_s=16.0)
    try:
        with jbps.init(servers=[f"127.0.0.1:{srv.port}"], num_workers=1, worker_rank=0, timeout_s=16.0):
            checked = 0
            for fd in map(int, os.listdir("/proc/self/fd")):
                try:
                    copy = os.dup(fd)
                except OSError:
                    continue  # listdir's own descriptor, closed since
                try:
                    s = socket.socket(fileno=copy)
                except OSError:
                    os.close(copy)  # not a socket (e.g. a shared-memory region)
                    continue
                with s:
                    if s.type != socket.SOCK_STREAM or s.family != socket.AF_INET:
                        continue
                    try:
                        ends = {s.getsockname()[1], s.getpeername()[1]}
                    except OSError:
                        continue  # the listening socket
                    if srv.port not in ends:
                        continue
                    # Both ends are in this process: the worker's and the server's.
                    assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                    assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 2
                    assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 2
                    assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
                    assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 8000
                    checked += 1
            assert checked == 2, tcp_sockets(os.getpid())
    finally:
        srv.stop()


def test_a_fault_that_fails_one_local_devices_part_of_a_psum_fails_every_devices_part(tmp_path):
    # 2 workers x 2 local devices, 2 servers, one chunk per device shard: device 0's
    # shard is summed on one server, device 1's on the other. With that server stopped,
    # device 0's part of the next psum is summed and device 1's waits; the server is then
    # killed. Device 1's part fails with the lost server. Device 0's must fail too: done,
    # it would go on to XLA's all-gather of the two shards and wait there for device 1,
    # whose program has stopped (XLA:CPU aborts the process 40 s later).
    go = tmp_path / "go"
    with LocalCluster(
        2,
        2,
        local_devices=2,
        timeout_s=90,
        python=sys.executable,
        env={"JBPS_TIMEOUT_S": "20", "JBPS_PARTITION_BYTES": "256"},
    ) as cluster:
        procs = cluster.start_workers([worker_script("one_device_fails.py"), "--go-file", str(go)])
        deadline = time.monotonic() + 60
        while not all("ready" in (cluster.dir / f"worker{r}.out").read_text() for r in range(2)):
            assert time.monotonic() < deadline, "workers never got ready"
            for rank, p in enumerate(procs):
                assert p.poll() is None, (cluster.dir / f"worker{rank}.err").read_text()[-3000:]
            time.sleep(0.02)
        victim = cluster.servers[1]
        os.kill(victim.pid, signal.SIGSTOP)
        go.touch()
        time.sleep(1.0)  # device 0's part is summed on the other server by now
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        results = cluster.wait_workers(procs, timeout_s=60)
    for r in results:
        assert r.returncode == 0, f"worker {r.rank}:\n{r.stderr[-3000:]}"
        rep = last_json(r.stdout)
        assert rep["error"] is not None and f"lost summation server {cluster.addresses[1]}" in rep["error"], rep
        latency = rep["at"] - killed_at
        print(f"worker {r.rank}: the psum failed {latency:.3f} s after the kill")
        assert latency < 5, latency


def test_a_local_devices_call_is_handed_back_with_the_same_steps_calls_of_the_others():
    # One device's call of a step (CallSpec::slots) waits for the other devices' calls
    # of that step; one that never comes fails it at the psum timeout, naming the device,
    # and the next step pairs up again.
    from concurrent.futures import ThreadPoolExecutor

    srv = _core.Server("127.0.0.1:0", 1, timeout_s=30.0)

    def call(shard, values, chunk_bytes=None):
        return _core.engine_psum_host(
            values,
            key=7,
            name="pair",
            partition_bytes=1 << 20,
            chunk_bytes=chunk_bytes or [values.nbytes],
            chunk_alone=[0],
            servers=[0],
            tree="",
            tree_key=0,
            wait_s=30,
            shard=shard,
            slots=2,
        )

    try:
        with jbps.init(servers=[f"127.0.0.1:{srv.port}"], num_workers=1, worker_rank=0, timeout_s=2.0):
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(call, 0, np.ones(16, np.float32))
                time.sleep(0.5)  # device 0's part is summed; it waits for device 1's
                assert not first.done()
                second = pool.submit(call, 1, np.full(16, 2, np.float32))
                first.result(timeout=10)
                second.result(timeout=10)
                started = time.monotonic()
                with pytest.raises(
                    RuntimeError, match=r"psum 'pair': local device 1 never made its call of this step within 2 s"
                ):
                    call(0, np.ones(16, np.float32))
                assert 1.5 < time.monotonic() - started < 5
                # Device 1's next call belongs to the next step, as does device 0's.
                pair = [pool.submit(call, s, np.full(16, s + 1, np.float32)) for s in (0, 1)]
                for p in pair:
                    p.result(timeout=10)
                # A failed call is handed back at once, and fails the step's other calls,
                # those before it (held) and those after it.
                started = time.monotonic()
                with pytest.raises(RuntimeError, match="add up to"):
                    call(1, np.ones(16, np.float32), chunk_bytes=[4])  # a bad chunk table fails it at once
                assert time.monotonic() - started < 1.5
                with pytest.raises(RuntimeError, match="add up to"):
                    call(0, np.ones(16, np.float32))
                pair = [pool.submit(call, s, np.full(16, s + 1, np.float32)) for s in (0, 1)]
                for p in pair:
                    p.result(timeout=10)
    finally:
        srv.stop()
