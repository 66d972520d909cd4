"""Thousands of small leaves over TCP (JBPS_SHM=0) under a wide credit window: a write
gathers several fused pushes, each an iovec per leaf. Prints {"rank", "calls"}."""

import json

import jax
import jax.numpy as jnp
import numpy as np

import jbps


def main():
    jbps.init(scheduling_credit=16)
    rank, size = jbps.rank(), jbps.size()
    tree = [jnp.full((64,), rank + 1.0, jnp.float32) for _ in range(3000)]
    f = jax.jit(lambda t: jbps.psum(t, name="many"))
    calls = 3
    for _ in range(calls):
        out = np.stack([np.asarray(x) for x in f(tree)])
        np.testing.assert_array_equal(out, size * (size + 1) / 2)
    assert jbps.engine_stats()["chunks_fused"] > 0
    jbps.shutdown()
    print(json.dumps({"rank": rank, "calls": calls}), flush=True)


if __name__ == "__main__":
    main()
