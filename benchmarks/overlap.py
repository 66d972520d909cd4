"""Overlap across emulated hosts: a training step's time with its gradients
reduced as one call, in buckets, by JAX's own pmean, against the step alone
and the communication alone; samples/s and scaling efficiency of each.

    python -m benchmarks.overlap [--workers 2] [--cpu-hosts 0,2] [--rate 1G] [--model mlp]
                                 [--layers 8] [--width 1024] [--batch 1024] [--steps 9]
                                 [--bucket-bytes 1M,16M] [--scan 4] [--skip-gloo] [--json]
                                 [--plot timeline.png]

Needs root (network namespaces, as `python -m benchmarks.network`). --model
mlp (default) is an MLP of --layers square layers (--width; float32), so its
gradients are layers x width² x 4 bytes; the defaults make compute and
communication take about as long on the development machine. --model resnet
and --model transformer train the examples' own models (step_models.py says
how --layers and --width size them). For each k CPU hosts: the step
with jbps.optax.distributed as one call (bucket_bytes 0) and in buckets
(the default, and each --bucket-bytes; --scan N: also N steps a program,
jbps.scan, each step's time the program's over N), and the psum of the same gradients
alone; once: the step in one process without jbps, the step alone on every
worker host at once (no communication; the bound uses this one, since the
workers share this machine's cores) and the step with lax.pmean over gloo
(jax.distributed).
Times are the slowest worker's median; samples/s are the job's (--batch x
workers per step), and the scaling efficiency is that over workers x the
samples/s of the step in one process. The target: a bucketed step within
1.15 x max(step alone, communication alone). Beside it, the machine's CPU
time per step of each (every host shares this machine's cores, its network
stack too) and the bound that sets: no overlap ends a step before the step's
and the psum's CPU time together have run on all cores. --plot draws worker 0's
bucketed step of median time from the engine's trace (the last k): when each
bucket's call was entered, its pushes and its pulls.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile

from .emulated_job import job_free_env, run_job
from .emulated_network import EmulatedNetwork, NetworkError, format_rate, parse_rate
from jbps.procs import terminate
from jbps.sizes import format_bytes, parse_bytes
from .network import _wait_all, parse_range, python_env
from . import step_models

log = logging.getLogger("benchmarks.overlap")
TARGET = 1.15


def parse_args(argv=None, prog=None):
    p = argparse.ArgumentParser(
        prog=prog or "python -m benchmarks.overlap",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=2, help="worker hosts, n (default 2)")
    p.add_argument(
        "--cpu-hosts",
        type=parse_range,
        default=parse_range("0,2"),
        help="CPU-only hosts k to try, a range or list (default 0,2)",
    )
    p.add_argument("--rate", default="1G", help="each NIC's rate each way, bits/s (default 1G)")
    step_models.add_model_flags(p)
    p.add_argument(
        "--bucket-bytes", default="", help="comma list of bucket sizes to run beside the default (e.g. 1M,16M)"
    )
    p.add_argument("--scan", type=int, default=0, help="also run N steps a program with jbps.scan (e.g. 4)")
    p.add_argument("--skip-gloo", action="store_true", help="do not run JAX's pmean over gloo")
    p.add_argument("--timeout", type=float, default=600, help="seconds any one job may take (default 600)")
    p.add_argument("--trace-dir", help="keep the engine's traces of the bucketed runs here (DIR/k<k>/<rank>/comm.json)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw worker 0's bucketed step from its trace")
    args = p.parse_args(argv)
    try:
        args.rate = parse_rate(args.rate)
        args.bucket_list = [parse_bytes(b.strip()) for b in args.bucket_bytes.split(",") if b.strip()]
    except (NetworkError, ValueError) as exc:
        p.error(str(exc))
    for name in ("workers", "layers", "width", "batch", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.workers + max(args.cpu_hosts) > 254:
        p.error("at most 254 hosts")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib: pip install matplotlib")
    return args


def _slowest(reports: list[dict]) -> dict:
    """The slowest worker's median, and the machine's CPU time per step (one
    worker's count: it is the whole machine's, every host included)."""
    slowest = max(r["median_s"] for r in reports)
    return {
        "median_s": slowest,
        "samples_per_s": len(reports) * reports[0]["samples"] / slowest,
        "per_worker_s": [r["median_s"] for r in reports],
        "cpu_core_s_per_step": reports[0]["cpu_core_s_per_step"],
        "cpu": reports[0]["cpu"],
    }


def _reports(stdouts: list[str], what: str) -> list[dict]:
    out = []
    for i, text in enumerate(stdouts):
        lines = [line for line in text.splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"{what}: worker {i} printed no result")
        out.append(json.loads(lines[-1]))
    return out


def run_on_workers(net: EmulatedNetwork, n: int, argv_for, env, timeout_s: float, what: str) -> list[dict]:
    """Runs argv_for(i) on each worker host i at once, without jbps."""
    procs, files = [], []
    try:
        for i in range(n):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(net.run(i, [sys.executable, *argv_for(i)], env=env, stdout=out, stderr=err))
        _wait_all(procs, files, timeout_s, what)
        texts = []
        for out, _ in files:
            out.seek(0)
            texts.append(out.read())
        return _reports(texts, what)
    finally:
        terminate(procs, 0.0, what)
        for out, err in files:
            out.close()
            err.close()


def run_jbps(net, n, k, args, mode: str, bucket_bytes: int | None, trace_dir: str | None = None, scan: int = 0) -> dict:
    argv = ["-m", "benchmarks.step_worker", "--mode", mode, *step_models.worker_args(args)]
    if bucket_bytes is not None:
        argv += ["--bucket-bytes", str(bucket_bytes)]
    if scan:
        argv += ["--scan", str(scan)]
    env = job_free_env()
    if trace_dir:
        env["JBPS_TRACE_DIR"] = trace_dir
    result = run_job(net, list(range(n)), list(range(n + k)), argv, env=env, timeout_s=args.timeout)
    reports = _reports([w.stdout for w in result.workers], f"jbps {mode}")
    if mode == "jbps" and not all(r["params_equal"] for r in reports):
        raise RuntimeError("jbps step: the workers' parameters differ after the run")
    out = _slowest(reports)
    out["median_step_us"] = reports[0]["median_step_us"]
    return out


def run(args) -> dict:
    n, ks = args.workers, args.cpu_hosts
    doc = {
        "workers": n,
        "cpu_hosts": ks,
        "rate_bits": args.rate,
        "model": args.model,
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "steps": args.steps,
        "cases": {},
    }
    env = python_env(XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip())
    with EmulatedNetwork(n + max(ks), args.rate) as net, tempfile.TemporaryDirectory(prefix="jbps-overlap-") as tmp:
        log.info("%d emulated hosts at %s; the step alone ...", len(net.hosts), format_rate(args.rate))
        (alone,) = run_on_workers(
            net,
            1,
            lambda i: ["-m", "benchmarks.step_worker", "--mode", "compute", *step_models.worker_args(args)],
            env,
            args.timeout,
            "the step in one process",
        )
        doc["one_process"] = _slowest([alone])
        doc["describe"], doc["grad_bytes"] = alone["model"], alone["grad_bytes"]
        doc["compute"] = _slowest(
            run_on_workers(
                net,
                n,
                lambda i: ["-m", "benchmarks.step_worker", "--mode", "compute", *step_models.worker_args(args)],
                env,
                args.timeout,
                "the step alone",
            )
        )
        if not args.skip_gloo:
            log.info("the step with lax.pmean over gloo ...")
            coordinator = f"{net.hosts[0].address}:{random.randint(20000, 60000)}"
            doc["gloo"] = _slowest(
                run_on_workers(
                    net,
                    n,
                    lambda i: [
                        "-m",
                        "benchmarks.step_worker",
                        "--mode",
                        "gloo",
                        *step_models.worker_args(args),
                        "--coordinator",
                        coordinator,
                        "--num-processes",
                        str(n),
                        "--process-id",
                        str(i),
                    ],
                    env,
                    args.timeout,
                    "gloo step",
                )
            )
        for k in ks:
            case = {}
            log.info("k = %d: the communication alone ...", k)
            case["comm"] = run_jbps(net, n, k, args, "comm", None)
            log.info("k = %d: the step, one call ...", k)
            case["one call"] = run_jbps(net, n, k, args, "jbps", 0)
            log.info("k = %d: the step, buckets (default) ...", k)
            trace = os.path.join(args.trace_dir or tmp, f"k{k}")
            case["buckets"] = run_jbps(net, n, k, args, "jbps", None, trace_dir=trace)
            case["buckets"]["trace"] = _timeline(trace, case["buckets"]["median_step_us"])
            for b in args.bucket_list:
                log.info("k = %d: the step, buckets of %s ...", k, format_bytes(b))
                extra = os.path.join(args.trace_dir, f"k{k}-{b}") if args.trace_dir else None
                case[f"buckets {format_bytes(b)}"] = run_jbps(net, n, k, args, "jbps", b, trace_dir=extra)
            if args.scan:
                log.info("k = %d: %d steps a program (jbps.scan) ...", k, args.scan)
                extra = os.path.join(args.trace_dir, f"k{k}-scan") if args.trace_dir else None
                case[f"scan {args.scan}"] = run_jbps(net, n, k, args, "jbps", None, trace_dir=extra, scan=args.scan)
            bound = max(doc["compute"]["median_s"], case["comm"]["median_s"])
            case["buckets_over_bound"] = case["buckets"]["median_s"] / bound
            case["one_call_over_bound"] = case["one call"]["median_s"] / bound
            if args.scan:
                case["scan_over_bound"] = case[f"scan {args.scan}"]["median_s"] / bound
            # The machine's own bound: the CPU time of the step alone and of the psum
            # alone, both on these cores, can overlap no better than all cores busy.
            cores = doc["compute"]["cpu"]["cores"]
            cpu_s = doc["compute"]["cpu_core_s_per_step"] + case["comm"]["cpu_core_s_per_step"]
            case["cpu_bound_s"] = cpu_s / cores
            case["buckets_over_cpu_bound"] = case["buckets"]["median_s"] / max(bound, case["cpu_bound_s"])
            if "gloo" in doc:
                case["gloo_over_buckets"] = doc["gloo"]["median_s"] / case["buckets"]["median_s"]
            doc["cases"][str(k)] = case
    return doc


def _timeline(trace_dir: str, step_us) -> list[dict]:
    """Worker 0's chunks of its step of median time, by call: entered, pushes, pulls."""
    from jbps.trace import read_trace, trace_path

    start, end = step_us
    calls: dict[str, dict] = {}
    for c in read_trace(trace_path(trace_dir, 0)):
        if not start <= c.queued <= end:
            continue
        call = c.tensor.split("[", 1)[0]
        entry = calls.setdefault(call, {"call": call, "entered": c.queued, "pushes": [], "pulls": []})
        entry["entered"] = min(entry["entered"], c.queued)
        entry["pushes"].append(((c.sent_start - start) / 1e3, (c.acked - start) / 1e3))
        entry["pulls"].append(((c.sum_arrived - start) / 1e3, (c.pulled - start) / 1e3))
    rows = sorted(calls.values(), key=lambda r: r["entered"])
    for r in rows:
        r["entered"] = (r["entered"] - start) / 1e3
    return [{"step_ms": (end - start) / 1e3}] + rows


