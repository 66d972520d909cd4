"""A worker of the rate-follow test (tests/test_multihost.py): psums of a few
MiB of random integers (exact in float32), each checked against numpy, until
--seconds pass, or until --replans re-plans have each been in use for
--measure-s seconds. Prints "running" once a psum has crossed every link. The
test changes a host's link meanwhile; from the latest re-plan of the rate
follower (jbps.runtime.replans()) on, the bytes each server gets are
counted. Prints one JSON line."""

import argparse
import json
import sys
import time

import jax
import numpy as np

import jbps

ELEMS = 1 << 20  # 4 MiB of float32


def data(step, rank):
    return np.random.default_rng([step, rank]).integers(-64, 64, ELEMS).astype(np.float32)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--replans", type=int, default=0, help="stop once this many re-plans were measured (0: never)")
    p.add_argument("--measure-s", type=float, default=3.0)
    args = p.parse_args()
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    f = jax.jit(lambda x: jbps.psum(x, name="grads"))
    deadline = time.monotonic() + args.seconds
    steps, wrong, since, at, seen, measured = 0, [], None, None, 0, 0.0
    while time.monotonic() < deadline:
        got = np.asarray(jax.block_until_ready(f(data(steps, rank))))
        if not np.array_equal(got, sum(data(steps, r) for r in range(size))):
            wrong.append(steps)
        steps += 1
        if steps == 1:
            print("running", flush=True)
        if len(jbps.runtime.replans()) > seen:
            seen = len(jbps.runtime.replans())
            at, since = steps + 2, None  # the split moves at the second call after every worker announced it
            print(f"replanned {seen}", flush=True)
        if since is None and at is not None and steps == at:
            since, measured = jbps.engine_stats(), time.monotonic()
        if args.replans and seen >= args.replans and since is not None and time.monotonic() - measured > args.measure_s:
            break
    after = jbps.engine_stats()
    pushed = (
        None if since is None else [a - b for a, b in zip(after["server_bytes_pushed"], since["server_bytes_pushed"])]
    )
    report = {
        "rank": rank,
        "steps": steps,
        "wrong": wrong,
        "servers": list(jbps.runtime.config().servers),
        "replans": jbps.runtime.replans(),
        "pushed_after_replan": pushed,
        "init_fractions": list(jbps.runtime.server_fractions()),
    }
    print(json.dumps(report), flush=True)
    jbps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
