"""A host's link changing rate in the middle of a timed run (`--change w0=400M@10`):
another tenant, a throttled NIC.

The bench cannot time `tc` against calls it does not see, so the job waits for it:
worker 0, before timed call CALL, writes "paused" to a file and waits for "go"; the
bench, watching the file, changes the host's rate (EmulatedNetwork.set_rate: tc qdisc
change on both ends of its link) and writes "go". The other workers wait for worker 0
in the next call's barrier, which is not timed. After the job the host's rate is set
back, so every job of a sweep starts on the same links.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from jbps.partition.rated_split import parse_host_rates
from .emulated_network import format_rate

PAUSED, GO = "paused", "go"
# How long worker 0 waits for the bench to change the rate (tc takes milliseconds).
PAUSE_TIMEOUT_S = 30.0
# Within this of the optimum for the new rates, the job has followed the change
# (the goal: back within 1.10x in at most 5 calls).
FOLLOWED_WITHIN = 1.10


@dataclasses.dataclass(frozen=True)
class RateChange:
    host: int  # machine index: worker hosts 0..n-1, then the CPU hosts
    rate: float  # bits/s each way from the change on
    at_call: int  # timed calls before the change


def parse_change(text: str, workers: int, cpu_machines: int, iters: int) -> RateChange:
    """RateChange from "w0=400M@10" (w<i>/s<j> as --rates names hosts); ValueError naming the fault."""
    host_text, sep, at = text.rpartition("@")
    if not sep or "," in host_text:
        raise ValueError(f"{text!r} is not one HOST=RATE@CALL (e.g. w0=400M@10)")
    rates = parse_host_rates(host_text, workers, cpu_machines)
    if not rates:
        raise ValueError(f"{text!r} names no host")
    ((host, rate),) = rates.items()
    try:
        call = int(at)
    except ValueError:
        raise ValueError(f"{text!r}: CALL {at!r} is not a whole number") from None
    if not 1 <= call < iters:
        raise ValueError(f"{text!r}: CALL must be from 1 to --iters - 1 ({iters - 1}), so calls run on both rates")
    return RateChange(host, rate, call)


@contextlib.contextmanager
def applied_during(net, change: RateChange, path: Path, said=lambda line: None) -> Iterator[None]:
    """While the block runs a job whose worker 0 calls pause_for_change(path) before timed call
    change.at_call, changes the host's rate when it does (and says so); afterwards sets it back."""
    original = net.rate_of(change.host)
    path.write_text("")
    stop = threading.Event()
    failed: list[BaseException] = []

    def watch() -> None:
        while not stop.wait(0.002):
            if path.read_text() == PAUSED:
                try:
                    net.set_rate(change.host, change.rate)
                except BaseException as exc:  # the job then times out waiting; the cause is raised below
                    failed.append(exc)
                    return
                said(f"host {change.host}'s link set to {format_rate(change.rate)} before timed call {change.at_call}")
                path.write_text(GO)
                return

    watcher = threading.Thread(target=watch, name="rate-change", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        if net.rate_of(change.host) != original:
            net.set_rate(change.host, original)
    if failed:
        raise RuntimeError(f"changing host {change.host}'s rate failed: {failed[0]}")


def pause_for_change(path: str, timeout_s: float = PAUSE_TIMEOUT_S) -> None:
    """Worker 0's side: says it paused and returns once the bench changed the rate."""
    Path(path).write_text(PAUSED)
    deadline = time.monotonic() + timeout_s
    while Path(path).read_text() != GO:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the bench did not change the link's rate within {timeout_s:g} s ({path})")
        time.sleep(0.002)


def answer_rates(before: dict, after: dict) -> list[float | None]:
    """Each server's acknowledged bytes per second of time with a push of this worker to it
    unacknowledged, between two jbps.engine_stats(): how fast it took this worker's pushes
    (None: none pushed)."""
    out: list[float | None] = []
    for i, waited in enumerate(after["server_unacked_seconds"]):
        waited -= before["server_unacked_seconds"][i]
        acked = after["server_bytes_acked"][i] - before["server_bytes_acked"][i]
        out.append(acked / waited if waited > 0 else None)
    return out


def calls_to_follow(per_call_s: list[float], at_call: int, optimum_s: float) -> int | None:
    """Calls from the change until the first of two running that take at most FOLLOWED_WITHIN x
    the optimum for the new rates, from which on the median call does too (1: the first call
    after the change); None if never. A lone slow call later does not count: the 2-core
    machine gives them on links that never change as well (0.39-0.47 s among 0.35 s calls)."""
    after = per_call_s[at_call:]
    bound = FOLLOWED_WITHIN * optimum_s
    for i, t in enumerate(after):
        next_within = i + 1 == len(after) or after[i + 1] <= bound
        if t <= bound and next_within and float(np.median(after[i:])) <= bound:
            return i + 1
    return None


def slow_after(per_call_s: list[float], at_call: int, optimum_s: float, follow: int) -> int:
    """How many calls after the follow point took more than FOLLOWED_WITHIN x the optimum."""
    return sum(t > FOLLOWED_WITHIN * optimum_s for t in per_call_s[at_call + follow :])
