"""`jbps plan`: what jbps would send where for a model, and how long it takes.

    jbps plan resnet50 --workers 4 --cpu-servers 0-4 --bandwidth 100
    jbps plan my_model.json --workers 8 --cpu-servers 0,2,8 --json
    jbps plan bert-base --plot split.png

For each k (CPU-only machines, one dedicated server each; every worker
machine also runs one colocated server) it plans the model's gradient as a
psum would (same chunking, keys and byte-balanced routing), and predicts one
push-pull's time from the busiest NIC: for jbps's actual routing, for the
optimal-split formula, for ring all-reduce and for a plain PS on the k CPU
machines.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys

import numpy as np

from . import defaults
from .assign import COLOCATED, DEDICATED, server_fractions
from .models import BUILTIN_MODELS, builtin_model, load_model_spec
from .plan import make_plan
from .rated_split import parse_host_rates, rated_split, worthwhile_split
from .split import allreduce_time_s, optimal_split
from .traffic import nic_bytes, standard_placement
from ..sizes import format_bytes, format_rate, parse_bytes

log = logging.getLogger("jbps.plan")
MiB = 2**20


def _counts(text: str) -> list[int]:
    """'0-4' or '0,2,8' -> [0, 1, 2, 3, 4] / [0, 2, 8]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 0-4 or 0,2,8") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: counts must be non-negative")
    return sorted(set(out))


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) if kind is parse_bytes else f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value

    return parse


def load_model(model: str) -> tuple[list[str], list[tuple[int, ...]], list[str]]:
    if model in BUILTIN_MODELS:
        spec = [(name, shape, "float32") for name, shape in builtin_model(model)]
    elif os.path.exists(model):
        spec = load_model_spec(model)
    else:
        raise ValueError(f"{model!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a spec file")
    names, shapes, dtypes = zip(*spec)
    return list(names), list(shapes), list(dtypes)


def plan_rows(
    model: str,
    workers: int,
    cpu_servers: list[int],
    bandwidth_gbit: float,
    partition_bytes: int | None,
    local_devices: int,
    host_rates: dict[int, float] | None = None,
) -> dict:
    """partition_bytes None: for each k, the chunk size jbps picks for this
    model's psum across hosts with NICs of this bandwidth (jbps/partition/defaults.py;
    jbps.init measures the rate it uses). host_rates: machines whose NIC differs,
    {machine: bits/s} (rated_split.parse_host_rates): the split and every time
    then follow each machine's own rate."""
    names, shapes, dtypes = load_model(model)
    bandwidth = bandwidth_gbit * 1e9 / 8  # bytes per second
    host_rates = host_rates or {}
    tree_bytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes))
    rows = []
    for k in cpu_servers:
        roles = [COLOCATED] * workers + [DEDICATED] * k
        rates = [host_rates.get(m, bandwidth * 8) / 8 for m in range(workers + k)]  # bytes/s, machine by machine
        rated = any(r != bandwidth for r in rates)
        fractions = worthwhile_split(roles, rates, workers).fractions if rated else server_fractions(roles, workers)
        chunk = partition_bytes or defaults.partition_bytes(
            tree_bytes, fractions, across_hosts=True, link_bytes_per_s=bandwidth
        )
        plan = make_plan(
            model,
            names,
            shapes,
            [np.dtype(d) for d in dtypes],
            local_devices,
            partition_bytes=chunk,
            ramp=True,  # across hosts, as jbps cuts it there
            server_fractions=fractions,
        )
        per_server = plan.server_bytes(len(roles))
        model_bytes = sum(per_server)
        split = optimal_split(workers, k)
        rows.append(
            {
                "k": k,
                "partition_bytes": chunk,
                "chunks": len(plan.chunk_servers),
                "model_bytes": model_bytes,
                "x": split.cpu_fraction,
                "y": split.colocated_fraction,
                "colocated_bytes": per_server[:workers],
                "dedicated_bytes": per_server[workers:],
                "target_bytes": [f * model_bytes for f in fractions],
                "jbps_s": max(
                    nbytes / rates[m]
                    for m, nbytes in nic_bytes(workers, standard_placement(workers, k), per_server).items()
                ),
                "formula_s": (
                    rated_split(roles, rates, workers).time_s(model_bytes)
                    if rated
                    else split.time_s(model_bytes, bandwidth)
                ),
                # The ring waits for its slowest link; a plain PS for its busiest machine.
                "allreduce_s": allreduce_time_s(workers, model_bytes, min(rates[:workers])),
                "ps_s": (
                    max(model_bytes / min(rates[:workers]), max(workers * model_bytes / k / r for r in rates[workers:]))
                    if k
                    else None
                ),
            }
        )
    return {
        "model": model,
        "workers": workers,
        "bandwidth_gbit": bandwidth_gbit,
        "partition_bytes": partition_bytes,
        "local_devices": local_devices,
        "host_rates_bits_per_s": {str(m): r for m, r in sorted(host_rates.items())},
        "rows": rows,
    }


def _span(values: list[int]) -> str:
    if not values:
        return "-"
    lo, hi = min(values) / MiB, max(values) / MiB
    return f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}"


def _partition(report: dict) -> str:
    if report["partition_bytes"] is not None:
        return f"chunks of at most {format_bytes(report['partition_bytes'])} (--partition-bytes)"
    sizes = sorted({r["partition_bytes"] for r in report["rows"]})
    if len(sizes) == 1:
        return f"chunks of at most {format_bytes(sizes[0])} (jbps's default across hosts)"
    return (
        f"chunks of at most {format_bytes(sizes[0])} to {format_bytes(sizes[-1])} (jbps's default across hosts, by k)"
    )


