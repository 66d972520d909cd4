"""An elastic job's loss across emulated hosts, timed with a model's step.

3 worker hosts (network namespaces, as root; the scheduler on host 0, a
colocated server in each worker) train --model (benchmarks/elastic_model_worker.py,
one device a worker). With --slow-rate, host 2's link drops to that rate after
--slow-after commits, and the rate follower moves the split; the links' rates
then size the step's chunks and buckets differently for the generation after a
loss. Worker 1 is killed (no goodbye) after --kill-after commits. Per run:

- loss: from the kill to the survivors' next commit (their failed psum, the
  regroup without it, the step again: traced and compiled again where the
  survivors forgot their programs);
- step before / after: the median time between two commits of the full job
  (the last 5) and of the survivors (after their first);
- state: whether the survivors kept their own (they held the same commit) or
  took rank 0's (a broadcast), and its time;
- programs: what the survivors' generation did with them (rank 0's log).

With --rejoin, worker 1 is then started again on host 1 and joins at the
survivors' next commit:

- join: from that commit (the regroup) to their next, which the newcomer's
  first step ends (traced, and compiled or taken from the job's compilation
  cache: jbps makes one for the job on each host, jbps/compile_cache.py; the
  emulated hosts share one file system, so one here), against
  the aim of the state's broadcast + one step;
- join broadcast: the state's broadcast to the newcomer (rank 0's log);
- step joined: the median step of the job with the newcomer (after its first).

    python -m benchmarks.elastic_hosts [--runs 2] [--rate 300M] [--slow-rate 60M | --slow-rate 0]
        [--model resnet --layers 2 --width 32 --batch 8] [--rejoin [--warm-up [run|compile]]] [--user-cache DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jbps.compile_cache import COMPILE_EVERY_PROGRAM

from . import step_models
from .elastic_log import generations
from .emulated_elastic_job import ElasticJob
from .emulated_job import python_env
from .emulated_network import EmulatedNetwork
from .network import parse_rate_arg

SECRET = "elastic-hosts-benchmark-secret-01"


def _commits(job: ElasticJob, name: str, size: int | None = None, since: float = 0.0) -> list[dict]:
    """name's commits (of `size` workers) after `since` (time.time())."""
    return [line for line in job.lines(name) if "size" in line and size in (None, line["size"]) and line["at"] > since]


def _until_commits(
    job: ElasticJob, name: str, count: int, deadline: float, size: int | None = None, since: float = 0.0
) -> None:
    what = f"{name}'s {count} commits" + ("" if size is None else f" of {size} workers")
    alive = [n for n in job.procs if n != "w1"]  # the one killed
    job.wait(lambda: len(_commits(job, name, size, since)) >= count, what, deadline - time.monotonic(), alive)


