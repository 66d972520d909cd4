"""Shutting down: twice, then init again, and leaving the interpreter with a
psum pending. Nothing hangs or crashes, and no process, thread or socket is
left behind."""

import sys
import time

from conftest import last_json, worker_script
from benchmarks.local_cluster import LocalCluster


def test_shutdown_twice_then_init_again_leaves_no_socket_thread_or_child():
    with LocalCluster(1, 1, python=sys.executable, timeout_s=120, server_args=["--keep-alive"]) as cluster:
        (result,) = cluster.run_workers([worker_script("shutdown_paths.py"), "--case", "repeat"])
        assert result.returncode == 0, result.stderr[-3000:]
        rep = last_json(result.stdout)
        for when in ("after_first", "after_second"):
            assert rep[when]["sockets"] == [], rep
            assert rep[when]["children"] == [], rep
        # The engine's threads (a dispatcher, a watchdog, two per server,
        # one per device) are joined: a second init/shutdown adds none.
        assert rep["after_second"]["threads"] == rep["after_first"]["threads"], rep
        assert rep["initialized"] is False
        assert cluster.servers[0].poll() is None  # keep-alive: still serving


def test_interpreter_exit_with_a_psum_pending_ends_at_once_and_cleanly():
    # A long psum timeout, so only a prompt shutdown can end the pending psum in time.
    with LocalCluster(2, 1, python=sys.executable, timeout_s=120, env={"JBPS_TIMEOUT_S": "60"}) as cluster:
        results = cluster.run_workers([worker_script("shutdown_paths.py"), "--case", "pending-exit"])
        ended = time.time()
        for r in results:
            assert r.returncode == 0, f"worker {r.rank}:\n{r.stderr[-3000:]}"
        exiting = float(results[0].stdout.split("exiting ", 1)[1].split()[0])
        assert ended - exiting < 10, f"rank 0 took {ended - exiting:.1f} s to exit"
        assert "Fatal Python error" not in results[0].stderr and "core dumped" not in results[0].stderr
        # Both workers said goodbye, so the server ended too.
        assert cluster.servers[0].wait(timeout=10) == 0
