"""Following links whose rates change while the job runs.

jbps.init measures each server's link and splits the bytes by those rates
(link_rate.py, partition/rated_split.py). A link can slow later (another
tenant, a throttled NIC): its server then sets every psum's pace. While a job
that spans hosts runs, a thread on every worker reads, every WINDOW_S, how
fast each server took this worker's pushes (bytes acknowledged over the time
some push waited for its acknowledgement: the server's own link, since a
push is acknowledged on arrival; the time still waiting counts, so a window
that ends inside a call reads it). A worker's reading needs MIN_READ_PUSHES
pushes: a call's last few go alone on the links, or wait long behind the
others, and read the link several times too fast or too slow. One small psum
gives every worker every worker's readings, so all decide alike from the same
numbers: per server the median over the workers that read it, when at least
half of them did (one worker on a slow link of its own reads every server
slow, and the others, waiting on it, push nothing for most of a call). That
psum goes ahead of the job's chunks: a window that waited behind a slowed
call would last as long as the call, and the follower would act one call later.

A server whose reading falls below 1/CHANGE of its baseline (the split's
first settled windows), in WINDOWS_TO_CHANGE windows running, is taken to
run at its planned rate times that ratio, and its share is planned for
SLOWED_SHADE of that; one planned below the job's full rate whose reading
rises above CHANGE times is taken back up the same way (never above the full
rate). A window without a reading is no news either way. The split for the
new rates (link_rate.fractions_for_rates) is handed to the engine as the
next route epoch (Engine::SetRoutes), and
every psum follows it from the same call on every worker (protocol.h,
kRoutes). Only readings relative to the baseline count, so a quieter phase
of the job (smaller psums read slower everywhere) moves nothing: the split
for rates scaled alike is the same. Only where every server's rate is read:
a server the split leaves without bytes keeps the rate it was planned at, so
a quieter phase read on the others alone moved the bytes to it. And small
pushes read a link's latency, not its rate, by phases of the job. So a
window counts only if the mean size of the workers' pushes in it is within
PHASE of the baseline's; in NEW_PHASE_WINDOWS running that are not, the job
has a new phase, and the baseline is taken again in it (of one phase too).

A worker machine's own link is read a second way: from its worker's
readings of the other servers, the fastest of them (a worker on a slowed
link reads every server slow, while a slow server elsewhere slows one of its
readings), against the same worker's baseline, over the median of all
worker machines' such ratios where that is below 1 (a quieter phase slows
every worker alike; while one machine is slow the others read faster, which
says nothing of its link), from windows that at least half the worker
machines, and two, read.
The others, waiting on a slowed worker, may push its server too little in a
window to read it (measured: 2 runs of 4 never followed a worker machine cut
to 400 of 1,000 Mbit/s); its worker's own pushes always read it. A worker
machine's server counts the slower of the two readings, and one the split
leaves without bytes is read by its worker's link alone, which is how it
comes back (no probe on a link that is already the slowest). A worker knows
its own server as the one colocated server it reaches through shared memory.

A server the split leaves without bytes (too slow to help) has no pushes to
read. For a CPU machine's (or a worker machine's whose link its worker's
readings do not give), now and then (PROBE_SHARE: at most every PROBE_EVERY
windows, and less often on a slow link, since a probe stalls the job for its
length) each worker times one psum routed to it alone (kept on that server
whatever the split: fixed routes), sent ahead of the job's chunks (at the
job's priority, a probe waited for whatever psum of the job was queued
before it: pairs probed one after the other read 0.26 and 0.38 s by turns on
equal links, and a recovered server probed first read 0.75 of its reference
every time, never back), sized to take about PROBE_S at the job's full rate:
long enough that a call's fixed costs are a small part of it once the link is back (a probe
sized for the slow rate took 0.069 s where its bytes take 0.048 s at the
full rate, and read a recovered 300 Mbit/s link at 210), and longer than a
rate cap's burst. The times are agreed with the next window's readings
(the fastest worker's: the sum waits for the last worker to start, so the
others' times hold that wait), and give its rate against a reference: a
server that serves at the full rate (of its role if one does, else a worker
machine's), probed beside it, whose time shares the job's traffic alike
(the job's chunks already in flight; a probe alone read an equal link at
0.72-1.0 of it, mostly above 0.85, against a full rate init reads high); a
server read as fast as it runs at the full rate. The order of the probes
turns round at every probe (the first meets the job's chunks in flight), and
a server read CHANGE times faster than planned, or at the full rate within
the probe's error (link_rate.reads_as_full), over two probes running (their
bytes over their seconds, against its reference's) is taken to run at the
rate they read, and the split is planned again: it gets its
share back once the rated split finds it worth one, and is probed on while
it has none and its planned rate is below the full one (or it was left out
for a slowdown: see _left_out_slow). Without a reference (no server serves
at the full rate) its probe alone gives the rate, which reads a recovered
link low rather than high.

Not followed: compressed psums move servers with the rest, and their
servers' error feedback for the moved chunks starts again from zero.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import NamedTuple, Sequence

import numpy as np

from . import link_rate
from .extension import load_core
from .partition import COLOCATED, DEDICATED, server_fractions
from .partition.priority import INT64_MAX

_core = load_core()
log = logging.getLogger("jbps.rates")  # what the follower read and decided (debug: every probe)

WINDOW_S = 0.5
BASELINE_WINDOWS = 3
CHANGE = 1.5  # a reading this many times slower (or faster) than the baseline is a change
# A slowed server's share is planned for this much of the rate its readings give. They read
# it high by up to about a tenth (a worker's pushes go faster once the others' are done),
# and the costs are not alike: a server given too much sets every call's pace by its
# excess, while what it is given too little is spread over all the others. Measured (a CPU
# host cut to 400 of 1,000 Mbit/s, 6 servers): planned at the rate read, 0.135-0.142 of the
# bytes and calls 1.2-1.5x the optimum; at 0.8 of it, 0.103-0.114 and 1.08-1.10x.
SLOWED_SHADE = 0.8
WINDOWS_TO_CHANGE = 3  # in this many windows running (1.5 s: two gave equal links a false change)
PROBES_TO_CHANGE = 2  # a left-out server read faster over this many probes running comes back
# A worker's reading of a server counts from this many pushes acknowledged in the window:
# the last few pushes of a call, alone on the links, read several times faster or (one
# waiting long for its acknowledgement) slower than the link.
MIN_READ_PUSHES = 4
# Readings compare with the baseline only in windows of like pushes: within this factor of the
# baseline's mean push size. A job of small psums reads its links at their latency, not their
# rate, by phases of the job: the loop family across emulated hosts read the same 300 Mbit/s
# links at 32-37 MB/s in a phase of 5.7 KB pushes and at 1.4-9 in phases of 240-720 B ones,
# and re-planned every served server at a tenth of its rate, giving a 30 Mbit/s CPU host left
# out half the bytes or more (whole jobs up to 3.5 times as long as without that host).
PHASE = 2.0
# Windows running of other pushes that make a new phase: the baseline is taken again in it.
NEW_PHASE_WINDOWS = 2 * BASELINE_WINDOWS
# A worker machine's own link is read from at least this many of its worker's readings (the
# fastest of them): from one, a slow server elsewhere would read as a slow worker machine.
MIN_LINK_READINGS = 2
SHARE_EPS = 1e-6  # a share below this is none
MIN_MOVE = 0.02  # a new split moves some server's share by at least this much, else it is not worth an epoch
PROBE_EVERY = 10  # windows (5 s) at least between probes of a server the split leaves without bytes
# A probe goes ahead of the job's chunks and holds the engine's credit window while it runs, so
# on a slow link it stalls the job for its whole length (the loop family across emulated hosts,
# a 30 Mbit/s CPU host left out: 2.7 s every 5 s; benchmarks.spare_host: 1.86x the job without
# that host, 0.99x with this). A server is probed again only after its latest probe's seconds
# over this share (before its first, those its planned rate gives): probes cost the job at most
# about this share of its time, and a recovered slow link is noticed that much later.
PROBE_SHARE = 0.05
PROBE_S = 0.25  # a probe's length at the job's full rate
# But a left-out server's probe takes at most about this long at its planned rate (and a
# quarter of the psum timeout): sized for the full rate, a probe of a host at 1/240 of it
# would stall the job's psums past the default 60 s timeout and end the job. Smaller, it
# reads a recovered link low (a call's fixed costs), which still brings it up by CHANGE at a
# time, each time with a larger probe. A server whose least probe would take half the psum
# timeout is not probed at all: it stays left out.
LONGEST_PROBE_S = 5.0
NAME = "jbps.rates"
AHEAD = INT64_MAX  # the windows' agreement and the probes go ahead of the job's chunks


def readings(before: dict, after: dict) -> list[float]:
    """Bytes per second each server took this worker's pushes between two
    engine_stats(); 0 where there was no reading (no push waited, or shared
    memory, which is not a link)."""
    acked, waited, pushes = (
        _since(before, after, key) for key in ("server_bytes_acked", "server_unacked_seconds", "server_chunks_acked")
    )
    return [
        0.0 if shm or w <= 0 or p < MIN_READ_PUSHES else a / w
        for shm, a, w, p in zip(after["server_shared_memory"], acked, waited, pushes)
    ]


def _since(before: dict, after: dict, key: str) -> list:
    """Per server, how much engine_stats()'s counter `key` grew between the two."""
    return [a - b for a, b in zip(after[key], before[key])]


