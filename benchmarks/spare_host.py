"""A slow spare host against leaving it out: the same training job on emulated
hosts three ways, side by side. benchmarks.data_parallel's steps (both styles,
blocks alternating) on worker hosts with colocated servers, and:

- with: one more host, a CPU host with a server on a slower link, the rate
  follower on (the default across hosts);
- without: no such host;
- fixed: that host, the follower off (JBPS_FOLLOW_RATES=0: init's split throughout).

Cases alternate run by run, so drift on a shared machine hits all alike. Prints,
per case, the median over runs of the timed steps' total seconds (stalls
included), and its ratio to `without`: a slower spare host must never make the
job slower than leaving it out. A small model (the default: 4 layers of 64, 64
KiB of gradients) makes small pushes, which read a link's latency, not its rate.

    python -m benchmarks.spare_host [--hosts 2] [--rate 300M] [--spare-rate 30M] [--width 64]
        [--layers 4] [--blocks 10] [--block-steps 800] [--runs 2] [--json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from .emulated_job import job_free_env, run_job
from .emulated_network import EmulatedNetwork, format_rate
from .network import parse_rate_arg

CASES = ("with", "without", "fixed")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spare_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="worker hosts, each with a colocated server (default 2)")
    p.add_argument(
        "--rate", type=parse_rate_arg, default="300M", help="the worker hosts' links, bits/s each way (default 300M)"
    )
    p.add_argument(
        "--spare-rate",
        type=parse_rate_arg,
        default="30M",
        help="the spare CPU host's link, bits/s each way (default 30M)",
    )
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=256, help="per worker, split over its devices")
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--block-steps", type=int, default=800)
    p.add_argument("--local-devices", type=int, default=2, help="each worker's CPU devices (default 2)")
    p.add_argument("--runs", type=int, default=2, help="runs of each case (default 2)")
    p.add_argument("--timeout", type=float, default=600, help="seconds any one job may take (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = p.parse_args(argv)

    n = args.hosts
    model = {"--width": args.width, "--layers": args.layers, "--batch": args.batch, "--blocks": args.blocks}
    model["--block-steps"] = args.block_steps
    worker_argv = ["-m", "benchmarks.data_parallel", "--json"] + [str(a) for kv in model.items() for a in kv]
    seconds: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.runs):
        for case in CASES:
            hosts = n if case == "without" else n + 1
            env = job_free_env(**({"JBPS_FOLLOW_RATES": "0"} if case == "fixed" else {}))
            spare = {n: args.spare_rate} if hosts > n else {}
            with EmulatedNetwork(hosts, args.rate, host_rates=spare) as net:
                result = run_job(
                    net,
                    list(range(n)),
                    list(range(hosts)),
                    worker_argv,
                    env=env,
                    local_devices=args.local_devices,
                    timeout_s=args.timeout,
                )
            report = json.loads(result.workers[0].stdout.strip().splitlines()[-1])
            seconds[case].append(sum(report["total_s"].values()))
    median = {case: float(np.median(s)) for case, s in seconds.items()}
    out = {
        "hosts": n,
        "rate_bits_per_s": args.rate,
        "spare_rate_bits_per_s": args.spare_rate,
        "gradient_kib": args.layers * args.width * args.width * 4 / 1024,
        "seconds": seconds,
        "median_s": median,
        "over_without": {case: median[case] / median["without"] for case in CASES},
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{n} worker hosts at {format_rate(args.rate)}, a spare CPU host at {format_rate(args.spare_rate)}; "
        f"{out['gradient_kib']:.0f} KiB of gradients; {args.blocks * args.block_steps} steps of each style"
    )
    print(f"{'case':<10} {'seconds (runs)':<28} {'median':>8} {'over without':>13}")
    for case in CASES:
        runs = ", ".join(f"{s:.2f}" for s in seconds[case])
        print(f"{case:<10} {runs:<28} {median[case]:>8.2f} {out['over_without'][case]:>13.2f}")


if __name__ == "__main__":
    main()
