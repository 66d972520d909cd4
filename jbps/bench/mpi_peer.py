"""Peer benchmark: MPI Allreduce (SUM) of one float32 buffer, via mpi4py.

Run under mpiexec, e.g.
    mpiexec -n 2 python -m jbps.bench.mpi_peer --sizes 4194304,67108864 --iters 10 --warmup 2
Rank 0 prints one JSON line: {"tool": ..., "results": {"<bytes>": {...}}}.
"""

import argparse
import json
import sys
import time

import numpy as np

from jbps.bench.report import summarize
from mpi4py import MPI

TOOL = "mpi4py Allreduce (MPICH)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", required=True,
                   help="comma-separated buffer sizes in bytes")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def bench_size(comm, nbytes, iters, warmup):
    rank, world = comm.Get_rank(), comm.Get_size()
    n = nbytes // 4
    # Each rank contributes rank+1, so the sum is known without communication.
    expected = world * (world + 1) / 2
    buf = np.empty(n, dtype=np.float32)

    times = []
    for i in range(warmup + iters):
        # Refill outside the timed region so every call sums fresh inputs.
        buf.fill(rank + 1)
        comm.Barrier()  # start all ranks together; otherwise we time skew
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        t1 = time.perf_counter()
        if i == 0 and not np.array_equal(buf, np.full(n, expected, np.float32)):
            raise RuntimeError(f"rank {rank}: wrong Allreduce result for {nbytes} bytes")
        if i >= warmup:
            times.append(t1 - t0)

    # Report the slowest rank per iteration: the collective is done only when all are.
    all_times = comm.gather(times, root=0)
    if rank != 0:
        return None
    per_iter = [max(ts) for ts in zip(*all_times)]
    return summarize(per_iter)


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    sizes = [int(s) for s in args.sizes.split(",") if s]
    results = {}
    for nbytes in sizes:
        r = bench_size(comm, nbytes, args.iters, args.warmup)
        if r is not None:
            results[str(nbytes)] = r
    if comm.Get_rank() == 0:
        print(json.dumps({"tool": TOOL, "results": results}), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # make one rank's failure end the whole job, not hang it
        print(f"mpi_peer: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
