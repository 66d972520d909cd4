"""`jbps run`: a whole job on this machine from one command.

    jbps run -n 2 [--servers 2] [--local-devices 4] python train.py args...

Starts a scheduler (on a thread of this process, on a free loopback port),
the summation servers and the workers, with the DMLC_* variables of the
environment bootstrap, so `jbps.init()` in train.py needs no setting. Every
line a child prints is prefixed with its role and rank. Ctrl-C (SIGINT) or
SIGTERM ends every child. The first child to fail ends the others, and its
exit code becomes ours; when every worker succeeds, the servers end on their
own and we exit 0. Children are ended by PID with everything they spawned
(jbps.procs), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from .errors import JbpsError
from .procs import terminate
from .scheduler.rendezvous import Scheduler

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
log = logging.getLogger("jbps.run")

# Variables of other bootstraps that would override the scheduler's answer.
_CLEARED = ("JBPS_SERVERS", "JBPS_NUM_WORKERS", "JBPS_WORKER_RANK", "JBPS_LOCAL_RANK", "JBPS_LOCAL_SIZE",
            "JBPS_SCHEDULER_HOST", "JBPS_SCHEDULER_PORT", "JBPS_NUM_SERVERS", "JBPS_ROLE", "DMLC_WORKER_ID")


class _Output:
    """Copies a child's output to ours line by line, each line prefixed."""

    lock = threading.Lock()

    def __init__(self, pipe, sink, prefix: str):
        self.thread = threading.Thread(target=self._pump, args=(pipe, sink, prefix.encode()), daemon=True)
        self.thread.start()

    @classmethod
    def _pump(cls, pipe, sink, prefix: bytes) -> None:
        with pipe:
            for line in iter(pipe.readline, b""):
                with cls.lock:
                    sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                    sink.flush()


class Job:
    def __init__(self, command: list[str], workers: int, servers: int, local_devices: int | None,
                 timeout_s: float):
        self.command, self.workers, self.servers = command, workers, servers
        self.local_devices, self.timeout_s = local_devices, timeout_s
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.outputs: list[_Output] = []
        self.scheduler_error: str | None = None

    def _env(self, scheduler: Scheduler, role: str, extra: dict) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
        host, _, port = scheduler.address.rpartition(":")
        env.update(DMLC_ROLE=role, DMLC_NUM_WORKER=str(self.workers), DMLC_NUM_SERVER=str(self.servers),
                   DMLC_PS_ROOT_URI=host, DMLC_PS_ROOT_PORT=port, JBPS_TIMEOUT_S=str(self.timeout_s),
                   PYTHONUNBUFFERED="1", **extra)
        if self.local_devices:
            flags = env.get("XLA_FLAGS", "")
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={self.local_devices}".strip()
        return env

    def _spawn(self, name: str, argv: list[str], env: dict, cwd: str | None = None) -> None:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        self.children.append((name, proc))
        self.outputs.append(_Output(proc.stdout, sys.stdout.buffer, f"[{name}] "))
        self.outputs.append(_Output(proc.stderr, sys.stderr.buffer, f"[{name}] "))

    def _rendezvous(self, scheduler: Scheduler) -> None:
        try:
            scheduler.run()
        except JbpsError as exc:
            self.scheduler_error = str(exc)  # every member was told, and fails with it
        finally:
            scheduler.close()

    def run(self) -> int:
        scheduler = Scheduler(self.workers, self.servers, bind="127.0.0.1:0", timeout_s=self.timeout_s)
        log.info("scheduler on %s; %d servers, %d workers: %s", scheduler.address, self.servers, self.workers,
                 " ".join(self.command))
        threading.Thread(target=self._rendezvous, args=(scheduler,), daemon=True).start()
        try:
            for i in range(self.servers):
                # `-m` puts the working directory first on sys.path: from a source
                # checkout that would be the unbuilt package. Servers run from the
                # folder holding the jbps this launcher imported, so they get the same.
                self._spawn(f"server {i}", [sys.executable, "-m", "jbps.server"], self._env(scheduler, "server", {}),
                            cwd=_PACKAGE_PARENT)
            for rank in range(self.workers):
                self._spawn(f"worker {rank}", self.command,
                            self._env(scheduler, "worker", {"DMLC_WORKER_ID": str(rank)}))
            return self._wait()
        finally:
            terminate([p for _, p in self.children], grace_s=2.0, what="jbps run")
            for out in self.outputs:
                out.thread.join(timeout=5)

    def _wait(self) -> int:
        workers = [p for name, p in self.children if name.startswith("worker")]
        servers_done_by = None
        while True:
            for name, proc in self.children:
                code = proc.poll()
                if code not in (None, 0):
                    log.error("%s exited with %d; ending the job", name, code)
                    return code if code > 0 else 128 - code  # killed by a signal: 128 + its number
            if all(p.poll() == 0 for p in workers):
                # Servers exit once every worker said goodbye; give them a moment.
                servers_done_by = servers_done_by or time.monotonic() + 10
                if all(p.poll() is not None for _, p in self.children) or time.monotonic() > servers_done_by:
                    return 0
            time.sleep(0.05)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    p = argparse.ArgumentParser(prog=prog or "python -m jbps.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--workers", type=int, required=True, help="worker processes")
    p.add_argument("--servers", type=int, default=None, help="summation server processes (default: as many as workers)")
    p.add_argument("--local-devices", type=int, default=None,
                   help="CPU devices per worker (sets --xla_force_host_platform_device_count)")
    p.add_argument("--timeout", type=float, default=float(os.environ.get("JBPS_TIMEOUT_S", 60)),
                   help="seconds for the job to assemble, and for each psum (JBPS_TIMEOUT_S; default 60)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, e.g. python train.py")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("give the command each worker runs, e.g. `jbps run -n 2 python train.py`")
    servers = args.servers if args.servers is not None else args.workers
    if args.workers < 1 or servers < 1 or (args.local_devices is not None and args.local_devices < 1):
        p.error("--workers, --servers and --local-devices must be at least 1")
    if not args.timeout > 0:
        p.error("--timeout must be positive")

    job = Job(args.command, args.workers, servers, args.local_devices, args.timeout)
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        return job.run()
    except KeyboardInterrupt:
        signum = stop["signal"] or signal.SIGINT
        log.error("%s: ending the job", signal.Signals(signum).name)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
