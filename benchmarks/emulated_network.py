"""Hosts emulated on this machine: one network namespace per host, joined by a bridge.

Each host is a network namespace with one veth ("eth0") into a bridge that lives
in a namespace of its own; a token-bucket filter (tc tbf) on both ends of every
veth caps that host's NIC at `rate` in each direction, so a host's upload and
download are separate links, as on a real full-duplex NIC. Addresses come from
the loopback range (127.2.0.1 to 127.2.0.254, with route_localnet on), so no
packet can leave the machine, and each namespace's loopback keeps only
127.0.0.1 (its usual 127.0.0.0/8 route would otherwise swallow its peers'
addresses). `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: each
host gets one that resolves this machine's host name to its own address (gloo
and MPI find their address that way) and every host's name to its address.

Everything is named after this run (jbps-<pid>-<random>-...), so two runs never
meet; closing removes the namespaces (which takes their veths and qdiscs with
them), the hosts files and every process started through run(). Needs root,
`ip` and `tc` (iproute2); without them the constructor says so in one line.

This kernel-level emulation has no added delay (no netem here): links differ
from real ones in having almost no propagation latency.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Mapping, Sequence

from jbps.procs import terminate
from jbps.sizes import format_rate, parse_rate  # noqa: F401 (the lab's rate words are the package's)

log = logging.getLogger(__name__)

NETNS_ETC = Path("/etc/netns")
FIRST_ADDRESS = ipaddress.IPv4Address("127.2.0.1")
PREFIX_LEN = 24
MAX_HOSTS = 2 ** (32 - PREFIX_LEN) - 2  # the subnet less its network and broadcast addresses
# The queue in front of each rate cap: what a NIC's queue or a switch port
# holds before it drops. 20 ms at the link's rate, and never less than
# Linux's default NIC queue (txqueuelen 1000 full-size frames): with less, a
# host sending to many peers at once drops its own packets at a slow rate.
QUEUE_S = 0.020
MIN_QUEUE_BYTES = 1000 * 1514
# Bytes the cap lets through at once: a couple of milliseconds of the link,
# and never below two 64 KiB TSO segments with their headers: tbf splits a
# segment larger than its burst into packets, each timed on its own, which
# at slow rates costs more CPU than the machine has.
BURST_S = 0.002
MIN_BURST_BYTES = 160 << 10
_NAME = re.compile(r"^jbps-(\d+)-[0-9a-f]{6}-")


_HYDRA_LAUNCHER = """#!/bin/sh
[ "$1" = "-x" ] && shift
host=$1; shift
exec ip netns exec "$host" sh -c "$*"
"""
# MPICH between emulated hosts: its TCP netmod, never shared memory (the hosts
# share this machine's /dev/shm, which real hosts would not).
MPI_TCP_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "MPIR_CVAR_NOLOCAL": "1", "FI_TCP_IFACE": "eth0"}


class NetworkError(RuntimeError):
    """The emulated network cannot be made here (not root, no iproute2, bad input)."""


@dataclasses.dataclass(frozen=True)
class Host:
    index: int
    name: str  # also its network namespace
    address: str


def _run(argv: Sequence[str], what: str) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise NetworkError(f"{what}: `{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}")


def check_tools() -> None:
    """NetworkError (one line) unless this process can make namespaces and caps."""
    if os.geteuid() != 0:
        raise NetworkError("emulated hosts need root (network namespaces and tc); run as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetworkError(f"emulated hosts need `{tool}` (Debian: apt-get install iproute2)")
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise NetworkError(f"`ip netns` does not work here: {proc.stderr.strip()}")


def remove_stale() -> list[str]:
    """Removes the namespaces and hosts files of earlier runs whose process is
    gone (a run killed with SIGKILL cannot clean up). Only names this module
    makes, and only when the PID in the name is not alive."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    stale = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            stale.append(name)
    if not stale:
        return []
    # Their processes first (orphans of the dead run), found by the namespace they live in.
    inodes = {}
    for name in stale:
        try:
            inodes[os.stat(f"/run/netns/{name}").st_ino] = name
        except OSError:
            pass
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for name in stale:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    log.warning("removed %d namespaces (and their processes) of an earlier run that no longer exists", len(stale))
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedNetwork:
    """`num_hosts` hosts, every NIC capped at `rate` each way (bits/s, or text for parse_rate). A context manager:
    everything is made on enter and removed on exit, on error and on SIGTERM/SIGINT
    (which the caller sees as KeyboardInterrupt/SystemExit)."""

    def __init__(
        self, num_hosts: int, rate: float | str, *, queue_s: float = QUEUE_S, host_rates: dict[int, float] | None = None
    ):
        if not isinstance(num_hosts, int) or num_hosts < 1:
            raise NetworkError(f"need at least one host, got {num_hosts!r}")
        if num_hosts > MAX_HOSTS:
            raise NetworkError(
                f"{num_hosts} hosts, but their address range {FIRST_ADDRESS - 1}/{PREFIX_LEN} has {MAX_HOSTS} addresses"
            )
        try:
            self.rate = parse_rate(rate) if isinstance(rate, str) else float(rate)
            if not self.rate >= 1e5:
                raise ValueError(f"rate {rate!r} bits/s is below 100 kbit/s")
        except ValueError as exc:
            raise NetworkError(str(exc)) from None
        self.queue_s = queue_s
        # Hosts whose NIC differs from `rate` (bits/s each way), by index.
        self.host_rates = dict(host_rates or {})
        for host, host_rate in self.host_rates.items():
            if not 0 <= host < num_hosts:
                raise NetworkError(f"a rate for host {host}, but the hosts are 0 to {num_hosts - 1}")
            if not host_rate >= 1e5:
                raise NetworkError(f"host {host}'s rate {host_rate!r} bits/s is below 100 kbit/s")
        self.run_id = f"jbps-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.run_id}-br"
        self.hosts = [Host(i, f"{self.run_id}-h{i}", str(FIRST_ADDRESS + i)) for i in range(num_hosts)]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces, in creation order
        self._old_handlers: dict[int, object] = {}

    # -- making and removing -------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        check_tools()
        remove_stale()
        self._catch_signals()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _catch_signals(self) -> None:
        """SIGTERM becomes SystemExit, so `with` blocks remove what they made."""

        def on_term(signum, frame):
            raise SystemExit(128 + signum)

        if threading.current_thread() is threading.main_thread():
            self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_term)

    def rate_of(self, host: int) -> float:
        """Host `host`'s NIC rate, bits/s each way."""
        return self.host_rates.get(host, self.rate)

    def _tbf(self, rate: float) -> list[str]:
        rate_bytes = rate / 8
        burst = max(MIN_BURST_BYTES, int(rate_bytes * BURST_S))
        limit = max(MIN_QUEUE_BYTES, int(rate_bytes * self.queue_s))
        return ["tbf", "rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(limit)]

    def set_rate(self, host: int, rate: float) -> None:
        """Changes host `host`'s NIC rate (bits/s each way) while everything runs: a
        throttled NIC, another tenant (tc qdisc change)."""
        self.host_rates[host] = float(rate)
        h, port = self.hosts[host], f"p{host}"
        _run(
            ["tc", "-n", h.name, "qdisc", "change", "dev", "eth0", "root", *self._tbf(rate)], f"host {host}: upload cap"
        )
        _run(
            ["tc", "-n", self.bridge_ns, "qdisc", "change", "dev", port, "root", *self._tbf(rate)],
            f"host {host}: download cap",
        )

    def _make(self) -> None:
        _run(["ip", "netns", "add", self.bridge_ns], "creating the bridge namespace")
        self._made.append(self.bridge_ns)
        br = ["ip", "-n", self.bridge_ns]
        _run(br + ["link", "add", "br0", "type", "bridge"], "creating the bridge")
        _run(br + ["link", "set", "br0", "up"], "starting the bridge")
        hostname = socket.gethostname()
        names = "".join(f"{h.address} {h.name} h{h.index}\n" for h in self.hosts)
        for h in self.hosts:
            _run(["ip", "netns", "add", h.name], f"creating host {h.index}")
            self._made.append(h.name)
            port = f"p{h.index}"
            ns = ["ip", "-n", h.name]
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    h.name,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    self.bridge_ns,
                ],
                f"creating host {h.index}'s link",
            )
            _run(br + ["link", "set", port, "master", "br0", "up"], f"plugging host {h.index} into the bridge")
            # Loopback keeps 127.0.0.1 only: its /8 route would make the peers' addresses local.
            _run(ns + ["link", "set", "lo", "up"], f"host {h.index}: loopback")
            _run(ns + ["addr", "del", "127.0.0.1/8", "dev", "lo"], f"host {h.index}: loopback")
            _run(ns + ["addr", "add", "127.0.0.1/32", "dev", "lo"], f"host {h.index}: loopback")
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    h.name,
                    "sysctl",
                    "-qw",
                    "net.ipv4.conf.all.route_localnet=1",
                    "net.ipv4.conf.eth0.route_localnet=1",
                ],
                f"host {h.index}: route_localnet",
            )
            _run(ns + ["addr", "add", f"{h.address}/{PREFIX_LEN}", "dev", "eth0"], f"host {h.index}: address")
            _run(ns + ["link", "set", "eth0", "up"], f"host {h.index}: link up")
            # The cap each way: the host's upload on its side, its download on the bridge's.
            _run(
                ["tc", "-n", h.name, "qdisc", "add", "dev", "eth0", "root", *self._tbf(self.rate_of(h.index))],
                f"host {h.index}: upload cap",
            )
            _run(
                ["tc", "-n", self.bridge_ns, "qdisc", "add", "dev", port, "root", *self._tbf(self.rate_of(h.index))],
                f"host {h.index}: download cap",
            )
            etc = NETNS_ETC / h.name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{h.address} {hostname}\n{names}")
        log.info("%d emulated hosts at %s each way (%s)", len(self.hosts), format_rate(self.rate), self.run_id)
        for host, host_rate in sorted(self.host_rates.items()):
            log.info("host %d at %s each way", host, format_rate(host_rate))

    def close(self) -> None:
        """Ends every process started with run(), then removes what was made. Safe to call twice."""
        if self.procs:
            terminate(self.procs, 0.0, "emulated hosts")
            self.procs = []
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        self._made = []
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}

    # -- using it ------------------------------------------------------------
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """argv run inside host `host` (as root, `ip netns exec` keeps the environment)."""
        return ["ip", "netns", "exec", self.hosts[host].name, *argv]

    def run(
        self,
        host: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout=None,
        stderr=None,
        cwd: str | None = None,
    ) -> subprocess.Popen:
        """Starts argv on host `host` in its own session; ended by close()."""
        proc = subprocess.Popen(
            self.command(host, argv),
            env=None if env is None else dict(env),
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            start_new_session=True,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def launcher(self, workdir: str) -> Path:
        """An ssh-like launcher written into `workdir`: `LAUNCHER [-x] HOST LINE`
        runs the shell line LINE in HOST's namespace, as ssh runs it on a host
        (MPICH's hydra, `jbps run --launcher`)."""
        launcher = Path(workdir) / "netns-launcher"
        launcher.write_text(_HYDRA_LAUNCHER)
        launcher.chmod(0o755)
        return launcher

    def mpiexec(self, mpiexec: str, workdir: str, ranks_per_host: Mapping[int, int]) -> list[str]:
        """The start of an MPICH `mpiexec` command line that runs its ranks on these
        hosts, as a real cluster's host file would: `ranks_per_host` {host: ranks}
        in rank order. Run it on the first of them (run(host, ...)) with MPI_TCP_ENV
        in the environment. Hydra's ssh launcher runs `LAUNCHER [-x] HOST COMMAND`:
        here the launcher, written into `workdir`, runs COMMAND in HOST's namespace."""
        launcher = self.launcher(workdir)
        hostfile = Path(workdir) / "hosts"
        hostfile.write_text("".join(f"{self.hosts[h].name}:{n}\n" for h, n in ranks_per_host.items()))
        first = self.hosts[next(iter(ranks_per_host))].name
        return [mpiexec, "-launcher", "ssh", "-launcher-exec", str(launcher), "-localhost", first, "-f", str(hostfile)]

    def cut(self, host: int) -> None:
        """Takes host `host`'s link down on the bridge side: its packets stop, with
        no FIN or RST, as when a cable is pulled or a machine loses power."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", f"p{host}", "down"], f"cutting host {host}'s link")

    def counters(self, host: int) -> dict[str, int]:
        """Bytes host `host`'s NIC sent and received (its eth0)."""
        out = subprocess.run(
            ["ip", "-n", self.hosts[host].name, "-s", "-j", "link", "show", "eth0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        stats = json.loads(out.stdout)[0]["stats64"]
        return {"tx_bytes": int(stats["tx"]["bytes"]), "rx_bytes": int(stats["rx"]["bytes"])}
