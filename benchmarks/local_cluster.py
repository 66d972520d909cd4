"""A jbps job on this machine: summation servers and worker processes.

Used by the tests and the benchmark. Servers bind port 0 and report the port
they got, so concurrent jobs never race for ports. Every process is started in
its own session and ended by PID; nothing is left behind, even on timeout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

log = logging.getLogger(__name__)

_LISTENING = re.compile(r"jbps\.server listening on (\S+:\d+)")
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclasses.dataclass
class WorkerResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def last_json_line(text: str) -> dict | None:
    """The last line of `text` that parses as a JSON object (libraries may print
    around it); None if there is none."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class LocalCluster:
    """Servers started on enter; workers run with run_workers(); all ended on exit."""

    def __init__(
        self,
        num_workers: int,
        num_servers: int,
        *,
        local_devices: int = 1,
        timeout_s: float = 120,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        server_args: Sequence[str] = (),
        server_roles: Sequence[str] | None = None,
        bind_host: str = "127.0.0.1",
    ):
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.local_devices = local_devices
        self.timeout_s = timeout_s
        self.python = python
        self.server_args = list(server_args)
        # Another loopback address (127.0.0.2, ...) makes the servers look like other hosts' to the workers.
        self.bind_host = bind_host
        self.server_roles = list(server_roles) if server_roles is not None else ["colocated"] * num_servers
        if len(self.server_roles) != num_servers:
            raise ValueError(f"{num_servers} servers but {len(self.server_roles)} roles")
        self.env = dict(os.environ)
        # The package must import in children whether it is installed or run from a checkout.
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, self.env.get("PYTHONPATH")) if p)
        self.env.update(env or {})
        self.addresses: list[str] = []
        self.servers: list[subprocess.Popen] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="jbps-cluster-")
        self.dir = Path(self._tmp.name)

    def __enter__(self) -> "LocalCluster":
        try:
            self.start_servers()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, argv: list[str], env: Mapping[str, str], stem: str) -> subprocess.Popen:
        out = open(self.dir / f"{stem}.out", "wb")
        err = open(self.dir / f"{stem}.err", "wb")
        try:
            # cwd: the job's own folder, so `python -m` never imports a source
            # checkout in the caller's cwd ahead of the installed package.
            return subprocess.Popen(
                argv,
                env=dict(env),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=self.dir,
                start_new_session=True,
            )
        finally:
            out.close()
            err.close()

    def start_servers(self) -> list[str]:
        for i in range(self.num_servers):
            argv = [
                self.python,
                "-m",
                "jbps.server",
                "--bind",
                f"{self.bind_host}:0",
                "--num-workers",
                str(self.num_workers),
                "--role",
                self.server_roles[i],
                *self.server_args,
            ]
            self.servers.append(self._spawn(argv, self.env, f"server{i}"))
        deadline = time.monotonic() + 60
        for i, proc in enumerate(self.servers):
            while True:
                match = _LISTENING.search(_output(self.dir / f"server{i}.out"))
                if match:
                    self.addresses.append(match.group(1))
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"server {i} did not start (exit code {proc.poll()}):\n{_output(self.dir / f'server{i}.err')}"
                    )
                time.sleep(0.02)
        return self.addresses

    def worker_env(self, rank: int) -> dict[str, str]:
        env = dict(self.env)
        env.update(
            {
                "JBPS_SERVERS": ",".join(self.addresses),
                "JBPS_NUM_WORKERS": str(self.num_workers),
                "JBPS_WORKER_RANK": str(rank),
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={self.local_devices}",
            }
        )
        return env

    def run_workers(
        self,
        argv: Sequence[str],
        env_per_rank: Mapping[int, Mapping[str, str]] | None = None,
        timeout_s: float | None = None,
    ) -> list[WorkerResult]:
        """Runs `python argv...` as every worker; returns when all have exited.

        On timeout every worker is killed and TimeoutError carries their output.
        """
        return self.wait_workers(self.start_workers(argv, env_per_rank), timeout_s)

    def start_workers(
        self, argv: Sequence[str], env_per_rank: Mapping[int, Mapping[str, str]] | None = None
    ) -> list[subprocess.Popen]:
        """Starts `python argv...` as every worker (output in self.dir/worker<rank>.out/.err)."""
        procs = []
        for rank in range(self.num_workers):
            env = self.worker_env(rank)
            env.update((env_per_rank or {}).get(rank, {}))
            procs.append(self._spawn([self.python, *argv], env, f"worker{rank}"))
        return procs

    def wait_workers(self, procs: Sequence[subprocess.Popen], timeout_s: float | None = None) -> list[WorkerResult]:
        """Waits for workers from start_workers; kills them all on timeout (TimeoutError)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for proc in procs:
                _end(proc)
            raise TimeoutError("workers did not finish in time:\n" + self._report(procs)) from None
        return [
            WorkerResult(
                rank, p.returncode, _output(self.dir / f"worker{rank}.out"), _output(self.dir / f"worker{rank}.err")
            )
            for rank, p in enumerate(procs)
        ]

    def _report(self, procs) -> str:
        parts = []
        for rank, p in enumerate(procs):
            parts.append(
                f"--- worker {rank} (exit {p.returncode}) stderr:\n{_output(self.dir / f'worker{rank}.err')[-3000:]}"
            )
        return "\n".join(parts)

    def close(self) -> None:
        # Servers exit by themselves once every worker said goodbye; give them a moment.
        deadline = time.monotonic() + 5
        for proc in self.servers:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _end(proc)
        self.servers.clear()
        self._tmp.cleanup()


def _end(proc: subprocess.Popen) -> None:
    """Ends one child we started (and its session) by PID, and reaps it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=3)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
