"""Following links whose rates change while the job runs.

jbps.init measures each server's link and splits the bytes by those rates
(link_rate.py, partition/rated_split.py). A link can slow later (another
tenant, a throttled NIC): its server then sets every psum's pace. While a job
that spans hosts runs, a thread on every worker reads, once a window, how
fast each server took this worker's pushes (bytes acknowledged over the time
some push waited for its acknowledgement: the server's own link, since a
push is acknowledged on arrival). One small psum gives every worker every
worker's readings, so all decide alike from the same numbers: per server the
median over the workers that reach it over the network (one worker on a slow
link of its own reads every server slow; the others do not).

A server whose reading falls below 1/CHANGE of its reading when the split in
use began, in two windows running, is taken to run at its planned rate times
that ratio; one planned below the job's full rate whose reading rises above
CHANGE times is taken back up the same way (never above the full rate). The
split for the new rates (link_rate.fractions_for_rates) is handed to the
engine as the next route epoch (Engine::SetRoutes), and every psum follows
it from the same call on every worker (protocol.h, kRoutes). Only readings
relative to the split's first window count, so a quieter phase of the job
(smaller psums read slower everywhere) moves nothing: every server reads
slower alike, and the split for rates scaled alike is the same.

Not followed: a server the split leaves without bytes (too slow to help) is
not read again, so it does not come back when its link recovers; compressed
psums move servers with the rest, and their servers' error feedback for the
moved chunks starts again from zero.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from . import link_rate
from .extension import load_core
from .partition import server_fractions

_core = load_core()

WINDOW_S = 1.0
CHANGE = 1.4  # a reading this many times slower (or faster) than the split's first one is a change
WINDOWS_TO_CHANGE = 2  # in this many windows running
MIN_MOVE = 0.02  # a new split moves some server's share by at least this much, else it is not worth an epoch
NAME = "jbps.rates"


def readings(before: dict, after: dict) -> list[float]:
    """Bytes per second each server took this worker's pushes between two
    engine_stats(); 0 where there was no reading (no push waited, or shared
    memory, which is not a link)."""
    out = []
    for s, shm in enumerate(after["server_shared_memory"]):
        acked = after["server_bytes_acked"][s] - before["server_bytes_acked"][s]
        waited = after["server_unacked_seconds"][s] - before["server_unacked_seconds"][s]
        out.append(0.0 if shm or waited <= 0 or acked <= 0 else acked / waited)
    return out


def agreed_readings(matrix: np.ndarray) -> list[float]:
    """Per server, the median of the workers' nonzero readings (rows: workers)."""
    out = []
    for column in matrix.T:
        seen = column[column > 0]
        out.append(float(np.median(seen)) if seen.size else 0.0)
    return out


class RateFollower:
    """Decides, from agreed readings, when the split should move and to what.
    Pure: the thread (Follower) feeds it; tests feed it directly."""

    def __init__(self, roles: Sequence[str], num_workers: int, rates: Sequence[float], fractions: Sequence[float]):
        self.roles = list(roles)
        self.num_workers = num_workers
        self.full = float(np.median(rates))
        self.planned = [float(r) for r in rates]  # the rates the split in use was planned for
        self.fractions = [float(f) for f in fractions]
        self.baseline: list[float] | None = None
        self.streak = 0

    def step(self, agreed: Sequence[float]) -> list[float] | None:
        """The new split, or None to keep the one in use."""
        if self.baseline is None:
            if all(r > 0 or f == 0 for r, f in zip(agreed, self.fractions)):
                self.baseline = list(agreed)
            return None
        estimate, changed = list(self.planned), False
        for s, (now, then) in enumerate(zip(agreed, self.baseline)):
            if now <= 0 or then <= 0:
                continue
            ratio = now / then
            if ratio < 1 / CHANGE or (ratio > CHANGE and self.planned[s] < self.full):
                estimate[s] = min(self.full, self.planned[s] * ratio)
                changed = True
        self.streak = self.streak + 1 if changed else 0
        if self.streak < WINDOWS_TO_CHANGE:
            return None
        self.streak = 0
        fractions = link_rate.fractions_for_rates(self.roles, estimate, self.num_workers)
        if fractions is None:
            fractions = server_fractions(self.roles, self.num_workers)
        self.planned = estimate
        self.baseline = None  # the new split's first window is the next baseline
        if max(abs(a - b) for a, b in zip(fractions, self.fractions)) < MIN_MOVE:
            return None
        self.fractions = list(fractions)
        return self.fractions


class Follower:
    """The thread that reads, agrees and re-plans on every worker. Every
    worker of the job runs one from jbps.init until jbps.shutdown."""

    def __init__(self, decide: RateFollower, rank: int, num_workers: int, init_fractions, timeout_s: float):
        self._decide = decide
        self._rank, self._n = rank, num_workers
        self._init_fractions = tuple(init_fractions)  # the agreement psum's own routes (the plans' fractions)
        self._wait_s = 2 * timeout_s + 10
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held while the engine is told a split; shutdown waits for it
        self.epochs: list[tuple[int, list[float]]] = []  # (epoch, split), for tests and the benchmark
        self._thread = threading.Thread(target=self._run, name="jbps-rates", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        count = len(self._decide.roles)
        before = _core.engine_stats()
        while not self._stop.wait(WINDOW_S):
            after = _core.engine_stats()
            matrix = np.zeros((self._n, count), np.float32)
            matrix[self._rank] = readings(before, after)
            before = after
            try:
                link_rate.psum_host(NAME, matrix.reshape(-1), self._init_fractions, self._wait_s)
            except RuntimeError:
                return  # the job ended or failed: its psums say so
            split = self._decide.step(agreed_readings(matrix.reshape(self._n, count)))
            if split is None:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self.epochs.append((_core.engine_set_routes(split), split))

    def stop(self) -> None:
        """Before the engine stops; the thread ends once its psum fails or returns."""
        with self._lock:
            self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
