"""A worker for launch tests: init from whatever bootstrap the environment
gives, one psum checked against numpy, print "ready <rank>", then optionally
crash (--crash-rank, with exit code 3) or linger (--sleep) before a second
psum. Prints one JSON line {"rank", "size", "local_rank", "local_size"}."""

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
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--sleep", type=float, default=0)
    args = p.parse_args()
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    f = jax.jit(lambda x: jbps.psum(x))
    x = jnp.arange(1000, dtype=jnp.float32) * (rank + 1)
    np.testing.assert_allclose(np.asarray(f(x)), np.arange(1000) * size * (size + 1) / 2)
    print(f"ready {rank}", flush=True)
    if rank == args.crash_rank:
        os._exit(3)
    time.sleep(args.sleep)
    np.testing.assert_allclose(np.asarray(f(x)), np.arange(1000) * size * (size + 1) / 2)
    # One write per line: mpiexec interleaves ranks' output at write boundaries.
    sys.stdout.write(
        json.dumps({"rank": rank, "size": size, "local_rank": jbps.local_rank(), "local_size": jbps.local_size()})
        + "\n"
    )
    sys.stdout.flush()
    jbps.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
