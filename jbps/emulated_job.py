"""A jbps job across emulated hosts (emulated_network.py), started as on real ones.

BytePS's environment bootstrap, nothing emulation-specific: a scheduler on the
first host, a summation server on every server host (the scheduler makes it
*colocated* when a worker shares its host, *dedicated* otherwise), and the
workers on theirs, all with the same DMLC_* variables. Servers listen on the
address their host reaches the scheduler from, so traffic between hosts
crosses the emulated links while a worker and the server on its own host
share memory, as they would on one machine.

Used by `python -m jbps.bench.network` and the multi-host tests.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from .emulated_network import EmulatedNetwork
from .procs import terminate

_PKG_PARENT = str(Path(__file__).resolve().parent.parent)
_SCHEDULER_LISTENING = re.compile(r"jbps\.scheduler listening on (\S+):(\d+)")
_SERVER_DONE = re.compile(r"done: (\d+) pushes, ([\d.]+) MiB received")


@dataclasses.dataclass
class ProcessOutput:
    name: str  # "worker 0", "server 2 (host 5)"
    host: int
    returncode: int | None
    stdout: str
    stderr: str


@dataclasses.dataclass
class JobResult:
    workers: list[ProcessOutput]
    servers: list[ProcessOutput]

    def server_mib_received(self) -> dict[int, float]:
        """MiB each server received, by host (from its exit line)."""
        out = {}
        for s in self.servers:
            m = _SERVER_DONE.search(s.stderr)
            if m:
                out[s.host] = float(m.group(2))
        return out


class JobFailed(RuntimeError):
    pass


def python_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for jbps processes: importing this jbps first."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_job(net: EmulatedNetwork, worker_hosts: Sequence[int], server_hosts: Sequence[int],
            argv: Sequence[str], *, env: Mapping[str, str] | None = None, local_devices: int = 1,
            timeout_s: float = 300, python: str = sys.executable) -> JobResult:
    """Runs `python argv...` as one worker on each of `worker_hosts` (rank i on
    worker_hosts[i]) with a server on each of `server_hosts`; returns when every
    worker has exited and the servers have. Raises JobFailed, with every
    process's output, when a worker fails or the job takes over `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix="jbps-emulated-job-") as tmp:
        job = _Job(net, Path(tmp), python_env(env), python)
        try:
            return job.run(list(worker_hosts), list(server_hosts), list(argv), local_devices, timeout_s)
        finally:
            job.end()


class _Job:
    def __init__(self, net: EmulatedNetwork, folder: Path, env: dict[str, str], python: str):
        self.net, self.dir, self.env, self.python = net, folder, env, python
        self.procs: list[tuple[str, int, subprocess.Popen]] = []

    def spawn(self, name: str, host: int, argv: list[str], env: Mapping[str, str]) -> subprocess.Popen:
        stem = name.replace(" ", "")
        with open(self.dir / f"{stem}.out", "w") as out, open(self.dir / f"{stem}.err", "w") as err:
            # cwd: the job's own folder, so `python -m` never imports a source checkout by accident.
            proc = self.net.run(host, argv, env=env, stdout=out, stderr=err, cwd=str(self.dir))
        self.procs.append((name, host, proc))
        return proc

    def output(self, name: str, host: int, proc: subprocess.Popen) -> ProcessOutput:
        stem = name.replace(" ", "")
        read = lambda suffix: (self.dir / f"{stem}.{suffix}").read_text(errors="replace")  # noqa: E731
        return ProcessOutput(name, host, proc.poll(), read("out"), read("err"))

    def describe(self) -> str:
        parts = []
        for name, host, proc in self.procs:
            o = self.output(name, host, proc)
            parts.append(f"--- {name} on host {host} (exit {o.returncode}):\n{o.stderr[-2500:]}")
        return "\n".join(parts)

    def run(self, worker_hosts, server_hosts, argv, local_devices, timeout_s) -> JobResult:
        deadline = time.monotonic() + timeout_s
        n, s = len(worker_hosts), len(server_hosts)
        timeout = self.env.get("JBPS_TIMEOUT_S") or str(max(30, int(timeout_s)))
        base = dict(self.env, JBPS_TIMEOUT_S=timeout, DMLC_NUM_WORKER=str(n), DMLC_NUM_SERVER=str(s))
        scheduler_host = worker_hosts[0]
        sched = self.spawn("scheduler", scheduler_host,
                           [self.python, "-m", "jbps.scheduler", "--bind",
                            f"{self.net.hosts[scheduler_host].address}:0"], dict(base, DMLC_ROLE="scheduler"))
        port = None
        while port is None:
            m = _SCHEDULER_LISTENING.search((self.dir / "scheduler.out").read_text())
            if m:
                port = m.group(2)
            elif sched.poll() is not None or time.monotonic() > deadline:
                raise JobFailed(f"the scheduler did not start:\n{self.describe()}")
            else:
                time.sleep(0.02)
        base.update(DMLC_PS_ROOT_URI=self.net.hosts[scheduler_host].address, DMLC_PS_ROOT_PORT=port)
        servers = [self.spawn(f"server {i}", host, [self.python, "-m", "jbps.server"], dict(base, DMLC_ROLE="server"))
                   for i, host in enumerate(server_hosts)]
        flags = f"{self.env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={local_devices}".strip()
        workers = [self.spawn(f"worker {rank}", host, [self.python, *argv],
                              dict(base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(rank), JAX_PLATFORMS="cpu",
                                   XLA_FLAGS=flags))
                   for rank, host in enumerate(worker_hosts)]
        while any(p.poll() is None for p in workers):
            if any(p.poll() not in (None, 0) for p in workers):
                break
            if time.monotonic() > deadline:
                raise JobFailed(f"the job did not finish within {timeout_s:g} s:\n{self.describe()}")
            time.sleep(0.05)
        if any(p.returncode != 0 for p in workers):
            time.sleep(1)  # let the others report what they saw
            raise JobFailed(f"a worker failed:\n{self.describe()}")
        for p in servers:  # they exit once every worker said goodbye
            try:
                p.wait(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise JobFailed(f"a server did not exit after the job:\n{self.describe()}") from None
        by_name = {name: (host, proc) for name, host, proc in self.procs}
        return JobResult(
            workers=[self.output(f"worker {r}", *by_name[f"worker {r}"]) for r in range(n)],
            servers=[self.output(f"server {i}", *by_name[f"server {i}"]) for i in range(s)])

    def end(self) -> None:
        procs = [p for _, _, p in self.procs]
        terminate(procs, 0.0, "emulated job")
        self.net.procs = [p for p in self.net.procs if p not in procs]
