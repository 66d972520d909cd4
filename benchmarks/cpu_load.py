"""How busy the machine's CPUs were between two moments, from /proc/stat.

On the emulated cluster every host shares this machine's cores: its
computation, its jbps threads and its network stack (the kernel's TCP, the
veths, the bridge and the rate caps). /proc/stat is the machine's, whatever
network namespace reads it, so one process can account for all of them.
"""

from __future__ import annotations

import os

# /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice.
_USER, _NICE, _SYSTEM, _IDLE, _IOWAIT, _IRQ, _SOFTIRQ, _STEAL = range(8)
_FIELDS = 8  # guest and guest_nice are counted in user and nice already


def sample() -> list[int]:
    """The machine's CPU time so far, in clock ticks, by kind."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def between(before: list[int], after: list[int]) -> dict:
    """The CPU time spent between two samples, in core-seconds, by kind, and
    the share of the machine that was busy. Busy is this machine's own work:
    time its hypervisor ran something else while its CPUs wanted to run
    (steal) is counted apart, as is neither busy nor idle."""
    tick = os.sysconf("SC_CLK_TCK")
    d = [b - a for a, b in zip(before[:_FIELDS], after[:_FIELDS])]
    d += [0] * (_FIELDS - len(d))
    busy = d[_USER] + d[_NICE] + d[_SYSTEM] + d[_IRQ] + d[_SOFTIRQ]
    return {
        "busy_share": busy / max(1, sum(d)),
        "busy_core_s": busy / tick,
        "user_core_s": (d[_USER] + d[_NICE]) / tick,
        "system_core_s": d[_SYSTEM] / tick,
        "interrupt_core_s": (d[_IRQ] + d[_SOFTIRQ]) / tick,
        "steal_core_s": d[_STEAL] / tick,
        "cores": os.cpu_count() or 1,
    }


class Meter:
    """The machine's CPU time over timed calls only: `with meter:` around each
    one. Off (`on=False`) it reads nothing, so it costs a call nothing."""

    def __init__(self, on: bool = True):
        self.on = on
        self.calls = 0
        self._total: list[int] | None = None

    def __enter__(self) -> "Meter":
        if self.on:
            self._before = sample()
        return self

    def __exit__(self, *exc) -> None:
        if not self.on:
            return
        delta = [b - a for a, b in zip(self._before, sample())]
        self._total = delta if self._total is None else [t + d for t, d in zip(self._total, delta)]
        self.calls += 1

    def per_call(self) -> dict | None:
        """between()'s numbers for the calls metered, the core-seconds per call;
        None when off or nothing was metered."""
        if not self._total:
            return None
        out = between([0] * len(self._total), self._total)
        for key in ("busy_core_s", "user_core_s", "system_core_s", "interrupt_core_s", "steal_core_s"):
            out[key] /= self.calls
        out["calls"] = self.calls
        return out
