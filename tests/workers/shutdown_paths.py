"""A worker of tests/test_shutdown.py.

--case repeat (1 worker, a keep-alive server): init, psum, shutdown twice,
init again, psum, shutdown; reports the TCP sockets, threads and child
processes this process has after each shutdown.
--case pending-exit (2 workers): rank 1 does one psum and exits; rank 0 does
one psum, then leaves the interpreter with a psum pending (rank 1 will never
push it). Prints "exiting <time.time()>" just before.

Prints one JSON line with what it found."""

import argparse
import json
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from leftovers import tcp_sockets  # noqa: E402

import jbps  # noqa: E402


def children():
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    pids.append(int(pid))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def state():
    return {"sockets": tcp_sockets(os.getpid()), "threads": len(os.listdir("/proc/self/task")), "children": children()}


def checked_psum(name):
    size = jbps.size()
    x = jnp.arange(10, dtype=jnp.float32) * (jbps.rank() + 1)
    np.testing.assert_allclose(
        np.asarray(jax.jit(lambda v: jbps.psum(v, name=name))(x)), np.arange(10) * size * (size + 1) / 2
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=["repeat", "pending-exit"], required=True)
    args = p.parse_args()
    report = {}
    if args.case == "repeat":
        jbps.init()
        checked_psum("first")
        jbps.shutdown()
        jbps.shutdown()  # a no-op
        report["after_first"] = state()
        jbps.init()
        checked_psum("second")
        jbps.shutdown()
        report["after_second"] = state()
        report["initialized"] = jbps.is_initialized()
        print(json.dumps(report), flush=True)
        return
    jbps.init()
    checked_psum("first")
    if jbps.rank() == 1:
        return  # exits; its atexit shutdown says goodbye
    never = jax.jit(lambda v: jbps.psum(v, name="never"))
    calls = jbps.engine_stats()["calls"]
    threading.Thread(target=lambda: never(jnp.ones(3)), daemon=True).start()
    # Until the engine has the psum (on the server, waiting for rank 1): a thread
    # still compiling it at interpreter exit would be torn down inside jaxlib.
    deadline = time.monotonic() + 60
    while jbps.engine_stats()["calls"] == calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    print(f"exiting {time.time()}", flush=True)


if __name__ == "__main__":
    main()
