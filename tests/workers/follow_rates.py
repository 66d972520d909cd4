"""A worker of the rate-follow test (tests/test_multihost.py): psums of a few
MiB of random integers (exact in float32), each checked against numpy, until
--seconds pass. Prints "running" once a psum has crossed every link. The test
slows a host's link meanwhile; once the rate follower has re-planned
(jbps.runtime.replans()) the bytes each server gets from then on are
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
    args = p.parse_args()
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    f = jax.jit(lambda x: jbps.psum(x, name="grads"))
    deadline = time.monotonic() + args.seconds
    steps, wrong, since, at = 0, [], None, None
    while time.monotonic() < deadline:
        got = np.asarray(jax.block_until_ready(f(data(steps, rank))))
        if not np.array_equal(got, sum(data(steps, r) for r in range(size))):
            wrong.append(steps)
        steps += 1
        if steps == 1:
            print("running", flush=True)
        if at is None and jbps.runtime.replans():
            at = steps + 2  # the split moves at the second call after every worker announced it
        if since is None and at is not None and steps == at:
            since = jbps.engine_stats()
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