def run_once(args, workdir: Path) -> dict:
    argv = [sys.executable, "-m", "benchmarks.elastic_model_worker", "--model", args.model, "--steps", "1000000"]
    argv += ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch)]
    argv += ["--print-regroups"] + (["--warm-up", args.warm_up] if args.warm_up else [])
    with EmulatedNetwork(3, args.rate) as net:
        deadline = time.monotonic() + args.timeout_s
        flags = ["--num-workers", "3", "--min-workers", "2", "--max-workers", "3"]
        # Started by the scheduler's variables, as on a cluster: each worker's compilation cache is
        # the job's directory jbps makes on its host (jbps/compile_cache.py; the emulated hosts
        # share this machine's, so one), or the one --user-cache names as a user might.
        user_cache = {"JAX_COMPILATION_CACHE_DIR": args.user_cache, **COMPILE_EVERY_PROGRAM}
        env = python_env(**(user_cache if args.user_cache else {}))
        job = ElasticJob(net, workdir, flags, env=env, secret=SECRET)
        try:
            for host in range(3):
                job.worker(f"w{host}", host, host, argv)
            _until_commits(job, "w0", args.slow_after, deadline)
            if args.slow_rate:
                net.set_rate(2, args.slow_rate)
            _until_commits(job, "w0", args.kill_after, deadline)
            job.procs["w1"].kill()
            killed_at = time.time()
            _until_commits(job, "w0", 7, deadline, size=2)
            if args.rejoin:
                restarted_at = time.time()
                job.worker("w1b", 1, 1, argv)
                _until_commits(job, "w0", 6, deadline, size=3, since=restarted_at)
        finally:
            job.end()
        full = [c["at"] for c in _commits(job, "w0", 3) if c["at"] < killed_at]  # not the join's
        after = [c["at"] for c in _commits(job, "w0", 2)]
        started = [g for g in generations(job.text("w0", "err")) if g["rank"] == 0]
    unseen = {"state": None, "state_s": float("nan"), "programs": None}
    survivors = next((g for g in started if g["workers"] == 2), unseen)
    row = {}
    if args.rejoin:
        regrouped = next(line["at"] for line in job.lines("w0") if "regrouped_at" in line)
        joined = [c["at"] for c in _commits(job, "w0", 3, since=regrouped)]
        broadcast = [g["state_s"] for g in started if g["workers"] == 3 and g["state"] == "from rank 0"]
        row = {
            "join_s": joined[0] - regrouped,
            "join_broadcast_s": float(broadcast[-1]),
            "step_joined_s": statistics.median(b - a for a, b in zip(joined[1:], joined[2:])),
        }
    return {
        "loss_s": after[0] - killed_at,
        "step_before_s": statistics.median(b - a for a, b in zip(full[-6:], full[-5:])),
        "step_after_s": statistics.median(b - a for a, b in zip(after[1:], after[2:])),
        "state": survivors["state"],
        "state_s": survivors["state_s"],
        "programs": survivors["programs"],
        **row,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic_hosts", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--rate", type=parse_rate_arg, default=parse_rate_arg("300M"), help="every link's (default 300M)")
    p.add_argument(
        "--slow-rate",
        type=lambda text: 0.0 if text in ("0", "none") else parse_rate_arg(text),
        default=parse_rate_arg("60M"),
        help="host 2's later (default 60M; 0: it stays)",
    )
    p.add_argument("--slow-after", type=int, default=8, help="commits before host 2 slows (default 8)")
    p.add_argument("--kill-after", type=int, default=45, help="commits before worker 1 is killed (default 45)")
    p.add_argument("--model", choices=step_models.MODELS, default="resnet")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rejoin", action="store_true", help="then start worker 1 again, and time its join")
    p.add_argument(
        "--warm-up",
        nargs="?",
        const="run",
        choices=("run", "compile"),
        help="the workers give jbps.elastic.run a warm_up that runs their step, or lowers and compiles it "
        "(with --rejoin: the newcomer does so before it asks to join)",
    )
    p.add_argument(
        "--user-cache",
        metavar="DIR",
        help="the workers' JAX_COMPILATION_CACHE_DIR, keeping every program (default: none set, jbps's own)",
    )
    p.add_argument("--timeout-s", type=float, default=600, help="a run's bound")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.kill_after <= args.slow_after:
        p.error("--kill-after must come after --slow-after")
    rows = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="jbps-elastic-hosts-") as tmp:
            rows.append(run_once(args, Path(tmp)))
        r = rows[-1]
        print(
            f"run {i + 1}: loss {r['loss_s']:.3f} s, step before {r['step_before_s']:.3f} s, "
            f"after {r['step_after_s']:.3f} s; state {r['state']} in {r['state_s']:.3f} s; programs {r['programs']}",
            file=sys.stderr,
            flush=True,
        )
        if args.rejoin:
            print(
                f"run {i + 1}: join {r['join_s']:.3f} s (broadcast {r['join_broadcast_s']:.3f} s), "
                f"step joined {r['step_joined_s']:.3f} s",
                file=sys.stderr,
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