def format_table(report: dict) -> str:
    rows = report["rows"]
    header = (
        f"{report['model']}: {rows[0]['model_bytes'] / MiB:.1f} MiB of gradient per worker, "
        f"n = {report['workers']} workers, {report['bandwidth_gbit']:g} Gbit/s per NIC, "
        f"{_partition(report)}, {report['local_devices']} local device(s)"
    )
    rated = report.get("host_rates_bits_per_s")
    if rated:
        header += "; machines at other rates: " + ", ".join(
            f"{_machine(int(m), report['workers'])} {format_rate(r)}" for m, r in rated.items()
        )
    cols = [
        "k",
        "chunks",
        "x",
        "y",
        "colocated MiB each",
        "dedicated MiB each",
        "jbps ms",
        "optimum ms" if rated else "formula ms",
        "all-reduce ms",
        "PS ms",
        "all-reduce/jbps",
    ]
    table = []
    for r in rows:
        table.append(
            [
                str(r["k"]),
                str(r["chunks"]),
                "-" if rated or not r["k"] else f"{r['x']:.4f}",
                "-" if rated else f"{r['y']:.4f}",
                _span(r["colocated_bytes"]),
                _span(r["dedicated_bytes"]),
                f"{r['jbps_s'] * 1e3:.2f}",
                f"{r['formula_s'] * 1e3:.2f}",
                f"{r['allreduce_s'] * 1e3:.2f}",
                "-" if r["ps_s"] is None else f"{r['ps_s'] * 1e3:.2f}",
                f"{r['allreduce_s'] / r['jbps_s']:.2f}x" if r["jbps_s"] else "-",
            ]
        )
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
    lines = [header, "  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table]
    if rated:
        lines.append(
            "jbps: the busiest NIC's time under the plan's routing; optimum: the least time on these links "
            "(docs/design.md, links of different rates); all-reduce and PS wait for their slowest link"
        )
    else:
        lines.append(
            "jbps: busiest NIC under the plan's actual routing; formula: T = 2n(n-1)M / ((n^2+kn-2k)B) "
            "(k <= n), max(M, nM/k)/B (k > n); x, y: byte share of each dedicated / colocated server"
        )
    return "\n".join(lines)


def _machine(m: int, workers: int) -> str:
    return f"w{m}" if m < workers else f"s{m - workers}"


def plot(report: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    ks = [r["k"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    ax.plot(ks, [r["jbps_s"] * 1e3 for r in rows], "o-", label="jbps (planned routing)")
    ax.plot(ks, [r["formula_s"] * 1e3 for r in rows], "--", label="optimal-split formula")
    ax.plot(ks, [r["allreduce_s"] * 1e3 for r in rows], "s-", label="all-reduce")
    ax.plot(ks, [np.nan if r["ps_s"] is None else r["ps_s"] * 1e3 for r in rows], "^-", label="plain PS")
    ax.set_xticks(ks)
    ax.set_xlabel("k (CPU-only machines)")
    ax.set_ylabel("communication time per step (ms)")
    ax.set_title(f"{report['model']}, n = {report['workers']}, {report['bandwidth_gbit']:g} Gbit/s")
    shown = [v for r in rows for v in (r["jbps_s"], r["formula_s"], r["allreduce_s"], r["ps_s"]) if v is not None]
    ax.set_ylim(0, max(shown) * 1e3 * 1.12)  # no point at the top cut
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # beside the data, never on it
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return fig


def main(argv=None, prog: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(
        prog=prog or "python -m jbps.partition",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        help=f"a built-in model ({', '.join(BUILTIN_MODELS)}) or a JSON spec file: "
        '{"name": [shape...]} or [{"name", "shape", "dtype"}]',
    )
    p.add_argument("--workers", "-n", type=_positive(int), default=4, help="worker machines n (default 4)")
    p.add_argument(
        "--cpu-servers",
        "-k",
        type=_counts,
        default=None,
        help="CPU-only machines k: a range 0-4 or a list 0,2,8 (default 0..n)",
    )
    p.add_argument("--bandwidth", type=_positive(float), default=100.0, help="Gbit/s per NIC (default 100)")
    p.add_argument(
        "--partition-bytes",
        type=_positive(parse_bytes),
        default=None,
        help="chunk size: bytes, or e.g. 4M (default: what jbps picks across hosts for this "
        "model, k and bandwidth, jbps/partition/defaults.py)",
    )
    p.add_argument(
        "--local-devices",
        type=_positive(int),
        default=1,
        help="devices per worker: each tensor is split into this many shards (default 1)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--rates",
        default="",
        help="machines whose NIC differs from --bandwidth: w<i>=RATE (worker machine i), s<j>=RATE (CPU machine j), "
        "bits/s: e.g. s1=400M,w0=800M; the split and the times then follow each machine's rate",
    )
    p.add_argument("--plot", metavar="PNG", help="draw time vs k into this file (needs matplotlib)")
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    ks = args.cpu_servers if args.cpu_servers is not None else list(range(args.workers + 1))
    try:
        host_rates = parse_host_rates(args.rates, args.workers, max(ks))
    except ValueError as exc:
        p.error(f"--rates: {exc}")
    try:
        report = plan_rows(
            args.model, args.workers, ks, args.bandwidth, args.partition_bytes, args.local_devices, host_rates
        )
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps(report) if args.json else format_table(report))
    if args.plot:
        plot(report, args.plot)
        log.info("wrote %s", args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
