"""Peer benchmark: cross-process psum of one float32 buffer in JAX over gloo (CPU).

Started once per process, e.g.
    python -m benchmarks.gloo_peer --coordinator 127.0.0.1:PORT --num-processes 2 \
        --process-id I --sizes 4194304,67108864 --iters 10 --warmup 2 [--tree-sizes ...]
Process 0 prints one JSON line: {"tool": ..., "results": {"<bytes>": {...}}[, "small_tensors": {...}]}.
"""

import argparse
import contextlib
import json
import os
import time

# Must be set before jax creates its backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import cpu_load  # noqa: E402
from benchmarks.report import summarize, with_cpu  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

TOOL = "JAX gloo psum"
# jax.shard_map from jax 0.6 on; jax.experimental.shard_map before.
shard_map = getattr(jax, "shard_map", None)
if shard_map is None:
    from jax.experimental.shard_map import shard_map  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--coordinator", required=True, help="host:port of process 0")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--sizes", required=True, help="comma-separated buffer sizes in bytes")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--tree-sizes",
        default="",
        help="also the many-small-tensors case: a tree of buffers of these sizes (comma-separated)",
    )
    p.add_argument("--tree-iters", type=int, default=None, help="timed calls of the tree (default --iters)")
    p.add_argument("--cpu", action="store_true", help="also the machine's CPU time per timed call (cpu_load.py)")
    return p.parse_args(argv)


def timed_psum(mesh, leaf_bytes, iters, warmup, tag, cpu=False):
    """One psum of a list of float32 buffers of these sizes, timed per call (slowest process)."""
    pid, nproc = jax.process_index(), jax.process_count()
    sharding = NamedSharding(mesh, P("i"))

    # Global shape (nproc, n): each process owns row `pid`, filled with pid+1,
    # so the expected sum is known without communication.
    def global_array(nbytes):
        local = jax.device_put(np.full((1, nbytes // 4), pid + 1, np.float32), jax.local_devices()[0])
        return jax.make_array_from_single_device_arrays((nproc, nbytes // 4), sharding, [local])

    xs = [global_array(b) for b in leaf_bytes]
    psum = jax.jit(shard_map(lambda a: jax.lax.psum(a, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i")))

    times = []
    meter = cpu_load.Meter(on=cpu and pid == 0)  # the machine's: one process counts it
    for i in range(warmup + iters):
        # Start all processes together (like MPI Barrier), else we time skew.
        multihost_utils.sync_global_devices(f"jbps_gloo_{tag}")
        with meter if i >= warmup else contextlib.nullcontext():
            t0 = time.perf_counter()
            y = jax.block_until_ready(psum(xs))
            t1 = time.perf_counter()
        if i == 0:
            for leaf in y:
                got = np.asarray(leaf.addressable_shards[0].data)
                if not np.array_equal(got, np.full(got.shape, nproc * (nproc + 1) / 2, np.float32)):
                    raise RuntimeError(f"process {pid}: wrong psum result for {tag}")
        if i >= warmup:
            times.append(t1 - t0)
        del y

    # Report the slowest process per iteration: the collective is done only when all are.
    all_times = multihost_utils.process_allgather(np.asarray(times))
    per_iter = np.max(np.asarray(all_times).reshape(nproc, -1), axis=0).tolist()
    return with_cpu(summarize(per_iter), meter)


def bench_size(mesh, nbytes, iters, warmup, cpu=False):
    return timed_psum(mesh, [nbytes], iters, warmup, str(nbytes), cpu)


def bench_tree(mesh, leaf_bytes, iters, warmup):
    """The many-small-tensors case: the tree in one psum, against one buffer of the same total bytes."""
    tree = timed_psum(mesh, leaf_bytes, iters, warmup, "small_tensors_tree")
    flat = timed_psum(mesh, [sum(leaf_bytes)], iters, warmup, "small_tensors_flat")
    return {
        "tool": TOOL,
        "leaves": len(leaf_bytes),
        "bytes": sum(leaf_bytes),
        "tree": tree,
        "flat": flat,
        "tree_over_flat": tree["median_s"] / flat["median_s"],
    }


def main(argv=None):
    args = parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
    )
    try:
        mesh = Mesh(np.array(jax.devices()), ("i",))
        results = {}
        for nbytes in (int(s) for s in args.sizes.split(",") if s):
            results[str(nbytes)] = bench_size(mesh, nbytes, args.iters, args.warmup, args.cpu)
        report = {"tool": TOOL, "results": results}
        if args.tree_sizes:
            report["small_tensors"] = bench_tree(
                mesh, [int(s) for s in args.tree_sizes.split(",") if s], args.tree_iters or args.iters, args.warmup
            )
        if jax.process_index() == 0:
            print(json.dumps(report), flush=True)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