def push_bytes(before: dict, after: dict) -> float:
    """The mean bytes of this worker's pushes acknowledged over the network
    between two engine_stats(); 0 where fewer than MIN_READ_PUSHES were."""
    network = [not shm for shm in after["server_shared_memory"]]
    acked = sum(a for a, n in zip(_since(before, after, "server_bytes_acked"), network) if n)
    pushes = sum(p for p, n in zip(_since(before, after, "server_chunks_acked"), network) if n)
    return acked / pushes if pushes >= MIN_READ_PUSHES else 0.0


def own_server(roles: Sequence[str], shared_memory: Sequence[bool]) -> int:
    """This worker's colocated server: the one colocated server it reaches
    through shared memory (its own machine's); -1 where there is not exactly one
    (shared memory off: its machine's link is then not read from its readings)."""
    own = [s for s, (role, shm) in enumerate(zip(roles, shared_memory)) if shm and role == COLOCATED]
    return own[0] if len(own) == 1 else -1


@dataclasses.dataclass(frozen=True)
class Window:
    """One window's readings, agreed: the same on every worker."""

    readings: tuple[float, ...]  # per server, the median of the workers' nonzero readings
    settled: bool  # every worker's window ran on the split in use from its start
    probes: tuple[float, ...] = ()  # per server, the fastest worker's probe seconds (0: not probed)
    # Per colocated server, its machine's own link as its worker read it: the fastest of that
    # worker's readings of the other servers (0: none). A worker on a slowed link reads every
    # server slow, however few pushes the others, waiting on it, send its server; a slow server
    # elsewhere slows one of its readings, not the fastest.
    links: tuple[float, ...] = ()
    push_bytes: float = 0.0  # the median of the workers' mean push sizes (0: not known)


