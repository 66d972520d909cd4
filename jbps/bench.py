"""`jbps bench`: this job's own psum, size by size, on the hosts and links it
really has (as nccl-tests' all_reduce_perf measures NCCL's). Every worker of
the job runs it; worker 0 prints the table.

    jbps run -n 2 jbps bench                          # a job on this machine
    mpirun -n 8 jbps bench --sizes 1K-256M            # across a cluster
    DMLC_ROLE=worker ... jbps bench                   # under the scheduler's variables

Per size: the time of one psum (the median of --iters calls, averaged over the
workers), the algorithm bandwidth (size / time), and across hosts the link
bandwidth: the bytes the busiest network card carries per psum (the servers'
split of the traffic) / time, which the link's rate bounds. The comparison
with MPI, JAX's gloo psum and the optimal-split formula is the lab's
(`python -m benchmarks` and `python -m benchmarks.network` in a checkout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from .sizes import format_bytes, parse_bytes

DEFAULT_SIZES = "4K-64M"


def parse_sizes(text: str) -> list[int]:
    """ "4K,1M,64M" or a range "4K-64M" (every fourth power of two: x4 steps); ValueError naming what is wrong."""
    text = text.strip()
    if "-" in text and "," not in text:
        low, high = (parse_bytes(part) for part in text.split("-", 1))
        if not 0 < low <= high:
            raise ValueError(f"--sizes {text!r}: the range must go from a positive size up")
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 4
        return sizes
    sizes = [parse_bytes(part) for part in text.split(",") if part.strip()]
    if not sizes or any(s < 4 for s in sizes):
        raise ValueError(f"--sizes {text!r}: give sizes of at least 4 bytes (one float32), e.g. 4K,1M or 4K-64M")
    return sizes


def measure(sizes: list[int], iters: int, warmup: int) -> list[dict]:
    """Every worker's psums of float32 buffers of `sizes` bytes: a row per size."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jbps
    from jbps import runtime

    rows = []
    share = runtime.nic_share() if runtime.spans_hosts() else 0
    for nbytes in sizes:
        psum = jax.jit(lambda x, n=nbytes: jbps.psum(x, name=f"jbps.bench.{n}"), donate_argnums=0)
        x = jnp.zeros(nbytes // 4, jnp.float32)
        times = []
        for i in range(warmup + iters):
            start = time.perf_counter()
            x = psum(x).block_until_ready()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        mine = np.array([statistics.median(times)], np.float32)
        seconds = float(jax.jit(lambda t: jbps.psum(t, name="jbps.bench.seconds"))(mine)[0]) / jbps.size()
        row = {"bytes": nbytes, "seconds": seconds, "algbw_gbps": nbytes / seconds / 1e9}
        if share:
            row["linkbw_gbps"] = share * nbytes / seconds / 1e9
        rows.append(row)
    return rows


def format_rows(rows: list[dict], workers: int) -> str:
    lines = [
        f"jbps bench: {workers} workers; median of each psum's time, averaged over the workers",
        f"{'size':>10} {'time (us)':>12} {'algbw (GB/s)':>13} {'link bw (GB/s)':>15}",
    ]
    for r in rows:
        link = f"{r['linkbw_gbps']:.3f}" if "linkbw_gbps" in r else "-"
        lines.append(f"{format_bytes(r['bytes']):>10} {r['seconds'] * 1e6:>12.1f} {r['algbw_gbps']:>13.3f} {link:>15}")
    if rows and "linkbw_gbps" not in rows[0]:
        lines.append("(one host: no network card carries the bytes, so no link bandwidth)")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=prog or "python -m jbps.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"bytes per psum: a list or a range (default {DEFAULT_SIZES})"
    )
    p.add_argument("--iters", type=int, default=20, help="timed psums per size (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed psums per size first (default 3)")
    p.add_argument("--json", action="store_true", help="worker 0 also prints the rows as one JSON line")
    args = p.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        p.error(str(exc))
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")

    import jbps

    jbps.init()
    rows = measure(sizes, args.iters, args.warmup)
    if jbps.rank() == 0:
        print(format_rows(rows, jbps.size()), flush=True)
        if args.json:
            print(json.dumps({"workers": jbps.size(), "rows": rows}), flush=True)
    jbps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
