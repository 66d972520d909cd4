"""The report every timing process prints: one JSON line, last on stdout.

{"tool": str, "results": {"<bytes>": {"median_s", "min_s", "iters", ...}}}
"""

from __future__ import annotations

import statistics

from .local_cluster import last_json_line


def summarize(per_iter: list[float]) -> dict:
    """Median and best of per-call times (each already the slowest process's)."""
    return {"median_s": statistics.median(per_iter), "min_s": min(per_iter), "iters": len(per_iter)}


def with_cpu(summary: dict, meter) -> dict:
    """The summary with the machine's CPU time per timed call (cpu_load.Meter), when metered."""
    cpu = meter.per_call()
    if cpu is not None:
        summary["cpu"] = cpu
    return summary


def parse_report(stdout: str, what: str) -> dict:
    """The report in a process's stdout, with results keyed by int byte count."""
    out = last_json_line(stdout)
    if out is None:
        raise RuntimeError(f"{what}: no JSON result in output:\n{stdout[-3000:]}")
    out["results"] = {int(k): v for k, v in out["results"].items()}
    return out
