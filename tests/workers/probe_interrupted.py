"""A worker of tests/test_multihost.py, around jbps.init's link probe.

--then die: worker 1 takes part in the probe's first psum only (so worker 0
is surely connected to every server, worker 1's own included, and inside the
probe) and dies there, as a crash: worker 0's init, measuring the network,
must fail naming it. --then psum: worker 1 sets its own chunk size; its init
measures the links with the others all the same (the split by the servers'
rates must not depend on the chunk size), and the first psum fails on both,
naming the setting. Each worker that lives prints one JSON line: {"rank",
"error", "seconds", "measured"} with the error (init's, or the psum's) and
how long the failing call took, and the rates its init measured."""

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
if rank == 1 and args.then == "die":

    def first_psum_then_crash(roles, fractions, num_workers, timeout_s):
        link_rate.warm_up(fractions, 60.0)
        os._exit(3)  # no goodbye: as a crash

    link_rate.measure = first_psum_then_crash  # where jbps.init calls it
start = time.monotonic()
error, measured = None, None
try:
    jbps.init(partition_bytes=(128 << 10) if rank == 1 else None)  # None: the default
    measured = runtime.measured_rates()
    start = time.monotonic()
    jbps.psum(np.ones(1 << 18, np.float32), name="after_init")  # 1 MiB: default chunks far below 128 KiB
except Exception as exc:  # init: JbpsError; the psum: jax's runtime error with a jbps: message
    error = str(exc)
print(json.dumps({"rank": rank, "error": error, "seconds": time.monotonic() - start, "measured": measured}), flush=True)
