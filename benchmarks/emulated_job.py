"""A jbps job across emulated hosts (emulated_network.py), started as on real ones.

BytePS's environment bootstrap, nothing emulation-specific: a scheduler on the
first host, a summation server on every server host (the scheduler makes it
*colocated* when a worker shares its host, *dedicated* otherwise), and the
workers on theirs, all with the same DMLC_* variables. Servers listen on the
address their host reaches the scheduler from, so traffic between hosts
crosses the emulated links while a worker and the server on its own host
share memory, as they would on one machine.

Used by `python -m benchmarks.network` and the multi-host tests.
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
from jbps.procs import terminate
from jbps.scheduler.admission import new_secret

_PKG_PARENT = str(Path(__file__).resolve().parent.parent)
_SCHEDULER_LISTENING = re.compile(r"jbps\.scheduler listening on (\S+):(\d+)")
_SERVER_DONE = re.compile(r"done: (\d+) pushes, [\d.]+ MiB received \((\d+) bytes\)")
_SERVER_LISTENING = re.compile(r"jbps\.server listening on (\S+:\d+) for \d+ workers \((\w+)")


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

    def servers_by_address(self) -> dict[str, dict]:
        """{address: {"host", "role", "bytes_received"}} of every server, from
        its listening line and its exit line (bytes None if it has none)."""
        out = {}
        for s in self.servers:
            listening = _SERVER_LISTENING.search(s.stdout)
            if listening:
                done = _SERVER_DONE.search(s.stderr)
                out[listening.group(1)] = {
                    "host": s.host,
                    "role": listening.group(2),
                    "bytes_received": int(done.group(2)) if done else None,
                }
        return out


class JobFailed(RuntimeError):
    pass


# What tells a process it is part of a job, or changes jbps's settings: jbps's,
# BytePS's and MPI launchers' variables.
JOB_VARIABLE_PREFIXES = ("JBPS_", "DMLC_", "BYTEPS_", "PMI_", "OMPI_", "PMIX_")


# For every process the lab and the tests start, unless the environment sets it: models draw their
# initial values with jax's non-partitionable threefry. jbps draws no random numbers and timed steps
# are the same, but jax 0.10's XLA:CPU compiles the partitionable one for seconds per kernel shape
# (a flax conv's (3, 3, 8, 16): 4.9 s, against 0.26 s), in every worker of every job.
QUICK_MODEL_INIT = ("JAX_THREEFRY_PARTITIONABLE", "0")


def job_free_env(**extra: str) -> dict[str, str]:
    """This process's environment (PATH, XLA_FLAGS, ...) without job variables,
    plus `extra`: what a job started here runs with, so its settings are
    jbps's defaults unless `extra` sets them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(JOB_VARIABLE_PREFIXES)}
    env.update(extra)
    return env


