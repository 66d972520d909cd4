"""Shared memory between workers and servers on one host (xla_ext/shm.h):
the same sums as TCP, chosen per connection without being asked, offers
checked, and nothing left mapped once a worker is gone."""

import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np

import jbps
from jbps import _core
from conftest import check_results, job_free_env, last_json, run_job, worker_script
from jbps.procs import terminate
from wire import HEADER, HELLO, HELLO_OK, ERROR, PUSH_SHM, SHM_OFFER, SHM_ACCEPT
from wire import frame as _frame

TOKEN = 0x5A11ED
ROUNDS = 3


def frame(type_, token=TOKEN, **fields):
    return _frame(type_, token, **fields)


def run_trees(env=None, env_per_rank=None):
    """random_trees.py on 2 workers x 1 device and 2 servers; small partitions
    make the big leaf several chunks, and the small leaves get fused."""
    results = run_job(
        [worker_script("random_trees.py"), "--rounds", str(ROUNDS), "--seed", "7", "--mode", "jit"],
        workers=2,
        servers=2,
        env={"JBPS_PARTITION_BYTES": "65536", **(env or {})},
        env_per_rank=env_per_rank,
    )
    check_results(results, ROUNDS)
    return [last_json(r.stdout) for r in results]


def test_shared_memory_and_tcp_give_the_same_sums():
    shm = run_trees()
    tcp = run_trees({"JBPS_SHM": "0"})  # workers and servers alike
    # Two workers: a + b is the same float either way round, so the bits match.
    assert shm[0]["digest"] == tcp[0]["digest"]
    for rep in shm:
        stats = rep["stats"]
        assert stats["shm_servers"] == 2, stats
        assert stats["bytes_shm"] == stats["bytes_pushed"] + stats["bytes_pulled"] > 0, stats
        assert stats["chunks_fused"] > 0, stats
    for rep in tcp:
        stats = rep["stats"]
        assert stats["shm_servers"] == 0 and stats["bytes_shm"] == 0, stats
        assert stats["chunks_fused"] > 0, stats  # fusion does not depend on the transport


def test_one_worker_on_tcp_and_one_on_shared_memory():
    reps = run_trees(env_per_rank={1: {"JBPS_SHM": "0"}})
    by_rank = {rep["rank"]: rep["stats"] for rep in reps}
    assert by_rank[0]["shm_servers"] == 2 and by_rank[0]["bytes_shm"] > 0
    assert by_rank[1]["shm_servers"] == 0 and by_rank[1]["bytes_shm"] == 0


def test_in_process_psum_uses_shared_memory():
    srv = _core.Server("127.0.0.1:0", 1, token=TOKEN)
    try:
        with jbps.init(
            servers=[f"127.0.0.1:{srv.port}"],
            num_workers=1,
            worker_rank=0,
            job_token=TOKEN,
            timeout_s=20,
            partition_bytes=1 << 16,
        ):
            x = np.arange(300_000, dtype=np.float32)
            tree = {"big": x, "small": [np.full(n, n, np.float32) for n in (1, 7, 1000)]}
            import jax

            before = jbps.engine_stats()  # the process's counters: earlier tests' bytes are in them
            out = jax.jit(jbps.psum)(tree)
            np.testing.assert_array_equal(out["big"], x)
            for got, want in zip(out["small"], tree["small"]):
                np.testing.assert_array_equal(got, want)
            after = jbps.engine_stats()
            stats = {k: after[k] - before[k] for k in ("bytes_shm", "bytes_pushed")}
            assert after["shm_servers"] == 1 and stats["bytes_shm"] == 2 * stats["bytes_pushed"] > 0, stats
            assert srv.stats()["shm_workers"] == 1
    finally:
        srv.stop()


