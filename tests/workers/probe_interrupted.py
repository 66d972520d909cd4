"""A worker of tests/test_multihost.py: worker 1 joins the job with its own
chunk size, so its jbps.init skips the link probe. With --then die it takes
part in the probe's first psum only (so worker 0 is surely connected to every
server, worker 1's own included, and inside the probe) and dies; worker 0's
init, measuring the network, must fail naming it. With --then psum it goes on
to a psum of its own, which worker 0's probe never matches. Worker 0 prints
one JSON line: {"rank", "error", "seconds"} with the init's error and how long
it took."""

import argparse
import json
import os
import time

import numpy as np

import jbps
from jbps import link_rate, runtime

p = argparse.ArgumentParser()
p.add_argument("--then", choices=["die", "psum"], required=True)
args = p.parse_args()
rank = int(os.environ["DMLC_WORKER_ID"])
if rank == 1:
    jbps.init(partition_bytes=128 << 10)
    if args.then == "psum":
        try:
            jbps.psum(np.ones(1024, np.float32), name="after_init")
        finally:
            os._exit(0)
    link_rate.warm_up(runtime._fractions, 60.0)  # the probe's first psum, then gone
    os._exit(3)  # no goodbye: as a crash
start = time.monotonic()
error = None
try:
    jbps.init()
except jbps.JbpsError as exc:
    error = str(exc)
print(json.dumps({"rank": rank, "error": error, "seconds": time.monotonic() - start}), flush=True)
