"""Worker 0 reaches the servers over loopback TCP (JBPS_SHM=0), the others through
shared memory, as in a job whose workers are on several hosts. Psums of 4 MiB chunks
(JBPS_PARTITION_BYTES) under a credit of 1, each call's values its own, each checked against numpy. Prints {"rank", "calls"}."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

if os.environ["JBPS_WORKER_RANK"] == "0":
    os.environ["JBPS_SHM"] = "0"

import jbps  # noqa: E402


def main():
    jbps.init(scheduling_credit=1)
    rank, size = jbps.rank(), jbps.size()
    # Leaves of several chunks and a small one: large TCP reads end in small remainders.
    # Each call's values differ from the last's, so a sum left over from an
    # earlier call cannot pass for this one's.
    sizes = (3 << 20, 5 << 19, 1 << 18, 3 << 16, 1000)
    f = jax.jit(lambda t: jbps.psum(t, name="mixed"))
    calls = 30
    for call in range(calls):
        tree = [jnp.full((n,), (rank + 1.0) * (call + 1), jnp.float32) for n in sizes]
        for leaf in f(tree):
            np.testing.assert_array_equal(np.asarray(leaf), (call + 1) * size * (size + 1) / 2)
    jbps.shutdown()
    print(json.dumps({"rank": rank, "calls": calls}), flush=True)


if __name__ == "__main__":
    main()
