"""A worker of tests/test_multihost.py: worker 1 joins the job with its own
chunk size (so it skips jbps.init's link probe) and dies at once; worker 0's
init, measuring the network, must fail naming it. Worker 0 prints one JSON
line: {"rank", "error", "seconds"} with the init's error and how long it took."""

import json
import os
import time

import jbps

rank = int(os.environ["DMLC_WORKER_ID"])
if rank == 1:
    jbps.init(partition_bytes=128 << 10)
    os._exit(3)  # no goodbye: as a crash
start = time.monotonic()
error = None
try:
    jbps.init()
except jbps.JbpsError as exc:
    error = str(exc)
print(json.dumps({"rank": rank, "error": error, "seconds": time.monotonic() - start}), flush=True)