def python_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for jbps processes: importing this jbps first; `base`
    by default this process's, without job variables (job_free_env)."""
    env = dict(job_free_env() if base is None else base)
    env.setdefault(*QUICK_MODEL_INIT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_job(
    net: EmulatedNetwork,
    worker_hosts: Sequence[int],
    server_hosts: Sequence[int],
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    local_devices: int = 1,
    timeout_s: float = 300,
    python: str = sys.executable,
) -> JobResult:
    """Runs `python argv...` as one worker on each of `worker_hosts` (rank i on
    worker_hosts[i]) with a server on each of `server_hosts`; returns when every
    worker has exited and the servers have. Raises JobFailed, with every
    process's output, when a worker fails or the job takes over `timeout_s`."""
    with EmulatedJob(
        net, worker_hosts, server_hosts, argv, env=env, local_devices=local_devices, timeout_s=timeout_s, python=python
    ) as job:
        return job.wait()


class EmulatedJob:
    """A job started on enter (scheduler, servers, workers) and ended on exit:
    every process it started, by PID. wait() collects it; in between, a test
    may read the workers' output or cut a host's link."""

    def __init__(
        self,
        net: EmulatedNetwork,
        worker_hosts: Sequence[int],
        server_hosts: Sequence[int],
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        local_devices: int = 1,
        timeout_s: float = 300,
        python: str = sys.executable,
    ):
        self.net, self.python = net, python
        self.worker_hosts, self.server_hosts = list(worker_hosts), list(server_hosts)
        self.argv, self.local_devices, self.timeout_s = list(argv), local_devices, timeout_s
        self.env = python_env(env)
        self._tmp = tempfile.TemporaryDirectory(prefix="jbps-emulated-job-")
        self.dir = Path(self._tmp.name)
        self.procs: list[tuple[str, int, subprocess.Popen]] = []
        self.workers: list[subprocess.Popen] = []
        self.servers: list[subprocess.Popen] = []
        self.deadline = 0.0

    def __enter__(self) -> "EmulatedJob":
        try:
            self.start()
        except BaseException:
            self.end()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.end()

    def spawn(self, name: str, host: int, argv: list[str], env: Mapping[str, str]) -> subprocess.Popen:
        stem = name.replace(" ", "")
        with open(self.dir / f"{stem}.out", "w") as out, open(self.dir / f"{stem}.err", "w") as err:
            # cwd: the job's own folder, so `python -m` never imports a source checkout by accident.
            proc = self.net.run(host, argv, env=env, stdout=out, stderr=err, cwd=str(self.dir))
        self.procs.append((name, host, proc))
        return proc

    def output(self, name: str) -> ProcessOutput:
        host, proc = next((h, p) for n, h, p in self.procs if n == name)
        stem = name.replace(" ", "")
        read = lambda suffix: (self.dir / f"{stem}.{suffix}").read_text(errors="replace")  # noqa: E731
        return ProcessOutput(name, host, proc.poll(), read("out"), read("err"))

    def describe(self) -> str:
        parts = []
        for name, host, _ in self.procs:
            o = self.output(name)
            parts.append(f"--- {name} on host {host} (exit {o.returncode}):\n{o.stderr[-2500:]}")
        return "\n".join(parts)

    def start(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s
        n, s = len(self.worker_hosts), len(self.server_hosts)
        timeout = self.env.get("JBPS_TIMEOUT_S") or str(max(30, int(self.timeout_s)))
        base = dict(self.env, JBPS_TIMEOUT_S=timeout, DMLC_NUM_WORKER=str(n), DMLC_NUM_SERVER=str(s))
        base.setdefault("JBPS_JOB_SECRET", new_secret())  # as a job across hosts should be started
        first = self.worker_hosts[0]
        address = self.net.hosts[first].address
        sched = self.spawn(
            "scheduler",
            first,
            [self.python, "-m", "jbps.scheduler", "--bind", f"{address}:0"],
            dict(base, DMLC_ROLE="scheduler"),
        )
        port = None
        while port is None:
            m = _SCHEDULER_LISTENING.search((self.dir / "scheduler.out").read_text())
            if m:
                port = m.group(2)
            elif sched.poll() is not None or time.monotonic() > self.deadline:
                raise JobFailed(f"the scheduler did not start:\n{self.describe()}")
            else:
                time.sleep(0.02)
        base.update(DMLC_PS_ROOT_URI=address, DMLC_PS_ROOT_PORT=port)
        self.servers = [
            self.spawn(f"server {i}", host, [self.python, "-m", "jbps.server"], dict(base, DMLC_ROLE="server"))
            for i, host in enumerate(self.server_hosts)
        ]
        flags = f"{self.env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={self.local_devices}"
        self.workers = [
            self.spawn(
                f"worker {rank}",
                host,
                [self.python, *self.argv],
                dict(base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(rank), JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip()),
            )
            for rank, host in enumerate(self.worker_hosts)
        ]

    def wait(self) -> JobResult:
        """Every worker's and server's output once all have exited; JobFailed
        when a worker fails or the job outlives its timeout."""
        while any(p.poll() is None for p in self.workers):
            if any(p.poll() not in (None, 0) for p in self.workers):
                break
            if time.monotonic() > self.deadline:
                raise JobFailed(f"the job did not finish within {self.timeout_s:g} s:\n{self.describe()}")
            time.sleep(0.05)
        if any(p.returncode != 0 for p in self.workers):
            time.sleep(1)  # let the others report what they saw
            raise JobFailed(f"a worker failed:\n{self.describe()}")
        for p in self.servers:  # they exit once every worker said goodbye
            try:
                p.wait(timeout=max(1.0, min(30.0, self.deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise JobFailed(f"a server did not exit after the job:\n{self.describe()}") from None
        return JobResult(
            workers=[self.output(f"worker {r}") for r in range(len(self.workers))],
            servers=[self.output(f"server {i}") for i in range(len(self.servers))],
        )

    def end(self) -> None:
        procs = [p for _, _, p in self.procs]
        terminate(procs, 0.0, "emulated job")
        self.net.procs = [p for p in self.net.procs if p not in procs]
        self._tmp.cleanup()