def format_table(doc: dict) -> str:
    ms = lambda s: f"{s * 1e3:.0f} ms"  # noqa: E731
    lines = [
        f"A training step across emulated hosts: {doc['workers']} worker hosts, "
        f"{format_rate(doc['rate_bits'])} each way per NIC, {doc['describe']} "
        f"({doc['grad_bytes'] / 2**20:.1f} MiB of gradients), batch {doc['batch']} per worker; "
        f"median of {doc['steps']} steps (slowest worker)",
        "",
    ]
    lines.append(f"step in one process, no jbps (the machine otherwise idle): {ms(doc['one_process']['median_s'])}")
    lines.append(f"step alone, every worker at once (no communication): {ms(doc['compute']['median_s'])}")
    if "gloo" in doc:
        lines.append(f"step with JAX's pmean over gloo: {ms(doc['gloo']['median_s'])}")
    lines.append("")
    names = [
        name for name in next(iter(doc["cases"].values())) if isinstance(next(iter(doc["cases"].values()))[name], dict)
    ]
    lines.append(
        "k  "
        + "  ".join(f"{name:>16}" for name in names)
        + "  buckets / max(step alone, comm alone)"
        + ("  gloo / buckets" if "gloo" in doc else "")
    )
    cpu_rows = []
    for k, case in doc["cases"].items():
        row = f"{k:<2} " + "  ".join(f"{ms(case[name]['median_s']):>16}" for name in names)
        row += (
            f"  {case['buckets_over_bound']:.2f} (target <= {TARGET:.2f}; one call: {case['one_call_over_bound']:.2f}"
            + (f"; scan: {case['scan_over_bound']:.2f}" if "scan_over_bound" in case else "")
            + ")"
        )
        if "gloo" in doc:
            row += f"  {case['gloo_over_buckets']:.2f}"
        lines.append(row)
        cpu_rows.append(
            f"{k:<2} {ms(doc['compute']['cpu_core_s_per_step']):>16}  {ms(case['comm']['cpu_core_s_per_step']):>16}"
            f"  {ms(case['buckets']['cpu_core_s_per_step']):>16}  {ms(case['cpu_bound_s']):>16}"
            f"  {case['buckets_over_cpu_bound']:.2f}"
        )
    lines.append("(comm: the psum of the step's gradients alone; one call: bucket_bytes 0; buckets: the default)")
    lines += _throughput_rows(doc, names)
    cores = doc["compute"]["cpu"]["cores"]
    lines += [
        "",
        f"The machine's CPU time per step (core-ms; every emulated host's computation, jbps and network stack "
        f"share these {cores} cores), and the bound it sets: (step alone + comm alone) / {cores} cores",
        f"k  {'step alone':>16}  {'comm alone':>16}  {'buckets':>16}  {'CPU bound':>16}"
        "  buckets / max(step alone, comm alone, CPU bound)",
        *cpu_rows,
    ]
    return "\n".join(lines)


