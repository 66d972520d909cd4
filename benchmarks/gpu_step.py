"""A training step on one machine's accelerator, shared by 2 workers (`jbps
run` on loopback): the step alone (both workers at once, no jbps), the psum
of its gradients alone, and the step with jbps.optax.distributed as one call
and in buckets. What .ci/gpu-check runs on a GPU machine; --platform cpu runs
the same on XLA:CPU.

    python -m benchmarks.gpu_step [--platform cuda] [--model mlp] [--layers 8] [--width 1024]
                                  [--batch 1024] [--steps 9] [--json]
    python -m benchmarks.gpu_step --summarize DIR    # .ci/gpu-check's table of DIR's results

Times are the slower worker's median (benchmarks/step_worker.py). Where the
step does not overlap its communication, a bucketed step takes step + psum;
where it does, max(step, psum).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from . import step_models
from jbps.procs import terminate

WAYS = (
    ("step alone", "compute", None),
    ("psum alone", "comm", None),
    ("one call", "jbps", 0),
    ("buckets", "jbps", None),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--platform", default="cuda", help="JAX_PLATFORMS for the workers (default cuda)")
    p.add_argument("--workers", type=int, default=2, help="worker processes sharing the machine (default 2)")
    step_models.add_model_flags(p)
    p.add_argument("--timeout", type=float, default=300, help="seconds each way may take (default 300)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--summarize", metavar="DIR", help="print the table of DIR/gpu_step.json and DIR/cuda_staging.json")
    return p.parse_args(argv)


def _reports(text: str, what: str) -> list[dict]:
    reports = [json.loads(line[line.index("{") :]) for line in text.splitlines() if '{"mode"' in line]
    if not reports:
        raise RuntimeError(f"{what}: no worker reported")
    return reports


def run_way(args, mode: str, bucket_bytes) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=args.platform, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    argv = [sys.executable, "-m", "benchmarks.step_worker", "--mode", mode, *step_models.worker_args(args)]
    argv += ["--bucket-bytes", str(bucket_bytes)] if bucket_bytes is not None else []
    if mode != "compute":  # with jbps: the launcher starts the servers and the workers
        argv = [sys.executable, "-m", "jbps.cli", "run", "-n", str(args.workers), *argv]
    count = args.workers if mode == "compute" else 1  # without jbps: the workers side by side
    procs = [
        subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        for _ in range(count)
    ]
    try:
        outs = [p.communicate(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{mode} took over {args.timeout:g} s (--timeout)") from None
    finally:
        terminate(procs, grace_s=3, what=mode)  # by PID, with everything they started
    failed = [err for p, (_, err) in zip(procs, outs) if p.returncode]
    if failed:
        raise RuntimeError(f"{mode} failed:\n{failed[0][-3000:]}")
    text = "\n".join(out for out, _ in outs)
    reports = _reports(text, mode)
    if mode == "jbps" and not all(r["params_equal"] for r in reports):
        raise RuntimeError("the workers' parameters differ after the run")
    return {"median_s": max(r["median_s"] for r in reports), "model": reports[0]["model"], "reports": reports}


def run(args) -> dict:
    doc = {"platform": args.platform, "workers": args.workers, "ways": {}}
    for name, mode, bucket_bytes in WAYS:
        doc["ways"][name] = run_way(args, mode, bucket_bytes)
    ways = doc["ways"]
    doc["model"] = ways["step alone"]["model"]
    doc["grad_bytes"] = ways["step alone"]["reports"][0]["grad_bytes"]
    bound = max(ways["step alone"]["median_s"], ways["psum alone"]["median_s"])
    doc["buckets_over_max"] = ways["buckets"]["median_s"] / bound
    doc["buckets_over_one_call"] = ways["buckets"]["median_s"] / ways["one call"]["median_s"]
    return doc


def format_table(doc: dict) -> str:
    lines = [
        f"A training step on {doc['platform']}, {doc['workers']} workers sharing the machine (jbps run, loopback): "
        f"{doc['model']}, {doc['grad_bytes'] / 2**20:.1f} MiB of gradients; the slower worker's median",
        "",
    ]
    for name, result in doc["ways"].items():
        lines.append(f"{name:>12}  {result['median_s'] * 1e3:9.1f} ms")
    lines.append(
        f"buckets / max(step alone, psum alone): {doc['buckets_over_max']:.2f} (goal <= 1.15); "
        f"buckets / one call: {doc['buckets_over_one_call']:.2f}"
    )
    return "\n".join(lines)


def summarize(folder: str) -> str:
    """The step's table and the staging costs, of whichever of the two ran."""
    parts = []
    for name, describe in (("gpu_step.json", format_table), ("cuda_staging.json", _staging_lines)):
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                parts.append(describe(json.load(f)))
        except (OSError, ValueError) as exc:
            parts.append(f"{name}: no result ({exc.__class__.__name__}: {exc})")
    return "\n\n".join(parts)


def _staging_lines(doc: dict) -> str:
    lines = [f"jbps.psum of one tensor, on {doc['device']} and on the CPU backend (benchmarks/cuda_staging.py):"]
    for s in doc["staging"]:
        lines.append(f"{s['bytes']:>10} B  GPU {s['psum_gpu_s'] * 1e3:8.2f} ms  CPU {s['psum_cpu_s'] * 1e3:8.2f} ms")
    step = doc["flax_mlp_step"]
    lines.append(
        f"flax MLP step: {step['without_jbps_s'] * 1e3:.2f} ms alone, {step['with_jbps_s'] * 1e3:.2f} ms with jbps"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    doc = run(args)
    print(json.dumps(doc, indent=1) if args.json else format_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
