"""`python -m benchmarks`'s latency sweep: small psums next to MPI and gloo, in place and out of place,
and where one call's time goes.

The sweep (4 KiB ... 4 MiB by default) is its own jbps job and its own peer runs: jbps in place
(the input donated, as a step's dead gradients are) and out of place (the input kept alive, so
XLA gives the sum a fresh output every call), calls alternating; MPI Allreduce in place and into
a separate receive buffer reused every call, alternating too; JAX's gloo psum (out of place, as
jax runs it). The size rows of the main table get the same out-of-place columns. Rank 0's
calls are also broken into stages (stages.py). Each ratio is jbps's time over the peer's, and
the targets are printed beside the measured values.
"""

from __future__ import annotations

import functools
import logging

from . import peers
from .stages import format_stages

log = logging.getLogger("benchmarks")

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M"
KIB, MIB = 1 << 10, 1 << 20
# The latency targets: seconds at most for the smallest psum, then jbps/MPI at most.
SMALL_BYTES, SMALL_TARGET_S = 4 * KIB, 100e-6
RATIO_TARGETS = ((4 * MIB, "in place", 1.3), (64 * MIB, "in place", 1.0), (64 * MIB, "out of place", 1.1))


def run_sweep(sizes, iters, warmup, workers, servers, timeout_s, run_jbps, run_peer, with_peers=True) -> dict:
    """The sweep's own jbps job and peer runs. run_jbps and run_peer are `python -m benchmarks`'s (its
    __main__), passed in so that the sweep runs exactly as the size rows do."""
    tools = {"jbps": None, "mpi": None, "gloo": None}
    errors = {}
    try:
        tools["jbps"] = run_jbps(sizes, iters, warmup, workers, servers, timeout_s, ["--out-of-place", "--stages"])
    except (RuntimeError, TimeoutError) as exc:
        log.error("latency sweep: jbps failed: %s", exc)
        errors["jbps"] = str(exc)
    if with_peers:
        runners = (
            ("mpi", functools.partial(peers.run_mpi_allreduce, out_of_place=True)),
            ("gloo", peers.run_gloo_psum),
        )
        for key, runner in runners:
            log.info("latency sweep: %s ...", key)
            try:
                tools[key] = run_peer(runner, sizes, iters, warmup, timeout_s)
            except (RuntimeError, TimeoutError) as exc:
                log.error("latency sweep: %s failed: %s", key, exc)
                errors[key] = str(exc)
    return {"sizes": list(sizes), "tools": tools, "errors": errors}


def _result(tools, key, nbytes):
    tool = tools.get(key)
    return None if tool is None else tool["results"].get(nbytes)


def _median(result, out_of_place=False):
    if result is None:
        return None
    if out_of_place:
        result = result.get("out_of_place")
    return None if result is None else result["median_s"]


def _ratio(a, b):
    return a / b if a is not None and b else None


def make_rows(sweep: dict | None, main_tools: dict | None) -> list[dict]:
    """One row per size: the sweep's sizes, then the main table's (from its own runs)."""
    rows = []
    sources = []
    if sweep:
        sources += [(s, sweep["tools"]) for s in sweep["sizes"]]
    if main_tools and main_tools.get("jbps"):
        seen = {s for s, _ in sources}
        sources += [(s, main_tools) for s in sorted(main_tools["jbps"]["results"]) if s not in seen]
    for nbytes, tools in sources:
        jbps, mpi, gloo = (_result(tools, k, nbytes) for k in ("jbps", "mpi", "gloo"))
        row = {
            "bytes": nbytes,
            "jbps_in_place_s": _median(jbps),
            "mpi_in_place_s": _median(mpi),
            "jbps_out_of_place_s": _median(jbps, True),
            "mpi_out_of_place_s": _median(mpi, True),
            "gloo_s": _median(gloo),
        }
        row["in_place_over_mpi"] = _ratio(row["jbps_in_place_s"], row["mpi_in_place_s"])
        row["out_of_place_over_mpi"] = _ratio(row["jbps_out_of_place_s"], row["mpi_out_of_place_s"])
        row["out_of_place_over_in_place"] = _ratio(row["jbps_out_of_place_s"], row["jbps_in_place_s"])
        row["in_place_over_gloo"] = _ratio(row["jbps_in_place_s"], row["gloo_s"])
        rows.append(row)
    return rows