def _throughput_rows(doc: dict, names: list[str]) -> list[str]:
    """The job's samples/s for each way, and the scaling efficiency: over
    workers x the samples/s of the step in one process (the machine otherwise
    idle), and over the step alone on every worker at once (what these shared
    cores allow without communication)."""
    one = doc["one_process"]["samples_per_s"] * doc["workers"]
    alone = doc["compute"]["samples_per_s"]
    ways = [("step alone", doc["compute"])] + ([("gloo pmean", doc["gloo"])] if "gloo" in doc else [])
    lines = [
        "",
        f"Samples/s over the job, and its scaling efficiency: / ({doc['workers']} x one process alone, "
        f"{one:.0f}) and / (every worker's step alone at once, {alone:.0f})",
        f"{'':>22}  {'samples/s':>10}  {'/ one':>6}  {'/ alone':>6}",
    ]
    for name, result in ways:
        rate = result["samples_per_s"]
        lines.append(f"{name:>22}  {rate:10.0f}  {rate / one:6.2f}  {rate / alone:6.2f}")
    for k, case in doc["cases"].items():
        for name in names:
            if name != "comm":
                rate = case[name]["samples_per_s"]
                label = f"k = {k}, {name}"
                lines.append(f"{label:>22}  {rate:10.0f}  {rate / one:6.2f}  {rate / alone:6.2f}")
    return lines


