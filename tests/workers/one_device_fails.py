"""A worker of tests/test_faults.py's split-device fault: 2 local devices, a
pmap psum whose two device shards go to different servers. After one good
round it prints "ready" and waits for --go-file; the test has then stopped
one server, so one device's part of the next psum is summed and the other's
waits until the test kills that server.

Prints one JSON line: {"rank", "error", "at"}: what the psum raised and when
(time.time())."""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jbps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--go-file", required=True)
    args = p.parse_args()
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    k = jax.local_device_count()
    f = jax.pmap(lambda x: jbps.psum(x, axis_name="d", name="split"), axis_name="d")
    x = (jnp.arange(k * 128, dtype=jnp.float32) * (rank + 1)).reshape(k, 128)
    want = np.broadcast_to(np.arange(k * 128).reshape(k, 128).sum(0) * size * (size + 1) / 2, (k, 128))
    np.testing.assert_allclose(np.asarray(f(x)), want)
    # One chunk per device shard (JBPS_PARTITION_BYTES=256), and both servers got bytes: each
    # device's shard goes to a server of its own, which is what the test's fault needs.
    pushed = jbps.engine_stats()["server_bytes_pushed"]
    assert len(pushed) == 2 and min(pushed) > 0, f"the shards did not go to both servers: {pushed}"
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(args.go_file):
        assert time.monotonic() < deadline, "the test never said go"
        time.sleep(0.02)
    report = {"rank": rank, "error": None, "at": None}
    try:
        jax.block_until_ready(f(x))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["at"] = time.time()
    jbps.shutdown()
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
