"""Benchmark jbps.psum against MPI Allreduce and JAX's gloo psum on this machine.

    python -m benchmarks [--sizes 4M,64M,256M] [--iters N] [--warmup N]
                         [--workers 2] [--servers 2] [--json] [--skip-peers] [--plot out.png]
                         [--priority-model resnet50] [--credits 1,2,4,8,16] [--skip-priority]
                         [--skip-small-tensors] [--tree-leaves 200] [--tree-min 4K] [--tree-max 256K]
                         [--tree-seed 0] [--skip-memory] [--memory-bytes M] [--memory-peak-rounds 5]
                         [--memory-round-bytes 4M] [--memory-rounds 1000]
                         [--latency-sizes 4K,16K,64K,256K,1M,4M] [--skip-latency]

One invocation measures, on this machine:

- psum time per size: jbps psum (CPU summation servers and worker processes
  started here) beside mpi4py Allreduce and JAX's gloo psum (2 processes each),
  each the median over the timed calls of the slowest process;
- the servers' summation kernels (float32, bfloat16, float16) beside numpy's
  add and a plain copy (benchmarks/summation.py);
- priority: a model's gradients in one psum under each credit window, first
  leaf first (jbps's default) and last leaf first (what FIFO gives in backprop
  order): how soon the first layer's sum is back, from the engine's trace;
- many small tensors: one psum of a tree of float32 leaves of log-uniform sizes
  (fixed seed) beside one psum of a buffer of the same bytes (the peers: an
  Allreduce per leaf, a gloo psum of the tree);
- memory: worker 0's peak RSS during psums of M bytes beyond jax's own buffers,
  in units of M, and its RSS growth over many rounds of a smaller buffer (the
  servers' too).

It ends with every ratio, jbps against the reference it names, beside the value
the design aims at. Progress goes to stderr; the table (or, with --json, one
JSON document) goes to stdout.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import sys
import time

import numpy as np

from .local_cluster import last_json_line
from . import latency
from .goals import format_cases, make_goals, tree_leaf_sizes
from .report import parse_report
from .plotting import finish
from .summation import bench_summation, format_summation

log = logging.getLogger("benchmarks")

DEFAULT_SIZES = "4M,64M,256M"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# As a module, not a file path: a script's folder would go first on the workers' sys.path.
_WORKER = ["-m", "benchmarks.jbps_worker"]


def parse_size(text: str) -> int:
    """'4M' -> 4194304 (binary units); a plain number is bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 64K, 4M or 1G")
    nbytes = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be a positive multiple of 4 bytes (float32)")
    return nbytes


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({parse_size(s) for s in text.split(",") if s.strip()})
    if not sizes:
        raise argparse.ArgumentTypeError("--sizes needs at least one size")
    return sizes


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def iters_for(nbytes: int, base: int, scale: bool) -> int:
    """Timed calls per size: more where calls are quick (noisier), fewer where one takes seconds."""
    if not scale:
        return base
    if nbytes <= 4 << 20:
        return base * 4
    if nbytes > 64 << 20:
        return max(3, base // 2)
    return base


def parse_args(argv=None, prog=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog or "python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes(DEFAULT_SIZES),
        help=f"comma-separated float32 buffer sizes, K/M/G = KiB/MiB/GiB (default {DEFAULT_SIZES})",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed calls per size (default 20, scaled: x4 up to 4 MiB, /2 above 64 MiB; "
        "given explicitly, every size gets exactly this many)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per size first (default 2)")
    p.add_argument("--workers", type=int, default=2, help="jbps worker processes (default 2)")
    p.add_argument("--servers", type=int, default=2, help="jbps summation servers (default 2)")
    p.add_argument("--timeout", type=float, default=600, help="seconds any one tool may take (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--skip-peers", action="store_true", help="do not run MPI and gloo")
    p.add_argument("--plot", metavar="PNG", help="also draw bandwidth vs size into this file (needs matplotlib)")
    p.add_argument(
        "--priority-model",
        default="resnet50",
        help="built-in model whose gradients the priority case sums (default resnet50)",
    )
    p.add_argument(
        "--credits",
        default="1,2,4,8,16",
        help="credit windows (chunks in flight) the priority case tries (default 1,2,4,8,16)",
    )
    p.add_argument("--skip-priority", action="store_true", help="do not run the priority case")

    # Each case's options, named after what it measures.
    def option(name, **kwargs):
        if "action" not in kwargs:
            kwargs["metavar"] = name[2:].upper().replace("-", "_")
        p.add_argument(name, **kwargs)

    option("--skip-small-tensors", action="store_true", help="do not run the many-small-tensors case")
    option(
        "--tree-leaves",
        type=int,
        default=200,
        help="many small tensors: leaves in the tree (default 200)",
    )
    option(
        "--tree-min",
        type=parse_size,
        default=parse_size("4K"),
        help="many small tensors: smallest leaf (default 4K)",
    )
    option(
        "--tree-max",
        type=parse_size,
        default=parse_size("256K"),
        help="many small tensors: largest leaf (default 256K)",
    )
    option("--tree-seed", type=int, default=0, help="many small tensors: seed of the leaf sizes (default 0)")
    option("--skip-memory", action="store_true", help="do not run the memory case")
    option(
        "--memory-bytes",
        type=parse_size,
        default=None,
        help="memory: M, the psum whose peak memory is measured (default the largest of --sizes)",
    )
    option(
        "--memory-peak-rounds",
        type=int,
        default=5,
        help="memory: psums of M while the peak is taken (default 5)",
    )
    option(
        "--memory-round-bytes",
        type=parse_size,
        default=parse_size("4M"),
        help="memory: the buffer of the growth rounds (default 4M)",
    )
    option(
        "--memory-rounds",
        type=int,
        default=1000,
        help="memory: growth rounds; RSS growth from the 10th percent of them to the last (default 1000)",
    )
    p.add_argument(
        "--latency-sizes",
        type=parse_sizes,
        default=parse_sizes(latency.DEFAULT_SIZES),
        help=f"the latency sweep's sizes (default {latency.DEFAULT_SIZES}); see benchmarks/latency.py",
    )
    p.add_argument("--skip-latency", action="store_true", help="do not run the latency sweep")
    args = p.parse_args(argv)
    try:
        args.credits = [int(c) for c in args.credits.split(",") if c.strip()]
    except ValueError:
        p.error(f"--credits {args.credits!r}: expected a comma-separated list of integers")
    if not args.credits or min(args.credits) < 1:
        p.error("--credits needs positive integers")
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must not be negative")
    if args.workers < 1 or args.servers < 1:
        p.error("--workers and --servers must be at least 1")
    if args.tree_leaves < 1 or args.tree_min > args.tree_max:
        p.error("many small tensors: --tree-leaves must be at least 1, and --tree-min at most --tree-max")
    if args.memory_peak_rounds < 1 or args.memory_rounds < 10:
        p.error("memory: --memory-peak-rounds must be at least 1, and --memory-rounds at least 10")
    args.memory_bytes = args.memory_bytes or args.sizes[-1]
    return args


def run_jbps(sizes, iters, warmup, workers, servers, timeout_s, cases=()) -> dict:
    """The size rows, and the worker's many-small-tensors and memory cases given as its
    arguments in `cases`."""
    from .local_cluster import LocalCluster

    argv = [
        *_WORKER,
        "--sizes",
        ",".join(map(str, sizes)),
        "--iters",
        ",".join(str(iters[s]) for s in sizes),
        "--warmup",
        str(warmup),
        *cases,
    ]
    with LocalCluster(workers, servers, local_devices=1, timeout_s=timeout_s) as cluster:
        log.info(
            "jbps: %s, %s at %s", _count(workers, "worker"), _count(servers, "server"), ",".join(cluster.addresses)
        )
        if "--memory" in cases:  # worker 0 reads the servers' memory too
            argv += ["--server-pids", ",".join(str(proc.pid) for proc in cluster.servers)]
        results = cluster.run_workers(argv)
    failed = [r for r in results if r.returncode != 0]
    if failed:
        raise RuntimeError(
            "jbps workers failed:\n"
            + "\n".join(f"--- worker {r.rank} (exit {r.returncode}):\n{r.stderr[-3000:]}" for r in failed)
        )
    return parse_report(results[0].stdout + "\n" + results[0].stderr[-3000:], "jbps worker 0")


def run_priority(model, credits, iters, warmup, workers, servers, timeout_s) -> dict:
    from .local_cluster import LocalCluster

    argv = [
        "-m",
        "benchmarks.priority_worker",
        "--model",
        model,
        "--credits",
        ",".join(map(str, credits)),
        "--iters",
        str(iters),
        "--warmup",
        str(warmup),
    ]
    # --keep-alive: each credit window is a new init() against the same servers.
    with LocalCluster(workers, servers, local_devices=1, timeout_s=timeout_s, server_args=["--keep-alive"]) as cluster:
        results = cluster.run_workers(argv)
    failed = [r for r in results if r.returncode != 0]
    if failed:
        raise RuntimeError(
            "priority workers failed:\n"
            + "\n".join(f"--- worker {r.rank} (exit {r.returncode}):\n{r.stderr[-3000:]}" for r in failed)
        )
    out = last_json_line(results[0].stdout)
    if out is None:
        raise RuntimeError(f"priority worker 0: no JSON result in output:\n{results[0].stdout[-3000:]}")
    return out


def format_priority(prio: dict, cfg: dict) -> list[str]:
    lines = [
        f"priority: {prio['model']} gradients ({prio['bytes'] / 2**20:.1f} MiB, {prio['leaves']} tensors) in one "
        f"psum, {_count(cfg['workers'], 'worker')}, {_count(cfg['servers'], 'server')}; ms from the first chunk "
        "queued until the first leaf's sum / the whole sum is back (median, rank 0's engine trace). "
        "forward = jbps default; backprop = last leaf first, as FIFO without priority.",
        "{:>7} {:>15} {:>16} {:>17} {:>13} {:>14}".format(
            "credit", "first fwd ms", "first bprop ms", "bprop/fwd first", "whole fwd ms", "whole bprop ms"
        ),
    ]
    for credit, r in prio["results"].items():
        fwd, back = r["forward"], r["backprop"]
        lines.append(
            "{:>7} {:>15.2f} {:>16.2f} {:>16.0f}x {:>13.2f} {:>14.2f}".format(
                credit,
                fwd["first_leaf_s"] * 1e3,
                back["first_leaf_s"] * 1e3,
                back["first_leaf_s"] / fwd["first_leaf_s"],
                fwd["total_s"] * 1e3,
                back["total_s"] * 1e3,
            )
        )
    return lines


def run_peer(runner, sizes, iters, warmup, timeout_s, tree_sizes=(), tree_iters=None) -> dict | None:
    """One peer tool over every size; sizes with different iteration counts run as separate jobs
    because the peer scripts take one count for all their sizes. The small tensors' tree, if given, runs with
    the first job."""
    merged = None
    for count in sorted(set(iters[s] for s in sizes)):
        group = [s for s in sizes if iters[s] == count]
        out = runner(group, count, warmup, timeout_s, tree_sizes=tree_sizes, tree_iters=tree_iters)
        if out is None:
            return None
        if merged is None:
            merged = {"tool": out["tool"], "results": {}, "small_tensors": out.get("small_tensors")}
            tree_sizes = ()
        merged["results"].update(out["results"])
    merged["results"] = dict(sorted(merged["results"].items()))
    return merged


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _median(tool: dict | None, nbytes: int) -> float | None:
    if tool is None or nbytes not in tool["results"]:
        return None
    return tool["results"][nbytes]["median_s"]


def _ratio(a, b):
    return a / b if a is not None and b else None


def make_rows(sizes, tools) -> list[dict]:
    rows = []
    for nbytes in sizes:
        jbps_s, mpi_s, gloo_s = (_median(tools[k], nbytes) for k in ("jbps", "mpi", "gloo"))
        rows.append(
            {
                "bytes": nbytes,
                "jbps_median_s": jbps_s,
                "jbps_gbps": nbytes / jbps_s / 1e9 if jbps_s else None,
                "bytes_pushed_per_call": (tools["jbps"] or {})
                .get("results", {})
                .get(nbytes, {})
                .get("bytes_pushed_per_call"),
                "mpi_median_s": mpi_s,
                "gloo_median_s": gloo_s,
                # Time ratios: below 1 means jbps is faster.
                "jbps_over_mpi": _ratio(jbps_s, mpi_s),
                "jbps_over_gloo": _ratio(jbps_s, gloo_s),
            }
        )
    return rows


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(doc: dict) -> str:
    cfg = doc["config"]
    header = ("size", "jbps ms", "jbps GB/s", "MPI ms", "gloo ms", "jbps/MPI", "jbps/gloo")
    lines = [
        f"jbps psum: {_count(cfg['workers'], 'worker')} x 1 CPU device, {_count(cfg['servers'], 'server')}; "
        f"peers: {_count(cfg['peer_processes'], 'process')}. Median of the slowest process per call; "
        "GB/s = bytes / time (algorithm bandwidth); jbps/X = time ratio, < 1 means jbps is faster.",
        "{:>9} {:>9} {:>10} {:>9} {:>9} {:>9} {:>10}".format(*header),
    ]
    for row in doc["rows"]:
        ms = lambda s: None if s is None else s * 1e3  # noqa: E731
        lines.append(
            "{:>9} {:>9} {:>10} {:>9} {:>9} {:>9} {:>10}".format(
                format_size(row["bytes"]),
                _cell(ms(row["jbps_median_s"]), ".2f"),
                _cell(row["jbps_gbps"], ".3f"),
                _cell(ms(row["mpi_median_s"]), ".2f"),
                _cell(ms(row["gloo_median_s"]), ".2f"),
                _cell(row["jbps_over_mpi"], ".2f"),
                _cell(row["jbps_over_gloo"], ".2f"),
            )
        )
    if doc["kernel"] is not None:
        lines += format_summation(doc["kernel"])
    if doc.get("priority"):
        lines += format_priority(doc["priority"], cfg)
    if doc.get("latency"):
        lines += latency.format_latency(doc["latency"], cfg)
    lines += format_cases(doc)
    for what, err in doc["errors"].items():
        last = next((line.strip() for line in reversed(err.splitlines()) if line.strip()), "")
        lines.append(f"{what} FAILED: {last} (details on stderr)")
    return "\n".join(lines)


def plot(doc: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    colors = {}
    highest = 0.0
    for key, tool in doc["tools"].items():
        if tool is None:
            continue
        sizes = sorted(tool["results"])
        rates = [s / tool["results"][s]["median_s"] / 1e9 for s in sizes]
        highest = max([highest, *rates])
        [line] = ax.plot(sizes, rates, marker="o", label=tool["tool"])
        colors[key] = line.get_color()
    # Many small tensors: the tree's bandwidth (total bytes / time) at its total size, in its tool's colour.
    for key, r in (doc.get("small_tensors") or {}).items():
        if isinstance(r, dict) and "tree" in r:
            highest = max(highest, r["bytes"] / r["tree"]["median_s"] / 1e9)
            ax.plot(
                [r["bytes"]],
                [r["bytes"] / r["tree"]["median_s"] / 1e9],
                marker="x",
                markersize=9,
                linestyle="none",
                color=colors.get(key),
                label=f"{r['tool']}: tree of {r['leaves']} leaves",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(doc["config"]["sizes"], [format_size(s) for s in doc["config"]["sizes"]])
    ax.minorticks_off()
    ax.set_xlabel("buffer size (float32)")
    ax.set_ylabel("algorithm bandwidth (GB/s)")
    ax.set_title("sum across processes on one machine")
    ax.grid(True, alpha=0.3)
    finish(fig, ax, path, highest)
    plt.close(fig)
    return fig


def _json_ready(doc: dict) -> dict:
    """JSON object keys must be strings: results are keyed by byte count."""
    out = dict(doc)
    out["tools"] = {
        k: None if t is None else {**t, "results": {str(s): r for s, r in t["results"].items()}}
        for k, t in doc["tools"].items()
    }
    return out


def main(argv=None, prog=None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    args = parse_args(argv, prog)
    # Fail before minutes of benchmarking, not after.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        log.error(
            "--plot needs matplotlib, which is not installed (pip install matplotlib); "
            "jbps itself does not depend on it"
        )
        return 2

    from . import peers

    sizes = args.sizes
    iters = {s: iters_for(s, args.iters or 20, scale=args.iters is None) for s in sizes}
    timeout = args.timeout
    tools = {"jbps": None, "mpi": None, "gloo": None}
    errors: dict[str, str] = {}

    log.info(
        "sizes %s, timed calls %s, warm-up %d",
        ", ".join(map(format_size, sizes)),
        ", ".join(str(iters[s]) for s in sizes),
        args.warmup,
    )
    tree_sizes = (
        []
        if args.skip_small_tensors
        else tree_leaf_sizes(args.tree_leaves, args.tree_min, args.tree_max, args.tree_seed)
    )
    tree_iters = args.iters or 20
    cases = ["--out-of-place"]  # the latency section's out-of-place columns at these sizes
    if tree_sizes:
        cases += ["--tree-sizes", ",".join(map(str, tree_sizes)), "--tree-iters", str(tree_iters)]
    if not args.skip_memory:
        cases += [
            "--memory",
            f"{args.memory_bytes},{args.memory_peak_rounds},{args.memory_round_bytes},{args.memory_rounds}",
        ]
    t0 = time.monotonic()
    log.info(
        "jbps psum%s ...",
        "".join(
            f", {c}"
            for c, skip in (("many small tensors", args.skip_small_tensors), ("memory", args.skip_memory))
            if not skip
        ),
    )
    try:
        tools["jbps"] = run_jbps(sizes, iters, args.warmup, args.workers, args.servers, timeout, cases)
    except (RuntimeError, TimeoutError) as exc:
        log.error("jbps psum failed: %s", exc)
        errors["jbps"] = str(exc)
    if not args.skip_peers:
        if args.workers != peers.NUM_PROCESSES:
            log.warning(
                "peers always run %d processes; jbps runs %d workers, so the ratios compare different jobs",
                peers.NUM_PROCESSES,
                args.workers,
            )
        for key, runner in (
            ("mpi", functools.partial(peers.run_mpi_allreduce, out_of_place=True)),
            ("gloo", peers.run_gloo_psum),
        ):
            log.info("%s ...", key)
            try:
                tools[key] = run_peer(runner, sizes, iters, args.warmup, timeout, tree_sizes, tree_iters)
                if tools[key] is None:
                    log.info("%s skipped: not installed", key)
            except (RuntimeError, TimeoutError) as exc:
                log.error("%s failed: %s", key, exc)
                errors[key] = str(exc)
    priority = None
    if not args.skip_priority:
        log.info("priority case: %s, credits %s ...", args.priority_model, args.credits)
        try:
            priority = run_priority(
                args.priority_model, args.credits, args.iters or 5, args.warmup, args.workers, args.servers, timeout
            )
        except (RuntimeError, TimeoutError) as exc:
            log.error("priority case failed: %s", exc)
            errors["priority"] = str(exc)
    sweep = None
    if not args.skip_latency:
        log.info("latency sweep: %s ...", ", ".join(map(format_size, args.latency_sizes)))
        sweep_iters = {s: iters_for(s, args.iters or 20, scale=args.iters is None) for s in args.latency_sizes}
        sweep = latency.run_sweep(
            args.latency_sizes,
            sweep_iters,
            args.warmup,
            args.workers,
            args.servers,
            timeout,
            run_jbps,
            run_peer,
            with_peers=not args.skip_peers,
        )
    log.info("summation kernels on %s ...", format_size(sizes[-1]))
    kernel = bench_summation(sizes[-1])
    log.info("done in %.0f s", time.monotonic() - t0)

    # The small-tensor and memory results travel in the tools' reports; the document keeps them
    # apart, each under the name of its case.
    small_tensors = None
    if tree_sizes:
        small_tensors = {
            "leaves": len(tree_sizes),
            "distribution": "log-uniform",
            "min_bytes": args.tree_min,
            "max_bytes": args.tree_max,
            "seed": args.tree_seed,
            "bytes": sum(tree_sizes),
            "iters": tree_iters,
            **{key: tools[key].pop("small_tensors", None) if tools[key] else None for key in tools},
            "leaf_bytes": tree_sizes,
        }
    memory = tools["jbps"].pop("memory", None) if tools["jbps"] else None
    doc = {
        "config": {
            "sizes": sizes,
            "iters": {str(s): iters[s] for s in sizes},
            "warmup": args.warmup,
            "workers": args.workers,
            "servers": args.servers,
            "peer_processes": peers.NUM_PROCESSES,
            "skip_peers": args.skip_peers,
            "skip_small_tensors": args.skip_small_tensors,
            "skip_memory": args.skip_memory,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "jax": _version("jax"),
            "numpy": np.__version__,
        },
        "tools": tools,
        "rows": make_rows(sizes, tools),
        "kernel": kernel,
        "priority": priority,
        "small_tensors": small_tensors,
        "memory": memory,
        "latency": latency.summarize(sweep, tools),
        "errors": errors,
    }
    doc["goals"] = make_goals(doc)
    if args.json:
        print(json.dumps(_json_ready(doc), indent=2))
    else:
        print(format_table(doc))
    if args.plot:
        plot(doc, args.plot)
        log.info("plot written to %s", args.plot)
    return 1 if errors or doc["latency"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
