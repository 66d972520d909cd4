"""Benchmark worker: jbps.psum of one float32 buffer, timed like the peer tools.

Run as every worker of a jbps job (LocalCluster sets JBPS_SERVERS,
JBPS_NUM_WORKERS and JBPS_WORKER_RANK), e.g.
    python -m jbps.bench.jbps_worker --sizes 4194304,67108864 --iters 40,10 --warmup 2
Rank 0 prints one JSON line: {"tool": ..., "results": {"<bytes>": {...}}}.
"""

import argparse
import json
import os
import sys
import time

# Must be set before jax creates its backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jbps  # noqa: E402
from jbps.bench.report import summarize  # noqa: E402

TOOL = "jbps psum"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", required=True, help="comma-separated buffer sizes in bytes")
    p.add_argument("--iters", default="10",
                   help="timed calls: one number for every size, or one per size (comma-separated)")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    iters = [int(s) for s in args.iters.split(",") if s]
    if len(iters) == 1:
        iters *= len(args.sizes)
    if len(iters) != len(args.sizes) or min(iters, default=1) < 1:
        p.error("--iters needs one positive number, or one per size")
    args.iters = iters
    return args


# One jitted function serves every barrier: the same name and shape each time.
_barrier = jax.jit(lambda x: jbps.psum(x, name="bench.barrier"))
_ONE = jnp.ones((1,), jnp.float32)


def barrier():
    """A tiny psum: it returns only after every worker has pushed, like MPI Barrier."""
    _barrier(_ONE).block_until_ready()


def gather_times(times, nbytes):
    """Every worker's timings, as a (workers, iters) array, summed through jbps itself."""
    rows = np.zeros((jbps.size(), len(times)), np.float32)
    rows[jbps.rank()] = times
    gather = jax.jit(lambda t: jbps.psum(t, name=f"bench.times.{nbytes}"))
    return np.asarray(gather(jnp.asarray(rows)))


def bench_size(nbytes, iters, warmup):
    rank, world = jbps.rank(), jbps.size()
    n = nbytes // 4
    # Each worker contributes rank+1, so the sum is known without communication.
    x = jnp.full((n,), rank + 1, jnp.float32)
    f = jax.jit(lambda x: jbps.psum(x, name=f"bench.{nbytes}"))

    for _ in range(warmup):
        f(x).block_until_ready()

    # One checked call, also measuring what a call sends (warm-up compiled it).
    before = jbps.engine_stats()
    y = np.asarray(f(x))
    after = jbps.engine_stats()
    expected = world * (world + 1) / 2
    if not np.array_equal(y, np.full(n, expected, np.float32)):
        bad = np.flatnonzero(y != expected)
        raise RuntimeError(f"rank {rank}: wrong psum result for {nbytes} bytes: {bad.size} elements differ, "
                           f"e.g. y[{bad[0]}] = {y[bad[0]]} (expected {expected})")
    del y

    times = []
    for _ in range(iters):
        barrier()  # start all workers together; otherwise we time skew
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)

    # Report the slowest worker per iteration: the sum is done only when all have it.
    per_iter = gather_times(times, nbytes).max(axis=0).tolist()
    return {**summarize(per_iter),
            "bytes_pushed_per_call": after["bytes_pushed"] - before["bytes_pushed"],
            "bytes_pulled_per_call": after["bytes_pulled"] - before["bytes_pulled"]}


def main(argv=None):
    args = parse_args(argv)
    jbps.init()
    try:
        stats_before = jbps.engine_stats()
        results = {}
        for nbytes, iters in zip(args.sizes, args.iters):
            results[str(nbytes)] = bench_size(nbytes, iters, args.warmup)
        stats_after = jbps.engine_stats()
        if jbps.rank() == 0:
            print(json.dumps({"tool": TOOL, "workers": jbps.size(), "results": results,
                              "engine_stats": {"before": stats_before, "after": stats_after}}), flush=True)
    finally:
        jbps.shutdown()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # one line naming the worker, then the traceback for detail
        print(f"jbps_worker: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
