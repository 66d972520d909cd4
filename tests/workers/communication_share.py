"""A 2-worker job in which worker 1 computes longer before each psum (it
sleeps), so worker 0 spends most of each step inside its psum waiting for it.
Prints one JSON line: this worker's own busy share, and what
jbps.communication_share makes of it."""

import argparse
import json
import time

import jax
import jax.numpy as jnp

import jbps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--compute-s", type=float, default=0.1)
    args = p.parse_args()
    jbps.init()
    step = jax.jit(lambda x: jbps.psum(x))
    x = jnp.ones(1 << 16, jnp.float32)
    jax.block_until_ready(step(x))  # compiled, and both workers here
    busy, start = jbps.engine_stats()["busy_seconds"], time.perf_counter()
    for _ in range(args.steps):
        if jbps.rank() == args.slow_rank:
            time.sleep(args.compute_s)
        jax.block_until_ready(step(x))
    elapsed = time.perf_counter() - start
    own = (jbps.engine_stats()["busy_seconds"] - busy) / elapsed
    share = jbps.communication_share(own * elapsed, elapsed)
    print(
        json.dumps({"rank": jbps.rank(), "own": own, "communication": share.communication, "waiting": share.waiting}),
        flush=True,
    )
    jbps.shutdown()


if __name__ == "__main__":
    main()
