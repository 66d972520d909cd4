"""Worker 1 calls psum with a tree whose leaf 'b' differs from worker 0's (in
shape or dtype). Every worker must raise naming the tensor, then still be able
to psum correctly. Prints {"rank", "error", "recovered"}."""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jbps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["shape", "dtype"], required=True)
    args = p.parse_args()
    jbps.init()
    rank = jbps.rank()
    tree = {"a": jnp.ones(8, jnp.float32), "b": jnp.ones(6, jnp.float32)}
    if rank == 1:
        tree["b"] = jnp.ones(7, jnp.float32) if args.what == "shape" else jnp.ones(6, jnp.float16)
    error = None
    try:
        jax.block_until_ready(jax.jit(lambda t: jbps.psum(t, name="mismatched"))(tree))
    except Exception as exc:  # XLA raises its runtime error type, which differs across jax versions
        error = str(exc)
    good = jax.jit(lambda t: jbps.psum(t, name="after"))(jnp.full(5, rank + 1.0, jnp.float32))
    expected = sum(range(1, jbps.size() + 1))
    recovered = bool(np.all(np.asarray(good) == expected))
    jbps.shutdown()
    print(json.dumps({"rank": rank, "error": error, "recovered": recovered}), flush=True)


if __name__ == "__main__":
    main()
