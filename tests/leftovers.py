"""What a job leaves behind, read from /proc: processes carrying a marker in
their environment, the TCP sockets a process holds, and the shared-memory
files MPICH made for the job (Linux only)."""

import os
import socket
import struct
import threading
import time

from jbps.bootstrap.mpi_guard import mapped_segments

LISTEN = "0A"  # the TCP state code of a listening socket in /proc/net/tcp


def processes_with(marker):
    """PIDs whose environment holds JBPS_TEST_MARKER=marker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"JBPS_TEST_MARKER={marker}".encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def assert_nothing_left(env):
    """Every process of the job marked in env is gone (within 10 s)."""
    deadline = time.monotonic() + 10
    while processes_with(env["JBPS_TEST_MARKER"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(env["JBPS_TEST_MARKER"]) == []


class MpichSegments:
    """While open, notes every MPICH shared-memory file (/dev/shm/mpich_shm_*)
    that a process of the marked job maps: the job's own, not other jobs'."""

    def __init__(self, env):
        self.marker, self.seen = env["JBPS_TEST_MARKER"], set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self._stop.wait(0.05):
            self.seen |= mapped_segments(processes_with(self.marker))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def assert_none_left(self):
        """The job mapped at least one file (else there was nothing to check)
        and every one is gone (within 10 s: the job's clean-up runs as it ends)."""
        assert self.seen, "the job mapped no MPICH shared-memory file: nothing was checked"
        deadline = time.monotonic() + 10
        while any(map(os.path.exists, self.seen)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in self.seen if os.path.exists(p)] == []


def _address(hex_addr):
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    # /proc/net/tcp6 prints the address as four little-endian 32-bit words.
    words = struct.unpack("<4I", raw)
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words)), int(port, 16)


def tcp_sockets(pid):
    """[(local ip, port, state code)] of every TCP socket `pid` holds open."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[9] in inodes:
                found.append((*_address(fields[1]), fields[3]))
    return found


def listening(pid):
    """[(ip, port)] `pid` listens on."""
    return [(ip, port) for ip, port, state in tcp_sockets(pid) if state == LISTEN]
