"""The optimal split for links of different rates.

split.py gives the shares when every NIC has the same bandwidth. Spare
machines rarely do: an older NIC, a busier host, a rack further away. With n
workers, each on a machine of its own with a colocated server, plus dedicated
servers on CPU-only machines, let server s own a fraction f_s of the bytes
(sum 1) and let its machine's NIC carry r_s bytes per second each way. Per M
bytes of gradient per worker, each way:

    a dedicated server's NIC carries          n·f_s·M
    a worker machine's NIC carries     M·(1 + (n-2)·f_s)

(its worker pushes everything its own server does not own, M·(1 - f_s), and
its server returns (n-1)·f_s·M of sums: split.py). A psum takes as long as
its busiest NIC, so the best split finishes every NIC together: for a time
τ per byte of M, each server can own at most

    dedicated:  τ·r_s / n        colocated:  (τ·r_s - 1) / (n - 2)  (at least 0)

and τ* is the least τ at which these add up to 1 (each grows with τ, so a
bisection finds it). A worker machine cannot finish before its own M has gone
out, τ ≥ 1/r_s: a colocated server slow enough that τ*·r_s ≤ 1 owns nothing,
and every other share follows from τ*. With every rate equal this is
split.py's x and y (tests/test_partition.py checks it). With two workers a
worker machine's NIC carries M whatever its server owns, so τ* = 1/(the
slowest worker machine) and the dedicated servers take what fits, by rate.

Where τ* is set by a worker machine (Σ caps > 1 there), any shares within
the caps finish together: the dedicated servers take theirs first (their
machines do no training), the colocated the rest in proportion to their caps
(with two workers, to their rates).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .assign import COLOCATED, DEDICATED, ROLES


@dataclasses.dataclass(frozen=True)
class RatedSplit:
    fractions: tuple[float, ...]  # per server, in server order; sum 1
    seconds_per_byte: float  # τ*: seconds per byte of each worker's gradient (a psum of M takes τ*·M)

    def time_s(self, model_bytes: float) -> float:
        return self.seconds_per_byte * model_bytes


def _caps(tau: float, roles: Sequence[str], rates: Sequence[float], num_workers: int) -> list[float]:
    n = num_workers
    caps = []
    for role, rate in zip(roles, rates):
        if rate <= 0:
            caps.append(0.0)
        elif role == DEDICATED:
            caps.append(tau * rate / n)
        elif n > 2:
            caps.append(max(0.0, (tau * rate - 1.0) / (n - 2)))
        else:  # n = 2: the machine carries M whatever its server owns
            caps.append(1.0 if tau * rate >= 1.0 else 0.0)
    return caps


def rated_split(roles: Sequence[str], rates: Sequence[float], num_workers: int) -> RatedSplit:
    """Each server's share for servers of `roles` on NICs of `rates` (bytes/s each
    way), with `num_workers` workers, each on a machine with one colocated server
    when there are colocated servers."""
    if len(roles) != len(rates) or not roles:
        raise ValueError(f"rated_split: {len(roles)} roles and {len(rates)} rates; give one of each per server")
    for i, (role, rate) in enumerate(zip(roles, rates)):
        if role not in ROLES:
            raise ValueError(f"server {i} has role {role!r}; expected one of {ROLES}")
        if not rate >= 0:
            raise ValueError(f"server {i}'s rate must be a non-negative number of bytes per second, got {rate!r}")
    n = num_workers
    if n < 1:
        raise ValueError(f"num_workers must be at least 1, got {n!r}")
    if n == 1:  # nothing needs to leave the worker's machine: its own servers take all, by rate
        local = [r if role == COLOCATED else 0.0 for role, r in zip(roles, rates)]
        weights = local if sum(local) > 0 else list(rates)
        total = sum(weights)
        return RatedSplit(tuple(w / total for w in weights), 0.0)
    if sum(rates) <= 0:
        raise ValueError("rated_split: every server's rate is 0")
    # Every worker machine's own M goes out, whatever its server owns.
    low = max((1.0 / r for role, r in zip(roles, rates) if role == COLOCATED and r > 0), default=0.0)
    high = max(low, 1.0 / max(rates)) * 4 * (n + len(roles))
    while sum(_caps(high, roles, rates, n)) < 1.0:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if sum(_caps(mid, roles, rates, n)) >= 1.0:
            high = mid
        else:
            low = mid
    tau = high
    caps = _caps(tau, roles, rates, n)
    dedicated = [c if role == DEDICATED else 0.0 for role, c in zip(roles, caps)]
    taken = sum(dedicated)
    if taken >= 1.0:
        return RatedSplit(tuple(c / taken for c in dedicated), tau)
    colocated = [c if role == COLOCATED else 0.0 for role, c in zip(roles, caps)]
    if n == 2:  # a cap of 1 means any share: the rest by rate
        colocated = [r if c > 0 else 0.0 for r, c in zip(rates, colocated)]
    scale = (1.0 - taken) / sum(colocated)
    return RatedSplit(tuple(d + c * scale for d, c in zip(dedicated, colocated)), tau)


# The dedicated servers slower than the fastest link must together save at
# least this share of the psum's time, or they are left out: a server costs
# the engine a little the formula does not count (its connections, its
# chunks' round trips). Measured on the emulated cluster (n = 4 at 1 Gbit/s,
# 32 MiB), a CPU machine at 400 Mbit/s beside one at 1 Gbit/s saves 4.3% in
# the formula and made the psum 2.5% faster than leaving it out (0.381 s
# against 0.390 s); one saving less than 3% is not worth the risk.
MIN_GAIN = 0.03


def worthwhile_split(
    roles: Sequence[str], rates: Sequence[float], num_workers: int, *, within: float = 1.0
) -> RatedSplit:
    """rated_split, or, where the dedicated servers slower than the fastest link
    save less than MIN_GAIN of the time the others take alone, the others'
    split (those servers' shares 0): a spare machine on a slower link must not
    make the job slower than leaving it out. A rate within a factor `within` of
    the fastest is not slower: measured rates pass the probe's error here, so
    that a CPU machine read a little low keeps its rate's share (which never
    outlasts the others, as the probe reads low, never high) instead of being
    left out where it saves nothing, as with two workers, where its share is
    a tie."""
    rates = list(rates)
    split = rated_split(roles, rates, num_workers)
    fastest = max(rates)
    slower = [s for s, (role, r) in enumerate(zip(roles, rates)) if role == DEDICATED and 0 < r * within < fastest]
    if not slower:
        return split
    without = rated_split(roles, [0.0 if s in slower else r for s, r in enumerate(rates)], num_workers)
    return split if split.seconds_per_byte <= (1 - MIN_GAIN) * without.seconds_per_byte else without


def parse_host_rates(text: str, workers: int, cpu_machines: int) -> dict[int, float]:
    """{machine: bits/s} from "s1=400M,w0=800M": w<i> is worker machine i (machine i),
    s<j> CPU machine j (machine workers + j). ValueError naming the item at fault."""
    from ..sizes import parse_rate

    out: dict[int, float] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or len(name) < 2 or name[0] not in "ws" or not name[1:].isdigit():
            raise ValueError(f"{item!r} is not w<i>=RATE (worker machine i) or s<j>=RATE (CPU machine j)")
        index, limit = int(name[1:]), workers if name[0] == "w" else cpu_machines
        if index >= limit:
            what = f"{workers} worker machines" if name[0] == "w" else f"at most {cpu_machines} CPU machines"
            raise ValueError(f"{item!r} names no machine: there are {what}")
        try:
            rate = parse_rate(value.strip())
        except ValueError as exc:
            raise ValueError(f"{item!r}: {exc}") from None
        out[index if name[0] == "w" else workers + index] = rate
    return out


__all__ = ["RatedSplit", "parse_host_rates", "rated_split"]
