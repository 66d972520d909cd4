"""A worker that starts a large low-priority psum on one local device, waits
until the engine is pushing its chunks, then starts a small high-priority
psum on another device (each device runs its own programs, so the second
call reaches the engine while the first one's chunks still queue). Run with
JBPS_TRACE_DIR set and 2 local devices: the test checks in the trace that
the small call's chunk went ahead of the large call's queued chunks. Both
sums are checked against numpy. Prints one JSON line {"rank"}."""

import concurrent.futures
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jbps

BIG, SMALL = 1 << 22, 1 << 12  # float32 elements: 256 and 1 chunks of 64 KiB


def main():
    jbps.init()
    rank, workers = jbps.rank(), jbps.size()
    dev_big, dev_small = jax.local_devices()[:2]
    big = jax.jit(lambda x: jbps.psum(x, name="big", priority=lambda p, x: -100))
    small = jax.jit(lambda x: jbps.psum(x, name="small", priority=lambda p, x: 100))
    xb = jax.device_put(jnp.full((BIG,), rank + 1.0, jnp.float32), dev_big)
    xs = jax.device_put(jnp.full((SMALL,), 10.0 * (rank + 1), jnp.float32), dev_small)
    jax.block_until_ready((big(xb), small(xs)))  # compile both first

    before = jbps.engine_stats()["chunks_pushed"]
    # A thread, since jax may run a CPU program inline in the dispatching thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending_big = pool.submit(lambda: jax.device_get(big(xb)))
        deadline = time.monotonic() + 30
        while jbps.engine_stats()["chunks_pushed"] < before + 16 and time.monotonic() < deadline:
            time.sleep(0.0002)
        out_small = jax.device_get(small(xs))
        out_big = pending_big.result(timeout=60)
    total = workers * (workers + 1) / 2
    np.testing.assert_array_equal(out_big, np.full(BIG, total, np.float32))
    np.testing.assert_array_equal(out_small, np.full(SMALL, 10 * total, np.float32))
    jbps.shutdown()
    print(json.dumps({"rank": rank}), flush=True)


if __name__ == "__main__":
    main()