def _per_column(matrix: np.ndarray, reduce) -> tuple[float, ...]:
    """Per column, `reduce` of its values above 0 (0 where none is)."""
    return tuple(float(reduce(c[c > 0])) if np.any(c > 0) else 0.0 for c in matrix.T)


def agreed_window(
    matrix: np.ndarray,
    settled: np.ndarray,
    probes: np.ndarray | None = None,
    own: np.ndarray | None = None,
    sizes: np.ndarray | None = None,
) -> Window:
    """matrix: every worker's readings (rows: workers); settled: each worker's
    flag; probes: every worker's probe seconds, if any; own: each worker's
    colocated server, -1 where it has none (or it is not known); sizes: each
    worker's mean push size (push_bytes), if known."""
    fastest = () if probes is None else _per_column(probes, np.min)
    # A server read by fewer than half the workers is no news: one worker on a slow link of
    # its own (the others waiting on it push nothing for most of a call) reads every server slow.
    few = np.sum(matrix > 0, axis=0) < matrix.shape[0] / 2
    median = tuple(0.0 if f else r for f, r in zip(few, _per_column(matrix, np.median)))
    links = [0.0] * matrix.shape[1]
    for row, s in zip(matrix, [] if own is None else own):
        if 0 <= s < len(links) and np.sum(row > 0) >= MIN_LINK_READINGS:
            links[int(s)] = float(np.max(row))
    size = 0.0 if sizes is None else _per_column(np.reshape(sizes, (-1, 1)), np.median)[0]
    return Window(median, bool(np.all(settled > 0)), fastest, tuple(links), size)


