"""Peer benchmark: MPI Allreduce (SUM) of one float32 buffer, via mpi4py.

Run under mpiexec, e.g.
    mpiexec -n 2 python -m benchmarks.mpi_peer --sizes 4194304,67108864 --iters 10 --warmup 2 \
        [--out-of-place] [--tree-sizes ...]
Rank 0 prints one JSON line: {"tool": ..., "results": {"<bytes>": {...}}[, "small_tensors": {...}]}.
--out-of-place also times Allreduce(send, recv) into a receive buffer reused every call,
calls alternating with the in-place ones (results[size]["out_of_place"]).
"""

import argparse
import contextlib
import json
import sys
import time

import numpy as np

from benchmarks import cpu_load
from benchmarks.report import summarize, with_cpu
from mpi4py import MPI

TOOL = "mpi4py Allreduce (MPICH)"
TREE_TOOL = "mpi4py Allreduce per leaf"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", required=True, help="comma-separated buffer sizes in bytes")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--tree-sizes",
        default="",
        help="also the many-small-tensors case: a tree of buffers of these sizes (comma-separated)",
    )
    p.add_argument("--tree-iters", type=int, default=None, help="timed calls of the tree (default --iters)")
    p.add_argument(
        "--out-of-place", action="store_true", help="also time Allreduce into a separate (reused) receive buffer"
    )
    p.add_argument("--cpu", action="store_true", help="also the machine's CPU time per timed call (cpu_load.py)")
    return p.parse_args(argv)


def timed_allreduce(comm, bufs, iters, warmup, what, cpu=False):
    """Allreduce(SUM) of each buffer in turn, timed as one call; rank 0 gets the summary."""
    rank, world = comm.Get_rank(), comm.Get_size()
    # Each rank contributes rank+1, so the sum is known without communication.
    expected = world * (world + 1) / 2

    times = []
    meter = cpu_load.Meter(on=cpu and rank == 0)  # the machine's: one rank counts it
    for i in range(warmup + iters):
        # Refill outside the timed region so every call sums fresh inputs.
        for buf in bufs:
            buf.fill(rank + 1)
        comm.Barrier()  # start all ranks together; otherwise we time skew
        with meter if i >= warmup else contextlib.nullcontext():
            t0 = time.perf_counter()
            for buf in bufs:
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            t1 = time.perf_counter()
        if i == 0 and not all(np.array_equal(buf, np.full(buf.size, expected, np.float32)) for buf in bufs):
            raise RuntimeError(f"rank {rank}: wrong Allreduce result for {what}")
        if i >= warmup:
            times.append(t1 - t0)

    # Report the slowest rank per iteration: the collective is done only when all are.
    all_times = comm.gather(times, root=0)
    if rank != 0:
        return None
    per_iter = [max(ts) for ts in zip(*all_times)]
    return with_cpu(summarize(per_iter), meter)


def bench_size(comm, nbytes, iters, warmup, out_of_place=False, cpu=False):
    if not out_of_place:
        return timed_allreduce(comm, [np.empty(nbytes // 4, dtype=np.float32)], iters, warmup, f"{nbytes} bytes", cpu)
    return timed_in_and_out_of_place(comm, nbytes, iters, warmup)


def timed_in_and_out_of_place(comm, nbytes, iters, warmup):
    """Allreduce in place and into a separate receive buffer (allocated once, as a program
    that reuses its buffers would), calls alternating; rank 0 gets both summaries."""
    rank, world = comm.Get_rank(), comm.Get_size()
    expected = world * (world + 1) / 2
    buf = np.empty(nbytes // 4, dtype=np.float32)
    send = np.full(nbytes // 4, rank + 1, dtype=np.float32)
    recv = np.empty(nbytes // 4, dtype=np.float32)
    times = {"in": [], "out": []}
    for i in range(warmup + iters):
        buf.fill(rank + 1)
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        t1 = time.perf_counter()
        comm.Barrier()
        t2 = time.perf_counter()
        comm.Allreduce(send, recv, op=MPI.SUM)
        t3 = time.perf_counter()
        if i == 0 and not (
            np.array_equal(buf, np.full(buf.size, expected, np.float32))
            and np.array_equal(recv, np.full(recv.size, expected, np.float32))
        ):
            raise RuntimeError(f"rank {rank}: wrong Allreduce result for {nbytes} bytes")
        if i >= warmup:
            times["in"].append(t1 - t0)
            times["out"].append(t3 - t2)
    gathered = {k: comm.gather(v, root=0) for k, v in times.items()}
    if rank != 0:
        return None
    slowest = {k: summarize([max(ts) for ts in zip(*v)]) for k, v in gathered.items()}
    return {**slowest["in"], "out_of_place": slowest["out"]}


def bench_tree(comm, leaf_bytes, iters, warmup):
    """The many-small-tensors case: MPI has no call for many buffers, so one Allreduce per leaf, against one
    Allreduce of the same total bytes."""
    leaves = [np.empty(b // 4, dtype=np.float32) for b in leaf_bytes]
    tree = timed_allreduce(comm, leaves, iters, warmup, "the small tensors' tree")
    flat = timed_allreduce(
        comm, [np.empty(sum(leaf_bytes) // 4, dtype=np.float32)], iters, warmup, "the small tensors' flat"
    )
    if tree is None:
        return None
    return {
        "tool": TREE_TOOL,
        "leaves": len(leaf_bytes),
        "bytes": sum(leaf_bytes),
        "tree": tree,
        "flat": flat,
        "tree_over_flat": tree["median_s"] / flat["median_s"],
    }


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    sizes = [int(s) for s in args.sizes.split(",") if s]
    results = {}
    for nbytes in sizes:
        r = bench_size(comm, nbytes, args.iters, args.warmup, args.out_of_place, args.cpu)
        if r is not None:
            results[str(nbytes)] = r
    report = {"tool": TOOL, "results": results}
    if args.tree_sizes:
        report["small_tensors"] = bench_tree(
            comm, [int(s) for s in args.tree_sizes.split(",") if s], args.tree_iters or args.iters, args.warmup
        )
    if comm.Get_rank() == 0:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # make one rank's failure end the whole job, not hang it
        print(f"mpi_peer: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
