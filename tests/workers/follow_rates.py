"""A worker of the rate-follow test (tests/test_multihost.py): psums of a few
MiB of random integers (exact in float32), each checked against numpy, until
--seconds pass or the test creates --stop-file (a one-element psum each step
tells every worker, so all stop after the same step). Prints "running" and the
servers and init's split once a psum has crossed every link, and "replanned
N" and the split of each re-plan of the rate follower (jbps.runtime.replans())
as it sees it, so the test can change links as the splits move (the
follower logs its probes and splits on stderr). From the latest re-plan on,
the bytes each server gets are counted. Prints one JSON line at the end."""

import argparse
import json
import logging
import os
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
    p.add_argument("--stop-file", default=None, help="stop once this file exists")
    args = p.parse_args()
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("jbps.rates").setLevel(logging.DEBUG)  # the follower's probes and splits, on stderr
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    f = jax.jit(lambda x, stop: (jbps.psum(x, name="grads"), jbps.psum(stop, name="stop")))
    deadline = time.monotonic() + args.seconds
    steps, wrong, since, at, seen, stop = 0, [], None, None, 0, 0.0
    while not stop:
        stop = float(time.monotonic() > deadline or bool(args.stop_file and os.path.exists(args.stop_file)))
        got, flag = jax.block_until_ready(f(data(steps, rank), np.float32(stop)))
        got, stop = np.asarray(got), float(flag)
        if not np.array_equal(got, sum(data(steps, r) for r in range(size))):
            wrong.append(steps)
        steps += 1
        if steps == 1:
            split = {"servers": list(jbps.runtime.config().servers), "fractions": list(jbps.runtime.server_fractions())}
            print("running", json.dumps(split), flush=True)
        replans = jbps.runtime.replans()
        if len(replans) > seen:
            seen = len(replans)
            at, since = steps + 2, None  # the split moves at the second call after every worker announced it
            print(f"replanned {seen}", json.dumps({k: replans[-1][k] for k in ("fractions", "rates")}), flush=True)
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
        "replans": jbps.runtime.replans(),
        "pushed_after_replan": pushed,
    }
    print(json.dumps(report), flush=True)
    jbps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