def stages_by_size(sweep: dict | None) -> list[dict]:
    """The sweep's stage breakdown, one {"bytes", stage: seconds...} per size (a list: JSON
    object keys would turn the sizes into strings)."""
    jbps = (sweep or {}).get("tools", {}).get("jbps")
    if not jbps:
        return []
    return [{"bytes": s, **r["stages"]} for s, r in sorted(jbps["results"].items()) if r.get("stages")]


def targets(rows: list[dict]) -> list[dict]:
    """The latency targets with the values this run measured (None where it did not)."""
    by_size = {r["bytes"]: r for r in rows}
    small = by_size.get(SMALL_BYTES, {}).get("jbps_in_place_s")
    out = [{"what": f"{SMALL_BYTES // KIB} KiB psum, in place", "value": small, "target": SMALL_TARGET_S, "unit": "s"}]
    for nbytes, how, target in RATIO_TARGETS:
        key = "in_place_over_mpi" if how == "in place" else "out_of_place_over_mpi"
        out.append(
            {
                "what": f"{nbytes // MIB} MiB jbps/MPI, {how}",
                "value": by_size.get(nbytes, {}).get(key),
                "target": target,
                "unit": "ratio",
            }
        )
    return out


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def _cell(value, fmt):
    return "-" if value is None else format(value, fmt)


def format_latency(latency: dict, cfg: dict) -> list[str]:
    rows = latency["rows"]
    if not rows:
        return []
    ms = lambda s: None if s is None else s * 1e3  # noqa: E731
    lines = [
        f"latency: jbps psum, {cfg['workers']} workers x 1 CPU device, {cfg['servers']} servers, in place "
        "(input donated) and out of place (input kept: a fresh output every call), calls alternating; "
        "MPI Allreduce in place and into a reused receive buffer; gloo: jax's psum. Median ms of the "
        "slowest process per call; jbps/X = time ratio.",
        "{:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}".format(
            "size", "in place", "MPI", "jbps/MPI", "out", "MPI out", "jbps/MPI", "out/in", "gloo", "jbps/gloo"
        ),
    ]
    for r in rows:
        lines.append(
            "{:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}".format(
                _size(r["bytes"]),
                _cell(ms(r["jbps_in_place_s"]), ".3f"),
                _cell(ms(r["mpi_in_place_s"]), ".3f"),
                _cell(r["in_place_over_mpi"], ".2f"),
                _cell(ms(r["jbps_out_of_place_s"]), ".3f"),
                _cell(ms(r["mpi_out_of_place_s"]), ".3f"),
                _cell(r["out_of_place_over_mpi"], ".2f"),
                _cell(r["out_of_place_over_in_place"], ".2f"),
                _cell(ms(r["gloo_s"]), ".3f"),
                _cell(r["in_place_over_gloo"], ".2f"),
            )
        )
    stages = latency.get("stages") or []
    if stages:
        lines.append(
            "where a jbps psum's time goes: rank 0's in-place calls of the sweep, the middle half by time, "
            "mean microseconds:"
        )
        lines += ["  " + line for line in format_stages(stages, _size)]
    lines.append("targets (this run's value, target):")
    for t in latency["targets"]:
        if t["unit"] == "s":
            value = _cell(None if t["value"] is None else t["value"] * 1e6, ".0f")
            lines.append(f"  {t['what']:<32} {value:>6} us  at most {t['target'] * 1e6:.0f} us")
        else:
            lines.append(f"  {t['what']:<32} {_cell(t['value'], '.2f'):>6}     at most {t['target']:g}")
    for what, err in latency.get("errors", {}).items():
        last = next((line.strip() for line in reversed(err.splitlines()) if line.strip()), "")
        lines.append(f"latency sweep: {what} did not run: {last} (details on stderr)")
    return lines


def summarize(sweep: dict | None, main_tools: dict | None) -> dict:
    """The document's "latency" section: the rows, the stages and the targets."""
    rows = make_rows(sweep, main_tools)
    return {
        "sizes": (sweep or {}).get("sizes", []),
        "rows": rows,
        "stages": stages_by_size(sweep),
        "targets": targets(rows),
        "errors": (sweep or {}).get("errors", {}),
    }
