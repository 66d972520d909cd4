"""Runs examples/psum_pmap.py as a jbps job on this machine: 2 summation
servers and 2 workers with 2 host devices each, then prints what each worker
printed. Equivalent to starting `python -m jbps.server` twice and the workers
with JBPS_* variables by hand (README)."""

import os
import sys

from jbps.local_cluster import LocalCluster

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    with LocalCluster(num_workers=2, num_servers=2, local_devices=2, timeout_s=300) as job:
        print(f"servers: {', '.join(job.addresses)}")
        results = job.run_workers([os.path.join(HERE, "psum_pmap.py")])
    for r in results:
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            sys.stderr.write(r.stderr)
            return r.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
