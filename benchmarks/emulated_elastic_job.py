"""An elastic job on emulated hosts (network namespaces, as root), started as
on a real cluster: the jbps scheduler (`python -m jbps.scheduler --bind ...
--min-workers ...`) on host 0, then the workers and dedicated servers a caller
starts on hosts, each process's stdout and stderr in files of its workdir. The
multihost tests and benchmarks.elastic_hosts run their elastic jobs with it.

    with EmulatedNetwork(3, "1G") as net:
        job = ElasticJob(net, workdir, ["--num-workers", "3", "--min-workers", "2", "--max-workers", "3"],
                         env=python_env(), secret="...")
        try:
            for h in range(3):
                job.worker(f"w{h}", h, h, [sys.executable, "train.py"])
            job.until("w0", lambda line: line.get("step", 0) >= 5)   # a JSON line the worker printed
        finally:
            job.end()

Every wait is bounded, and fails as soon as a process it watches has exited.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from jbps.procs import terminate

from .emulated_network import EmulatedNetwork


class JobWaitFailed(AssertionError):
    """A wait of ElasticJob's that timed out or whose process exited (an
    AssertionError: in a test it reads as the failed check it is)."""


class ElasticJob:
    def __init__(
        self,
        net: EmulatedNetwork,
        workdir: Path,
        scheduler_flags: Sequence[str],
        *,
        env: Mapping[str, str],
        secret: str,
        timeout_s: float = 15,
    ):
        """Starts the scheduler on host 0 with `scheduler_flags` and waits
        (60 s at most) until it listens. `env`: the processes' environment,
        to which the job's secret, JBPS_TIMEOUT_S and the scheduler's address
        are added."""
        self.net, self.workdir, self.procs = net, Path(workdir), {}
        self.env = dict(env, JBPS_TIMEOUT_S=f"{timeout_s:g}", JBPS_JOB_SECRET=secret)
        # The processes' temporary directory, in workdir: what they leave there (a killed worker's
        # share of the job's compilation cache, jbps/compile_cache.py) goes with it.
        self.tmpdir = self.workdir / "tmp"
        self.tmpdir.mkdir(exist_ok=True)
        self.env.setdefault("TMPDIR", str(self.tmpdir))
        address = net.hosts[0].address
        argv = [sys.executable, "-m", "jbps.scheduler", "--bind", f"{address}:0", *scheduler_flags]
        self.scheduler = self.spawn("scheduler", 0, argv, self.env)
        self.wait(lambda: "listening on " in self.text("scheduler"), "the scheduler to listen", 60, ["scheduler"])
        listening = self.text("scheduler").split("listening on ")[1].split()[0]
        self.env.update(DMLC_PS_ROOT_URI=address, DMLC_PS_ROOT_PORT=listening.rsplit(":", 1)[1])

    def spawn(self, name: str, host: int, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        """argv on `host` as `name` (its output in name.out and name.err)."""
        out, err = open(self.workdir / f"{name}.out", "w"), open(self.workdir / f"{name}.err", "w")
        self.procs[name] = self.net.run(host, list(argv), env=dict(env), stdout=out, stderr=err, cwd=str(self.workdir))
        return self.procs[name]

    def worker(self, name: str, host: int, worker_id: int, argv: Sequence[str]) -> subprocess.Popen:
        """A worker of the job (one CPU device), as DMLC_WORKER_ID `worker_id`."""
        env = dict(self.env, DMLC_ROLE="worker", DMLC_WORKER_ID=str(worker_id), JAX_PLATFORMS="cpu")
        return self.spawn(name, host, argv, dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=1"))

    def server(self, name: str, host: int) -> subprocess.Popen:
        """A dedicated server of the job (`python -m jbps.server`)."""
        return self.spawn(name, host, [sys.executable, "-m", "jbps.server"], dict(self.env, DMLC_ROLE="server"))

    def text(self, name: str, stream: str = "out") -> str:
        return (self.workdir / f"{name}.{stream}").read_text()

    def err(self, name: str) -> str:
        """The end of name's stderr, for a failure's message."""
        return self.text(name, "err")[-3000:]

    def lines(self, name: str) -> list[dict]:
        """The JSON lines name printed (whole lines only)."""
        text = self.text(name)
        return [json.loads(s) for s in text.splitlines(keepends=True) if s.startswith("{") and s.endswith("\n")]

    def wait(self, done: Callable[[], bool], what: str, seconds: float, watch: Iterable[str] = ()) -> None:
        """Until done(); JobWaitFailed after `seconds`, or once a process of
        `watch` has exited without done() (its output is then all there is)."""
        deadline = time.monotonic() + seconds
        while not done():
            exited = [n for n in watch if self.procs[n].poll() is not None]
            if exited and not done():
                code = self.procs[exited[0]].returncode
                raise JobWaitFailed(f"waiting for {what}: {exited[0]} exited with {code}:\n{self.err(exited[0])}")
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{self.err(n)}" for n in watch)
                raise JobWaitFailed(f"waiting for {what}: not after {seconds:g} s\n{tails}")
            time.sleep(0.05)

    def until(self, name: str, what: Callable[[dict], bool], seconds: float = 120) -> None:
        """Until name prints a JSON line for which what(line) holds."""
        self.wait(lambda: any(what(line) for line in self.lines(name)), f"a line of {name}'s", seconds, [name])

    def printed(self, name: str, text: str, count: int = 1, seconds: float = 200, stream: str = "out") -> None:
        """Until name has printed `text` `count` times (on stdout, or stderr)."""
        self.wait(lambda: self.text(name, stream).count(text) >= count, f"{name} to print {text!r}", seconds, [name])

    def end(self) -> None:
        """Ends what is still running (by PID)."""
        terminate([p for p in self.procs.values() if p.poll() is None], 1.0, "elastic job")
