"""jbps against all-reduce across emulated hosts: time per psum vs CPU-only machines.

    python -m benchmarks.network [--workers 4] [--cpu-hosts 0-4] [--size 32M] [--rate 1G]
                                 [--iters 8] [--warmup 2] [--partition 4M,256K] [--credit 8]
                                 [--compression bf16,fp16,onebit] [--skip-peers] [--json] [--plot out.png]
                                 [--trace-dir DIR] [--rates s1=400M] [--change w0=400M@10]
    python -m benchmarks.network ...                       (the same)

Needs root: every host is a network namespace on this machine (jbps.emulated_network),
each NIC capped at --rate in each direction. n worker hosts each run one worker and a
colocated summation server; k CPU-only hosts run one dedicated server each; the job
starts through the DMLC_* scheduler bootstrap, as on a real cluster. For each k it
times jbps.psum of --size float32 bytes per worker (in place, every result checked),
and, once on the worker hosts, JAX's own psum over gloo (jax.distributed) and MPICH's
Allreduce over TCP (mpi4py), every result checked too. Each time is the median over
--iters calls of the slowest process. Next to each: the time the optimal split
predicts, T = 2n(n-1)M / ((n² + kn - 2k)B) (docs/design.md), and the ratios.

--partition and --credit (comma lists) add jbps runs with those settings beside the
defaults, to compare; --compression bf16,fp16,onebit adds a column per compressor (16-bit
floats, or onebit records with error feedback: jbps/ops/compression.py, onebit.py; the
residuals go in and come out of every call, as a training step's optimizer state).
Progress goes to stderr; the table (or --json) to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .emulated_job import JobFailed, job_free_env, python_env, run_job
from .emulated_network import MPI_TCP_ENV, EmulatedNetwork, NetworkError, format_rate, parse_rate
from jbps.partition import COLOCATED, DEDICATED
from jbps.partition.rated_split import parse_host_rates, rated_split
from jbps.partition.split import allreduce_time_s, optimal_split
from jbps.procs import terminate
from . import cpu_load
from .plotting import finish
from .rate_change import applied_during, calls_to_follow, parse_change, slow_after
from .report import parse_report

log = logging.getLogger("benchmarks.network")

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str, multiple: int = 4) -> int:
    """'32M' -> 33554432 (binary units); a plain number is bytes; a positive multiple of
    `multiple` (4: whole float32 elements)."""
    import re

    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 256K, 32M or 1G")
    nbytes = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if nbytes < multiple or nbytes % multiple:
        what = "a positive multiple of 4 bytes (float32)" if multiple == 4 else "positive"
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be {what}")
    return nbytes


def parse_range(text: str) -> list[int]:
    """'0-4' -> [0, 1, 2, 3, 4]; '0,2,4' -> [0, 2, 4]."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            out.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of counts like 0-4 or 0,2,4") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: counts must be 0 or more")
    return sorted(out)


