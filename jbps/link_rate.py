"""The network's rate, measured once when a job that spans hosts starts.

The chunk size that keeps a psum's pipeline short depends on how long a chunk
takes on the link (partition/defaults.py), so jbps.init times psums of
doubling size through the job's own servers, from 256 KiB until one takes at
least PROBE_MIN_S (or reaches PROBE_MAX_BYTES). The rate is the bytes the
busiest NIC carried in the last doubling over the time it added, so a call's
fixed costs cancel (or the last call's bytes over its time, if more; and at
most 1.25 times that: rate_from_probes). Every
worker must plan the same chunks, so the times are agreed, not local: each
probe's seconds are summed by one more psum, and every worker reads the same
sum from the servers and so derives the same rate. It costs 0.3-0.5 s per
init at 200 Mbit/s and at 1 Gbit/s alike (at 10 Gbit/s it stops at 16 MiB,
well above the rates where it matters).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .extension import load_core
from .partition import COLOCATED, make_plan
from .partition.plan import tree_description, tree_key
from .partition.traffic import busiest_nic_bytes

PROBE_START_BYTES = 256 << 10
PROBE_MAX_BYTES = 16 << 20
# Long enough that a chunk's fill and drain and the calls' own latency are a
# small part of it, so the rate is the link's and not the overheads': at 200
# Mbit/s, 1 MiB probes (~70 ms) read 96-160 Mbit/s, 2 MiB ones 160-190.
PROBE_MIN_S = 0.12
# Chunks of the size large psums get at 1 Gbit/s and up: smaller ones would
# measure this machine's CPU per chunk as much as the link.
PROBE_PARTITION_BYTES = 128 << 10
NAME = "jbps.link_probe"
_core = load_core()


def busiest_nic_share(roles: Sequence[str], fractions: Sequence[float], num_workers: int) -> float:
    """Bytes the busiest NIC carries (one direction) per byte of a worker's
    psum, with one worker machine per colocated server (jbps's launchers'
    placement; every worker on a machine of its own when no server is)."""
    colocated = [f for r, f in zip(roles, fractions) if r == COLOCATED]
    dedicated = [f for r, f in zip(roles, fractions) if r != COLOCATED]
    machines = len(colocated) or num_workers
    placement = list(range(len(colocated))) + [machines + i for i in range(len(dedicated))]
    return busiest_nic_bytes(machines, placement, colocated + dedicated)


def backstop_s(timeout_s: float) -> float:
    """How long a host psum's caller waits at most: the engine fails the call
    itself after the timeout, so this only bounds a wait the engine never ends."""
    return 2 * timeout_s + 10


def psum_host(
    name: str,
    values: np.ndarray,
    fractions: Sequence[float],
    wait_s: float,
    fixed_routes: bool = False,
    priority: int = 0,
) -> float:
    """Seconds of one psum of `values` (summed in place) through the running
    engine. fixed_routes: routed by `fractions` even after the rate follower
    announced another split (replan.py's probes); priority: larger is sent
    sooner, among the job's own psums' chunks."""
    plan = make_plan(
        name,
        ("",),
        (values.shape,),
        (values.dtype,),
        1,
        partition_bytes=PROBE_PARTITION_BYTES,
        server_fractions=fractions,
        ramp=True,
    )
    sizes, _, alone = plan.chunk_table([0])
    return _core.engine_psum_host(
        values,
        key=plan.leaves[0].key,
        name=name,
        partition_bytes=plan.partition_bytes,
        chunk_bytes=sizes,
        chunk_alone=[int(a) for a in alone],
        servers=list(plan.chunk_servers),
        tree=tree_description(name, [""], [values.shape], [values.dtype]),
        tree_key=tree_key(name),
        wait_s=wait_s,
        fixed_routes=fixed_routes,
        priority=priority,
    )


def _agreed_seconds(name: str, nbytes: int, fractions: Sequence[float], num_workers: int, wait_s: float) -> float:
    """One probe of `nbytes`: the workers' mean time, the same number on every worker."""
    took = psum_host(name, np.zeros(nbytes // 4, np.float32), fractions, wait_s)
    agreed = np.array([took], np.float32)
    psum_host(f"{name}.seconds", agreed, fractions, wait_s)
    return float(agreed[0]) / num_workers


def warm_up(fractions: Sequence[float], wait_s: float) -> None:
    """The probe's first psum, untimed: the connections' first bytes (slow
    start) are not the rate."""
    name = f"{NAME}.{PROBE_START_BYTES}"
    psum_host(name, np.zeros(PROBE_START_BYTES // 4, np.float32), fractions, wait_s)


def measure(roles: Sequence[str], fractions: Sequence[float], num_workers: int, timeout_s: float) -> float | None:
    """Bytes per second of the busiest link, the same number on every worker;
    None where no byte crosses a NIC. Every worker of the job must call it at
    the same point (jbps.init does), as every psum. The probes' sizes and
    agreed times are left in `probes`."""
    share = busiest_nic_share(roles, fractions, num_workers)
    probes.clear()
    if share <= 0:
        return None
    wait_s = backstop_s(timeout_s)
    warm_up(fractions, wait_s)
    nbytes = PROBE_START_BYTES
    while True:
        probes.append((nbytes, _agreed_seconds(f"{NAME}.{nbytes}", nbytes, fractions, num_workers, wait_s)))
        if probes[-1][1] >= PROBE_MIN_S or nbytes >= PROBE_MAX_BYTES:
            break
        nbytes *= 2
    return rate_from_probes(probes, share)


# A call of PROBE_MIN_S or more spends at most this part of its time on fixed
# costs, so the link carries its bytes at most 1 / (1 - this) times faster
# than the whole call reads.
MAX_FIXED_SHARE = 0.2


def rate_from_probes(timed: Sequence[tuple[int, float]], share: float) -> float:
    """The busiest link's bytes per second from the probes' (bytes, agreed
    seconds), doubling in size: the last doubling's bytes over the time it
    added, so that a call's fixed costs (its first chunk's round trip, waking
    threads) cancel; but never less than the whole last call gives, which
    counts those costs as link time (when the smaller call was quick by
    chance, as when tbf's burst lets its first bytes through at once, the
    difference alone underestimates), and, where the last call took
    PROBE_MIN_S or more, never more than 1 / (1 - MAX_FIXED_SHARE) of that
    (when the smaller call was slow by chance, a busy CPU, the difference
    alone overestimates: read 1.9 Gbit/s on a 1 Gbit/s link once)."""
    (small, t_small), (large, t_large) = ([(0, 0.0)] + list(timed))[-2:]
    whole = share * large / t_large
    added = t_large - t_small
    rate = whole if added <= 0 else max(whole, share * (large - small) / added)
    return min(rate, whole / (1 - MAX_FIXED_SHARE)) if t_large >= PROBE_MIN_S else rate


probes: list[tuple[int, float]] = []


# Each server's own link, probed alone: every chunk of a psum of `nbytes` goes
# to that one server, whose NIC then carries n·nbytes each way (dedicated) or
# (n-1)·nbytes (colocated: its own worker's push stays on the machine).
SERVER_PROBE_S = 0.06  # each server's probe is sized to take about this long on its own link
SERVER_PROBE_MIN_BYTES = 256 << 10
# A probe that took under this part of SERVER_PROBE_S is sized up and run
# again: a probe sized for the busiest link's rate, which a slow spare host
# sets, passes a fast link in a few ms, mostly within a rate limiter's burst
# and a call's fixed costs (a 30 Mbit/s CPU host beside 300 Mbit/s worker
# hosts read the worker hosts' servers at 58-125 MB/s for their 37.5). Half:
# the busiest-link probe reads up to 20% low, so sizes from it often fall a
# little short of the aim, and another round of every server's probe is not
# worth that.
SERVER_PROBE_SHORT = 0.5
# At most this many times larger per resizing: one probe slowed by a busy CPU
# reads quick links slow, never fast, so a jump from it cannot overshoot far.
SERVER_PROBE_GROWTH = 8
# Each server is probed this many times, in turn, at its final size, and its
# fastest time kept: a probe is read slow when the machine's CPUs are busy
# (other processes, the other probes' sums), never fast, and one slow reading
# of a worker machine's link moves its share far more than its rate.
SERVER_PROBE_ROUNDS = 3
# But once only where that took this long or more: there a stall of the CPUs is
# a small part of it (such a probe is of the least size, SERVER_PROBE_MIN_BYTES,
# or on a link 4x slower than the busiest-link probe read). A 3 Mbit/s spare
# host's probes took 1.4 s each, 4.2 s of init for its three.
SERVER_PROBE_LONG_S = 4 * SERVER_PROBE_S
# Readings within these factors of the job's full rate are read as it: the
# probe's error (the 1 Gbit/s links of one run read 650-1,050 Mbit/s on the
# 2-core machine, an 800 Mbit/s one 600-780), not a slower link.
SAME_RATE = 1.3  # a worker machine's
DEDICATED_SAME_RATE = 1.12  # a CPU machine's


def reads_as_full(role: str, rate: float, full: float) -> bool:
    """Whether a server's reading is the job's full rate within the probe's
    error (SAME_RATE, DEDICATED_SAME_RATE)."""
    return rate * (SAME_RATE if role == COLOCATED else DEDICATED_SAME_RATE) >= full


def one_server(count: int, server: int) -> list[float]:
    """The fractions that route every chunk to `server`."""
    return [1.0 if i == server else 0.0 for i in range(count)]


def server_load(role: str, num_workers: int) -> int:
    """Bytes a server's NIC carries each way per byte of a psum routed to it alone."""
    return num_workers if role != COLOCATED else max(1, num_workers - 1)


def server_probe_bytes(role: str, num_workers: int, rate: float, seconds: float = SERVER_PROBE_S) -> int:
    """Bytes of a psum routed to one server alone that take about `seconds`
    on a link of `rate` bytes per second."""
    nbytes = int(min(PROBE_MAX_BYTES, max(SERVER_PROBE_MIN_BYTES, rate * seconds / server_load(role, num_workers))))
    return nbytes - nbytes % 4


def probe_server(
    name: str, nbytes: int, count: int, server: int, wait_s: float, fixed_routes: bool = False, priority: int = 0
) -> float:
    """Seconds of one psum of `nbytes` routed to `server` alone, started by
    every worker together: a one-float psum to that server first. Where one
    worker still pulls the last probe's sum (from a slow host one of two pulls
    can end 0.1 s or more before the other), the others' time of this probe
    would count the wait for it, and its own miss what they had already sent:
    2 MiB probes of 300 Mbit/s links beside a 3-10 Mbit/s host read 15-883
    Mbit/s without the start."""
    routes = one_server(count, server)
    psum_host(f"{name}.start", np.zeros(1, np.float32), routes, wait_s, fixed_routes, priority)
    return psum_host(name, np.zeros(nbytes // 4, np.float32), routes, wait_s, fixed_routes, priority)


def resized_probe(nbytes: int, seconds: float) -> int:
    """The next size of a server's probe that took `seconds` (agreed) at
    `nbytes`: the same where it took SERVER_PROBE_SHORT of SERVER_PROBE_S or
    more (or is at PROBE_MAX_BYTES), else the doubling that brings it to
    SERVER_PROBE_S at the rate it read, at most SERVER_PROBE_GROWTH times."""
    if seconds >= SERVER_PROBE_SHORT * SERVER_PROBE_S or nbytes >= PROBE_MAX_BYTES:
        return nbytes
    growth = 2
    while growth < SERVER_PROBE_GROWTH and seconds * growth < SERVER_PROBE_S:
        growth *= 2
    return min(PROBE_MAX_BYTES, nbytes * growth)


def server_rates(roles: Sequence[str], num_workers: int, link_bytes_per_s: float, timeout_s: float) -> list[float]:
    """Bytes per second each server's NIC carries each way, the same numbers on
    every worker: a psum routed to that server alone, timed by every worker,
    the times agreed (one psum of all of them). Each probe starts at the size
    the busiest link's rate gives and grows until it takes about
    SERVER_PROBE_S on that server's own link (resized_probe, on agreed times,
    so every worker grows the same ones), and is then run SERVER_PROBE_ROUNDS
    times, the fastest kept (once where it took SERVER_PROBE_LONG_S or more).
    Every worker calls it at the same point, after measure()."""
    n, count = num_workers, len(roles)
    wait_s = backstop_s(timeout_s)
    sizes = [server_probe_bytes(role, n, link_bytes_per_s) for role in roles]

    def probe_round(label: str, servers: Sequence[int]) -> np.ndarray:
        took = np.zeros(count, np.float32)
        for s in servers:
            took[s] = probe_server(f"{NAME}.server{s}.{sizes[s]}.{label}", sizes[s], count, s, wait_s)
        return took

    growing, seconds, resizing = list(range(count)), np.full(count, np.inf, np.float32), 0
    again = []  # servers probed SERVER_PROBE_ROUNDS times, not once
    while growing:
        took = probe_round(f"size{resizing}", growing)
        agreed = took.copy()
        psum_host(f"{NAME}.server_sizes.{resizing}", agreed, [1.0 / count] * count, wait_s)
        still = []
        for s in growing:
            grown = resized_probe(sizes[s], float(agreed[s]) / n)
            if grown != sizes[s]:
                sizes[s] = grown
                still.append(s)
                continue
            seconds[s] = took[s]  # the first of its rounds at its final size
            if float(agreed[s]) / n < SERVER_PROBE_LONG_S:
                again.append(s)
        growing, resizing = still, resizing + 1
    again.sort()
    for r in range(1, SERVER_PROBE_ROUNDS):
        seconds[again] = np.minimum(seconds[again], probe_round(str(r), again)[again])
    psum_host(f"{NAME}.server_seconds", seconds, [1.0 / count] * count, wait_s)
    loads = [server_load(role, n) * nbytes for role, nbytes in zip(roles, sizes)]
    return [load / (float(t) / n) for load, t in zip(loads, seconds)]


def fractions_for_rates(roles: Sequence[str], rates: Sequence[float], num_workers: int) -> list[float] | None:
    """The split for these measured rates (partition/rated_split.py), or None
    when the links are alike as far as the probe can tell (the formula's split
    stands). The job's full rate is the median reading (most links run at it;
    one probe that reads high must not make the others look slow). A reading
    near it counts as it: within SAME_RATE for a worker machine, whose share
    moves with (its rate · tau - 1), far more than its rate does; within
    DEDICATED_SAME_RATE for a CPU machine, whose share moves with its rate,
    and which, given an equal share on a link 20% slower, would set every
    psum's pace (measured: 1.24x the time without that machine). No reading
    counts above it. A CPU machine clearly slower (beyond SAME_RATE) and
    too slow to save much is left out (worthwhile_split)."""
    from .partition.rated_split import worthwhile_split

    if not rates:
        return None
    full = float(np.median(rates))
    snapped = [full if reads_as_full(role, r, full) else r for role, r in zip(roles, rates)]
    if min(snapped) == full:
        return None
    return list(worthwhile_split(roles, snapped, num_workers, within=SAME_RATE).fractions)
