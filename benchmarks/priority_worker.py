"""Benchmark worker: does priority scheduling get the first layer's sum back sooner?

Every worker psums one model's gradients (a built-in parameter list, e.g.
resnet50) in one call, under each credit window, with two priority orders:

    forward   jbps's default: first leaf first (the next forward pass needs it first)
    backprop  last leaf first: what FIFO gives when gradients are queued in the
              order backpropagation produces them, i.e. no priority

and reads the engine's own chunk timeline to find when the first leaf's
last chunk arrived (and when the whole call did), relative to the call's
first chunk entering the queue. Rank 0 prints one JSON line:
{"tool", "model", "results": {"<credit>": {"forward"|"backprop": {"first_leaf_s", "total_s", "iters"}}}}.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jbps  # noqa: E402
from jbps import _core  # noqa: E402
from jbps.partition.models import builtin_model  # noqa: E402
from jbps.trace import ChunkTrace  # noqa: E402

TOOL = "jbps priority"
ORDERS = ("forward", "backprop")


def timeline(records, first_tensor):
    chunks = [ChunkTrace(*r) for r in records]
    start = min(ch.queued for ch in chunks)
    first = max(ch.pulled for ch in chunks if ch.tensor == first_tensor)
    return first - start, max(ch.pulled for ch in chunks) - start


def run_order(params, order, iters, warmup, barrier):
    count = len(params)
    priority = None if order == "forward" else (lambda path, leaf: int(path.strip("[]")))
    name = f"bench.priority.{order}"
    f = jax.jit(
        lambda tree: jbps.psum(tree, name=name, priority=priority, bucket_bytes=0)
    )  # one call: priority within it
    first_tensor = f"{name}[0]"
    firsts, totals = [], []
    for i in range(warmup + iters):
        barrier()
        _core.engine_take_trace()  # only this call's chunks below
        out = f(params)
        jax.block_until_ready(out)
        first, total = timeline(_core.engine_take_trace(), first_tensor)
        if i >= warmup:
            firsts.append(first / 1e6)
            totals.append(total / 1e6)
    expected = jbps.size()  # every worker pushes ones
    if not all(float(x.reshape(-1)[0]) == expected for x in jax.device_get(out)):
        raise RuntimeError(f"rank {jbps.rank()}: wrong psum result in the {order} run ({count} leaves)")
    return {"first_leaf_s": statistics.median(firsts), "total_s": statistics.median(totals), "iters": iters}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--credits", default="1,2,4,8,16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    credits = [int(c) for c in args.credits.split(",")]
    params = [jnp.ones(shape, jnp.float32) for _, shape in builtin_model(args.model)]
    # One barrier function for every credit window: jit compiles it once.
    barrier_fn = jax.jit(lambda x: jbps.psum(x, name="bench.barrier"))
    barrier = lambda: barrier_fn(jnp.ones((1,), jnp.float32)).block_until_ready()  # noqa: E731
    results = {}
    # The engine records chunk timelines only when tracing; the records are
    # read directly below, and the file shutdown() writes goes to scratch.
    scratch = tempfile.TemporaryDirectory(prefix="jbps-priority-bench-")
    for credit in credits:
        jbps.init(scheduling_credit=credit, trace_dir=scratch.name)
        try:
            results[str(credit)] = {
                order: run_order(params, order, args.iters, args.warmup, barrier) for order in ORDERS
            }
        finally:
            rank = jbps.rank()
            jbps.shutdown()
    scratch.cleanup()
    if rank == 0:
        print(
            json.dumps(
                {
                    "tool": TOOL,
                    "model": args.model,
                    "leaves": len(params),
                    "bytes": sum(x.size * 4 for x in params),
                    "results": results,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:
        print(f"priority_worker: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
