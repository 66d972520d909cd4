"""Worker 1 calls psum with a tree that differs from worker 0's: leaf 'b' of
another size, dtype or shape (same size), or a leaf 'c' more. Every worker
must raise naming the tensor, then still be able to psum correctly. With
--good-calls N, both first make N calls of the same psum with the same tree
(so the servers already know worker 0's tree when worker 1's differs). With
--what chunks the trees agree (leaf 'a' of 256 KiB) and the test gives the
workers different chunk sizes. Prints {"rank", "error", "seconds",
"recovered", "sum"} (seconds: how long the bad call took; sum: what it
returned, if it returned)."""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jbps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["shape", "dtype", "layout", "leaves", "chunks"], required=True)
    p.add_argument("--good-calls", type=int, default=0)
    args = p.parse_args()
    jbps.init()
    rank = jbps.rank()
    tree = {"a": jnp.ones(8 if args.what != "chunks" else 1 << 16, jnp.float32), "b": jnp.ones((2, 3), jnp.float32)}
    for _ in range(args.good_calls):
        jax.block_until_ready(jax.jit(lambda t: jbps.psum(t, name="mismatched"))(tree))
    if rank == 1 and args.what != "chunks":
        tree["b"] = {
            "shape": jnp.ones(7, jnp.float32),
            "dtype": jnp.ones((2, 3), jnp.float16),
            "layout": jnp.ones((3, 2), jnp.float32),
            "leaves": tree["b"],
        }[args.what]
        if args.what == "leaves":
            tree["c"] = jnp.ones(4, jnp.float32)
    error = summed = None
    bad = jax.jit(lambda t: jbps.psum(t, name="mismatched")).lower(tree).compile()
    start = time.monotonic()
    try:
        out = jax.block_until_ready(bad(tree))
        summed = {k: np.asarray(v).tolist() for k, v in out.items()}
    except Exception as exc:  # XLA raises its runtime error type, which differs across jax versions
        assert jbps.is_jbps_error(exc), exc
        error = str(exc)
    seconds = time.monotonic() - start
    good = jax.jit(lambda t: jbps.psum(t, name="after"))(jnp.full(5, rank + 1.0, jnp.float32))
    expected = sum(range(1, jbps.size() + 1))
    recovered = bool(np.all(np.asarray(good) == expected))
    jbps.shutdown()
    print(
        json.dumps({"rank": rank, "error": error, "seconds": seconds, "recovered": recovered, "sum": summed}),
        flush=True,
    )


if __name__ == "__main__":
    main()
