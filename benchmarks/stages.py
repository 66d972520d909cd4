"""Where the time of one psum goes: its stages, from the engine's and the servers' stamps.

With stage timing on (`jbps._core.engine_set_stage_timing(True)`), the engine stamps each call
as it passes a stage (xla_ext/engine.h, StageRecord) and asks the servers to time its rounds;
the caller stamps the call's start and end with time.perf_counter_ns(), the same clock
(CLOCK_MONOTONIC). The stages below add up to the call's time as the caller sees it.
"""

from __future__ import annotations

import statistics

# (key, what it covers), in the order a call passes them.
STAGES = (
    ("dispatch", "XLA dispatch: the Python call until the handler hands the psum to the engine"),
    ("push", "worker hand-off: the engine hands the push to its connection and copies it in"),
    ("peers", "on the server: this worker's push read until the last worker's is"),
    ("server", "on the server: the last push read until the sum is written (summing thread, writer)"),
    ("wire", "the socket both ways: the push written and read, the sum written and read (wake-ups)"),
    ("pull", "the sum copied into XLA's output"),
    ("tree", "waiting for the tree check's answer after the sum is in"),
    ("complete", "completion hand-off: the result reaches the waiting handler (or the completion thread)"),
    ("return", "XLA finishes the call and the caller has the result"),
)


def call_stages(record: dict, start_ns: int, end_ns: int) -> dict[str, float] | None:
    """Seconds of each stage of one call (a StageRecord as a dict, see
    engine_take_stages), started and ended at these perf_counter_ns() stamps.
    None when the call failed or missed a stamp."""
    r = record
    if r["failed"] or not all(r[k] for k in ("submitted", "pushed", "sum_arrived", "pulled", "done")):
        return None
    ready = max(r["pulled"], r["tree_checked"])
    round_trip = r["sum_arrived"] - r["pushed"]
    ns = {
        "dispatch": r["submitted"] - start_ns,
        "push": r["pushed"] - r["submitted"],
        "peers": r["peer_wait_ns"],
        "server": r["server_ns"],
        "wire": round_trip - r["peer_wait_ns"] - r["server_ns"],
        "pull": r["pulled"] - r["sum_arrived"],
        "tree": ready - r["pulled"],
        "complete": r["done"] - ready,
        "return": end_ns - r["done"],
    }
    out = {k: v * 1e-9 for k, v in ns.items()}
    out["total"] = (end_ns - start_ns) * 1e-9
    return out


def typical_stages(calls: list[dict[str, float] | None]) -> dict[str, float] | None:
    """The mean of each stage over the middle half of the calls by total time (from its 25th to
    its 75th percentile), so that the stages add up to that half's mean total: a typical call,
    without the scheduler's outliers either way."""
    calls = sorted((c for c in calls if c is not None), key=lambda c: c["total"])
    if not calls:
        return None
    middle = calls[len(calls) // 4 : len(calls) - len(calls) // 4]
    out = {k: sum(c[k] for c in middle) / len(middle) for k in calls[0]}
    out["calls"] = len(middle)
    out["median_total"] = statistics.median(c["total"] for c in calls)
    return out


def format_stages(by_size: list[dict], size_label) -> list[str]:
    """A table: one row per stage, one column per size ({"bytes", stage: seconds...} each), in
    microseconds."""
    if not by_size:
        return []
    lines = ["{:<10} {}  {}".format("stage", " ".join(f"{size_label(c['bytes']):>9}" for c in by_size), "what")]
    for key, what in STAGES + (("total", "the call as the caller sees it (the stages' sum)"),):
        lines.append("{:<10} {}  {}".format(key, " ".join(f"{c[key] * 1e6:>9.1f}" for c in by_size), what))
    return lines