def parse_rate_arg(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def parse_args(argv=None, prog=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog or "python -m benchmarks.network",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=4, help="worker hosts, n (default 4)")
    p.add_argument(
        "--cpu-hosts",
        type=parse_range,
        default=parse_range("0-4"),
        help="CPU-only hosts k to try, a range or list (default 0-4)",
    )
    p.add_argument(
        "--size",
        type=parse_bytes,
        default=parse_bytes("32M"),
        help="float32 bytes each worker sums, K/M/G = KiB/MiB/GiB (default 32M)",
    )
    p.add_argument(
        "--rate",
        type=parse_rate_arg,
        default=parse_rate("1G"),
        help="each NIC's rate in each direction: 1G, 200M, 2.5G (bits/s; default 1G)",
    )
    p.add_argument(
        "--rates",
        default="",
        help="hosts whose NIC differs from --rate: w<i>=RATE for worker host i, s<j>=RATE for CPU host j "
        "(e.g. s1=400M,w0=800M); the table then holds the optimum for those links (partition/rated_split.py)",
    )
    p.add_argument(
        "--change",
        default="",
        help="one host's rate changes mid-run in every jbps run: HOST=RATE@CALL, e.g. w0=400M@10 (before timed "
        "call 10; hosts named as in --rates); the table then follows the calls after it (rate_change.py)",
    )
    p.add_argument("--iters", type=int, default=8, help="timed calls per case (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    p.add_argument(
        "--partition",
        default="",
        help="comma list of partition sizes (e.g. 256K,1M): extra jbps runs beside the defaults",
    )
    p.add_argument(
        "--credit",
        default="",
        help="comma list of credit windows (chunks in flight): extra jbps runs beside the defaults",
    )
    p.add_argument(
        "--compression",
        default="",
        help="comma list of compressions (bf16, fp16, onebit, topk, topk:FRACTION): extra jbps runs beside the defaults",
    )
    p.add_argument("--skip-peers", action="store_true", help="do not run gloo and MPI")
    p.add_argument("--timeout", type=float, default=600, help="seconds any one job may take (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--plot", metavar="PNG", help="draw time vs k with the formula and the peers (needs matplotlib)")
    p.add_argument(
        "--trace-dir",
        metavar="DIR",
        help="keep the jbps workers' chunk timelines in DIR/k<k>/<variant>/<rank>/comm.json",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log every step")
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error("--workers must be at least 2 (one worker sends nothing over the network)")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")
    try:
        partitions = [parse_bytes(s, multiple=1) for s in args.partition.split(",") if s.strip()]
        credits = [int(s) for s in args.credit.split(",") if s.strip()]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        p.error(f"--partition/--credit: {exc}")
    if any(c < 1 for c in credits):
        p.error("--credit values must be at least 1")
    compressions = [c.strip() for c in args.compression.split(",") if c.strip()]
    # topk:FRACTION's fraction is checked by the workers (jbps/ops/compression.py: no jax here).
    bad = [c for c in compressions if c not in ("bf16", "fp16", "onebit", "topk") and not c.startswith("topk:")]
    if bad:
        p.error(f"--compression: {bad[0]!r} is not bf16, fp16, onebit, topk or topk:FRACTION")
    args.variants = variants(partitions, credits, compressions)
    try:
        args.host_rates = parse_host_rates(args.rates, args.workers, max(args.cpu_hosts))
    except ValueError as exc:
        p.error(f"--rates: {exc}")
    try:
        args.rate_change = (
            parse_change(args.change, args.workers, max(args.cpu_hosts), args.iters) if args.change.strip() else None
        )
    except ValueError as exc:
        p.error(f"--change: {exc}")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib: pip install matplotlib")
    return args


def optimum_s(n: int, k: int, size: int, rate: float, host_rates: dict[int, float]) -> float:
    """The least time a psum of `size` per worker can take on these links: split.py's
    formula on equal links, else rated_split's optimum for the hosts' own rates."""
    if not any(host < n + k for host in host_rates):
        return optimal_split(n, k).time_s(size, rate / 8)
    roles = [COLOCATED] * n + [DEDICATED] * k
    rates = [host_rates.get(h, rate) / 8 for h in range(n + k)]
    return rated_split(roles, rates, n).time_s(size)


def variants(partitions: list[int], credits: list[int], compressions: list[str] = ()) -> list[dict]:
    """The jbps settings to run: the defaults, each compression, then each combination asked for."""
    out = [{"name": "defaults", "env": {}}]
    out += [{"name": f"compression {c}", "env": {}, "args": ["--compression", c]} for c in compressions]
    for part in partitions or [None]:
        for credit in credits or [None]:
            if part is None and credit is None:
                continue
            env, words = {}, []
            if part is not None:
                env["JBPS_PARTITION_BYTES"] = str(part)
                words.append(f"partition {format_size(part)}")
            if credit is not None:
                env["JBPS_SCHEDULING_CREDIT"] = str(credit)
                words.append(f"credit {credit}")
            out.append({"name": ", ".join(words), "env": env})
    return out


def bench_jbps(net: EmulatedNetwork, n: int, k: int, args, variant: dict) -> dict:
    env = job_free_env(**variant["env"])
    if args.trace_dir:
        tag = variant["name"].replace(" ", "").replace(",", "_")
        env["JBPS_TRACE_DIR"] = str(Path(args.trace_dir).resolve() / f"k{k}" / tag)
    argv = [
        "-m",
        "benchmarks.jbps_worker",
        "--sizes",
        str(args.size),
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--cpu",
        *variant.get("args", []),
    ]
    change = args.rate_change
    with contextlib.ExitStack() as during:
        if change is not None:
            pause_file = Path(during.enter_context(tempfile.TemporaryDirectory(prefix="jbps-rate-change-"))) / "pause"
            argv += ["--pause-at", str(change.at_call), "--pause-file", str(pause_file)]
            during.enter_context(applied_during(net, change, pause_file, log.info))
        result = run_job(net, list(range(n)), list(range(n + k)), argv, env=env, timeout_s=args.timeout)
    report = parse_report(result.workers[0].stdout, "jbps worker 0")
    timing = report["results"][args.size]
    by_address = result.servers_by_address()
    received = {s["host"]: s["bytes_received"] for s in by_address.values()}
    # What worker 0's psums pushed to each server (init's link probes left out): the split.
    stats = report["engine_stats"]  # jbps_worker always reports them
    pushed = [a - b for a, b in zip(stats["after"]["server_bytes_pushed"], stats["before"]["server_bytes_pushed"])]
    hosts = [by_address[a]["host"] if a in by_address else a for a in report.get("servers", [])]
    return {
        "median_s": timing["median_s"],
        "min_s": timing["min_s"],
        "iters": timing["iters"],
        "per_call_s": timing.get("per_call_s"),
        "server_answer_rates": timing.get("server_answer_rates"),
        "replans": timing.get("replans"),
        "server_hosts": hosts,  # the servers' hosts, in the order the engine lists them
        "server_mib_received": {str(h): (b or 0) / 2**20 for h, b in sorted(received.items())},
        "psum_mib_pushed": {str(h): float(b) / 2**20 for h, b in sorted(zip(hosts, pushed))},
        "engine_per_call": timing.get("engine_per_call", {}),
        "cpu": timing.get("cpu"),
        # What the defaults chose: the rate jbps.init measured, and the chunk it led to.
        "link_bytes_per_s": report.get("link_bytes_per_s"),
        "link_probes": report.get("link_probes"),
        "partition_bytes": timing.get("partition_bytes"),
        "server_rates_bytes_per_s": report.get("server_rates_bytes_per_s"),
        "server_fractions": report.get("server_fractions"),
    }


def bench_gloo(net: EmulatedNetwork, n: int, args) -> dict:
    coordinator = f"{net.hosts[0].address}:{random.randint(20000, 60000)}"
    env = python_env(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip(),
    )
    procs, files = [], []
    try:
        for i in range(n):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(
                net.run(
                    i,
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.gloo_peer",
                        "--coordinator",
                        coordinator,
                        "--num-processes",
                        str(n),
                        "--process-id",
                        str(i),
                        "--sizes",
                        str(args.size),
                        "--iters",
                        str(args.iters),
                        "--warmup",
                        str(args.warmup),
                        "--cpu",
                    ],
                    env=env,
                    stdout=out,
                    stderr=err,
                )
            )
        _wait_all(procs, files, args.timeout, "gloo psum")
        files[0][0].seek(0)
        return parse_report(files[0][0].read(), "gloo peer")["results"][args.size]
    finally:
        terminate(procs, 0.0, "gloo peer")
        for out, err in files:
            out.close()
            err.close()


def bench_mpi(net: EmulatedNetwork, n: int, args) -> dict | None:
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        log.warning("mpi4py is not installed: no MPI column (pip install 'jbps[bench]')")
        return None
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not os.access(mpiexec, os.X_OK):
        log.warning("no mpiexec beside %s: no MPI column", sys.executable)
        return None
    with tempfile.TemporaryDirectory(prefix="jbps-mpi-") as tmp:
        cmd = [
            *net.mpiexec(str(mpiexec), tmp, {i: 1 for i in range(n)}),
            "-n",
            str(n),
            sys.executable,
            "-m",
            "benchmarks.mpi_peer",
            "--sizes",
            str(args.size),
            "--iters",
            str(args.iters),
            "--warmup",
            str(args.warmup),
            "--cpu",
        ]
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = net.run(0, cmd, env=python_env(**MPI_TCP_ENV), stdout=out, stderr=err, cwd=tmp)
            try:
                _wait_all([proc], [(out, err)], args.timeout, "MPI Allreduce", grace_s=3.0)
            finally:
                terminate([proc], 3.0, "mpiexec")
            out.seek(0)
            return parse_report(out.read(), "MPI peer")["results"][args.size]


# The link check: every host streams to the next (a ring, so every NIC sends and
# receives at once) for a few seconds with plain TCP.
_SINK = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
conn, _ = server.accept()
got, start = 0, None
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    start = start or time.monotonic()
    got += len(data)
print(got / (time.monotonic() - start) if start else 0.0)
"""
_SOURCE = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
data, end = bytes(1 << 20), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    conn.sendall(data)
conn.close()
"""
LINK_CHECK_S = 3.0
LINK_CHECK_MACHINE_BOUND = 0.90
LINK_CHECK_PORT = 5399


def link_check(net: EmulatedNetwork, hosts: int, seconds: float = LINK_CHECK_S) -> dict:
    """What plain TCP gets through every emulated link at once, as a share of the cap, and
    how busy the machine's CPUs were. TCP/IP headers take ~4.4% at MTU 1500; well below
    that ceiling the machine, not the links, is the limit at this rate and host count."""
    sinks = [
        net.run(i, [sys.executable, "-c", _SINK, net.hosts[i].address, str(LINK_CHECK_PORT)], stdout=subprocess.PIPE)
        for i in range(hosts)
    ]
    time.sleep(0.5)
    before = cpu_load.sample()
    sources = [
        net.run(
            i, [sys.executable, "-c", _SOURCE, net.hosts[(i + 1) % hosts].address, str(LINK_CHECK_PORT), str(seconds)]
        )
        for i in range(hosts)
    ]
    try:
        for p in sources:
            p.wait(timeout=seconds + 30)
        after = cpu_load.sample()
        rates = [float(p.communicate(timeout=30)[0] or 0) for p in sinks]
    finally:
        terminate(sinks + sources, 0.0, "link check")
    # Host i receives from host i - 1: its cap is the slower of the two NICs.
    shares = [r * 8 / min(net.rate_of(i), net.rate_of((i - 1) % hosts)) for i, r in enumerate(rates)]
    return {
        "hosts": hosts,
        "share_of_cap_min": min(shares),
        "share_of_cap_mean": sum(shares) / len(shares),
        "cpu_busy": cpu_load.between(before, after)["busy_share"],
    }


def _wait_all(procs, files, timeout_s, what, grace_s=0.0):
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        bad = [i for i, rc in enumerate(codes) if rc not in (None, 0)]
        if bad or time.monotonic() > deadline:
            err = files[bad[0] if bad else 0][1]
            err.seek(0)
            why = f"process {bad[0]} exited with {codes[bad[0]]}" if bad else f"timed out after {timeout_s:g} s"
            raise RuntimeError(f"{what}: {why}; stderr:\n{err.read()[-3000:]}")
        if all(rc == 0 for rc in codes):
            return
        time.sleep(0.05)


def run(args) -> dict:
    n, ks = args.workers, args.cpu_hosts
    bandwidth = args.rate / 8
    doc = {
        "workers": n,
        "bytes": args.size,
        "rate_bits_per_s": args.rate,
        "iters": args.iters,
        "variants": [v["name"] for v in args.variants],
        "cases": [],
        "peers": {},
    }
    doc["host_rates_bits_per_s"] = {str(h): r for h, r in sorted(args.host_rates.items())}
    change = args.rate_change
    if change is not None:
        doc["rate_change"] = {"host": change.host, "rate_bits_per_s": change.rate, "at_call": change.at_call}
    with EmulatedNetwork(n + max(ks), args.rate, host_rates=args.host_rates) as net:
        log.info("%d emulated hosts at %s; link check ...", len(net.hosts), format_rate(args.rate))
        doc["link_check"] = link_check(net, len(net.hosts))
        for k in ks:
            case = {"k": k, "formula_s": optimum_s(n, k, args.size, args.rate, args.host_rates), "jbps": {}}
            if change is not None:
                after = {**args.host_rates, change.host: change.rate}
                case["optimum_after_change_s"] = optimum_s(n, k, args.size, args.rate, after)
            for v in args.variants:
                log.info("jbps, k = %d, %s ...", k, v["name"])
                try:
                    case["jbps"][v["name"]] = bench_jbps(net, n, k, args, v)
                except JobFailed as exc:
                    raise RuntimeError(f"jbps with k = {k} ({v['name']}) failed: {exc}") from None
            if change is not None:  # None: not within 1.10x of the new optimum by the last call
                case["calls_to_follow"] = calls_to_follow(
                    case["jbps"]["defaults"]["per_call_s"], change.at_call, case["optimum_after_change_s"]
                )
            doc["cases"].append(case)
        if not args.skip_peers:
            doc["allreduce_ideal_s"] = allreduce_time_s(n, args.size, bandwidth)
            log.info("JAX gloo psum ...")
            doc["peers"]["gloo"] = bench_gloo(net, n, args)
            log.info("MPI Allreduce ...")
            mpi = bench_mpi(net, n, args)
            if mpi is not None:
                doc["peers"]["mpi"] = mpi
    doc["goals"] = goals(doc)
    return doc


def goals(doc: dict) -> list[dict]:
    """The targets jbps is held to here, each with its measured ratio (defaults only)."""
    out = []
    cases = {c["k"]: c for c in doc["cases"]}
    for k, c in cases.items():
        out.append(
            {
                "what": f"jbps / formula, k = {k}",
                "ratio": c["jbps"]["defaults"]["median_s"] / c["formula_s"],
                "target": "<= 1.10",
            }
        )
        out += compression_goals(k, c["jbps"])
        if "calls_to_follow" in c:
            follow = c["calls_to_follow"]
            out.append(
                {
                    "what": f"calls after the rate change until within 1.10x its optimum, k = {k}",
                    "ratio": None if follow is None else float(follow),
                    "target": "<= 5",
                }
            )
    gloo = doc["peers"].get("gloo")
    if gloo:
        n = doc["workers"]
        if n in cases:
            out.append(
                {
                    "what": f"gloo / jbps, k = {n}",
                    "ratio": gloo["median_s"] / cases[n]["jbps"]["defaults"]["median_s"],
                    "target": ">= 1.35",
                }
            )
        if 0 in cases:
            out.append(
                {
                    "what": "jbps / gloo, k = 0",
                    "ratio": cases[0]["jbps"]["defaults"]["median_s"] / gloo["median_s"],
                    "target": "<= 1.00",
                }
            )
    return out


# A compressed psum's time over float32's in the same run, at most (the compression issue's
# goals; topk as its default keeps 1%).
COMPRESSION_TARGETS = {"fp16": 0.55, "bf16": 0.55, "onebit": 0.10, "topk": 0.10}


def compression_goals(k: int, results: dict) -> list[dict]:
    """Each compressed variant of `results` (one k's jbps runs) against float32 (defaults), with the
    shortest time this machine's CPU allows it: its CPU time per psum spread over every core,
    over float32's time. Where that floor is above the target, the CPUs, not jbps's schedule or the
    links, stop the target here (every emulated host shares them)."""
    base = results.get("defaults")
    out = []
    for name, r in results.items():
        codec = name.removeprefix("compression ")
        if name == codec or codec not in COMPRESSION_TARGETS or not base:
            continue
        cpu = r.get("cpu")
        out.append(
            {
                "what": f"jbps {codec} / float32, k = {k}",
                "ratio": r["median_s"] / base["median_s"],
                "target": f"<= {COMPRESSION_TARGETS[codec]:.2f}",
                "cpu_floor": cpu["busy_core_s"] / cpu["cores"] / base["median_s"] if cpu else None,
            }
        )
    return out


def format_table(doc: dict) -> str:
    n, names = doc["workers"], doc["variants"]
    gloo, mpi = doc["peers"].get("gloo"), doc["peers"].get("mpi")
    lines = [
        f"jbps.psum across emulated hosts: {n} worker hosts (each with a colocated server) + k CPU hosts, "
        f"{format_rate(doc['rate_bits_per_s'])} each way per NIC, {format_size(doc['bytes'])} float32 per worker, "
        f"median of {doc['iters']} calls (slowest process)",
        "",
    ]
    rated = bool(doc.get("host_rates_bits_per_s"))
    if rated:
        lines.insert(
            1,
            "hosts at other rates: "
            + ", ".join(f"host {h} {format_rate(r)}" for h, r in doc["host_rates_bits_per_s"].items())
            + " (hosts 0..n-1 are the worker hosts, then the CPU hosts)",
        )
    head = ["k", "optimum" if rated else "formula"] + [f"jbps {v}" for v in names]
    if gloo:
        head += ["gloo / jbps"]
    rows = []
    for c in doc["cases"]:
        row = [str(c["k"]), f"{c['formula_s']:.3f} s"]
        for v in names:
            t = c["jbps"][v]["median_s"]
            row.append(f"{t:.3f} s ({t / c['formula_s']:.2f}x)")
        if gloo:
            row.append(f"{gloo['median_s'] / c['jbps']['defaults']['median_s']:.2f}")
        rows.append(row)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    lines.append(
        "(jbps: time per psum, and its ratio to "
        + ("the optimum for these links: partition/rated_split.py)" if rated else "the formula)")
    )
    for c in doc["cases"]:
        d = c["jbps"].get("defaults", {})
        if rated and d.get("server_rates_bytes_per_s"):
            lines.append(
                f"k = {c['k']}: servers' links as jbps.init measured them "
                + ", ".join(format_rate(8 * r) for r in d["server_rates_bytes_per_s"])
                + "; shares "
                + ", ".join(f"{f:.3f}" for f in d["server_fractions"])
            )
    lines += _change_lines(doc)
    lines += _replan_lines(doc)
    chosen = [(c["k"], c["jbps"]["defaults"]) for c in doc["cases"] if "defaults" in c["jbps"]]
    if any(d.get("link_bytes_per_s") for _, d in chosen):
        lines.append(
            "jbps defaults: the busiest link as jbps.init measured it, and the chunk size chosen: "
            + ", ".join(
                f"k = {k}: {format_rate(8 * d['link_bytes_per_s'])}, {format_size(d['partition_bytes'])}"
                for k, d in chosen
                if d.get("link_bytes_per_s") and d.get("partition_bytes")
            )
        )
    check = doc.get("link_check")
    if check:
        lines.append(
            f"Link check: plain TCP through all {check['hosts']} hosts' links at once carried "
            f"{check['share_of_cap_mean']:.2f} of the cap (slowest link {check['share_of_cap_min']:.2f}; "
            f"TCP/IP headers leave at most ~0.95 at MTU 1500) with the CPUs {check['cpu_busy']:.0%} busy"
            + (
                "; below 0.90 this machine, not the links, limits every tool at this rate"
                if check["share_of_cap_min"] < LINK_CHECK_MACHINE_BOUND
                else ""
            )
        )
    if gloo or mpi:
        lines.append("")
        ideal = doc.get("allreduce_ideal_s")
        for label, peer in (("JAX gloo psum", gloo), ("MPI Allreduce (MPICH, TCP)", mpi)):
            if peer:
                lines.append(
                    f"{label}: {peer['median_s']:.3f} s ({peer['median_s'] / ideal:.2f}x the ring all-reduce "
                    f"ideal {ideal:.3f} s)"
                )
    cpu_lines = [f"  jbps {v}, k = {c['k']}: {_cpu_text(c['jbps'][v].get('cpu'))}" for c in doc["cases"] for v in names]
    cpu_lines += [f"  {label}: {_cpu_text(peer.get('cpu'))}" for label, peer in (("gloo", gloo), ("MPI", mpi)) if peer]
    lines.append("")
    lines.append(
        "The machine's CPU time per psum (every emulated host shares its cores; core-ms, "
        "user + kernel + interrupts) and how busy its cores were during the calls:"
    )
    lines += cpu_lines
    lines.append("")
    lines.append(
        "Bytes each server received over the whole run, init's link probes included "
        "(MiB, by host; hosts < n are worker hosts):"
    )
    for c in doc["cases"]:
        got = c["jbps"]["defaults"]["server_mib_received"]
        lines.append(f"  k = {c['k']}: " + ", ".join(f"host {h}: {mib:.0f}" for h, mib in got.items()))
    lines.append("Bytes worker 0's psums pushed to each server (MiB, by host): the split")
    for c in doc["cases"]:
        got = c["jbps"]["defaults"].get("psum_mib_pushed", {})
        lines.append(f"  k = {c['k']}: " + ", ".join(f"host {h}: {mib:.1f}" for h, mib in got.items()))
    lines.append("")
    lines.append("Targets (defaults):")
    for g in doc["goals"]:
        floor = g.get("cpu_floor")
        lines.append(
            f"  {g['what']}: {'not reached' if g['ratio'] is None else format(g['ratio'], '.2f')} (target {g['target']}"
            + ("" if floor is None else f"; this machine's CPU time alone: {floor:.2f}")
            + ")"
        )
    if any(g.get("cpu_floor") is not None for g in doc["goals"]):
        lines.append(
            "  (CPU time alone: the variant's CPU time per psum spread over every core, over float32's time: "
            "the least this machine can take, however the work is scheduled)"
        )
    return "\n".join(lines)


def _replan_lines(doc: dict) -> list[str]:
    """The splits the rate follower moved to (jbps/replan.py), per k: none on links that keep their rate."""
    lines = []
    for c in doc["cases"]:
        d = c["jbps"].get("defaults")
        if d is None or d.get("replans") is None:
            continue
        if not d["replans"]:
            lines.append(f"k = {c['k']}: the rate follower kept the split jbps.init chose")
        for replan in d["replans"]:
            lines.append(
                f"k = {c['k']}: the rate follower re-planned (epoch {replan['epoch']}): "
                + ", ".join(
                    f"host {h} {f:.3f} of the bytes ({format_rate(8 * r)})"
                    for h, f, r in zip(d["server_hosts"], replan["fractions"], replan["rates"])
                )
            )
    return lines


def _change_lines(doc: dict) -> list[str]:
    """The calls around the mid-run rate change, per k (defaults), against the optimum for the new links."""
    change = doc.get("rate_change")
    if not change:
        return []
    at = change["at_call"]
    lines = [
        f"Host {change['host']}'s link changed to {format_rate(change['rate_bits_per_s'])} before timed call {at} "
        "(jbps defaults; each call's time, the slowest process's):"
    ]
    for c in doc["cases"]:
        per_call = c["jbps"]["defaults"]["per_call_s"]
        best, follow = c["optimum_after_change_s"], c["calls_to_follow"]
        lines.append(
            f"  k = {c['k']}: before {', '.join(f'{t:.3f}' for t in per_call[:at])} s; after "
            f"{', '.join(f'{t:.3f}' for t in per_call[at:])} s; optimum for the new links {best:.3f} s: "
            + (
                "not within 1.10x of it by the last call"
                if follow is None
                else f"within 1.10x from call {follow} on"
                + f" ({slow_after(per_call, at, best, follow)} later calls above it)"
            )
        )
        answers = c["jbps"]["defaults"].get("server_answer_rates")
        if answers:
            lines.append(
                "    how fast each server took worker 0's pushes (bytes acknowledged over the time one was "
                "unacknowledged): "
                + "; ".join(
                    f"{when} "
                    + ", ".join(
                        f"host {h} " + ("-" if r is None else f"{8 * r / 1e6:.0f}")
                        for h, r in zip(c["jbps"]["defaults"]["server_hosts"], answers[when])
                    )
                    + " Mbit/s"
                    for when in ("before", "after")
                )
            )
    return lines


def _cpu_text(cpu: dict | None) -> str:
    if not cpu:
        return "not measured"
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    return (
        f"{ms(cpu['busy_core_s'])} core-ms ({ms(cpu['user_core_s'])} + {ms(cpu['system_core_s'])} + "
        f"{ms(cpu['interrupt_core_s'])}), cores {cpu['busy_share']:.0%} busy"
        + (
            f", {ms(cpu['steal_core_s'])} core-ms stolen by the hypervisor"
            if cpu.get("steal_core_s", 0) >= 5e-4
            else ""
        )
    )


def plot(doc: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [c["k"] for c in doc["cases"]]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    shown = [c["formula_s"] for c in doc["cases"]]
    ax.plot(ks, shown, "k-", label="optimal split (formula)")
    for v in doc["variants"]:
        times = [c["jbps"][v]["median_s"] for c in doc["cases"]]
        shown += times
        ax.plot(ks, times, "o-", label=f"jbps ({v})")
    styles = {"gloo": ("JAX gloo psum", "--"), "mpi": ("MPI Allreduce (TCP)", ":")}
    for key, (label, style) in styles.items():
        if key in doc["peers"]:
            shown.append(doc["peers"][key]["median_s"])
            ax.axhline(
                doc["peers"][key]["median_s"], linestyle=style, color="gray" if key == "mpi" else "tab:red", label=label
            )
    ax.set_xlabel("CPU-only hosts k")
    ax.set_ylabel("seconds per psum")
    ax.set_xticks(ks)
    ax.set_title(
        f"{doc['workers']} worker hosts, {format_rate(doc['rate_bits_per_s'])}, {format_size(doc['bytes'])} per worker"
    )
    finish(fig, ax, path, max(shown), legend_fontsize=8)
    plt.close(fig)
    return fig


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr
    )
    log.setLevel(logging.INFO)
    try:
        doc = run(args)
    except NetworkError as exc:
        print(f"{prog or 'python -m benchmarks.network'}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; everything it started is removed", file=sys.stderr)
        return 130
    except SystemExit:  # SIGTERM (emulated_network turns it into SystemExit once hosts exist)
        print("terminated; everything it started is removed", file=sys.stderr)
        raise
    except RuntimeError as exc:
        print(f"{prog or 'python -m benchmarks.network'}: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        plot(doc, args.plot)
    print(json.dumps(doc, indent=1) if args.json else format_table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