def _alike(size: float, baseline: float) -> bool:
    """Whether a window's mean push size is of the baseline's phase (PHASE);
    either unknown (0) counts as alike."""
    return size <= 0 or baseline <= 0 or baseline / PHASE <= size <= baseline * PHASE


class ProbeRead(NamedTuple):
    """One probe of a left-out server, beside its reference's (-1, 0, 0: none)."""

    reference: int
    nbytes: int
    seconds: float
    reference_nbytes: int
    reference_seconds: float


class RateFollower:
    """Decides, from agreed windows, when the split should move and to what.
    Pure: the thread (Follower) feeds it; tests feed it directly.

    A window's readings vary by a quarter or more on steady links (a window
    holds a few calls and the gaps between them), so the baseline is the
    median of the split's first BASELINE_WINDOWS settled windows, and a
    change is a factor CHANGE that holds for one server in WINDOWS_TO_CHANGE
    of its readings running (a slower reading of one server, then a faster
    one of another, once made three and re-planned nothing, but restarted
    the baseline in the slowed state). A changed server is taken to run at
    its planned rate times its ratio in the latest of those windows (the
    first may still hold calls from before the change), never above the
    job's full rate. The ratio, not the readings themselves:
    a server that is not the job's bottleneck reads far below its link (its
    pushers wait on their own links), and init's probe reads links on a
    scale of its own, so only a reading against the same server's earlier
    ones says how its link moved."""

    def __init__(
        self,
        roles: Sequence[str],
        num_workers: int,
        rates: Sequence[float],
        fractions: Sequence[float],
        timeout_s: float = 60.0,
    ):
        self.roles = list(roles)
        self.num_workers = num_workers
        self.timeout_s = timeout_s  # the job's psum timeout: a probe stalls the job's psums
        self.full = float(np.median(rates))
        # The rates the split in use was planned for: bytes/s where measured (they size the probes).
        self.planned = [float(r) for r in rates]
        self.slowed: set[int] = set()  # servers planned at a rate read from a slowdown (SLOWED_SHADE)
        self.fractions = [float(f) for f in fractions]
        self.baseline: list[float] | None = None
        self.link_baseline: list[float] = [0.0] * len(self.roles)  # per colocated server, its machine's link
        self.links_read: set[int] = set()  # colocated servers whose machine's link the latest window read
        self.first: list[Window] = []  # the split's first settled windows, until the baseline
        self.push_baseline = 0.0  # the baseline's mean push size (0: not known)
        self.off_phase = 0  # windows running of pushes unlike the baseline's
        self._restart_streaks()
        self.windows = 0
        self.probing: dict[int, int] = {}  # bytes of the probes whose times the next window brings
        self.next_probe: dict[int, int] = {}  # per server probed, the window of its next probe
        self.probe_count: dict[int, int] = {}  # per server, its probes so far (the order turns on them)
        self._probes_at = -1  # the window the latest probes() chose for
        self.references: dict[int, int] = {}  # of those, a left-out server's reference (_recovered)
        self.probe_reads: dict[int, list[ProbeRead]] = {}  # per left-out server, its latest PROBES_TO_CHANGE

    def _restart_streaks(self) -> None:
        count = len(self.roles)
        self.slow_streak = [0] * count  # per server, its readings running that read it CHANGE times slower
        self.fast_streak = [0] * count  # or faster
        self.ratios = [1.0] * count  # per server, its latest reading over its baseline

    def _serves(self, s: int) -> bool:
        return self.fractions[s] > SHARE_EPS

    def _reference(self, role: str) -> int | None:
        """A server that serves at the job's full rate, if any: of this role if
        one does (its probe meets the job's traffic most alike), else of another
        (a probe alone read a recovered CPU host at 0.8-0.9 of the full rate,
        which init reads high, and left it out: two runs of four). Planned
        within a CPU machine's error of the full rate either way: a server left
        out is read at the reference's planned rate, so one planned high reads
        it high (init once read a worker machine's 300 Mbit/s link at 9 times
        the job's median, which read a CPU host on 30 Mbit/s as recovered)."""
        full = [
            s
            for s, rate in enumerate(self.planned)
            if self._serves(s)
            and link_rate.reads_as_full(DEDICATED, rate, self.full)
            and link_rate.reads_as_full(DEDICATED, self.full, rate)
        ]
        return next((s for s in full if self.roles[s] == role), full[0] if full else None)

    def _left_out_slow(self, s: int) -> bool:
        """Whether the split leaves server s without bytes for its rate: planned
        below the job's full rate, or planned from a slowdown its readings showed
        (a link read at 0.6 of a rate init read high can plan within the probe's
        error of the full rate, and two workers leave out a CPU host even 0.7 as
        fast). One left out at the full rate, as saving nothing, has nothing to
        come back from."""
        if self._serves(s):
            return False
        return s in self.slowed or not link_rate.reads_as_full(self.roles[s], self.planned[s], self.full)

    def _probed(self, s: int) -> bool:
        """Whether server s is probed: left out for its rate, not a worker
        machine's whose link its worker's readings give (they need no probe on a
        link already slow), and not so slow that its probe would take half the
        psum timeout (LONGEST_PROBE_S)."""
        if not self._left_out_slow(s) or s in self.links_read:
            return False
        nbytes = self._left_out_probe_bytes(s)
        return self._probe_seconds(s, nbytes, self.planned[s]) < self.timeout_s / 2

    def probes(self) -> dict[int, int]:
        """{server: bytes} to probe after the latest window, in the order to
        probe them: each server the split leaves without bytes for its rate
        (_left_out_slow) whose next probe is due (PROBE_SHARE), sized for the
        full rate (at most LONGEST_PROBE_S at its planned rate); and beside them a reference, a server that serves at the
        full rate (_reference), sized so too (see _recovered). The order turns
        round at every probe: the first probe meets the job's chunks still in
        flight and the next ones do not (on CI's machine a recovered CPU host
        always probed before its reference read 0.93 of it over 15 probes,
        0.77-1.30 each, and never came back in 120 s), so over two probes
        running each server is probed once first."""
        if self._probes_at == self.windows:
            return dict(self.probing)
        self._probes_at = self.windows
        self.probing, self.references = {}, {}
        for s in range(len(self.roles)):
            if not self._probed(s):
                self.next_probe.pop(s, None)  # left out again later: its probes start from then
                continue
            nbytes = self._left_out_probe_bytes(s)
            planned_gap = self._probe_gap(self._probe_seconds(s, nbytes, self.planned[s]))
            if self.windows >= self.next_probe.setdefault(s, self.windows + planned_gap):
                self.probing[s] = nbytes
                self.next_probe[s] = self.windows + planned_gap  # until its time is read (_recovered)
        left_out = sorted(self.probing)
        for s in left_out:
            ref = self._reference(self.roles[s])
            if ref is not None:
                self.references[s] = ref
                self.probing[ref] = self._probe_bytes(ref)
        if left_out:
            turn = self.probe_count.get(left_out[0], 0) % 2 == 1
            self.probing = {s: self.probing[s] for s in sorted(self.probing, reverse=turn)}
            for s in left_out:
                self.probe_count[s] = self.probe_count.get(s, 0) + 1
        return dict(self.probing)

    def _probe_bytes(self, s: int) -> int:
        """A probe of server s: about PROBE_S at the job's full rate on its NIC."""
        return link_rate.server_probe_bytes(self.roles[s], self.num_workers, self.full, PROBE_S)

    def _left_out_probe_bytes(self, s: int) -> int:
        """A probe of server s left out: _probe_bytes, but no longer than
        LONGEST_PROBE_S (or a quarter of the psum timeout) at its planned rate."""
        longest = min(LONGEST_PROBE_S, self.timeout_s / 4)
        capped = link_rate.server_probe_bytes(self.roles[s], self.num_workers, self.planned[s], longest)
        return min(self._probe_bytes(s), capped)

    def _probe_gap(self, seconds: float) -> int:
        """Windows from a probe that took `seconds` to the next of its server (PROBE_SHARE)."""
        return max(PROBE_EVERY, math.ceil(seconds / PROBE_SHARE / WINDOW_S))

    def _probe_seconds(self, s: int, nbytes: int, rate: float) -> float:
        """Seconds a probe of nbytes takes on server s's NIC at `rate` (_probe_rate's inverse)."""
        return link_rate.server_load(self.roles[s], self.num_workers) * nbytes / max(rate, 1.0)

    def _recovered(self, window: Window) -> dict[int, float]:
        """{server left out: the rate its latest PROBES_TO_CHANGE probes read},
        for those read CHANGE times faster than planned, or at the full rate
        (within the probe's error), over them together: the sum of their bytes
        over the sum of their seconds, so that the turns of the order (probes)
        cancel, and one probe slowed by chance does not hold it out, nor one
        read fast bring it back."""
        out = {}
        for s, nbytes in self.probing.items():
            seconds = window.probes[s] if s < len(window.probes) else 0.0
            if seconds <= 0 or self._serves(s):
                continue
            self.next_probe[s] = self.windows - 1 + self._probe_gap(seconds)  # from the probe's window
            ref = self.references.get(s, -1)
            ref_seconds = window.probes[ref] if 0 <= ref < len(window.probes) else 0.0
            if ref_seconds <= 0:
                ref = -1
            reads = [r for r in self.probe_reads.get(s, []) if r.reference == ref]  # beside another reference: apart
            reads = (reads + [ProbeRead(ref, nbytes, seconds, self.probing.get(ref, 0), ref_seconds)])[
                -PROBES_TO_CHANGE:
            ]
            self.probe_reads[s] = reads
            if len(reads) < PROBES_TO_CHANGE:
                continue
            rate = self._probe_rate(s, sum(r.nbytes for r in reads), sum(r.seconds for r in reads))
            if ref >= 0:
                # Probes share the workers' links with the job's chunks in flight, which read a
                # recovered link below its rate; a reference probed beside it shares them alike
                # and serves at the full rate (_reference), so a server read as fast runs at it.
                total = self._probe_rate(
                    ref, sum(r.reference_nbytes for r in reads), sum(r.reference_seconds for r in reads)
                )
                rate *= self.full / total
            role = self.roles[s]
            if rate > CHANGE * self.planned[s] or link_rate.reads_as_full(role, rate, self.full):
                out[s] = rate
        return out

    def _probe_rate(self, s: int, nbytes: int, seconds: float) -> float:
        """Bytes per second server s's NIC carried in a probe of nbytes."""
        return link_rate.server_load(self.roles[s], self.num_workers) * nbytes / seconds

    def split_rates(self, estimate: list[float] | None = None) -> list[float]:
        """The rates the split is planned for: the estimate (by default the
        planned rates), a slowed server's at SLOWED_SHADE of it."""
        estimate = self.planned if estimate is None else estimate
        return [SLOWED_SHADE * e if s in self.slowed else e for s, e in enumerate(estimate)]

    def _plan(self, estimate: list[float]) -> list[float] | None:
        """The split for these rates, taken as planned; None if it moves too little."""
        shaded = self.split_rates(estimate)
        fractions = link_rate.fractions_for_rates(self.roles, shaded, self.num_workers)
        if fractions is None:
            fractions = server_fractions(self.roles, self.num_workers)
        fractions = [f if f > SHARE_EPS else 0.0 for f in fractions]
        # A left-out server's probes running stand while it stays planned at the same rate:
        # a re-plan for another server's change (or one that moves nothing) says nothing of
        # its link, and probes come only now and then (PROBE_SHARE).
        self.probe_reads = {
            s: r for s, r in self.probe_reads.items() if estimate[s] == self.planned[s] and fractions[s] <= SHARE_EPS
        }
        self.planned = estimate
        self.baseline = None  # the new split's first settled windows make the next one
        self._restart_streaks()
        if max(abs(a - b) for a, b in zip(fractions, self.fractions)) < MIN_MOVE:
            return None
        self.fractions = fractions
        return self.fractions

    def _links(self, window: Window) -> tuple[float, ...]:
        """The window's worker-machine links (none read: zeros)."""
        return window.links or (0.0,) * len(self.roles)

    def _link_ratios(self, window: Window) -> dict[int, float]:
        """{colocated server: its machine's link over its baseline, over the
        median of the worker machines' such ratios} for those read in this
        window and the baseline: one worker machine that slows reads slow
        against the others, while a quieter phase of the job (every worker
        reading every server slower) moves none."""
        links = self._links(window)
        self.links_read = {s for s, r in enumerate(links) if r > 0 and self.roles[s] == COLOCATED}
        raw = {s: links[s] / self.link_baseline[s] for s in self.links_read if self.link_baseline[s] > 0}
        # Read by fewer than half the worker machines (at least two), a window is no news: a slowed
        # machine's worker alone, while the others wait on it and push too little to read, would
        # read itself at its own median, as recovered, and break the slowdown's windows running.
        known = sum(1 for b in self.link_baseline if b > 0)
        if len(raw) < max(2, known / 2):
            return {}
        # Over the median of all of them, its own included: with two workers, over the other's
        # alone, one worker's noise would read doubled in both. Only a median below 1 (a quieter
        # phase) counts: while one machine's link is slow, the others, their pushes no longer
        # sharing the servers' links with its, read 1.3-1.6x faster, which says nothing of its link.
        middle = min(1.0, float(np.median(list(raw.values()))))
        return {s: r / middle for s, r in raw.items()}

    def step(self, window: Window) -> list[float] | None:
        """The new split, or None to keep the one in use."""
        self.windows += 1
        recovered = self._recovered(window)
        link_ratios = self._link_ratios(window)
        if recovered:
            self.slowed -= set(recovered)
            return self._plan([min(self.full, recovered.get(s, p)) for s, p in enumerate(self.planned)])
        if self.baseline is None:
            if window.settled and all(r > 0 or not self._serves(s) for s, r in enumerate(window.readings)):
                # Of one phase (PHASE): a window of other pushes starts the baseline again from it.
                if self.first and not _alike(window.push_bytes, self.first[0].push_bytes):
                    self.first = []
                self.first.append(window)
            if len(self.first) == BASELINE_WINDOWS:
                self.baseline = [float(np.median(column)) for column in zip(*(w.readings for w in self.first))]
                self.link_baseline = list(_per_column(np.array([self._links(w) for w in self.first]), np.median))
                self.push_baseline = float(np.median([w.push_bytes for w in self.first]))
                self.first, self.off_phase = [], 0
            return None
        # A window of pushes unlike the baseline's is no news (PHASE); in enough of them
        # running, the job has a new phase, and the baseline is taken again in it.
        if not _alike(window.push_bytes, self.push_baseline):
            self.off_phase += 1
            if self.off_phase >= NEW_PHASE_WINDOWS:
                self.baseline = None
                self._restart_streaks()
            return None
        self.off_phase = 0
        # Per server: its readings running (a window without one is no news of it, as when a
        # step is longer than a window) that read it CHANGE times slower, or faster. A worker
        # machine's server is read by its pushers and by its own worker's link (the slower of
        # the two counts); one the split leaves without bytes, by its worker's link alone.
        for s, (now, then) in enumerate(zip(window.readings, self.baseline)):
            serves = self._serves(s)
            read = [now / then] if now > 0 and then > 0 and serves else []
            if s in link_ratios:
                read.append(link_ratios[s])
            if not read:
                continue
            ratio = min(read)
            self.slow_streak[s] = self.slow_streak[s] + 1 if serves and ratio < 1 / CHANGE else 0
            self.fast_streak[s] = self.fast_streak[s] + 1 if ratio > CHANGE and self.planned[s] < self.full else 0
            # The rate it is taken to run at: of the readings that read the slowdown, the least
            # slow (its worker's link reads a slowed machine low: 267-367 Mbit/s for 400 where
            # init read 830-900 for 1,000, and its pushers' readings, when there are some, 347-447).
            self.ratios[s] = max(r for r in read if r < 1 / CHANGE) if ratio < 1 / CHANGE else ratio
        slower = {s for s, n in enumerate(self.slow_streak) if n >= WINDOWS_TO_CHANGE}
        faster = {s for s, n in enumerate(self.fast_streak) if n >= WINDOWS_TO_CHANGE}
        if not slower and not faster:
            return None
        self.slowed = (self.slowed | slower) - faster
        # Its latest ratio: the first window of a change may still hold calls from before it.
        return self._plan(
            [min(self.full, p * self.ratios[s]) if s in slower | faster else p for s, p in enumerate(self.planned)]
        )


