"""Runs the loop family (tests/workers/loops.py) many times, as users start
jobs (`jbps run`), and counts the jobs that fail or stall.

    python tests/stress_loops.py --runs 200              # jobs in all, cycling through the configurations
    python tests/stress_loops.py --runs 50 --no-waits    # never wait between steps, whatever the jax

Each job is one configuration of (workers, local devices) from the test's list,
every API and kind of step; a job that does not end within --job-timeout is
ended (its process group, by PID) and counted as stalled. Prints a line per
job (with the output's last lines for a failure), then a table per
configuration and one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (3, 2)]  # as tests/test_loops.py


def run_job(workers: int, devices: int, args) -> tuple[str, float, str]:
    """('ok' | 'failed' | 'stalled', seconds, the output's last lines)."""
    jbps_cli = shutil.which("jbps") or "jbps"
    cmd = [jbps_cli, "run", "-n", str(workers), "--local-devices", str(devices), sys.executable]
    cmd += [str(HERE / "workers" / "loops.py"), "--steps", str(args.steps)]
    if args.no_waits:
        cmd.append("--no-waits")
    env = dict(os.environ, JBPS_TIMEOUT_S=str(args.psum_timeout))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.job_timeout)
        outcome = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the job's own session: jbps run and what it started
        out, _ = proc.communicate()
        outcome = "stalled"
    tail = "\n".join(out.decode(errors="replace").splitlines()[-6:])
    return outcome, time.monotonic() - start, tail


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=len(CONFIGS), help="jobs in all, cycling through the configurations")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--no-waits", action="store_true", help="pass --no-waits to the workers")
    p.add_argument("--configs", help="WxL,... (default: every configuration of tests/test_loops.py)")
    p.add_argument("--psum-timeout", type=float, default=30.0, help="JBPS_TIMEOUT_S for the jobs")
    p.add_argument("--job-timeout", type=float, default=300.0)
    args = p.parse_args()
    configs = CONFIGS
    if args.configs:
        configs = [tuple(int(n) for n in c.split("x")) for c in args.configs.split(",")]
    tally: dict = collections.defaultdict(collections.Counter)
    seconds: dict = collections.defaultdict(float)
    for i in range(args.runs):
        w, d = configs[i % len(configs)]
        outcome, took, tail = run_job(w, d, args)
        tally[(w, d)][outcome] += 1
        seconds[(w, d)] += took
        # A line per job, so a run cut short still says how far it got.
        print(f"job {i + 1}/{args.runs} ({w} workers x {d} devices): {outcome} after {took:.0f} s", flush=True)
        if outcome != "ok":
            print(f"{tail}\n", flush=True)
    print(f"{'workers x devices':>18} {'jobs':>5} {'ok':>5} {'failed':>7} {'stalled':>8} {'s/job':>6}")
    for (w, d), c in sorted(tally.items()):
        jobs = sum(c.values())
        print(
            f"{f'{w} x {d}':>18} {jobs:>5} {c['ok']:>5} {c['failed']:>7} {c['stalled']:>8} {seconds[(w, d)] / jobs:>6.1f}"
        )
    import jax  # only for the report: which jax ran the jobs

    bad = sum(c["failed"] + c["stalled"] for c in tally.values())
    print(
        json.dumps(
            {
                "jax": jax.__version__,
                "runs": args.runs,
                "no_waits": args.no_waits,
                "failed_or_stalled": bad,
                "by_config": {f"{w}x{d}": dict(c) for (w, d), c in sorted(tally.items())},
            }
        )
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
