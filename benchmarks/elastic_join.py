"""An elastic job's join, timed: how long after the regroup for a joining
worker the survivors commit their next step, against the state's broadcast
plus one step (the aim of an elastic join).

`jbps run -n N --min-workers N-1 --max-workers N` runs the elastic test worker
(tests/workers/elastic_train.py, which checks every sum against numpy); one
worker kills itself at step 5 and `jbps run` starts it again, and it joins at
the others' next commit. A step is a psum and a sleep of --work-seconds before
its commit (the step's computation: a regroup does not skip it). Per run:

- step: the median time between two commits of the full job;
- join: from the commit at which the survivors regrouped (saved, then the new
  generation) to their next commit, which the newcomer's first step (traced
  and, from jax's compilation cache, compiled) ends;
- broadcast: the state's broadcast in the new generation (rank 0's log);
- over: join - (broadcast + step), what the regroup and the new generation's
  first trace of the step add;
- next step: the survivors' step after that (with --placed-state, where the
  step adds to a state leaf through a pmap, it shows a newcomer compiling its
  second step again);
- loss: from the kill (right after the dying worker's commit) to the
  survivors' next commit: their failed psum, the regroup without it, and the
  step again (their programs kept), against the aim of two steps
  (the link's liveness bound does not come into a kill, whose connections close).

With --model resnet, transformer or mlp (--layers, --width, --batch as in
step_models.py) each worker instead trains that model, one device a worker
(benchmarks/elastic_model_worker.py): a real step, which the newcomer traces
afresh (its program from the job's compilation cache) and the survivors keep.

    python -m benchmarks.elastic_join [--runs 3] [--workers 3] [--local-devices 2]
        [--work-seconds 0.1] [--steps 40] [--placed-state] [--json]
        [--model resnet --layers 2 --width 32 --batch 8] [--warm-up [run|compile]]

With --warm-up the workers give jbps.elastic.run(warm_up=...) a function that
runs their step (a rehearsal: jbps.elastic.run's docs), or with `compile` one
that lowers and compiles it: the newcomer does that before it asks to join.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jbps.procs import terminate

from . import step_models
from .elastic_log import generations

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "elastic_train.py"
DIE_AT = 5


def run_once(args, die_file: str) -> dict:
    cmd = [
        *(sys.executable, "-m", "jbps", "run"),
        *("-n", str(args.workers), "--min-workers", str(args.workers - 1), "--max-workers", str(args.workers)),
    ]
    if args.model == "psum":
        cmd += [
            *("--local-devices", str(args.local_devices), sys.executable, str(WORKER)),
            *("--step-seconds", "0", "--work-seconds", str(args.work_seconds)),
            *(["--placed-state"] if args.placed_state else []),
        ]
    else:  # one device a worker: the model's step under jit
        cmd += [sys.executable, "-m", "benchmarks.elastic_model_worker", "--model", args.model]
        cmd += ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch)]
    cmd += [
        *("--steps", str(args.steps), "--die-at", str(DIE_AT), "--die-file", die_file, "--print-regroups"),
        # A restart slower than the steps left (a loaded machine) is waited for, near the end.
        *("--hold-at", str(args.steps - 3), "--hold-for", str(args.workers)),
        *(["--warm-up", args.warm_up] if args.warm_up else []),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        terminate([proc], grace_s=5, what="the elastic job")  # jbps run and every worker it started
        raise SystemExit(f"elastic_join: the job took over {args.timeout_s:g} s (--timeout-s)")
    if proc.returncode != 0:
        raise SystemExit(f"elastic_join: the job failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    by_worker: dict[str, list[dict]] = {}
    for line in stdout.splitlines():
        head, _, body = line.partition("] ")
        if head.startswith("[worker ") and body.startswith("{"):
            by_worker.setdefault(head, []).append(json.loads(body))
    # A survivor: a worker that regrouped for the join (the newcomer never did).
    lines = next((v for v in by_worker.values() if any("regrouped_at" in d for d in v)), None)
    if lines is None:
        raise SystemExit(
            f"elastic_join: no worker regrouped for a join (the restarted worker came after the last of --steps):\n"
            f"{stdout[-3000:]}"
        )
    commits = [d for d in lines if "size" in d]
    full = max(d["size"] for d in commits)
    step = statistics.median(b["at"] - a["at"] for a, b in zip(commits, commits[1:]) if a["size"] == b["size"] == full)
    regrouped = next(d for d in lines if "regrouped_at" in d)
    after = next(d for d in commits if d["at"] > regrouped["at"])
    broadcast = [
        g["state_s"] for g in generations(stderr) if (g["workers"], g["rank"], g["state"]) == (full, 0, "from rank 0")
    ]
    row = {"step_s": step, "join_s": after["at"] - regrouped["at"], "broadcast_s": float(broadcast[-1])}
    # The step after: where a newcomer that compiled its first step for inputs placed otherwise
    # than its outputs compiles again, the others wait for it.
    row["next_step_s"] = next(d["at"] for d in commits if d["at"] > after["at"]) - after["at"]
    row["over_s"] = row["join_s"] - row["broadcast_s"] - step

    # The loss before it: one worker killed itself right after its commit of step DIE_AT (it
    # never committed the step after); the survivors redo that step without it. Their commit
    # of it is the join's regroup where the restarted worker came back before it (a model's
    # step, compiled again for the smaller job, can take longer than a process's start).
    def commit_of(v: list[dict], step: int) -> float | None:
        return next((d["at"] for d in v if step in (d.get("step"), d.get("regrouped_at"))), None)

    killed = [commit_of(v, DIE_AT) for v in by_worker.values() if commit_of(v, DIE_AT) and not commit_of(v, DIE_AT + 1)]
    if len(killed) != 1:
        raise SystemExit(f"elastic_join: no worker ended at step {DIE_AT}:\n{stdout[-3000:]}")
    row["loss_s"] = commit_of(lines, DIE_AT + 1) - killed[0]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic_join", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workers", type=int, default=3, help="the full job's workers (one leaves and joins again)")
    p.add_argument("--local-devices", type=int, default=None, help="each worker's (default 2)")
    p.add_argument("--work-seconds", type=float, default=None, help="each step's computation (a sleep; default 0.1)")
    p.add_argument(
        "--steps",
        type=int,
        default=40,
        help="steps of the job (the restarted worker joins by the third-last, waited for there)",
    )
    p.add_argument(
        "--placed-state",
        action="store_true",
        help="the worker's state also holds a leaf a pmap adds each step's sums to (from the host at first)",
    )
    p.add_argument(
        "--model",
        choices=("psum",) + step_models.MODELS,
        default="psum",
        help="psum (default): the elastic test worker's step, a psum and --work-seconds; else that model's "
        "training step (benchmarks/elastic_model_worker.py, one device a worker)",
    )
    p.add_argument("--layers", type=int, default=2, help="with --model: its layers or blocks (step_models.py)")
    p.add_argument("--width", type=int, default=32, help="with --model: its width or channels")
    p.add_argument("--batch", type=int, default=8, help="with --model: examples per worker per step")
    p.add_argument(
        "--warm-up",
        nargs="?",
        const="run",
        choices=("run", "compile"),
        help="the workers give jbps.elastic.run a warm_up that runs their step (or lowers and compiles it): "
        "the newcomer does so before it asks to join",
    )
    p.add_argument("--timeout-s", type=float, default=300, help="a run's bound")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    psum_only = {"--placed-state": args.placed_state, "--local-devices": args.local_devices}
    psum_only["--work-seconds"] = args.work_seconds
    given = [name for name, value in psum_only.items() if value not in (None, False)]
    if args.model != "psum" and given:
        p.error(f"{', '.join(given)}: the psum step's (--model psum), not a model's")
    args.local_devices = 2 if args.local_devices is None else args.local_devices
    args.work_seconds = 0.1 if args.work_seconds is None else args.work_seconds
    if args.workers < 2 or args.steps < 2 * DIE_AT + 6:
        p.error(f"--workers must be at least 2 and --steps at least {2 * DIE_AT + 6}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jbps-elastic-join-") as tmp:
        for i in range(args.runs):
            rows.append(run_once(args, os.path.join(tmp, f"die-{i}")))
            r = rows[-1]
            print(
                f"run {i + 1}: step {r['step_s']:.3f} s, loss {r['loss_s']:.3f} s, join {r['join_s']:.3f} s,"
                f" next step {r['next_step_s']:.3f} s,"
                f" broadcast {r['broadcast_s']:.2f} s, over broadcast + step {r['over_s']:+.3f} s",
                file=sys.stderr,
                flush=True,
            )
    if args.json:
        print(json.dumps({"runs": rows}))
        return
    print(
        "| run | step | loss (kill -> next commit) | join (regroup -> next commit) | next step | broadcast"
        " | join - (broadcast + step) |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(
            f"| {i + 1} | {r['step_s']:.3f} s | {r['loss_s']:.3f} s | {r['join_s']:.3f} s | {r['next_step_s']:.3f} s"
            f" | {r['broadcast_s']:.2f} s"
            f" | {r['over_s']:+.3f} s |"
        )


if __name__ == "__main__":
    main()