def _maps_of_pushes(ignore=((), ())):
    """This process's mappings and descriptors of push regions, less those in `ignore`
    (what earlier tests' engines in this process may still hold)."""
    with open("/proc/self/maps") as f:
        maps = [line.split()[4] for line in f if "jbps-push" in line]  # inode of the memfd
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "jbps-push" in os.readlink(f"/proc/self/fd/{fd}"):
                fds.append(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass  # closed meanwhile
    return [m for m in maps if m not in ignore[0]], [f for f in fds if f not in ignore[1]]


LOOPER = """
import sys, time
import numpy as np, jax, jbps
jbps.init(servers=[sys.argv[1]], num_workers=2, worker_rank=int(sys.argv[2]), job_token=int(sys.argv[3]), timeout_s=20)
f = jax.jit(lambda x: jbps.psum(x, name="loop"))
print("ready", flush=True)
for _ in range(100000):
    f(np.ones(1 << 16, np.float32)).block_until_ready()
    time.sleep(0.01)
"""


def test_a_lost_workers_region_is_unmapped():
    srv = _core.Server("127.0.0.1:0", 2, token=TOKEN, keep_alive=True, timeout_s=20)
    procs = []
    before = _maps_of_pushes()
    try:
        for rank in (0, 1):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", LOOPER, f"127.0.0.1:{srv.port}", str(rank), str(TOKEN)],
                    env=job_free_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd="/",
                )
            )  # -c puts the cwd first: not a source checkout
        deadline = time.monotonic() + 60
        while srv.stats()["shm_workers"] < 2 or len(_maps_of_pushes(before)[0]) < 2:
            assert time.monotonic() < deadline, f"workers never attached: {srv.stats()}"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        # The lost worker's job is aborted: the other worker fails too.
        assert procs[0].wait(timeout=60) != 0
        procs[1].wait(timeout=10)
        deadline = time.monotonic() + 10
        while _maps_of_pushes(before) != ([], []) or srv.stats()["shm_workers"] != 0:
            assert time.monotonic() < deadline, f"still mapped after the job ended: {_maps_of_pushes(before)}"
            time.sleep(0.05)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("jbps")]
    finally:
        terminate(procs)
        srv.stop()


def _sealed_region(nbytes, seal=True):
    fd = os.memfd_create("test-region", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _offer(instance, header, fd=None):
    """One offer on the server's shared-memory socket; (reply header fields, text, fd) or None if closed."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    try:
        s.connect(f"\0jbps-{TOKEN:016x}-{instance:016x}")
        socket.send_fds(s, [header], [fd] if fd is not None else [])
        data, fds, _, _ = socket.recv_fds(s, 2048, 4)
    finally:
        s.close()
    for extra in fds[1:]:
        os.close(extra)
    if not data:
        return None
    fields = HEADER.unpack(data[: HEADER.size])
    return fields, data[HEADER.size :].decode(errors="replace"), (fds[0] if fds else None)


def test_offers_and_shared_memory_pushes_are_checked():
    srv = _core.Server("127.0.0.1:0", 1, token=TOKEN, keep_alive=True, timeout_s=10)
    try:
        tcp = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        tcp.sendall(frame(HELLO, key=1, sender=0))
        reply = HEADER.unpack(tcp.recv(HEADER.size, socket.MSG_WAITALL))
        assert reply[2] == HELLO_OK
        instance = (reply[5] << 32) | reply[9]  # round: high half, sender: low half
        assert instance != 0

        rejected = srv.stats()["rejected"]
        assert _offer(instance, frame(SHM_OFFER, token=TOKEN ^ 1, key=4096)) is None  # wrong token: no answer
        fields, text, _ = _offer(instance, frame(SHM_OFFER, key=4096))
        assert fields[2] == ERROR and "no region" in text
        unsealed = _sealed_region(1 << 20, seal=False)
        fields, text, _ = _offer(instance, frame(SHM_OFFER, key=4096), unsealed)
        assert fields[2] == ERROR and "not sealed" in text
        os.close(unsealed)
        fields, text, _ = _offer(instance, frame(SHM_OFFER, sender=3, key=4096), _sealed_region(1 << 20))
        assert fields[2] == ERROR and "worker 3" in text
        assert srv.stats()["rejected"] == rejected + 4

        region = _sealed_region(1 << 20)
        fields, _, arena = _offer(instance, frame(SHM_OFFER, key=4096), region)
        assert fields[2] == SHM_ACCEPT and arena is not None
        assert os.fstat(arena).st_size > 0
        os.close(arena)
        assert srv.stats()["shm_workers"] == 1
        # A push that points outside the region ends the connection.
        tcp.sendall(frame(PUSH_SHM, key=5, dtype=0, nbytes=16) + struct.pack("<QQ", 1 << 20, 4))
        while tcp.recv(1 << 16):  # the server closes it (a timeout here fails the test)
            pass
        deadline = time.monotonic() + 10
        while srv.stats()["shm_workers"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert srv.stats()["rejected"] == rejected + 5
        tcp.close()
        os.close(region)

        # The server still sums for the next job.
        with jbps.init(servers=[f"127.0.0.1:{srv.port}"], num_workers=1, worker_rank=0, job_token=TOKEN, timeout_s=20):
            import jax

            x = np.arange(1000, dtype=np.float32)
            np.testing.assert_array_equal(jax.jit(jbps.psum)(x), x)
            assert jbps.engine_stats()["shm_servers"] == 1
    finally:
        srv.stop()