class Follower:
    """The thread that reads, agrees and re-plans on every worker. Every
    worker of the job runs one from jbps.init until jbps.shutdown."""

    def __init__(self, decide: RateFollower, rank: int, num_workers: int, timeout_s: float):
        self._decide = decide
        self._rank, self._n = rank, num_workers
        self._init_fractions = tuple(decide.fractions)  # the agreement psum's own routes (the plans' fractions)
        self._wait_s = link_rate.backstop_s(timeout_s)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held while the engine is told a split; shutdown waits for it
        self.epochs: list[dict] = []  # each split announced: epoch, fractions, the rates behind them
        self._thread = threading.Thread(target=self._run, name="jbps-rates", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        count = len(self._decide.roles)
        before = _core.engine_stats()
        epoch = 0  # the latest split this worker announced
        probed = np.zeros(count, np.float32)  # seconds of the latest window's probes, per server
        own = own_server(self._decide.roles, before["server_shared_memory"])
        while not self._stop.wait(WINDOW_S):
            after = _core.engine_stats()
            # Every worker's readings, whether its window ran on the latest split
            # throughout, its probes' seconds, its colocated server (+1; 0: none), and
            # its pushes' mean size.
            matrix = np.zeros((self._n, 2 * count + 3), np.float32)
            matrix[self._rank, :count] = readings(before, after)
            matrix[self._rank, count] = before["routes_used"] >= epoch
            matrix[self._rank, count + 1 : 2 * count + 1] = probed
            matrix[self._rank, -2] = own + 1
            matrix[self._rank, -1] = push_bytes(before, after)
            before = after
            try:
                link_rate.psum_host(NAME, matrix.reshape(-1), self._init_fractions, self._wait_s, priority=AHEAD)
                window = agreed_window(
                    matrix[:, :count],
                    matrix[:, count],
                    matrix[:, count + 1 : 2 * count + 1],
                    matrix[:, -2] - 1,
                    matrix[:, -1],
                )
                split = self._decide.step(window)
                if any(window.probes):
                    log.debug(
                        "window %d: probe seconds %s, probes held per server %s, planned %s",
                        self._decide.windows,
                        [round(p, 3) for p in window.probes],
                        {s: len(r) for s, r in self._decide.probe_reads.items()},
                        [f"{r / 1e6:.0f}M" for r in self._decide.planned],
                    )
                probed = self._probe(self._decide.probes(), count)
            except RuntimeError:
                return  # the job ended or failed: its psums say so
            if split is None:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                epoch = _core.engine_set_routes(split)
                self.epochs.append(
                    {
                        "epoch": epoch,
                        "fractions": split,
                        "rates": list(self._decide.planned),
                        "split_rates": self._decide.split_rates(),
                    }
                )
            log.info(
                "window %d: split %s for rates %s (route epoch %d)",
                self._decide.windows,
                [round(f, 3) for f in split],
                [f"{r / 1e6:.0f}M" for r in self._decide.planned],
                epoch,
            )

    def _probe(self, sizes: dict[int, int], count: int) -> np.ndarray:
        """Seconds of one psum of sizes[s] bytes routed to server s alone, per
        server (0 where none); every worker probes the same servers at the same window."""
        seconds = np.zeros(count, np.float32)
        for s, nbytes in sizes.items():  # in the order given: the same on every worker
            seconds[s] = link_rate.probe_server(f"{NAME}.probe{s}", nbytes, count, s, self._wait_s, True, AHEAD)
        return seconds

    def stop(self) -> None:
        """Before the engine stops; the thread ends once its psum fails or returns."""
        with self._lock:
            self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
