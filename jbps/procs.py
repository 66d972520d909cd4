"""Ending the processes we started, and everything they spawned, by PID.

Children are started in their own session (start_new_session=True), so a
group signal reaches what they fork. mpiexec's proxies and ranks call setsid
and leave that group, so before signalling we snapshot every descendant from
/proc and afterwards kill the ones still alive, matching PID *and* start time
so a recycled PID is never hit. Nothing here ever signals a process by name.

An MPI job killed this way never reaches MPI_Finalize, where MPICH removes its
shared-memory file (/dev/shm/mpich_shm_*): the files the family maps are noted
before the kill and removed after it, once no process maps them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Iterable, Sequence

from .bootstrap.mpi_guard import mapped_segments, remove_unmapped

log = logging.getLogger(__name__)


def _proc_start(pid: int) -> tuple[int, str] | None:
    """(ppid, start time) of `pid` from /proc, or None if it is gone (Linux only)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[19]
    except (OSError, IndexError, ValueError):
        return None


def descendants(root_pids: Iterable[int]) -> dict[int, str]:
    """Snapshot {pid: start time} of every live descendant of `root_pids`."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    info = {pid: st for pid in pids if (st := _proc_start(pid)) is not None}
    found: dict[int, str] = {}
    todo = list(root_pids)
    while todo:
        parent = todo.pop()
        for pid, (ppid, start) in info.items():
            if ppid == parent and pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group start_new_session created
    except ProcessLookupError:
        pass


def terminate(procs: Sequence[subprocess.Popen], grace_s: float = 0.0, what: str = "processes") -> None:
    """SIGTERM the groups (if grace_s > 0: e.g. mpiexec then tears its ranks
    down), wait up to grace_s, SIGKILL what is left and every descendant from
    the snapshot, then reap the children."""
    live = [p for p in procs if p.poll() is None]
    family = descendants(p.pid for p in live) if live else {}
    segments = mapped_segments([*family, *(p.pid for p in live)])
    if grace_s > 0:
        for p in live:
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.05)
    for p in live:
        if p.poll() is None:
            signal_group(p, signal.SIGKILL)
    for pid, start in family.items():
        st = _proc_start(pid)
        if st is not None and st[1] == start:
            log.debug("%s: killing leftover pid %d", what, pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("%s: pid %d did not exit after SIGKILL", what, p.pid)
    remove_unmapped(segments)