def plot(doc: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k, case = list(doc["cases"].items())[-1]
    head, *rows = case["buckets"]["trace"]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(rows)))
    ax.barh(len(rows), head["step_ms"], left=0, height=0.6, color="0.75")
    for y, r in enumerate(reversed(rows)):
        for a, b in r["pushes"]:
            ax.barh(y + 0.15, max(b - a, 0.05), left=a, height=0.3, color="tab:blue")
        for a, b in r["pulls"]:
            ax.barh(y - 0.15, max(b - a, 0.05), left=a, height=0.3, color="tab:orange")
        ax.plot([r["entered"]], [y], marker="|", markersize=14, color="black")
    ax.set_yticks(range(len(rows) + 1), [r["call"] for r in reversed(rows)] + ["step"])
    ax.set_xlabel("ms since the step started (worker 0)")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color="0.75", label="the step (compute and waits)"),
            Patch(color="tab:blue", label="pushes (until acknowledged)"),
            Patch(color="tab:orange", label="pulls (sum arriving)"),
            Line2D([], [], marker="|", linestyle="", markersize=14, color="black", label="call entered"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0.0,
        fontsize=8,
    )
    ax.set_title(f"One bucketed step, k = {k} CPU hosts, {format_rate(doc['rate_bits'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return fig


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        doc = run(args)
    except NetworkError as exc:
        print(f"python -m benchmarks.overlap: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        plot(doc, args.plot)
    print(json.dumps(doc, indent=1) if args.json else format_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
