"""A worker of the lost-peer tests (tests/test_faults.py). After one good
round, every rank but --late-rank prints "pending" and calls a second
psum, which waits for the late rank: the test then kills a worker or a server. The
late rank either never gets that far (it is the killed worker) or waits for
the test's go file and then psums (its psum comes after the fault).

Prints one JSON line: {"rank", "pending_error", "pending_at", "next_error",
"check_error", "converted"} with the errors' messages and when (time.time())
the pending psum failed."""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jbps


def message(fn):
    """The message of what fn() raises, or None."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--late-rank", type=int, required=True)
    p.add_argument("--go-file", required=True, help="the late rank psums once this exists")
    args = p.parse_args()
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    # A file barrier first: the short psum timeout must not count the others' start-up.
    sync = os.path.dirname(args.go_file)
    open(os.path.join(sync, f"ready{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while sum(os.path.exists(os.path.join(sync, f"ready{r}")) for r in range(size)) < size:
        assert time.monotonic() < deadline, "the other workers never started"
        time.sleep(0.02)
    f = jax.jit(lambda x: jbps.psum(x, name="step"))
    x = jnp.arange(64, dtype=jnp.float32) * (rank + 1)
    np.testing.assert_allclose(np.asarray(f(x)), np.arange(64) * size * (size + 1) / 2)
    report = {"rank": rank, "pending_error": None, "pending_at": None}
    if rank == args.late_rank:
        deadline = time.monotonic() + 60
        while not os.path.exists(args.go_file) and time.monotonic() < deadline:
            time.sleep(0.02)
    else:
        print("pending", flush=True)  # jax may run f inline: say so first
        report["pending_error"] = message(lambda: jax.block_until_ready(f(x)))  # waits on the late rank
        report["pending_at"] = time.time()
    report["next_error"] = message(lambda: jax.block_until_ready(f(x)))
    report["check_error"] = message(jbps.check)

    def converted():
        with jbps.errors.converted():
            jax.block_until_ready(f(x))

    report["converted"] = message(converted)
    jbps.shutdown()
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
