"""A worker of the cut-link test (tests/test_multihost.py): psums of a few MiB,
each checked, until one fails or --seconds pass. Prints "running" once a psum
has crossed every link, then, on failure, one JSON line: {"rank", "error",
"failed_at"} with the message and when (time.time()) the psum failed."""

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jbps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=4)
    p.add_argument("--seconds", type=float, default=120)
    args = p.parse_args()
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    f = jax.jit(lambda x: jbps.psum(x, name="step"))
    x = jnp.full((args.mib << 18,), rank + 1, jnp.float32)
    want = size * (size + 1) / 2
    deadline = time.monotonic() + args.seconds
    rounds, error = 0, None
    while time.monotonic() < deadline:
        try:
            y = np.asarray(jax.block_until_ready(f(x)))
        except Exception as exc:  # the psum the cut interrupted, or a later one
            error = f"{type(exc).__name__}: {exc}"
            break
        assert (y == want).all(), f"round {rounds}: wrong sum"
        rounds += 1
        if rounds == 1:
            print("running", flush=True)
    print(json.dumps({"rank": rank, "rounds": rounds, "error": error, "failed_at": time.time()}), flush=True)
    jbps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
